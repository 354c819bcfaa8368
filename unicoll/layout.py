"""Local row orders of the MoE operators, as index arrays computed on the host.

A received all-to-all buffer is *rank-major*: for each source rank c, for each expert e, the
rows c sent to e. global_scatter's output is *expert-major*: for each expert e, for each
source rank c. Both orders are row permutations of the same segments; these functions return
the index array that takes one order to the other, so the move itself is one ``take``.
"""

from __future__ import annotations

import numpy as np


def _exclusive_cumsum(a: np.ndarray) -> np.ndarray:
    out = np.zeros_like(a)
    np.cumsum(a[:-1], out=out[1:])
    return out


def rank_major_to_expert_major(counts: np.ndarray) -> np.ndarray:
    """Indices ``idx`` such that ``rank_major[idx]`` is the expert-major order.

    ``counts`` has shape ``(W, E)``: ``counts[c, e]`` rows from source rank c for expert e.

    >>> rank_major_to_expert_major(np.array([[1, 2], [1, 0]]))   # segments a0 b0 b1 | c0
    array([0, 3, 1, 2])
    """
    lengths_rm = counts.reshape(-1)
    starts_rm = _exclusive_cumsum(lengths_rm).reshape(counts.shape)
    lengths_em = counts.T.reshape(-1)
    starts_src = starts_rm.T.reshape(-1)
    starts_dst = _exclusive_cumsum(lengths_em)
    total = int(lengths_em.sum())
    return np.repeat(starts_src - starts_dst, lengths_em) + np.arange(total, dtype=np.int64)


def expert_major_to_rank_major(counts: np.ndarray) -> np.ndarray:
    """Indices ``idx`` such that ``expert_major[idx]`` is the rank-major order (the inverse).

    >>> expert_major_to_rank_major(np.array([[1, 2], [1, 0]]))
    array([0, 2, 3, 1])
    """
    forward = rank_major_to_expert_major(counts)
    inverse = np.empty_like(forward)
    inverse[forward] = np.arange(forward.size, dtype=np.int64)
    return inverse
