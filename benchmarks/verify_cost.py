"""What verification costs: calls with it off, on every call, and on 1 call in 100, side by side.

    unicoll run -n 2 benchmarks/verify_cost.py --backend gloo
    unicoll run -n 2 --mpi benchmarks/verify_cost.py --backend mpi

For ``alltoall_single`` and ``all_reduce`` of 64 KiB, 1 MiB and 64 MiB of float32 per rank (rows of
256 values, and ``all_reduce`` of the same values as one 1-D array, as a gradient bucket),
rank 0 prints the median time per call (slowest rank) with verification off (the backend
itself), on every call, and at a share of 0.01, the three interleaved in rounds so that drift
hits them alike, and each one's ratio to off; and the floor of verifying every call, what any
implementation of the check must add to the call: one more small exchange (an all-gather of
``5 + 4 W`` int64, timed alone) and two reads of the rows (what was sent, what arrived; timed
as the cheapest pass over them, their words summed), with every call's ratio to that floor.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

import unicoll as uc
from unicoll import runtime
from unicoll.checksums import row_hashes
from unicoll.verify import VerifiedBackend

SIZES = {"64 KiB": 64 << 10, "1 MiB": 1 << 20, "64 MiB": 64 << 20}
SETTINGS = {"off": 0.0, "every call": 1.0, "1 in 100": 0.01}


def median_us(call: Callable[[], object], iters: int) -> float:
    """The median time of ``call`` on the slowest rank, after a barrier each time."""
    times = []
    for _ in range(iters):
        uc.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    mine = statistics.median(times) * 1e6
    return float(uc.all_gather(None, np.array([mine])).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    uc.init(args.backend)
    torch.set_num_threads(1)
    state = runtime.state("verify_cost")
    inner = state.backend
    backends = {
        name: inner if rate == 0 else VerifiedBackend(inner, rate, state.timeout) for name, rate in SETTINGS.items()
    }
    record = inner.to_native(torch.zeros(5 + 4 * uc.get_world_size(), dtype=torch.int64))
    gathered = inner.empty_rows(record, uc.get_world_size() * record.shape[0])
    exchange = min(
        median_us(lambda: inner.all_gather_even(gathered, record, state.world, True).wait(state.timeout), 100)
        for _ in range(args.rounds)
    )
    rows = []
    for label, nbytes in SIZES.items():
        x = torch.randn(nbytes // 4 // 256, 256)
        iters = 100 if nbytes <= 1 << 20 else 100 // 10
        flat = x.reshape(-1)  # a gradient bucket: each value is its own row
        calls = {
            "alltoall_single": lambda x=x: uc.alltoall_single(None, x),
            "all_reduce": lambda x=x: uc.all_reduce(x),
            "all_reduce 1-D": lambda flat=flat: uc.all_reduce(flat),
        }
        for op, call in calls.items():
            times: dict[str, list[float]] = {name: [] for name in SETTINGS}
            for _ in range(args.rounds):
                for name in SETTINGS:
                    state.backend = backends[name]
                    state.memory.clear()  # a remembered call keeps the backend it ran on
                    times[name].append(median_us(call, iters))
            best = {name: min(values) for name, values in times.items()}
            rows_read = flat if op.endswith("1-D") else x
            read = min(median_us(lambda rows_read=rows_read: row_hashes(rows_read), iters) for _ in range(args.rounds))
            best["floor"] = best["off"] + exchange + 2 * read
            rows.append((op, label, best))
    state.backend = inner
    if uc.get_rank() == 0:
        print(
            f"{uc.get_backend()}, {uc.get_world_size()} ranks, float32, median per call (slowest rank), "
            f"best of {args.rounds} rounds"
        )
        print(
            f"{'operator':<16} {'size':>7} {'off (us)':>10} {'every (us)':>11} {'ratio':>6} "
            f"{'1/100 (us)':>11} {'ratio':>6} {'floor (us)':>11} {'every/floor':>12}"
        )
        for op, label, t in rows:
            off, every, sampled = t["off"], t["every call"], t["1 in 100"]
            print(
                f"{op:<16} {label:>7} {off:>10.0f} {every:>11.0f} {every / off:>6.3f} "
                f"{sampled:>11.0f} {sampled / off:>6.3f} {t['floor']:>11.0f} {every / t['floor']:>12.3f}"
            )
        print(f"the floor: the call off, one exchange ({exchange:.0f} us alone) and two reads of the rows")
    uc.finalize()


if __name__ == "__main__":
    main()
