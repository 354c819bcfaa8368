"""unicoll's calls beside the raw transfer of the same tensors, per call and in microseconds.

    python -m unicoll run -n 1 benchmarks/call_overhead.py --backend torch-nccl

For ``alltoall_single``, ``global_scatter`` (4 experts per rank) and a top-2 ``moe.dispatch``
followed by ``moe.combine``, at 64 KiB, 1 MiB and 64 MiB of tokens per rank (rows of 1024
float32), this times unicoll's call and the raw all-to-all of the same buffers, interleaved:
``torch.distributed.all_to_all_single`` (on ``cupy-nccl``, torch's NCCL is started beside it,
as ``unicoll bench`` does) or bare mpi4py on ``mpi``. The raw side of the MoE step is the two
all-to-alls of its dispatched rows (there and back), with no reorder and no weighted sum, so the
difference is everything unicoll adds: routing, reorders, the counts' exchange, the checks.

On a GPU it then checks the MoE step's goals (issue 41): within the raw all-to-alls + 60 us at
1 MiB and below, within 1.5x of them at 64 MiB, one ``goal: ...: pass|fail`` line each.

A time is the median over blocks of 20 calls followed by one device synchronization, divided by
20, on the slowest rank. Runs on every backend (CPU tensors on gloo and mpi).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import unicoll as uc
from unicoll.cli.bench_baselines import Baseline, for_backend

HIDDEN, EXPERTS, TOPK = 1024, 4, 2
SIZES = (64 << 10, 1 << 20, 64 << 20)
CALLS, BLOCKS = 20, 15
#: The MoE step's GPU goals: at most this many microseconds over the raw all-to-alls up to
#: SMALL_BYTES per rank, and at most RATIO_GOAL times them above.
EXCESS_GOAL_US, SMALL_BYTES, RATIO_GOAL = 60.0, 1 << 20, 1.5


def _timer(baseline: Baseline) -> Callable[[Callable[[], Any]], float]:
    """A function giving the median seconds per call of ``fn`` (blocks of CALLS calls)."""
    cuda = baseline.device.type == "cuda"

    def per_call(fn: Callable[[], Any]) -> float:
        blocks = []
        for _ in range(BLOCKS + 2):  # two blocks of warm-up
            baseline.barrier()
            start = time.perf_counter()
            for _ in range(CALLS):
                fn()
            if cuda:
                torch.cuda.synchronize()
            blocks.append((time.perf_counter() - start) / CALLS)
        return statistics.median(blocks[2:])

    return per_call


def _cases(baseline: Baseline, nbytes: int, world: int) -> list[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    """(name, unicoll's call, the raw transfers of the same buffers) at ``nbytes`` per rank."""
    rows = nbytes // (HIDDEN * 4)
    device = baseline.device
    gen = torch.Generator().manual_seed(uc.get_rank())
    x = torch.randn(rows, HIDDEN, generator=gen).to(device)
    out = torch.empty_like(x)
    even = [rows // world] * world
    even[-1] += rows - sum(even)
    a2a_out = torch.empty(sum(even) if world == 1 else rows, HIDDEN, device=device)

    # global_scatter: this rank's rows spread over the world's experts, counts fixed for the run.
    local = torch.multinomial(torch.ones(world * EXPERTS), rows, replacement=True, generator=gen)
    local_count = torch.bincount(local, minlength=world * EXPERTS)
    global_count = uc.exchange_counts(local_count)
    send = local_count.view(world, EXPERTS).sum(1).tolist()
    recv = global_count.view(world, EXPERTS).sum(1).tolist()
    scattered = torch.empty(sum(recv), HIDDEN, device=device)
    lc, gc = local_count.tolist(), global_count.tolist()

    # The MoE step: top-2 over the world's experts, a new draw each size (fixed within it).
    topk_idx = torch.rand(rows, world * EXPERTS, generator=gen).argsort(dim=1)[:, :TOPK].to(device)
    topk_weights = torch.rand(rows, TOPK, generator=gen).to(device)
    rows_out, _, handle = uc.moe.dispatch(x, topk_idx, topk_weights, experts_per_rank=EXPERTS)
    sent = torch.empty(rows * TOPK, HIDDEN, device=device)
    got = torch.empty(rows_out.shape[0], HIDDEN, device=device)
    moe_send, moe_recv = handle.plan.send, handle.plan.recv

    def moe_step() -> Any:
        dispatched, _, h = uc.moe.dispatch(x, topk_idx, topk_weights, experts_per_rank=EXPERTS)
        return uc.moe.combine(dispatched, h)

    moe_there = baseline.alltoallv(got, sent, moe_recv, moe_send)
    moe_back = baseline.alltoallv(sent, got, moe_send, moe_recv)
    return [
        ("alltoall_single", lambda: uc.alltoall_single(out, x), baseline.alltoallv(a2a_out, x, even, even)),
        ("global_scatter", lambda: uc.global_scatter(x, lc, gc), baseline.alltoallv(scattered, x, recv, send)),
        ("moe.dispatch+combine", moe_step, lambda: (moe_there(), moe_back())),
    ]


def _goals(lines: list[tuple[str, int, float, float]]) -> list[str]:
    """The MoE step's goals, one ``goal: WHAT: FIGURE (goal TARGET): pass|fail`` line per size."""
    found = []
    for name, nbytes, mine_s, raw_s in lines:
        if name != "moe.dispatch+combine":
            continue
        if nbytes <= SMALL_BYTES:
            excess = (mine_s - raw_s) * 1e6
            figure, target, met = f"{excess:.1f}us", f"<= {EXCESS_GOAL_US:g}us over raw", excess <= EXCESS_GOAL_US
        else:
            ratio = mine_s / raw_s
            figure, target, met = f"{ratio:.2f}x", f"<= {RATIO_GOAL:g}x raw", ratio <= RATIO_GOAL
        found.append(f"goal: {name} at {nbytes} bytes: {figure} (goal {target}): {'pass' if met else 'fail'}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="unicoll backend (default: UNICOLL_BACKEND or auto)")
    args = parser.parse_args()
    uc.init(args.backend)
    if uc.get_backend() in ("torch-nccl", "cupy-nccl"):
        torch.cuda.set_device(0 if uc.get_world_size() == 1 else uc.get_rank() % torch.cuda.device_count())
    baseline = for_backend(uc.get_backend())
    per_call = _timer(baseline)
    world, rank = uc.get_world_size(), uc.get_rank()
    lines = []
    for nbytes in SIZES:
        for name, mine, raw in _cases(baseline, nbytes, world):
            timed = per_call(mine), per_call(raw)
            lines.append((name, nbytes, *baseline.slowest(timed)))
    if rank == 0:
        where = torch.cuda.get_device_name() if baseline.device.type == "cuda" else "cpu"
        print(f"# unicoll {uc.get_backend()} against raw {baseline.name}, {world} rank(s) on {where}")
        print(f"{'op':>22} {'bytes':>10} {'unicoll (us)':>13} {'raw (us)':>10} {'overhead (us)':>14} {'ratio':>6}")
        for name, nbytes, mine_s, raw_s in lines:
            mine_us, raw_us = mine_s * 1e6, raw_s * 1e6
            excess, ratio = mine_us - raw_us, mine_us / raw_us
            print(f"{name:>22} {nbytes:>10} {mine_us:>13.1f} {raw_us:>10.1f} {excess:>14.1f} {ratio:>6.2f}")
        if baseline.device.type == "cuda":
            for line in _goals(lines):
                print(line)
    uc.finalize()


if __name__ == "__main__":
    main()
