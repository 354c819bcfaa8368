"""What check mode costs: each operator with check mode off and on, side by side in one run.

    unicoll run -n 2 benchmarks/check_mode_cost.py [--iters 300]

Rank 0 prints the median time per call (slowest rank) with check mode off and on, and the
difference: the price of the extra exchange that compares the ranks' arguments.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import unicoll as uc
from unicoll import runtime


def median_us(call, iters: int) -> float:
    times = []
    for _ in range(iters):
        uc.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    mine = statistics.median(times[iters // 10 :]) * 1e6
    return float(uc.all_gather(None, np.array([mine])).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    uc.init("gloo")
    world = uc.get_world_size()
    x = torch.randn(256, 1)  # 1 KiB of float32 per rank
    counts = np.full(4 * world, 256 // (4 * world))
    calls = {
        "alltoall_single": lambda: uc.alltoall_single(None, x),
        "all_gather": lambda: uc.all_gather(None, x),
        "global_scatter": lambda: uc.global_scatter(x, counts, counts),
        "global_gather": lambda: uc.global_gather(x, counts, counts),
    }
    rows = []
    for name, call in calls.items():
        timings = {}
        for check in (False, True, False, True):  # interleaved, so drift hits both
            runtime.state(name).check = check
            timings.setdefault(check, []).append(median_us(call, args.iters))
        rows.append((name, min(timings[False]), min(timings[True])))
    if uc.get_rank() == 0:
        print(f"gloo, {world} ranks, 1 KiB per rank, median of {args.iters} calls (slowest rank)")
        print(f"{'operator':<16} {'check off (us)':>15} {'check on (us)':>14} {'extra (us)':>11}")
        for name, off, on in rows:
            print(f"{name:<16} {off:>15.1f} {on:>14.1f} {on - off:>11.1f}")
    uc.finalize()


if __name__ == "__main__":
    main()
