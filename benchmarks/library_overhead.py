"""unicoll's calls on Paddle tensors and JAX arrays beside the same calls on torch tensors, the
conversions written by hand, and the raw transfer, per call and in microseconds.

    python -m unicoll run -n 2 benchmarks/library_overhead.py --backend gloo

For ``alltoall_single(None, x)`` of rows of 64 float32 (8 KiB to 4 MiB per rank), this times,
in turn block by block: the raw all-to-all of torch tensors (``torch.distributed.all_to_all_single``, or
bare mpi4py on ``mpi``), unicoll on torch tensors, and for each of Paddle and JAX: the call by
hand (the library's array read as torch through DLPack, unicoll on torch, the result handed back
through DLPack) and unicoll on the library's array. The carry floor's own cost is the difference
between the last two. A time is the median over blocks of 20 calls, on the slowest rank; the variants' blocks
alternate, so that the machine's drift falls on all of them alike.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import unicoll as uc
from unicoll.cli.bench_baselines import Baseline, for_backend

HIDDEN = 64
SIZES = (8 << 10, 256 << 10, 4 << 20)
CALLS, BLOCKS = 20, 15


def _per_call(baseline: Baseline, cases: list[tuple[str, Callable[[], Any]]]) -> dict[str, float]:
    """Each case's median seconds per call over blocks of CALLS calls (two of warm-up), the
    cases' blocks taken in turn, so that the machine's drift falls on all of them alike."""
    blocks: dict[str, list[float]] = {name: [] for name, _ in cases}
    for _ in range(BLOCKS + 2):
        for name, fn in cases:
            baseline.barrier()
            start = time.perf_counter()
            for _ in range(CALLS):
                fn()
            blocks[name].append((time.perf_counter() - start) / CALLS)
    return {name: statistics.median(times[2:]) for name, times in blocks.items()}


def _cases(baseline: Baseline, nbytes: int, world: int, libraries: list[str]) -> list[tuple[str, Callable[[], Any]]]:
    """(name, call) of each variant at ``nbytes`` per rank (rows split evenly over the ranks)."""
    rows = nbytes // (HIDDEN * 4) // world * world
    values = np.random.default_rng(uc.get_rank()).standard_normal((rows, HIDDEN)).astype(np.float32)
    x = torch.from_numpy(values)
    even = [rows // world] * world
    cases = [
        ("raw", baseline.alltoallv(torch.empty_like(x), x, even, even)),
        ("torch", lambda: uc.alltoall_single(None, x)),
    ]
    if "paddle" in libraries:
        import paddle

        p = paddle.to_tensor(values)
        cases += [
            ("paddle by hand", lambda: paddle.from_dlpack(uc.alltoall_single(None, torch.from_dlpack(p)))),
            ("paddle", lambda: uc.alltoall_single(None, p)),
        ]
    if "jax" in libraries:
        import jax

        j = jax.device_put(values)
        cases += [
            ("jax by hand", lambda: jax.dlpack.from_dlpack(uc.alltoall_single(None, torch.from_dlpack(j)))),
            ("jax", lambda: uc.alltoall_single(None, j)),
        ]
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="unicoll backend (default: UNICOLL_BACKEND or auto)")
    parser.add_argument("--library", action="append", choices=("paddle", "jax"), help="(repeatable; default: both)")
    args = parser.parse_args()
    libraries = args.library or ["paddle", "jax"]
    uc.init(args.backend)
    baseline = for_backend(uc.get_backend())
    world, rank = uc.get_world_size(), uc.get_rank()
    table: dict[tuple[int, str], float] = {}
    for nbytes in SIZES:
        per_call = _per_call(baseline, _cases(baseline, nbytes, world, libraries))
        for name, slowest in zip(per_call, baseline.slowest(list(per_call.values()))):
            table[nbytes, name] = slowest
    if rank == 0:
        print(f"# alltoall_single(None, x) on {uc.get_backend()}, {world} rank(s), rows of {HIDDEN} float32: "
              "us per call (slowest rank); own = unicoll on the library's arrays - by hand")  # fmt: skip
        names = ["raw", "torch"] + [f"{lib}{part}" for lib in libraries for part in (" by hand", "")]
        print(f"{'bytes':>9} " + " ".join(f"{name:>14}" for name in names) + " " +
              " ".join(f"{lib + ' own':>10} {lib + '/torch':>12}" for lib in libraries))  # fmt: skip
        for nbytes in SIZES:
            us = {name: table[nbytes, name] * 1e6 for name in names}
            own = " ".join(f"{us[lib] - us[f'{lib} by hand']:>10.1f} {us[lib] / us['torch']:>12.2f}"
                           for lib in libraries)  # fmt: skip
            print(f"{nbytes:>9} " + " ".join(f"{us[name]:>14.1f}" for name in names) + " " + own)
    uc.finalize()


if __name__ == "__main__":
    main()
