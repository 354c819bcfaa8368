"""The blocks of a static-shape top-k dispatch, as the transports move them: the layout that
says where each slot's row goes, and the array-API steps around the transfer (numpy, torch,
cupy and JAX, eager or traced), which :meth:`~unicoll.backends.base.Backend.moe_dispatch_static`
and :meth:`~unicoll.backends.base.Backend.moe_combine_static` compose and the traced forms
share. :mod:`unicoll.static_layout` computes the layout.

With ``capacity`` C, ``W`` ranks and ``E`` experts per rank, a rank's send buffer has
``W * E * C`` rows: block ``g = c * E + e`` (C rows) holds what it sends to local expert e of
rank c, its kept slots first in slot order ``s = t * k + j``, then padding (zeros); a slot
whose expert already has C earlier slots is dropped, as is a slot whose id is -1 (or outside
``0 .. W * E - 1``). The even
all-to-all of that buffer hands each rank a ``(W, E, C)`` grid of blocks by source rank, which
:func:`expert_major` turns into the ``(E, W * C)`` rows the experts see. With each block, a rank
tells its destination ``1 + 2E`` ints (:func:`counts_told`): the capacity, the rows it sends
each expert, the slots it routed there before the capacity.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from unicoll.arrays import place
from unicoll.errors import CrossRankMismatchError


class StaticLayout(NamedTuple):
    """Where each slot's row goes in the send buffer, as arrays of topk_idx's library and device.

    ``slot_rows[s]``: slot s's row in the send buffer (0 where the slot is dropped);
    ``kept[t, j]``: whether slot ``t * k + j`` is sent; ``row_slots[r]``: the slot whose row
    fills send row r (0 for padding); ``filled[r]``: whether send row r holds a slot's row;
    ``sent[g]``: the rows sent to global expert g (at most C); ``demand[g]``: the slots routed
    to g before C dropped any (the true counts).
    """

    slot_rows: Any
    kept: Any
    row_slots: Any
    filled: Any
    sent: Any
    demand: Any

    def blocks(self, world: int) -> tuple[int, int]:
        """``(E, C)``: the experts per rank and the capacity of this layout's blocks."""
        experts = self.sent.shape[0]
        return experts // world, self.filled.shape[0] // experts

    def row_index(self, rows: int) -> Any:
        """Which row of a source of ``rows`` rows fills each send row: the source has one row
        per token (a dispatch), or one per slot (``T * k`` rows: a combine's backward; the two
        agree where k is 1)."""
        tokens, k = self.kept.shape
        return self.row_slots if rows == tokens * k else self.row_slots // k


def send_rows(xp: Any, x: Any, layout: StaticLayout) -> Any:
    """The send buffer: row r is x's row :meth:`~StaticLayout.row_index` ``[r]`` where
    ``filled[r]``, else zeros (whatever x holds: inf and nan stay out of the padding)."""
    rows = xp.take(_one_row_at_least(xp, x), layout.row_index(x.shape[0]), axis=0)
    return xp.where(_kept_column(xp, layout.filled, x.ndim), rows, xp.zeros_like(rows))


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


def slot_index(xp: Any, layout: StaticLayout, rows: int) -> Any:
    """Each slot's row in what a combine's transfer brought back (``rows`` rows in send order,
    then one zero row): its send row, or for a dropped slot the zero row (index ``rows``), so
    that whatever the padding holds (inf, nan) is never read. ``T * k`` int64, slot order."""
    return xp.where(xp.reshape(layout.kept, (-1,)), xp.reshape(layout.slot_rows, (-1,)), rows)


def with_zero_row(xp: Any, rows: Any) -> Any:
    """``rows`` followed by one row of zeros (the row :func:`slot_index` gives a dropped slot)."""
    zero = xp.zeros((1, *rows.shape[1:]), dtype=rows.dtype, device=place(rows))
    return xp.concat([rows, zero], axis=0)


def slots_of(xp: Any, back: Any, index: Any) -> Any:
    """Each slot's row, ``back[index]``: ``T * k`` rows in slot order (see :func:`slot_index`)."""
    return xp.take(back, index, axis=0)


def weighted_sum(xp: Any, slots: Any, kept: Any, weights: Any) -> Any:
    """``out[t] = sum_j w[t, j] * slots[t * k + j]`` (w = 1 without ``weights``; a dropped slot,
    whose row is zeros, weighs zero whatever its weight), in the promoted dtype of the rows and
    the weights, as the rows' dtype."""
    tokens, k = kept.shape
    trailing = tuple(slots.shape[1:])
    rows = xp.reshape(slots, (tokens, k, math.prod(trailing)))
    if weights is None:
        out = xp.sum(rows, axis=1)
    else:
        common = xp.result_type(slots.dtype, weights.dtype)
        w = xp.where(kept, weights, xp.zeros_like(weights))
        out = xp.matmul(
            xp.astype(xp.reshape(w, (tokens, 1, k)), common, copy=False), xp.astype(rows, common, copy=False)
        )
    return xp.astype(xp.reshape(out, (tokens, *trailing)), slots.dtype, copy=False)


def counts_told(xp: Any, layout: StaticLayout, world: int) -> Any:
    """What this rank tells each rank c with its blocks: the capacity, then for each of c's
    experts the rows it sends and the slots it routed there before the capacity
    (``W * (1 + 2E)`` int64, block c for rank c)."""
    experts, capacity = layout.blocks(world)
    sent = xp.reshape(layout.sent, (world, experts))
    wanted = xp.reshape(layout.demand, (world, experts))
    capacities = xp.full((world, 1), capacity, dtype=sent.dtype, device=place(sent))
    return xp.reshape(xp.concat([capacities, sent, wanted], axis=1), (-1,))


def counts_heard(xp: Any, received: Any, world: int, experts_per_rank: int) -> tuple[Any, Any, Any]:
    """The ints of :func:`counts_told` as received from every rank: each rank's capacity
    ``(W,)``, and as ``(E, W)`` arrays (``[e, c]``: rank c about this rank's expert e) the valid
    rows of each block and the slots routed there before the capacity."""
    got = xp.reshape(received, (world, 1 + 2 * experts_per_rank))

    def grid(part: Any) -> Any:  # (W, E) columns of got as (E, W), copied: DLPack takes it whole
        return xp.asarray(xp.permute_dims(part, (1, 0)), copy=True)

    return got[:, 0], grid(got[:, 1 : 1 + experts_per_rank]), grid(got[:, 1 + experts_per_rank :])


def refuse_other_capacities(capacities: Any, capacity: int) -> None:
    """Every rank's capacity (``(W,)`` host ints, as each told this rank with its counts)
    against this rank's: a rank that computed its own (from its own token count, say) would
    make blocks the others misread, so every rank raises the same error before any row moves."""
    if (capacities != capacity).any():
        told = ", ".join(f"rank {c}: {int(v)}" for c, v in enumerate(capacities))
        expected = "expected the same capacity on every rank"
        raise CrossRankMismatchError(f"moe.dispatch_static: capacity: {expected}, got {told}")


def _one_row_at_least(xp: Any, x: Any) -> Any:
    """``x``, or for an array of no rows one row of zeros made from it: a take then reads a row
    it masks out, and the result still comes from x, so autograd runs its backward on this rank
    as on the others (a rank without tokens joins the transfer back)."""
    return x if x.shape[0] else with_zero_row(xp, x)


def _kept_column(xp: Any, mask: Any, ndim: int) -> Any:
    """A 1-D mask shaped to broadcast over rows of ``ndim - 1`` trailing dimensions."""
    return xp.reshape(mask, (mask.shape[0], *([1] * (ndim - 1))))
