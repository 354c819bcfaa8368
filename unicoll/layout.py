"""Local row orders of the MoE operators, as index arrays computed on the host.

A received all-to-all buffer is *rank-major*: for each source rank c, for each expert e, the
rows c sent to e. global_scatter's output is *expert-major*: for each expert e, for each
source rank c. Both orders are row permutations of the same segments; these functions return
the index array that takes one order to the other, so the move itself is one ``take``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

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


@dataclass(frozen=True)
class MoePlan:
    """What global_scatter and global_gather derive from their counts, computed once per
    distinct (local_count, global_count, W) and shared between calls: treat it as read-only.

    ``send[c]``/``recv[c]``: rows global_scatter sends to / receives from rank c (global_gather
    swaps them). ``to_expert_major``/``to_rank_major``: the reorders of the received rows, None
    where rank-major already is expert-major (one rank, or one expert per rank).
    """

    send: list[int]
    recv: list[int]
    to_expert_major: np.ndarray | None
    to_rank_major: np.ndarray | None


def moe_plan(local_count: np.ndarray, global_count: np.ndarray, world: int) -> MoePlan:
    """The :class:`MoePlan` of validated host int64 counts of length ``world * E``.

    >>> moe_plan(np.array([1, 0, 2, 1]), np.array([1, 0, 0, 2]), 2).recv
    [1, 2]
    """
    return _cached_plan(local_count.tobytes(), global_count.tobytes(), world)


@lru_cache(maxsize=256)
def _cached_plan(local: bytes, global_: bytes, world: int) -> MoePlan:
    sent = np.frombuffer(local, dtype=np.int64).reshape(world, -1)
    received = np.frombuffer(global_, dtype=np.int64).reshape(world, -1)
    if world == 1 or received.shape[1] == 1:
        forward = inverse = None
    else:
        forward = rank_major_to_expert_major(received)
        inverse = expert_major_to_rank_major(received)
    return MoePlan(sent.sum(axis=1).tolist(), received.sum(axis=1).tolist(), forward, inverse)
