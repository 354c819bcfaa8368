"""The layout of a top-k dispatch, computed on the host from the router's expert ids, and the
handle that keeps it for the combine, the backward passes and later layers (redispatch).

A token's ``k`` slots are numbered ``s = t * k + j`` (token ``t``, slot ``j``). A kept slot
sends one copy of its token's row; the rows leave in *send order*: by global expert id
``i = rank * E + e``, then by slot number (so the lowest token index first), which is the
order ``global_scatter`` expects. ``-1`` drops a slot, and so does ``capacity``: each rank
sends each expert at most ``capacity`` rows, the lowest slot numbers first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .arrays import library_of, place_of
from .backends.blocks import StaticLayout
from .backends.layout import MoePlan, Routing
from .libraries import NATIVE
from .session import join_session

if TYPE_CHECKING:
    from .group import Group


def route(topk_idx: np.ndarray, experts: int, capacity: int | None) -> Routing:
    """The :class:`Routing` of validated expert ids ``topk_idx`` (host int64, shape ``(T, k)``,
    values from -1 to ``len(local_count) - 1``) for ``experts`` global experts.

    >>> r = route(np.array([[1, 0], [1, -1], [0, 1]]), 2, capacity=None)
    >>> r.local_count.tolist(), r.send_tokens.tolist(), r.slot_rows.tolist()
    ([2, 3], [0, 2, 0, 1, 2], [2, 0, 3, 5, 1, 4])
    >>> route(np.array([[1, 0], [1, -1], [0, 1]]), 2, capacity=1).slot_rows.tolist()
    [1, 0, 2, 2, 2, 2]
    """
    tokens, k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    if flat.size and int(flat.min()) < 0:
        slots = np.flatnonzero(flat >= 0)
        destinations = flat[slots]
        sent = slots[_stable_order(destinations, experts)]  # by expert, then by slot number
    else:
        destinations = flat
        sent = _stable_order(flat, experts)
    local_count = np.bincount(destinations, minlength=experts).astype(np.int64, copy=False)
    if capacity is not None and sent.size and int(local_count.max()) > capacity:
        starts = np.cumsum(local_count) - local_count
        place = np.arange(sent.size, dtype=np.int64) - np.repeat(starts, local_count)
        sent = sent[place < capacity]
        local_count = np.minimum(local_count, capacity)
    slot_rows = np.full(tokens * k, sent.size, dtype=np.int64)
    slot_rows[sent] = np.arange(sent.size, dtype=np.int64)
    return Routing(local_count, sent // k, slot_rows, sent.size < tokens * k, k)


def static_route(topk_idx: np.ndarray, experts: int, capacity: int) -> StaticLayout:
    """The static mode's :class:`~unicoll.backends.blocks.StaticLayout` of host int ids
    ``topk_idx`` (``(T, k)``; a slot whose id is not in ``0 .. experts - 1`` is dropped), made
    from :func:`route`'s send order: the layout :func:`unicoll.static_layout.static_layout`
    makes, as numpy arrays, in under a third of its time there, which a host backend's step pays.

    >>> layout = static_route(np.array([[1, 0], [1, -1], [0, 1]]), 2, 2)
    >>> layout.slot_rows.tolist(), layout.row_slots.tolist(), layout.filled.tolist(), layout.demand.tolist()
    ([2, 0, 3, 0, 1, 0], [1, 4, 0, 2], [True, True, True, True], [2, 3])
    """
    ids = np.asarray(topk_idx).astype(np.int64, copy=False)
    routed = (ids >= 0) & (ids < experts)
    if not routed.all():
        ids = np.where(routed, ids, -1)
    demand = np.bincount(ids[routed], minlength=experts)
    routing = route(ids, experts, capacity)
    sent = routing.local_count
    flat = ids.reshape(-1)
    kept = routing.slot_rows < routing.send_tokens.size
    slot_rows = np.zeros(flat.size, dtype=np.int64)
    experts_kept = flat[kept]
    starts = np.cumsum(sent) - sent
    slot_rows[kept] = experts_kept * capacity + routing.slot_rows[kept] - starts[experts_kept]
    row_slots = np.zeros(experts * capacity, dtype=np.int64)
    row_slots[slot_rows[kept]] = np.flatnonzero(kept)
    filled = np.zeros(experts * capacity, dtype=bool)
    filled[slot_rows[kept]] = True
    return StaticLayout(slot_rows, kept.reshape(ids.shape), row_slots, filled, sent, demand)


_RADIX_FROM = 4096
"""The slots from which :func:`_stable_order` sorts 16-bit ids."""


def _stable_order(ids: np.ndarray, experts: int) -> np.ndarray:
    """The stable argsort of expert ids below ``experts``: from a few thousand slots, on 16-bit
    ids where they fit, which numpy sorts by radix, ten times faster than int64 (0.45 ms for
    256k slots here); fewer sort faster than they convert."""
    if ids.size >= _RADIX_FROM and experts <= np.iinfo(np.int16).max:
        ids = ids.astype(np.int16)
    return np.argsort(ids, kind="stable")


class SessionHandle:
    """What every MoE handle shares: its group, the caller's ``topk_weights`` (None without
    them), which combine weighs by when it runs, the dispatch's number in check mode, and the
    end of its session, after which it refuses to be used and lets go of the weights."""

    def __init__(self, group: Group, weights: Any, dispatch_number: int) -> None:
        self.group = group
        self.weights = weights
        """The caller's ``topk_weights`` (None without them), which combine weighs by."""
        self.dispatch_number = dispatch_number
        self.link: Any = None
        """Where the dispatch recorded a gradient, an empty tensor of its autograd node, which
        combine joins its rows to (:func:`unicoll.eager.autograd.attach_linked`), else None."""
        self._ended: str | None = None
        join_session(group.session, self)

    @property
    def weighted(self) -> bool:
        """Whether dispatch was given ``topk_weights`` (combine then weighs each slot by its own)."""
        return self.weights is not None

    @property
    def ended(self) -> str | None:
        """Why the handle cannot be used any more (its session ended), or None while it can."""
        return self._ended

    def _end_session(self, reason: str, keep_handles: bool) -> None:
        self._ended = reason
        self.weights = self.link = None


class Handle(SessionHandle):
    """What :func:`unicoll.moe.dispatch` hands back for the matching :func:`unicoll.moe.combine`:
    the layout of one routing (counts on both sides, the rows' order, each slot's row), so a
    combine, the backward passes and a second layer with the same routing
    (:func:`unicoll.moe.redispatch`, then combine) exchange no counts.

    It keeps the caller's ``topk_weights`` (combine weighs by them when it runs, so a change
    made to them in place in between is seen, and their gradient flows through it) and nothing
    else of the caller's: no token rows, no expert ids. Once the session that made it ends
    (``finalize()``) it refuses to be used and lets go of the weights. ``bytes_sent`` and
    ``bytes_one_row_per_slot`` say what the dispatch sent the other ranks, and what one row per
    slot would have (less where each token went once per rank, :mod:`unicoll.backends.once`).

    >>> y, rows_per_expert, handle = uc.moe.dispatch(x, topk_idx, w, experts_per_rank=2)  # doctest: +SKIP
    >>> handle.rows_per_expert == rows_per_expert, handle.tokens, handle.topk              # doctest: +SKIP
    (True, 4, 2)
    """

    def __init__(
        self,
        routing: Routing,
        plan: MoePlan,
        group: Group,
        weights: Any,
        like: Any,
        dispatch_number: int = -1,
        once: Any = None,
        row_nbytes: int = 0,
    ) -> None:
        """``routing``: where each slot's row went, on the host or, where the routing ran on
        the device, on x's device. ``plan``: the :class:`~unicoll.backends.layout.MoePlan` of
        the routing's counts and the counts received (on the host: combine, redispatch and the
        backward passes read nothing more from a device). ``like``: the dispatched x, whose
        library and device combine's rows must have (not kept). ``dispatch_number``: in check
        mode, the dispatch's collective number on ``group`` (:func:`unicoll.check.call_number`),
        which tells handles of two dispatches apart across the ranks; -1 where it was not
        numbered. ``once``: the layout that sent each token once per rank
        (:class:`unicoll.eager.moe_once.OnceLayout`), or None where the rows went one per slot.
        ``row_nbytes``: the bytes of one dispatched row."""
        self.routing = routing
        """The layout, which the backends' gathers and combine's sums read."""
        self.once = once
        """How each token went once per rank (:mod:`unicoll.backends.once`), or None."""
        self.local_count = routing.local_count
        self.plan = plan
        """Shared by the calls and backward passes of this routing."""
        self.global_count = plan.received.reshape(-1)
        self.tokens, self.topk = routing.tokens, routing.topk
        self.dropped = routing.dropped
        self.library = library_of(like)
        self.device = place_of(like)
        self.received = sum(plan.recv)
        self.rows_per_expert: list[int] = plan.received.sum(0).tolist()
        self._slot_bytes = (sum(plan.send) - plan.send[group.rank]) * row_nbytes
        super().__init__(group, weights, dispatch_number)

    @property
    def bytes_sent(self) -> int:
        """The bytes of rows (and their metadata) this rank's dispatch sent the other ranks."""
        if self.once is not None:
            return self.once.bytes_sent(self.group.rank)[0]
        return self._slot_bytes

    @property
    def bytes_one_row_per_slot(self) -> int:
        """The bytes this rank's dispatch would have sent the other ranks with one row per slot."""
        return self._slot_bytes

    def counts(self) -> tuple[np.ndarray, np.ndarray]:
        """The counts this rank sent to each global expert, and those it received from each
        (rank, local expert), as global_scatter's ``local_count`` and ``global_count``."""
        return self.local_count, self.global_count

    def local_expert_ids(self) -> Any:
        """Each row dispatch returned, its local expert (``0 .. experts_per_rank - 1``), as
        ``rows_per_expert`` says: int64, of x's library on its device (numpy for another
        library's). What an experts module that routes rows by id takes: rows_per_expert
        ``[2, 0, 1]`` gives ``[0, 0, 2]``."""
        ids = np.repeat(np.arange(len(self.rows_per_expert), dtype=np.int64), self.rows_per_expert)
        description = NATIVE.get(self.library)
        return ids if description is None else description.from_host(ids, self.device, None)

    def __repr__(self) -> str:
        state = f"ended: {self._ended}" if self._ended else f"rows per expert {self.rows_per_expert}"
        return f"<unicoll.moe.Handle {self.tokens} tokens x top-{self.topk}, {state}>"
