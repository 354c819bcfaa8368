"""Local row orders of the MoE operators, as index arrays computed on the host, the plan that
keeps them and the routing of a top-k dispatch.

A received all-to-all buffer is *rank-major*: for each source rank c, for each expert e, the
rows c sent to e. global_scatter's output is *expert-major*: for each expert e, for each
source rank c. Both orders are row permutations of the same segments; these functions return
the index array that takes one order to the other, so the move itself is one ``take``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from unicoll.counts import rank_totals

_PLAN_OVERHEAD = 512
"""Bytes counted per plan beside its arrays and lists: its Python objects."""

_BYTES_PER_CHUNK = 80
"""Bytes counted per (rank, expert) chunk of :attr:`MoePlan.expert_major_chunks`: an entry in
each of its two lists (a pointer and an int)."""


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
    return _inverse(rank_major_to_expert_major(counts))


def row_words(x: Any, address: int = 0) -> Any:
    """The rows of the C-contiguous array ``x`` (numpy or cupy) as a 2-D view of the widest
    unsigned word, up to 8 bytes, that divides a row's bytes and ``address`` (where the words
    are loaded on a device that needs them aligned: the data's address, or the gcd of several;
    0 for none): a row gather then moves a few wide elements per row instead of many narrow
    ones (cupy's ``take`` costs per element, not per byte), and moves the bits unchanged.
    ``x`` itself when the view would not be wider.

    >>> row_words(np.zeros((3, 4), dtype=np.float32)).dtype, row_words(np.zeros((3, 4), dtype=np.float32)).shape
    (dtype('uint64'), (3, 2))
    >>> row_words(np.zeros((3, 4), dtype=np.float32), address=4).dtype
    dtype('float32')
    """
    row_bytes = x.itemsize * math.prod(x.shape[1:])
    word = next(w for w in (8, 4, 2, 1) if row_bytes % w == 0 and address % w == 0)
    if x.ndim < 2 or row_bytes == 0 or word <= x.itemsize:
        return x
    return x.reshape(x.shape[0], row_bytes // x.itemsize).view(np.dtype(f"uint{8 * word}"))


def _padded_expert_major(counts: np.ndarray, capacity: int) -> np.ndarray:
    """Indices that take rank-major rows (``counts``: ``(W, E)``) followed by one zero row to
    padded expert-major order: block ``(e, c)`` of ``capacity`` rows, its rows first, then
    the zero row's index for each padding row.

    >>> _padded_expert_major(np.array([[1, 2], [1, 0]]), 2)   # segments a0 b0 b1 | c0, zero row 4
    array([0, 4, 3, 4, 1, 2, 4, 4])
    """
    starts = _exclusive_cumsum(counts.reshape(-1)).reshape(counts.shape).T[..., None]  # (E, W, 1)
    within = np.arange(capacity, dtype=np.int64)
    held = within < counts.T[..., None]
    return np.where(held, starts + within, int(counts.sum())).reshape(-1)


def _inverse(order: np.ndarray) -> np.ndarray:
    """The permutation that undoes ``order``."""
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size, dtype=np.int64)
    return inverse


class MoePlan:
    """What global_scatter and global_gather derive from their counts: made where a call is
    read in full and remembered with it (:func:`unicoll.validate.prepare`), or once per routing
    (:mod:`unicoll.moe`'s handle), and shared by the calls, and the backward passes, that use
    those counts: treat it as read-only. It keeps copies, never the caller's counts.

    ``send[c]``/``recv[c]``: rows global_scatter sends to / receives from rank c (global_gather
    swaps them). ``received[c, e]``: rows rank c sends this rank's expert e (global_count as a
    ``(W, E)`` array). ``to_expert_major``/``to_rank_major``: the reorders of the received rows,
    computed on first use (a backend that places rows itself never asks), None where rank-major
    already is expert-major (one rank, or one expert per rank).

    With a ``capacity`` C (the static-shape MoE mode's blocks), the expert-major side is
    *padded*: ``E * W * C`` rows (:attr:`expert_major_rows`), block ``(e, c)`` at row
    ``(e * W + c) * C``, its ``received[c, e]`` rows first, then padding, which global_scatter
    fills with zeros and global_gather never reads; only the received rows travel.

    >>> plan = MoePlan(np.array([1, 0, 2, 1]), np.array([1, 0, 0, 2]), 2)
    >>> plan.send, plan.recv, plan.to_expert_major
    ([1, 3], [1, 2], array([0, 1, 2]))
    >>> padded = MoePlan(np.array([1, 0, 2, 1]), np.array([1, 0, 0, 2]), 2, capacity=2)
    >>> padded.expert_major_rows, padded.to_expert_major   # row 3 is a zero row after the 3 received
    (8, array([0, 3, 3, 3, 3, 3, 1, 2]))
    """

    __slots__ = ("send", "recv", "received", "capacity", "expert_major_rows", "reordered", "_to_expert_major",
                 "_to_rank_major", "_chunks")  # fmt: skip

    def __init__(
        self,
        local_count: np.ndarray,
        global_count: np.ndarray,
        world: int,
        capacity: int | None = None,
        orders: tuple[Any, Any] | None = None,
    ) -> None:
        """``local_count``/``global_count``: validated host int64 counts of length ``world * E``
        (at most ``capacity`` each, where one is given). ``orders``: :attr:`to_expert_major` and
        :attr:`to_rank_major` made where the rows are (on their device; unpadded plans only),
        for a plan whose reorders must not be made on the host; None: made on first use."""
        self.send = rank_totals(local_count, world)
        self.recv = rank_totals(global_count, world)
        self.received = global_count.reshape(world, -1).copy()  # not the caller's, which may change
        self.capacity = capacity
        self.expert_major_rows = sum(self.recv) if capacity is None else self.received.size * capacity
        """The rows of the expert-major side: those received, or every block's C (padded)."""
        self.reordered = capacity is not None or (world > 1 and self.received.shape[1] > 1)
        """Whether the received rows need a reorder: more than one rank and expert, or padding."""
        self._to_expert_major, self._to_rank_major = (None, None) if orders is None else orders
        self._chunks: list[tuple[list[int], list[int]]] | None = None

    @property
    def to_expert_major(self) -> np.ndarray | None:
        """Indices that take the received (rank-major) rows to expert-major order; padded,
        ``sum(recv)`` (one zero row after the received ones) for each padding row."""
        if self._to_expert_major is None and self.reordered:
            if self.capacity is None:
                self._to_expert_major = rank_major_to_expert_major(self.received)
            else:
                self._to_expert_major = _padded_expert_major(self.received, self.capacity)
        return self._to_expert_major

    @property
    def padding_rows(self) -> np.ndarray:
        """The padding rows of a padded plan's expert-major side (empty unpadded), made per
        use from :attr:`to_expert_major` (not kept)."""
        if self.capacity is None:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(self.to_expert_major == sum(self.recv))

    @property
    def to_rank_major(self) -> np.ndarray | None:
        """Indices that take expert-major rows back to rank-major order (global_gather's):
        ``sum(recv)`` of them, padding left out."""
        if self._to_rank_major is None and self.reordered:
            order = self.to_expert_major
            if self.capacity is None:
                self._to_rank_major = _inverse(order)
            else:
                held = order < sum(self.recv)
                self._to_rank_major = np.empty(sum(self.recv), dtype=np.int64)
                self._to_rank_major[order[held]] = np.flatnonzero(held)
        return self._to_rank_major

    @property
    def expert_major_chunks(self) -> list[tuple[list[int], list[int]]]:
        """Per source rank c: the rows of its chunk for each expert (``received[c]``) and the
        row where each chunk starts in expert-major order, as lists; made on first use, for a
        backend that places the received rows itself (mpi's indexed datatypes).

        >>> MoePlan(np.array([1, 0, 2, 1]), np.array([1, 2, 1, 0]), 2).expert_major_chunks
        [([1, 2], [0, 2]), ([1, 0], [1, 4])]
        """
        if self._chunks is None:
            if self.capacity is None:  # expert-major: each expert, each rank
                starts = _exclusive_cumsum(self.received.T.reshape(-1))
            else:
                starts = np.arange(self.received.size, dtype=np.int64) * self.capacity
            by_rank = starts.reshape(self.received.shape[1], -1).T
            self._chunks = [(counts.tolist(), first.tolist()) for counts, first in zip(self.received, by_rank)]
        return self._chunks

    @property
    def nbytes(self) -> int:
        """What the plan holds once both reorders and the chunks are made: counted in full
        from the start, since a remembered plan makes them after it is counted."""
        reorders = 8 * (sum(self.recv) + self.expert_major_rows) if self.reordered else 0
        chunks = _BYTES_PER_CHUNK * self.received.size if self.reordered else 0
        return self.received.nbytes + 16 * len(self.send) + reorders + chunks + _PLAN_OVERHEAD


@dataclass(frozen=True, eq=False)
class Routing:
    """Where each slot's row goes in a top-k dispatch (:mod:`unicoll.routing`): what the
    backends' MoE entry points (:meth:`~unicoll.backends.base.Backend.moe_dispatch`,
    :meth:`~unicoll.backends.base.Backend.moe_combine`) take beside the plan.

    ``local_count[i]``: rows this rank sends to global expert ``i`` (length ``W*E``, host
    int64). ``send_tokens[n]``: the token whose row is the ``n``-th row sent.
    ``slot_rows[s]``: the position of slot ``s``'s row among the rows sent, or
    ``len(send_tokens)`` for a dropped slot. Both are int64 index arrays: on the host where the
    routing was computed there (a host backend), else of the rows' library on their device.
    ``dropped``: whether any slot is dropped. ``topk``: the slots per token.
    """

    local_count: np.ndarray
    send_tokens: np.ndarray
    slot_rows: np.ndarray
    dropped: bool
    topk: int

    @cached_property
    def kept(self) -> np.ndarray:
        """Whether each slot is kept, as a ``(tokens, k)`` bool array."""
        return (self.slot_rows < self.send_tokens.shape[0]).reshape(-1, self.topk)

    @property
    def tokens(self) -> int:
        """The tokens routed."""
        return self.slot_rows.shape[0] // self.topk


LAST_PLAN_BYTES = 16 * 2**20
"""The largest plan :func:`moe_plan` keeps for the next call (the bytes its ``nbytes`` counts)."""

_last: tuple[tuple[bytes, bytes, int, int | None], MoePlan] | None = None
"""The counts and plan of the last :func:`moe_plan` call (at most one plan, of at most
:data:`LAST_PLAN_BYTES`; copies only), or None."""


def moe_plan(local_count: np.ndarray, global_count: np.ndarray, world: int, capacity: int | None = None) -> MoePlan:
    """The :class:`MoePlan` of validated host int64 counts of length ``world * E``: the one the
    last call made when the counts are the same, else a new one. A training step calls
    global_gather with the counts global_scatter just used, and their backward passes run
    with the same plans: with new counts every step, this makes one plan per step, not two.

    >>> counts = np.array([1, 0, 2, 1])
    >>> moe_plan(counts, counts, 2) is moe_plan(counts.copy(), counts, 2)
    True
    """
    global _last
    key = (local_count.tobytes(), global_count.tobytes(), world, capacity)
    if _last is not None and _last[0] == key:
        return _last[1]
    plan = MoePlan(local_count, global_count, world, capacity)
    _last = (key, plan) if plan.nbytes <= LAST_PLAN_BYTES else None
    return plan
