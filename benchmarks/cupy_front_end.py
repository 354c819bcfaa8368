"""Where ``cupy-nccl``'s front end spends its time with torch tensors, on one GPU rank.

    python -m unicoll run -n 1 benchmarks/cupy_front_end.py

Prints, in microseconds per call (the median of blocks of calls, the GPU idle between them):
the crossing of a CUDA torch tensor into cupy and back through DLPack and through
:mod:`~unicoll.backends.cupy.torch_bridge`; ``alltoall_single(out, x)`` at 64 KiB on torch
tensors and on cupy arrays of the same memory, whose difference is what torch tensors cost; then
the functions that take the most time over those torch calls, from ``cProfile``.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import cupy
import torch

import unicoll as uc
from unicoll.backends.cupy import torch_bridge

ROWS, HIDDEN = 16, 1024  # 64 KiB of float32
CALLS, BLOCKS, PROFILED = 200, 12, 2000


def per_call_us(fn: Callable[[], Any]) -> float:
    """The median microseconds per call of ``fn`` over blocks of CALLS calls (one block of warm-up)."""
    blocks = []
    for _ in range(BLOCKS + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
        blocks.append((time.perf_counter() - start) / CALLS * 1e6)
    return statistics.median(blocks[1:])


def main() -> None:
    uc.init("cupy-nccl")
    x = torch.randn(ROWS, HIDDEN, device="cuda")
    out = torch.empty_like(x)
    x_cupy, out_cupy = cupy.from_dlpack(x), cupy.from_dlpack(out)
    rows = [
        ("torch -> cupy, cupy.from_dlpack", lambda: cupy.from_dlpack(x.detach())),
        ("torch -> cupy, torch_bridge.as_cupy", lambda: torch_bridge.as_cupy(x)),
        ("cupy -> torch, torch.from_dlpack", lambda: torch.from_dlpack(x_cupy)),
        ("torch -> cupy -> torch, torch_bridge", lambda: torch_bridge.as_torch(torch_bridge.as_cupy(x))),
        ("alltoall_single(out, x), torch tensors", lambda: uc.alltoall_single(out, x)),
        ("alltoall_single(out, x), cupy arrays", lambda: uc.alltoall_single(out_cupy, x_cupy)),
        ("alltoall_single(None, x), torch tensors", lambda: uc.alltoall_single(None, x)),
        ("alltoall_single(None, x), cupy arrays", lambda: uc.alltoall_single(None, x_cupy)),
    ]
    print(f"# cupy-nccl's front end on {torch.cuda.get_device_name()}, {ROWS * HIDDEN * 4} bytes, us per call")
    for name, fn in rows:
        print(f"{name:>42} {per_call_us(fn):8.1f}")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(PROFILED):
        uc.alltoall_single(out, x)
    profile.disable()
    torch.cuda.synchronize()
    print(f"# cProfile of {PROFILED} alltoall_single(out, x) on torch tensors, by own time")
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)
    uc.finalize()


if __name__ == "__main__":
    main()
