"""The GPU side of issue 5's goal: the local expert-major reorder against a device-to-device copy.

    python benchmarks/gpu_reorder.py [--library torch|cupy] [--dtype float32] [--iters 50]

global_scatter receives rank-major rows and reorders them expert-major with one gather of rows
(``unicoll.backends.layout`` computes the index on the host; the backend's ``take_rows`` moves the
rows). On one rank of ``torch-nccl`` (``--library torch``) or ``cupy-nccl`` (``--library
cupy``), for buffers from 1 MiB to 1 GiB, this times with CUDA events the median of:

- ``copy``: a device-to-device copy of the whole buffer (the card's reference bandwidth);
- ``reorder``: the row gather with the index already on the device (the kernel alone);
- ``unicoll``: the backend's ``take_rows`` as global_scatter calls it (index uploaded each call).

Bandwidth counts the bytes read plus written (2 x buffer). The goal is reorder >= 80% of
copy. Then, for the same buffers, verification's checksum of the rows per rank's block
(``unicoll.checksums.block_checksums``, on the device: the bytes read once), against the copy;
its goal is at least 50% of the copy's bandwidth (issue 45). Without a CUDA device it says so
and exits with code 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

import unicoll as uc
from unicoll import runtime
from unicoll.backends import layout
from unicoll.checksums import block_checksums

WORLD, EXPERTS, HIDDEN = 8, 4, 1024  # a typical expert-parallel shape: 8 ranks x 4 experts


class _Torch:
    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"no CUDA device is visible to torch {torch.__version__}")
        self.torch = torch
        self.device = torch.cuda.get_device_name()

    def buffer(self, rows: int, dtype: str) -> Any:
        return self.torch.randn(rows, HIDDEN, device="cuda").to(getattr(self.torch, dtype))

    def index(self, order: np.ndarray) -> Any:
        return self.torch.from_numpy(order).cuda()

    def gather(self, src: Any, index: Any, dst: Any) -> None:
        self.torch.index_select(src, 0, index, out=dst)

    def time_ms(self, fn: Callable[[], None], iters: int) -> float:
        times = []
        for _ in range(iters):
            start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times[2:])


class _Cupy:
    def __init__(self) -> None:
        import cupy

        cupy.cuda.runtime.getDeviceCount()  # raises without a driver
        self.cupy = cupy
        self.device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()

    def buffer(self, rows: int, dtype: str) -> Any:
        return self.cupy.random.standard_normal((rows, HIDDEN), dtype=np.float32).astype(dtype)

    def index(self, order: np.ndarray) -> Any:
        return self.cupy.asarray(order)

    def gather(self, src: Any, index: Any, dst: Any) -> None:
        from unicoll.backends.cupy.rows import gather_rows

        gather_rows(src, index, dst)

    def time_ms(self, fn: Callable[[], None], iters: int) -> float:
        times = []
        for _ in range(iters):
            start, end = self.cupy.cuda.Event(), self.cupy.cuda.Event()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(self.cupy.cuda.get_elapsed_time(start, end))
        return statistics.median(times[2:])


def _timings(lib: _Torch | _Cupy, src: Any, dst: Any, order: np.ndarray, iters: int) -> list[float]:
    """Median milliseconds of the copy, the row gather alone, and the backend's ``take_rows``."""
    backend = runtime.state("gpu_reorder").backend
    index = lib.index(order)

    def copy() -> None:
        dst[...] = src

    return [
        lib.time_ms(copy, iters),
        lib.time_ms(lambda: lib.gather(src, index, dst), iters),
        lib.time_ms(lambda: backend.take_rows(src, order), iters),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", choices=["torch", "cupy"], default="torch")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.library == "cupy" and args.dtype == "bfloat16":
        parser.error("cupy has no bfloat16")
    try:
        lib = _Torch() if args.library == "torch" else _Cupy()
        uc.init("torch-nccl" if args.library == "torch" else "cupy-nccl")
    except Exception as exc:  # ImportError, no CUDA device or driver, backend not usable
        print(f"gpu_reorder: skipped: {type(exc).__name__}: {exc}")
        return 0
    rng = np.random.default_rng(args.seed)
    itemsize = np.dtype("float16" if args.dtype == "bfloat16" else args.dtype).itemsize
    print(f"{lib.device}, {args.library} {args.dtype}, rows of {HIDDEN}, {WORLD} ranks x {EXPERTS} experts")
    print(f"{'bytes':>12} {'copy GB/s':>10} {'reorder GB/s':>13} {'ratio':>6} {'unicoll GB/s':>13} {'ratio':>6}")
    worst, checksums = 1.0, []
    for shift in range(20, 31, 2):
        rows = (1 << shift) // (HIDDEN * itemsize)
        counts = rng.multinomial(rows, np.full(WORLD * EXPERTS, 1 / (WORLD * EXPERTS))).reshape(WORLD, EXPERTS)
        order = layout.rank_major_to_expert_major(counts)
        src, dst = lib.buffer(rows, args.dtype), lib.buffer(rows, args.dtype)
        moved = 2 * rows * HIDDEN * itemsize / 1e9  # GB read + written
        copy, reorder, full = (moved / (ms / 1e3) for ms in _timings(lib, src, dst, order, args.iters))
        worst = min(worst, reorder / copy)
        splits = counts.sum(axis=1).tolist()
        summed = lib.time_ms(lambda src=src, splits=splits: block_checksums(src, splits), args.iters)
        checksums.append((1 << shift, moved / 2 / (summed / 1e3), copy))
        print(
            f"{1 << shift:>12} {copy:>10.1f} {reorder:>13.1f} {reorder / copy:>6.2f} {full:>13.1f} {full / copy:>6.2f}"
        )
    print(f"goal: reorder / copy, worst size: {worst:.2f} (goal >= 0.80): {'pass' if worst >= 0.8 else 'fail'}")
    for nbytes, gbps, copy in checksums:
        print(f"checksum of {nbytes} bytes: {gbps:.1f} GB/s read, {gbps / copy:.2f} of a copy")
    least = min(gbps / copy for _, gbps, copy in checksums)
    print(f"goal: checksum / copy, worst size: {least:.2f} (goal >= 0.50): {'pass' if least >= 0.5 else 'fail'}")
    uc.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
