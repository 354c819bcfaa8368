"""What the handshake costs: each operator with the ranks comparing nothing, with the handshake
(the default on gloo and mpi) and with check mode, side by side in one run.

    unicoll run -n 2 benchmarks/handshake_cost.py [--iters 200]
    unicoll run --mpi -n 2 benchmarks/handshake_cost.py

Rank 0 prints, per operator and size, the time per call (back-to-back calls, the best of five
blocks, slowest rank) in each setting and the handshake's share over the call without it. The
settings take turns block by block, so drift on a shared machine hits all three alike.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

import unicoll as uc
from unicoll import runtime

SIZES = {"1 KiB": 1 << 10, "64 KiB": 1 << 16, "1 MiB": 1 << 20, "16 MiB": 1 << 24}
SETTINGS = {"off": (False, False), "handshake": (True, False), "check": (False, True)}


def per_call_us(call: Callable[[], object], iters: int) -> float:
    """Seconds per call of ``call`` over ``iters`` back-to-back calls, in µs, on the slowest rank."""
    uc.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    mine = (time.perf_counter() - start) / iters * 1e6
    return float(uc.all_gather(None, np.array([mine])).max())


def operators(nbytes: int, world: int) -> dict[str, Callable[[], object]]:
    """The calls measured at ``nbytes`` per rank: an all-to-all into a given output (the
    handshake's own exchange), one whose receive sizes are exchanged (merged into it), an
    all_reduce, and a top-2 MoE dispatch and combine."""
    rows = max(world, nbytes // 256)  # rows of 64 float32
    x = torch.randn(rows - rows % world, 64)
    out = torch.empty_like(x)
    splits = [len(x) // world] * world
    ids = torch.randint(0, 4 * world, (len(x) // 2, 2))
    tokens = x[: len(ids)]

    def moe_step() -> None:
        received, _, handle = uc.moe.dispatch(tokens, ids, experts_per_rank=4)
        uc.moe.combine(received, handle)

    return {
        "alltoall_single into out": lambda: uc.alltoall_single(out, x),
        "alltoall_single, sizes exchanged": lambda: uc.alltoall_single(None, x, None, splits),
        "all_reduce": lambda: uc.all_reduce(x),
        "moe.dispatch + combine": moe_step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    uc.init()
    world, state = uc.get_world_size(), runtime.state("bench")
    rows = []
    for size, nbytes in SIZES.items():
        iters = max(5, min(args.iters, (args.iters << 20) // (nbytes * 16)))
        for name, call in operators(nbytes, world).items():
            call()  # the first call of each shape plans it
            best = {setting: float("inf") for setting in SETTINGS}
            for _ in range(5):
                for setting, (handshake, check) in SETTINGS.items():
                    state.handshake, state.check = handshake, check
                    best[setting] = min(best[setting], per_call_us(call, iters))
            rows.append((name, size, best))
    state.handshake, state.check = runtime.state("bench").backend.host_memory, False
    if uc.get_rank() == 0:
        print(f"{state.backend.name}, {world} ranks, µs per call (best of 5 blocks, slowest rank)")
        print(f"{'operator':<34} {'size':>7} {'off':>9} {'handshake':>10} {'check':>9} {'handshake/off':>14}")
        for name, size, best in rows:
            share = best["handshake"] / best["off"] - 1
            print(
                f"{name:<34} {size:>7} {best['off']:>9.1f} {best['handshake']:>10.1f} {best['check']:>9.1f} "
                f"{share:>+13.1%}"
            )
    uc.finalize()


if __name__ == "__main__":
    main()
