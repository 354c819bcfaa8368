"""The layout of a static-shape top-k dispatch, computed where the router's ids are (host or
device) with array-API operations only, so numpy, torch and cupy, eager or traced by
torch.compile or ``jax.jit``, share this one code path and nothing is read to the host; and the
step written once around an exchange of whole blocks (:data:`Exchange`), for the callers that
move blocks themselves (torch.compile's traced forms, ``jax.jit``'s callbacks, the tests' whole
world on one process). Eager calls move them through the backend's entry points instead
(:meth:`~unicoll.backends.base.Backend.moe_dispatch_static`). The blocks themselves are
described in :mod:`unicoll.backends.blocks`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from .arrays import library_of, place, place_of
from .backends.blocks import (
    StaticLayout,
    counts_heard,
    counts_told,
    expert_major,
    send_rows,
    slot_index,
    slots_of,
    source_major,
    weighted_sum,
    with_zero_row,
)
from .counts import host_as, on_host
from .device_routing import index_dtype, order_slots
from .routing import SessionHandle


def static_layout(xp: Any, topk_idx: Any, experts: int, capacity: int) -> StaticLayout:
    """The :class:`StaticLayout` of ``topk_idx`` (a ``(T, k)`` int array) for ``experts``
    global experts and ``capacity`` rows per (rank, expert) block. ``xp``: topk_idx's array
    namespace (array-api-compat's).

    >>> import array_api_compat.numpy as xp, numpy as np
    >>> layout = static_layout(xp, np.array([[1, 0], [1, -1], [0, 1]]), 2, 2)
    >>> layout.slot_rows.tolist(), layout.kept.tolist(), layout.row_slots.tolist(), layout.sent.tolist()
    ([2, 0, 3, 0, 1, 0], [[True, True], [True, False], [True, False]], [1, 4, 0, 2], [2, 2])
    >>> layout.demand.tolist()   # expert 1 was picked by three slots; capacity 2 kept the first two
    [2, 3]
    """
    tokens, k = topk_idx.shape
    s = order_slots(xp, topk_idx, experts, capacity)
    where, index = place(topk_idx), index_dtype(xp)
    slot_rows = xp.where(s.kept, s.ids * capacity + s.place, xp.zeros_like(s.ids))
    rows = xp.arange(experts * capacity, dtype=index, device=where)
    block, within = rows // capacity if capacity else rows, rows % capacity if capacity else rows
    filled = within < xp.take(s.sent, block) if tokens * k else xp.zeros(rows.shape, dtype=xp.bool, device=where)
    if tokens * k:
        source = xp.take(s.starts, block) + within
        source = xp.where(filled, source, xp.zeros_like(source))
        row_slots = xp.where(filled, xp.take(s.order, source), xp.zeros_like(source))
    else:
        row_slots = xp.zeros_like(rows)
    return StaticLayout(slot_rows, xp.reshape(s.kept, (tokens, k)), row_slots, filled, s.sent, s.demand)


Exchange = Callable[[Any], Any]
"""How a caller moves a static step's blocks: the even all-to-all of an array's rows (``W``
equal blocks, block c to rank c), returning what arrived, with its gradient where the caller
records one. Eager calls, torch.compile's traced forms, ``jax.jit``'s callbacks and the tests'
whole world on one process each supply theirs; the step itself is written once, here."""


class Outgoing(NamedTuple):
    """What a static dispatch sends: its ``layout``, the send buffer ``rows`` (``W * E * C``
    rows) and the ``counts`` (``W * (1 + 2E)`` ints: :func:`~unicoll.backends.blocks.counts_told`)."""

    layout: StaticLayout
    rows: Any
    counts: Any


class Arrived(NamedTuple):
    """What a static dispatch hands its caller: the ``rows`` as ``(E, W * C, ...)`` blocks, the
    ``counts`` (``(E, W)``: each block's valid rows) and ``received_before_drop`` (``(E, W)``)."""

    rows: Any
    counts: Any
    received_before_drop: Any


def dispatch_outgoing(xp: Any, x: Any, topk_idx: Any, world: int, experts_per_rank: int, capacity: int) -> Outgoing:
    """The first half of a static dispatch: the layout of ``topk_idx`` and what it sends."""
    layout = static_layout(xp, topk_idx, world * experts_per_rank, capacity)
    return Outgoing(layout, send_rows(xp, x, layout), counts_told(xp, layout, world))


def dispatch_arrived(xp: Any, rows: Any, counts: Any, world: int, experts_per_rank: int) -> Arrived:
    """The second half: the rows and the counts that arrived, as the caller gets them."""
    _, valid, before = counts_heard(xp, counts, world, experts_per_rank)
    return Arrived(expert_major(xp, rows, world, experts_per_rank), valid, before)


def dispatch_blocks(
    xp: Any, x: Any, topk_idx: Any, world: int, experts_per_rank: int, capacity: int, exchange: Exchange
) -> tuple[StaticLayout, Arrived]:
    """A static dispatch whose blocks move by ``exchange``: the layout and what arrived."""
    out = dispatch_outgoing(xp, x, topk_idx, world, experts_per_rank, capacity)
    return out.layout, dispatch_arrived(xp, exchange(out.rows), exchange(out.counts), world, experts_per_rank)


def redispatch_blocks(
    xp: Any, x: Any, layout: StaticLayout, world: int, experts_per_rank: int, exchange: Exchange
) -> Any:
    """A static redispatch (other rows of the same tokens along ``layout``) by ``exchange``."""
    return expert_major(xp, exchange(send_rows(xp, x, layout)), world, experts_per_rank)


def combine_blocks(
    xp: Any, y: Any, layout: StaticLayout, weights: Any, world: int, experts_per_rank: int, exchange: Exchange
) -> Any:
    """A static combine of blocks ``y`` by ``exchange``: sent back, each token's slots summed."""
    back = exchange(source_major(xp, y, world, experts_per_rank))
    slots = slots_of(xp, with_zero_row(xp, back), slot_index(xp, layout, back.shape[0]))
    return weighted_sum(xp, slots, layout.kept, weights)


class StaticHandle(SessionHandle):
    """What :func:`unicoll.moe.dispatch_static` hands back for the matching
    :func:`unicoll.moe.combine_static` and :func:`unicoll.moe.redispatch_static`: the layout of
    one routing, the block shape, and the counts.

    ``counts`` and ``received_before_drop``: ``(E, W)`` int64 arrays on x's device, the rows each
    (local expert, source rank) block holds and the slots its source routed there before the
    capacity dropped any; ``sent_before_drop``: ``(W * E,)``, the slots this rank routed to each
    global expert before the capacity; ``kept``: ``(tokens, k)`` bool, which slots were sent.
    Like :class:`~unicoll.routing.Handle` it keeps the caller's ``topk_weights`` (combine weighs
    by them when it runs) and nothing else of the caller's, and refuses to be used once its
    session ends.
    """

    def __init__(
        self,
        group: Any,
        experts_per_rank: int,
        capacity: int,
        weights: Any,
        like: Any,
        counts: tuple[Any, Any, Any],
        kept: Any,
        layout: StaticLayout,
        dispatch_number: int = -1,
        once: Any = None,
        row_nbytes: int = 0,
        whole_blocks: bool = True,
    ) -> None:
        """``like``: the dispatched x, whose library and device later rows must have (not kept).
        ``counts``: ``counts``, ``received_before_drop`` and ``sent_before_drop``. ``layout``:
        the :class:`~unicoll.backends.blocks.StaticLayout` as the backend takes it (numpy
        arrays on a host backend, else where the router's ids were).
        ``dispatch_number``: in check mode, the dispatch's collective number on ``group``.
        ``once``: how each token went once per rank (see :attr:`once`), or None.
        ``row_nbytes``: the bytes of one dispatched row. ``whole_blocks``: whether the blocks
        travelled whole (else only their valid rows did)."""
        self.layout = layout
        """What combine, redispatch and the backward passes follow (see above)."""
        self.once = once
        """How each token went once per rank (:class:`unicoll.eager.static_once.StaticOnce` on a
        host backend, :class:`unicoll.once_blocks.BlocksOnce` in fixed shapes), or None."""
        self._row_nbytes, self._whole_blocks = row_nbytes, whole_blocks
        self.world = group.world_size
        self.experts_per_rank = experts_per_rank
        self.capacity = capacity
        self.tokens, self.topk = kept.shape
        self.library = library_of(like)
        self.device = place_of(like)
        self.counts, self.received_before_drop, self.sent_before_drop = counts
        self.valid = counts[0]
        """The valid rows of each block as the dispatch made them, an array of the layout's
        library (a joined library's caller is handed :attr:`counts` in its own)."""
        self.kept = kept
        super().__init__(group, weights, dispatch_number)

    @classmethod
    def of_blocks(
        cls,
        group: Any,
        experts_per_rank: int,
        capacity: int,
        weights: Any,
        like: Any,
        layout: StaticLayout,
        arrived: Arrived,
        dispatch_number: int = -1,
        once: Any = None,
        row_nbytes: int = 0,
        whole_blocks: bool = True,
    ) -> StaticHandle:
        """The handle of a dispatch of ``like`` by ``layout`` (as the backend takes it), whose
        counts ``arrived`` with its blocks; the layout's ``kept`` and ``demand`` are shown in
        like's library on its device. The rest: as the constructor's."""
        counts = (arrived.counts, arrived.received_before_drop, host_as(layout.demand, like))
        return cls(group, experts_per_rank, capacity, weights, like, counts, host_as(layout.kept, like), layout,
                   dispatch_number, once, row_nbytes, whole_blocks)  # fmt: skip

    @property
    def bytes_sent(self) -> int:
        """The bytes of rows (and their metadata) this rank's dispatch sent the other ranks: its
        whole blocks where they travelled whole (a device backend, compiled code), else their
        valid rows, each token once per rank where it went so."""
        if self.once is not None:
            return self.once.bytes_sent(self.group.rank)
        if self._whole_blocks:
            return (self.world - 1) * self.experts_per_rank * self.capacity * self._row_nbytes
        return self.bytes_one_row_per_slot

    @property
    def bytes_one_row_per_slot(self) -> int:
        """The bytes this rank's dispatch would have sent the other ranks with one row per kept
        slot (the counts are read on the host where they are on a device)."""
        per_rank = on_host(self.layout.sent).reshape(self.world, -1).sum(1)
        return (int(per_rank.sum()) - int(per_rank[self.group.rank])) * self._row_nbytes

    def __repr__(self) -> str:
        blocks = f"{self.experts_per_rank} x {self.world * self.capacity} rows"
        state = f"ended: {self._ended}" if self._ended else blocks
        return f"<unicoll.moe.StaticHandle {self.tokens} tokens x top-{self.topk}, capacity {self.capacity}, {state}>"
