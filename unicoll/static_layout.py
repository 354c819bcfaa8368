"""The layout of a static-shape top-k dispatch, computed where the router's ids are (host or
device) with array-API operations only, so numpy, torch and cupy, eager or traced by
torch.compile, share this one code path and nothing is read to the host. (On a host backend,
:mod:`unicoll.eager.static_host` routes the same slots with moe.dispatch's router.)

With ``capacity`` C, rank r's send buffer has ``W * E * C`` rows: block ``g = c * E + e`` (C
rows) holds what r sends to local expert e of rank c, its kept slots first in slot order
``s = t * k + j``, then padding (zeros). A slot whose expert already has C earlier slots is
dropped, as is a slot whose id is -1 (or outside ``0 .. W * E - 1``). The even all-to-all of
that buffer hands each rank a ``(W, E, C)`` grid of blocks by source rank, which
:func:`expert_major` turns into the ``(E, W * C)`` rows the experts see.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from .arrays import library_of, place_of
from .device_routing import index_dtype, order_slots, place
from .routing import Routing, SessionHandle

if TYPE_CHECKING:
    from .backends.layout import MoePlan


class StaticLayout(NamedTuple):
    """Where each slot's row goes in the send buffer, as arrays of topk_idx's library and device.

    ``slot_rows[s]``: slot s's row in the send buffer (0 where the slot is dropped);
    ``kept[s]``: whether slot s is sent; ``row_tokens[r]``: the token whose row fills send row r
    (0 for padding); ``filled[r]``: whether send row r holds a token; ``sent[g]``: the rows
    sent to global expert g (at most C); ``demand[g]``: the slots routed to g before C dropped
    any (the true counts).
    """

    slot_rows: Any
    kept: Any
    row_tokens: Any
    filled: Any
    sent: Any
    demand: Any


def static_layout(xp: Any, topk_idx: Any, experts: int, capacity: int) -> StaticLayout:
    """The :class:`StaticLayout` of ``topk_idx`` (a ``(T, k)`` int array) for ``experts``
    global experts and ``capacity`` rows per (rank, expert) block. ``xp``: topk_idx's array
    namespace (array-api-compat's).

    >>> import array_api_compat.numpy as xp, numpy as np
    >>> layout = static_layout(xp, np.array([[1, 0], [1, -1], [0, 1]]), 2, 2)
    >>> layout.slot_rows.tolist(), layout.kept.tolist(), layout.row_tokens.tolist(), layout.sent.tolist()
    ([2, 0, 3, 0, 1, 0], [[True, True], [True, False], [True, False]], [0, 2, 0, 1], [2, 2])
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
        row_tokens = xp.where(filled, xp.take(s.order, source) // k, xp.zeros_like(source))
    else:
        row_tokens = xp.zeros_like(rows)
    return StaticLayout(slot_rows, xp.reshape(s.kept, (tokens, k)), row_tokens, filled, s.sent, s.demand)


def send_rows(xp: Any, x: Any, layout: StaticLayout) -> Any:
    """The send buffer: row r is x's row ``row_tokens[r]`` where ``filled[r]``, else zeros
    (whatever x holds: inf and nan stay out of the padding)."""
    rows = xp.take(_one_row_at_least(xp, x), layout.row_tokens, axis=0)
    return xp.where(_column(xp, layout.filled, x.ndim), rows, xp.zeros_like(rows))


def expert_major(xp: Any, received: Any, world: int, experts_per_rank: int) -> Any:
    """The rows an even all-to-all delivered (``W`` blocks of ``E * C`` rows by source rank)
    as ``(E, W * C, *trailing)``: expert-major, then source rank."""
    trailing, capacity = tuple(received.shape[1:]), received.shape[0] // (world * experts_per_rank)
    grid = xp.reshape(received, (world, experts_per_rank, capacity, *trailing))
    swapped = xp.permute_dims(grid, (1, 0, 2, *range(3, grid.ndim)))
    return xp.reshape(swapped, (experts_per_rank, world * capacity, *trailing))


def source_major(xp: Any, rows: Any, world: int, experts_per_rank: int) -> Any:
    """The inverse of :func:`expert_major`: ``(E, W * C, ...)`` rows as ``W * E * C`` rows by
    destination rank, ready for the even all-to-all back."""
    trailing, capacity = tuple(rows.shape[2:]), rows.shape[1] // world
    grid = xp.reshape(rows, (experts_per_rank, world, capacity, *trailing))
    swapped = xp.permute_dims(grid, (1, 0, 2, *range(3, grid.ndim)))
    return xp.reshape(swapped, (world * experts_per_rank * capacity, *trailing))


def counts_grid(xp: Any, received: Any, world: int, experts_per_rank: int) -> Any:
    """The per-block counts an even all-to-all of ``(W * E,)`` counts delivered, as ``(E, W)``:
    ``[e, c]`` is what rank c sent this rank's expert e."""
    return xp.permute_dims(xp.reshape(received, (world, experts_per_rank)), (1, 0))


def counts_out(xp: Any, layout: StaticLayout, world: int, experts_per_rank: int) -> Any:
    """What this rank tells each rank c in the counts' even all-to-all: for each of c's experts,
    the rows it sends and the slots it routed there before the capacity (block c of ``W * 2E``
    int64)."""
    sent = xp.reshape(layout.sent, (world, experts_per_rank))
    wanted = xp.reshape(layout.demand, (world, experts_per_rank))
    return xp.reshape(xp.concat([sent, wanted], axis=1), (-1,))


def counts_in(xp: Any, received: Any, world: int, experts_per_rank: int) -> tuple[Any, Any]:
    """The counts' even all-to-all as received (:func:`counts_out` of every rank), as two
    ``(E, W)`` arrays: the valid rows of each block, and the slots routed there before the
    capacity."""
    got = xp.reshape(received, (world, 2 * experts_per_rank))
    valid = xp.reshape(got[:, :experts_per_rank], (-1,))
    before = xp.reshape(got[:, experts_per_rank:], (-1,))
    return counts_grid(xp, valid, world, experts_per_rank), counts_grid(xp, before, world, experts_per_rank)


def sum_slots(xp: Any, back: Any, layout: StaticLayout, weights: Any) -> Any:
    """``out[t] = sum_j w[t, j] * back[slot_rows[t, j]]`` over kept slots (w = 1 without
    ``weights``), in the promoted dtype of back and the weights, as back's dtype. A dropped
    slot contributes exactly zero (its row is not read: inf or nan there stay out)."""
    tokens, k = layout.kept.shape
    trailing = tuple(back.shape[1:])
    rows = xp.take(_one_row_at_least(xp, back), layout.slot_rows, axis=0)
    rows = xp.where(_column(xp, xp.reshape(layout.kept, (-1,)), back.ndim), rows, xp.zeros_like(rows))
    rows = xp.reshape(rows, (tokens, k, math.prod(trailing)))
    if weights is None:
        out = xp.sum(rows, axis=1)
    else:
        common = xp.result_type(back.dtype, weights.dtype)
        w = xp.where(layout.kept, weights, xp.zeros_like(weights))
        out = xp.matmul(xp.astype(xp.reshape(w, (tokens, 1, k)), common), xp.astype(rows, common))
    return xp.astype(xp.reshape(out, (tokens, *trailing)), back.dtype)


Exchange = Callable[[Any], Any]
"""How a caller moves a static step's blocks: the even all-to-all of an array's rows (``W``
equal blocks, block c to rank c), returning what arrived, with its gradient where the caller
records one. Eager calls, torch.compile's traced forms, ``jax.jit``'s callbacks and the tests'
whole world on one process each supply theirs; the step itself is written once, here."""


class Outgoing(NamedTuple):
    """What a static dispatch sends: its ``layout``, the send buffer ``rows`` (``W * E * C``
    rows) and the ``counts`` (``W * 2E`` ints: :func:`counts_out`)."""

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
    return Outgoing(layout, send_rows(xp, x, layout), counts_out(xp, layout, world, experts_per_rank))


def dispatch_arrived(xp: Any, rows: Any, counts: Any, world: int, experts_per_rank: int) -> Arrived:
    """The second half: the rows and the counts that arrived, as the caller gets them."""
    valid, before = counts_in(xp, counts, world, experts_per_rank)
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
    return sum_slots(xp, exchange(source_major(xp, y, world, experts_per_rank)), layout, weights)


def _one_row_at_least(xp: Any, x: Any) -> Any:
    """``x``, or for an array of no rows one row of zeros made from it: a take then reads a row
    it masks out, and the result still comes from x, so autograd runs its backward on this rank
    as on the others (a rank without tokens joins the transfer back)."""
    if x.shape[0]:
        return x
    return xp.concat([x, xp.zeros((1, *x.shape[1:]), dtype=x.dtype, device=place(x))], axis=0)


def _column(xp: Any, mask: Any, ndim: int) -> Any:
    """A 1-D mask shaped to broadcast over rows of ``ndim - 1`` trailing dimensions."""
    return xp.reshape(mask, (mask.shape[0], *([1] * (ndim - 1))))


class HostRoute(NamedTuple):
    """A static layout on a host backend, as the dynamic mode's routing (the valid rows in
    send order, each slot's place among them) and padded plan, which the transfers follow."""

    routing: Routing
    plan: MoePlan


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
        layout: StaticLayout | HostRoute,
        dispatch_number: int = -1,
    ) -> None:
        """``like``: the dispatched x, whose library and device later rows must have (not kept).
        ``counts``: ``counts``, ``received_before_drop`` and ``sent_before_drop``. ``layout``:
        the :class:`StaticLayout` where the router's ids were (a device backend), or the
        routing and plan on the host (a host backend). ``dispatch_number``: in check mode, the
        dispatch's collective number on ``group``."""
        self.layout = layout
        """What combine, redispatch and the backward passes follow (see above)."""
        self.world = group.world_size
        self.experts_per_rank = experts_per_rank
        self.capacity = capacity
        self.tokens, self.topk = kept.shape
        self.library = library_of(like)
        self.device = place_of(like)
        self.counts, self.received_before_drop, self.sent_before_drop = counts
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
    ) -> StaticHandle:
        """The handle of a dispatch whose whole blocks moved (:func:`dispatch_blocks`, or its
        halves): ``layout`` where the router's ids were, and the counts ``arrived`` with them."""
        counts = (arrived.counts, arrived.received_before_drop, layout.demand)
        return cls(group, experts_per_rank, capacity, weights, like, counts, layout.kept, layout, dispatch_number)

    def __repr__(self) -> str:
        blocks = f"{self.experts_per_rank} x {self.world * self.capacity} rows"
        state = f"ended: {self._ended}" if self._ended else blocks
        return f"<unicoll.moe.StaticHandle {self.tokens} tokens x top-{self.topk}, capacity {self.capacity}, {state}>"
