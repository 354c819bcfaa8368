"""The sweep of ``unicoll bench`` on every rank (:mod:`unicoll.cli.bench`): each operator and
size timed beside its raw baseline, interleaved, and the whole call at the front-end payload
beside the raw one (the overhead on N ranks)."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from ..launch.process import write_atomically
from .bench_cases import CASES, World, check
from .bench_config import Config

BLOCK_BYTES, MAX_BLOCK = 1 << 20, 16
"""A timed block is ``BLOCK_BYTES // size`` calls, between 1 and ``MAX_BLOCK``."""
FRONTEND_BYTES = 256
"""Payload of the front-end measurement: small enough that the transfer costs next to nothing."""
_OVERHEAD_SAMPLES = 5
"""The whole call on N ranks at the front-end payload: this many times ``--iters`` samples of
``MAX_BLOCK`` calls, so that a difference of a few microseconds shows through the noise."""


def time_calls(
    w: World, calls: Sequence[Callable[[], Any]], iters: int, warmup: int, block: int, barrier: Callable[[], None]
) -> list[float]:
    """This rank's median time per call in µs of each of ``calls`` (unicoll's call, the raw
    call, ...), in their order.

    Each of the ``iters`` samples is a block of ``block`` back-to-back calls after a barrier
    (so the barrier's exit skew is paid once per block, as in nccl-tests); the calls alternate
    block by block, in reversed order every other iteration.
    """
    for _ in range(warmup):
        for call in calls:
            call()
    samples: list[list[float]] = [[] for _ in calls]
    order = list(enumerate(calls))
    for i in range(iters):
        for index, call in order if i % 2 == 0 else order[::-1]:
            barrier()
            w.sync()
            start = time.perf_counter_ns()
            for _ in range(block):
                call()
            w.sync()
            samples[index].append((time.perf_counter_ns() - start) / block)
    return [statistics.median(times) / 1e3 for times in samples]


def _bandwidths(op: str, nbytes: int, us: float, world: int) -> tuple[float, float]:
    """algbw and busbw in GB/s. nccl-tests (doc/PERFORMANCE.md): algbw = S / t with S the size
    column (for all_gather the whole output, sendcount * N elements; for reduce_scatter the whole
    input); busbw = algbw * 2(N-1)/N for AllReduce, algbw for Broadcast, and algbw * (N-1)/N for
    AllGather, ReduceScatter and AlltoAll, which we also use for the MoE operators (all-to-alls)."""
    algbw = nbytes / (us * 1e3)
    factor = {"all_reduce": 2 * (world - 1) / world, "broadcast": 1.0}.get(op, (world - 1) / world)
    return algbw, algbw * factor


def sweep(config: Config, result_path: str, progress_path: str) -> None:
    w = World(config)
    rows, steps, done = [], [(op, size) for op in config.ops for size in config.sizes()], 0
    for op, size in steps:
        case = CASES[op](w, size, w.baseline.moe_reorder)
        correct = check(w, case)
        block = min(MAX_BLOCK, max(1, BLOCK_BYTES // size))
        calls = [case.unicoll, case.raw] + ([] if case.transfer is None else [case.transfer])
        uc_us, raw_us, *transfer_us = time_calls(w, calls, config.iters, config.warmup, block, w.baseline.barrier)
        uc_us, raw_us, wrong, *transfer_us = w.baseline.slowest([uc_us, raw_us, 0.0 if correct else 1.0, *transfer_us])
        sent, slots = (0, 0) if case.sent is None else case.sent()
        sent, slots = w.baseline.slowest([float(sent), float(slots)])
        algbw, busbw = _bandwidths(op, case.nbytes, uc_us, w.world)
        raw_algbw, raw_busbw = _bandwidths(op, case.nbytes, raw_us, w.world)
        rows.append(
            {
                "op": op,
                "size_bytes": case.nbytes,
                "count": case.count,
                "dtype": config.dtype,
                "time_us": uc_us,
                "algbw_gbps": algbw,
                "busbw_gbps": busbw,
                "correct": wrong == 0.0,
                "raw_time_us": raw_us,
                "raw_algbw_gbps": raw_algbw,
                "raw_busbw_gbps": raw_busbw,
                "ratio": uc_us / raw_us,
                "transfer_time_us": transfer_us[0] if transfer_us else None,
                "transfer_ratio": uc_us / transfer_us[0] if transfer_us else None,
                "bytes_sent": int(sent) if case.sent else None,
                "bytes_one_row_per_slot": int(slots) if case.sent else None,
                "sent_ratio": sent / slots if case.sent and slots else None,
                "calls_per_sample": block,
            }
        )
        done += 1
        if w.rank == 0:
            write_atomically(progress_path, f"{done} {op} {case.nbytes}")
    overhead = _overhead(w)
    if w.rank == 0:
        result = {**environment(w), "config": asdict(config), "rows": rows, "overhead": overhead}
        write_atomically(result_path, json.dumps(result))


def _overhead(w: World) -> dict[str, Any]:
    """Per operator, on every rank of the sweep: the whole call at the front-end payload beside
    the raw call with the same arguments (the sweep's baseline: for the MoE operators on
    torch.distributed the transfer and the reorder by hand), the slowest rank's medians; what
    unicoll costs on top of the transport on this machine. The raw call is timed twice, in the
    same rotation: ``raw_again_ratio``, one against the other, is how far apart two identical
    calls measure here, the resolution of ``ratio``."""
    figures, samples = {}, _OVERHEAD_SAMPLES * w.config.iters
    for op in w.config.ops:
        case = CASES[op](w, FRONTEND_BYTES, w.baseline.moe_reorder)
        times = time_calls(
            w, [case.unicoll, case.raw, case.raw], samples, w.config.warmup, MAX_BLOCK, w.baseline.barrier
        )
        uc_us, raw_us, again_us = w.baseline.slowest(times)
        figures[op] = {
            "unicoll_us": uc_us,
            "raw_us": raw_us,
            "difference_us": uc_us - raw_us,
            "ratio": uc_us / raw_us,
            "raw_again_ratio": again_us / raw_us,
        }
    blocks = {"samples": samples, "calls_per_sample": MAX_BLOCK}
    return {"bytes": FRONTEND_BYTES, "ranks": w.world, **blocks, "ops": figures}


def environment(w: World) -> dict[str, Any]:
    import torch

    import unicoll as uc

    return {
        "unicoll": uc.__version__,
        "torch": torch.__version__,
        "backend": uc.get_backend(),
        "baseline": w.baseline.name,
        "world_size": w.world,
        "device": str(w.device),
        "cpus": os.cpu_count(),
        "threads_per_rank": torch.get_num_threads(),
    }
