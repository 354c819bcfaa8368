"""bfloat16 arithmetic on 16-bit words, for the reductions MPI cannot run itself.

numpy has no bfloat16 and MPICH no bfloat16 arithmetic: the ``mpi`` backend moves bfloat16
tensors as 16-bit words and reduces them with :func:`reduce_words`, which computes in float32
(where every bfloat16 value is exact) and rounds each result to bfloat16 to nearest even, as
torch rounds its own bfloat16 arithmetic. Imports numpy only, so it is testable without MPI.

>>> import numpy as np
>>> words = np.array([0x3FC0, 0x4000], dtype=np.uint16)   # 1.5, 2.0
>>> hex(int(reduce_words(np.add, words[:1], words[1:])[0]))  # 3.5
'0x4060'
"""

from __future__ import annotations

import numpy as np

_QUIET_NAN = np.uint16(0x7FC0)


def widened(words: np.ndarray) -> np.ndarray:
    """bfloat16 values, given as their 16-bit words, as float32 (exactly)."""
    return (words.astype(np.uint32) << 16).view(np.float32)


def rounded(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 words, to nearest even; NaN stays a (quiet) NaN."""
    bits = values.view(np.uint32)
    words = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), _QUIET_NAN, words)


def reduce_words(ufunc: np.ufunc, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``ufunc(a, b)`` of two arrays of bfloat16 words, as bfloat16 words (overflow gives inf
    and invalid operations NaN, as IEEE arithmetic does, without numpy's warnings)."""
    with np.errstate(all="ignore"):
        return rounded(ufunc(widened(a), widened(b)))
