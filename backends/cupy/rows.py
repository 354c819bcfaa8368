"""Row gathers on the GPU for ``cupy-nccl``: ``out[i] = x[index[i]]`` at close to a copy's speed.

cupy's ``take`` costs per element (an index division each), so rows of float32 move at under
half a device-to-device copy's bandwidth on an H100. Rows whose bytes are a multiple of 16 (at
least 128) go through one small kernel instead: a block per output row, each thread moving
16-byte words. Other rows are gathered with ``take`` on their widest words
(:func:`~unicoll.backends.layout.row_words`), no wider than the addresses' alignment allows. Both
move the bits unchanged, on the current stream.
"""

from __future__ import annotations

import functools
import math

import cupy
import numpy as np

from unicoll.backends.layout import row_words

_WORD = 16
_MIN_ROW_BYTES = 128
"""Below this the kernel's blocks are mostly idle threads; ``take`` on wide words does better."""


@functools.cache
def _gather_kernel() -> cupy.RawKernel:
    """The kernel, made on first use (cupy compiles it then, once per process)."""
    return cupy.RawKernel(
        r"""extern "C" __global__
        void unicoll_gather_rows(const uint4* src, const long long* index, uint4* dst, long long words) {
            const uint4* from = src + index[blockIdx.x] * words;
            uint4* to = dst + (long long)blockIdx.x * words;
            for (long long w = threadIdx.x; w < words; w += blockDim.x) to[w] = from[w];
        }""",
        "unicoll_gather_rows",
    )


def gather_rows(x: cupy.ndarray, index: cupy.ndarray, out: cupy.ndarray) -> None:
    """Fill ``out`` (C-contiguous, ``len(index)`` rows of ``x``'s shape and dtype) with the rows
    ``x[index]``; ``x`` C-contiguous, ``index`` integers on the device."""
    rows = len(index)
    row_bytes = x.itemsize * math.prod(x.shape[1:])
    if rows == 0 or row_bytes == 0:
        return
    index = index.astype(cupy.int64, copy=False)  # the kernel reads 64-bit indices
    address = math.gcd(x.data.ptr, out.data.ptr)  # words must be aligned on both sides
    if row_bytes % _WORD == 0 and row_bytes >= _MIN_ROW_BYTES and address % _WORD == 0:
        words = row_bytes // _WORD
        threads = min(256, -(-words // 32) * 32)
        _gather_kernel()((rows,), (threads,), (x, index, out, np.int64(words)))
    else:
        cupy.take(row_words(x, address), index, axis=0, out=row_words(out, address))


def take_rows(x: cupy.ndarray, index: np.ndarray | cupy.ndarray) -> cupy.ndarray:
    """A new array of the rows ``x[index]`` (``index``: int64, on x's device or on the host,
    uploaded here)."""
    out = cupy.empty((len(index), *x.shape[1:]), dtype=x.dtype)
    gather_rows(x, cupy.asarray(index, dtype=cupy.int64), out)
    return out
