"""The static-shape MoE mode on a host backend with each token sent once per destination rank
(:mod:`unicoll.backends.once`): the blocks keep their shapes, what travels shrinks.

On a host backend a static dispatch sends only its blocks' valid rows, and those are the
dynamic mode's rows of the same routing (:func:`routing_of`), capacity applied. So the static
dispatch tells its peers its blocks' counts and its offer of the once form in one exchange
(:func:`dispatch`); where the ranks agree on the form, the dynamic mode's once transfer moves
the rows and the expansion lays them straight into the blocks, else the backend's own static
transfer moves them with the counts heard. combine, redispatch and the backward passes take the
blocks' valid rows (:class:`BlockRows`) through the dynamic mode's once operations.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from array_api_compat import array_namespace, device

from ..backends.base import Backend, Pending
from ..backends.blocks import StaticLayout, counts_heard, counts_told, refuse_other_capacities
from ..backends.layout import Routing, moe_plan
from ..backends.once import bounds
from ..group import Group
from ..spec import MOE_DISPATCH_STATIC
from . import moe_once
from .moe_once import OnceLayout, as_native, as_torch
from .once_choice import Offer, offer


def routing_of(layout: StaticLayout) -> Routing:
    """The dynamic mode's :class:`~unicoll.backends.layout.Routing` of a static layout on the
    host: the blocks' valid rows in block order (by global expert, then slot) are the rows
    sent, and each kept slot's row is its place among them.

    >>> from unicoll.routing import static_route
    >>> r = routing_of(static_route(np.array([[1, 0], [1, -1], [0, 1]]), 2, 2))
    >>> r.local_count.tolist(), r.send_tokens.tolist(), r.slot_rows.tolist(), r.dropped
    ([2, 2], [0, 2, 0, 1], [2, 0, 3, 4, 1, 4], True)
    """
    tokens, k = layout.kept.shape
    send_slots = layout.row_slots[layout.filled]
    slot_rows = np.full(tokens * k, send_slots.size, dtype=np.int64)
    slot_rows[send_slots] = np.arange(send_slots.size)
    return Routing(np.asarray(layout.sent), send_slots // k, slot_rows, send_slots.size < tokens * k, k)


class BlockRows(NamedTuple):
    """Where the valid rows of a static dispatch's blocks are: ``valid_rows`` (each valid row's
    row among the ``(E * W * C)`` rows of the blocks, expert-major, then source rank, then
    slot: the dynamic mode's order) and ``placed`` (each block row's valid row, or -1 for
    padding)."""

    valid_rows: np.ndarray
    placed: np.ndarray

    @classmethod
    def of(cls, valid: np.ndarray, capacity: int) -> BlockRows:
        """Those of blocks with ``valid[e, c]`` valid rows of ``capacity``.

        >>> b = BlockRows.of(np.array([[1, 0], [2, 1]]), 2)
        >>> b.valid_rows.tolist(), b.placed.tolist()
        ([0, 4, 5, 6], [0, -1, -1, -1, 1, 2, 3, -1])
        """
        counts = np.asarray(valid, dtype=np.int64).reshape(-1)
        starts = np.arange(counts.size, dtype=np.int64) * capacity
        firsts = bounds(counts)
        valid_rows = np.repeat(starts - firsts[:-1], counts) + np.arange(firsts[-1], dtype=np.int64)
        placed = np.full(counts.size * capacity, -1, dtype=np.int64)
        placed[valid_rows] = np.arange(valid_rows.size, dtype=np.int64)
        return cls(valid_rows, placed)


class StaticOnce(NamedTuple):
    """What a static handle keeps of a dispatch that sent each token once per rank: the once
    ``layout``, the ``routing`` it was made from and where the blocks' valid rows are."""

    layout: OnceLayout
    routing: Routing
    rows: BlockRows

    def bytes_sent(self, rank: int) -> int:
        """The bytes of rows and metadata the dispatch sent the other ranks."""
        return self.layout.bytes_sent(rank)[0]


def static_offer(layout: StaticLayout, rank: int, world: int, native: Any, weights: Any) -> Offer:
    """This rank's offer of the once form for a static dispatch of ``native`` by ``layout``
    (:func:`~unicoll.eager.once_choice.offer`): only where ``UNICOLL_MOE_ONCE=1``. By default
    the static mode sends one row per slot: its blocks add passes over the rows to the form's
    local work, and with the backward pass the form was slower on mpi's shared memory even at
    top-8 (1.27-1.48 of the time; 0.64-0.81 on gloo; docs/performance.md)."""
    routing = routing_of(layout)
    return offer(MOE_DISPATCH_STATIC.name, routing, rank, world, native, weights, False, by_default=False)


def dispatch(
    backend: Backend,
    group: Group,
    x: Any,
    layout: StaticLayout,
    offered: Offer,
    weights: Any,
    async_op: bool,
    calc_stream: bool,
) -> tuple[StaticOnce | None, Pending]:
    """A static dispatch of ``x`` (native) by ``layout`` (host) on a host backend: the blocks'
    counts and the offer told in one exchange (every rank refusing capacities that differ),
    then the rows moved once per rank where the ranks agree, else by the backend's static
    transfer. Returns what the handle keeps of the once form (None for the plain one) and the
    transfer, which finishes as the backend's does: ``(blocks, heard)``."""
    world = group.world_size
    experts, capacity = layout.blocks(world)
    counts = counts_told(np, layout, world).reshape(world, -1)
    told = np.concatenate([counts, offered.told], axis=1)
    heard = backend.exchange_ints(told.reshape(-1), group).reshape(world, -1)
    heard_counts = np.ascontiguousarray(heard[:, : counts.shape[1]]).reshape(-1)
    capacities, valid, _ = counts_heard(np, heard_counts, world, experts)
    refuse_other_capacities(capacities, capacity)
    plan = moe_plan(offered.routing.local_count, np.ascontiguousarray(valid.T).reshape(-1), world)
    once = offered.agreed(heard[:, counts.shape[1] :], np.array(plan.recv, dtype=np.int64))
    if once is None:
        pending = backend.moe_dispatch_static(x, layout, group, async_op, calc_stream, valid)
        return None, Pending(pending.works, lambda: (pending.finish()[0], _as_x(heard_counts, x)))
    rows = BlockRows.of(valid, capacity)
    moved = moe_once.dispatch(backend, group, x, once, plan, weights, async_op, calc_stream, rows.placed)

    def finish() -> tuple[Any, Any]:
        blocks = moved.finish()
        return blocks.reshape(experts, world * capacity, *blocks.shape[1:]), _as_x(heard_counts, x)

    return StaticOnce(once, offered.routing, rows), Pending(moved.works, finish)


def _as_x(ints: np.ndarray, x: Any) -> Any:
    """Host ints as an array of x's library (a host backend's native: numpy or a CPU tensor)."""
    return array_namespace(x).asarray(ints, device=device(x))


def redispatch(
    backend: Backend, group: Group, x: Any, once: StaticOnce, blocks: tuple[int, int], async_op: bool, calc_stream: bool
) -> Pending:
    """A static redispatch of ``x`` (native) along ``once``, which finishes as the backend's
    does: ``(blocks, None)``, the blocks ``(E, W * C, ...)`` (``blocks``: E and W * C)."""
    moved = moe_once.redispatch(backend, group, x, once.layout, async_op, calc_stream, once.rows.placed)
    return Pending(moved.works, lambda: (_shaped(moved.finish(), blocks), None))


def _shaped(rows: Any, blocks: tuple[int, int]) -> Any:
    return rows.reshape(*blocks, *rows.shape[1:])


def valid_rows(backend: Backend, blocks: Any, once: StaticOnce) -> Any:
    """The valid rows of native blocks ``(E, W * C, ...)``, in the dynamic mode's expert-major order."""
    return backend.take_rows(blocks.reshape(-1, *blocks.shape[2:]), once.rows.valid_rows)


def placed(backend: Backend, rows: Any, once: StaticOnce, blocks: tuple[int, int]) -> Any:
    """Native expert-major rows laid into blocks ``(E, W * C, ...)`` (``blocks``: E and W * C),
    zeros after each block's valid rows."""
    import torch  # the sums are torch's on every host backend (moe_once)

    flat = as_torch(rows)
    out = flat.new_zeros((once.rows.placed.size, *flat.shape[1:]))
    out.index_copy_(0, torch.from_numpy(once.rows.valid_rows), flat)
    return _shaped(as_native(out, rows), blocks)
