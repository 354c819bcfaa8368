"""Local row orders of the MoE operators, as index arrays computed on the host.

A received all-to-all buffer is *rank-major*: for each source rank c, for each expert e, the
rows c sent to e. global_scatter's output is *expert-major*: for each expert e, for each
source rank c. Both orders are row permutations of the same segments; these functions return
the index array that takes one order to the other, so the move itself is one ``take``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from unicoll.cache import BoundedCache
from unicoll.counts import rank_totals

PLAN_CACHE_BYTES = 16 * 2**20
"""The most the plans of recent counts may hold: their reorder indices grow with the rows
received, and a training loop brings new counts every step."""

_ENTRY_OVERHEAD = 512
"""Bytes counted per plan beside its arrays: the key's and the plan's Python objects."""

_plans = BoundedCache(PLAN_CACHE_BYTES)


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


class MoePlan(NamedTuple):
    """What global_scatter and global_gather derive from their counts, computed once per
    distinct (local_count, global_count, W) while it stays among the recent ones (at most
    :data:`PLAN_CACHE_BYTES` of plans), and shared between calls: treat it as read-only. (A
    named tuple: one is made for every call with new counts, in a few hundred nanoseconds less
    than a frozen dataclass.)

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
    key = (local_count.tobytes(), global_count.tobytes(), world)
    plan = _plans.get(key)
    if plan is None:
        plan = _plan(local_count, global_count, world)
        _plans.put(key, plan, _plan_bytes(plan, key))
    return plan


def _plan(local_count: np.ndarray, global_count: np.ndarray, world: int) -> MoePlan:
    received = global_count.reshape(world, -1)
    if world == 1 or received.shape[1] == 1:
        forward = inverse = None
    else:
        forward = rank_major_to_expert_major(received)
        inverse = expert_major_to_rank_major(received)
    return MoePlan(rank_totals(local_count, world), rank_totals(global_count, world), forward, inverse)


def _plan_bytes(plan: MoePlan, key: tuple[bytes, bytes, int]) -> int:
    """What ``plan`` and its ``key`` hold: the counts, the rank sums and the reorder indices."""
    indices = 0 if plan.to_expert_major is None else 2 * plan.to_expert_major.nbytes  # the order and its inverse
    return len(key[0]) + len(key[1]) + 16 * len(plan.send) + indices + _ENTRY_OVERHEAD
