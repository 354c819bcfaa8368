"""``unicoll.moe``'s static-shape operators, eagerly: ``dispatch_static``, ``redispatch_static``
and ``combine_static``.

The layout (:mod:`unicoll.static_layout`) is computed where the router's ids are, with
array-API operations, so nothing is read to the host; the rows and the counts travel as even
all-to-alls (``W`` blocks of ``E * C`` rows, and of ``2 * E`` counts), which every backend has
and whose shapes the call's arguments fix. Gradients: the gathers, the padding and the weighted
sum are the array library's own differentiable operations, and the transfer's backward is
alltoall_single's (the even all-to-all back). The semantics are in docs/semantics.md.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from array_api_compat import array_namespace

from ..arrays import library_of
from ..backends.base import Backend, Pending
from ..backends.host import host_view
from ..check import call_number, verify
from ..counts import on_host
from ..errors import bad_input
from ..group import Group
from ..routing import Routing
from ..spec import MOE_COMBINE_STATIC, MOE_DISPATCH_STATIC, MOE_REDISPATCH_STATIC, Call
from ..static_layout import (
    StaticHandle,
    StaticLayout,
    counts_in,
    counts_out,
    expert_major,
    send_rows,
    source_major,
    static_layout,
    sum_slots,
)
from ..task import Task
from ..validate import prepare
from .moe import handle_group, host_as, records_gradient
from .moe import sum_slots as moe_sum_slots
from .ops import _functional, _run, alltoall_single_backward


def dispatch_static(
    x: Any,
    topk_idx: Any,
    topk_weights: Any | None = None,
    *,
    experts_per_rank: int,
    capacity: int,
    group: Group | None = None,
    sync_op: bool = True,
    overflow: str = "drop",
) -> tuple[Any, Any, StaticHandle] | Task:
    """Send each token to its top-k experts in blocks of a fixed size; returns ``(rows, counts, handle)``.

    ``rows`` has shape ``(experts_per_rank, W * capacity, *x.shape[1:])``: block
    ``[e, c * capacity:(c + 1) * capacity]`` holds the rows rank c sent this rank's expert e, its
    kept slots in slot order ``t * k + j``, then zeros. ``counts`` (``(experts_per_rank, W)``,
    int64, on x's device) says how many rows of each block are valid. Every shape follows from
    the arguments' shapes, and nothing is read to the host: no synchronization, and
    torch.compile traces it without dynamic shapes. Each rank sends each expert at most
    ``capacity`` rows, the lowest slots first; the handle's ``received_before_drop`` and
    ``sent_before_drop`` count the slots before that. ``sync_op=False`` returns a
    :class:`~unicoll.Task` whose ``wait()`` returns the same tuple.

    >>> # W=1, E=2, capacity 2: tokens x = [1, 2, 3], top-2 experts [[1, 0], [1, -1], [0, 1]]
    >>> rows, counts, handle = uc.moe.dispatch_static(x, topk_idx, experts_per_rank=2, capacity=2)  # doctest: +SKIP
    >>> rows.tolist(), counts.tolist()                                                                # doctest: +SKIP
    ([[1, 3], [1, 2]], [[2], [2]])
    """
    arguments = dict(x=x, topk_idx=topk_idx, topk_weights=topk_weights, experts_per_rank=experts_per_rank,
                     capacity=capacity, group=group, sync_op=sync_op, overflow=overflow)  # fmt: skip
    return _dispatch(prepare(MOE_DISPATCH_STATIC, arguments), arguments)


def redispatch_static(x: Any, handle: StaticHandle, *, sync_op: bool = True) -> Any | Task:
    """Send other rows of the same tokens along a static handle's routing (a second layer):
    no routing, no count exchange. Returns rows laid out as :func:`dispatch_static`'s.

    >>> rows2 = uc.moe.redispatch_static(h2, handle)   # doctest: +SKIP
    """
    arguments = dict(x=x, handle=handle, sync_op=sync_op, group=_static_group(MOE_REDISPATCH_STATIC.name, handle))
    return _redispatch(prepare(MOE_REDISPATCH_STATIC, arguments), arguments)


def combine_static(y: Any, handle: StaticHandle, *, sync_op: bool = True) -> Any | Task:
    """Send expert outputs back and sum each token's kept slots: ``out[t] = sum_j w[t, j] * y[row of (t, j)]``.

    ``y`` has :func:`dispatch_static`'s layout, ``(experts_per_rank, W * capacity, ...)`` (its
    trailing shape may differ from x's); padding rows travel but are never read, so whatever an
    expert makes of them (a bias, nan) stays out. Dropped slots contribute exactly zero.

    >>> out = uc.moe.combine_static(rows * 10, handle)   # doctest: +SKIP
    """
    arguments = dict(y=y, handle=handle, sync_op=sync_op, group=_static_group(MOE_COMBINE_STATIC.name, handle))
    return _combine(prepare(MOE_COMBINE_STATIC, arguments), arguments)


def _static_group(op: str, handle: Any) -> Group:
    """The group of a usable static handle (:func:`unicoll.eager.moe.handle_group`)."""
    return handle_group(op, handle, StaticHandle, "moe.dispatch_static")


def _even(rows: int, world: int) -> list[int]:
    return [rows // world] * world


def _transfer(backend: Backend, native: Any, group: Group, async_op: bool, calc_stream: bool) -> Pending:
    """The even all-to-all of ``native``'s rows (W equal blocks)."""
    splits = _even(native.shape[0], group.world_size)
    return backend.alltoall_single(None, native, splits, splits, group, async_op, calc_stream)


def _dispatch(call: Call, arguments: dict[str, Any]) -> Any:
    backend, grp, x, weights = call.backend, call.group, arguments["x"], arguments["topk_weights"]
    world, experts, capacity = call.W, call.experts_per_rank, call.capacity
    xp = array_namespace(x)
    layout = static_layout(xp, arguments["topk_idx"], world * experts, capacity)
    outgoing = _Outgoing(backend, xp, x, layout)
    counts = counts_out(xp, layout, world, experts)
    number = -1

    def issue() -> Pending:
        nonlocal number
        if call.check:
            verify(MOE_DISPATCH_STATIC, call, topk_idx=arguments["topk_idx"])
            number = call_number(grp)
        if call.overflow == "error":
            _refuse_drops(backend, grp, layout, capacity)
        rows = _transfer(backend, outgoing.native, grp, not call.sync_op, call.sync_op)
        got = _transfer(backend, backend.to_native(counts), grp, not call.sync_op, call.sync_op)
        return Pending(rows.works + got.works, lambda: (outgoing.sent(rows.finish()), got.finish()))

    received = _functional(MOE_DISPATCH_STATIC.name, call, outgoing.array, _backward(call))

    def finish(result: tuple[Any, Any]) -> tuple[Any, Any, StaticHandle]:
        rows, got = result
        rows = _expert_major(backend, xp, outgoing, received, rows, world, experts)
        valid, before = counts_in(xp, backend.from_native(got, library_of(x)), world, experts)
        handle = StaticHandle(layout, grp, experts, capacity, weights, x, valid, before, dispatch_number=number)
        return rows, valid, handle

    return _run(MOE_DISPATCH_STATIC.name, call, issue, finish)


def _redispatch(call: Call, arguments: dict[str, Any]) -> Any:
    backend, grp, handle, x = call.backend, call.group, arguments["handle"], arguments["x"]
    xp = array_namespace(x)
    outgoing = _Outgoing(backend, xp, x, handle.layout)

    def issue() -> Pending:
        if call.check:
            verify(MOE_REDISPATCH_STATIC, call)
        rows = _transfer(backend, outgoing.native, grp, not call.sync_op, call.sync_op)
        return Pending(rows.works, lambda: outgoing.sent(rows.finish()))

    received = _functional(MOE_REDISPATCH_STATIC.name, call, outgoing.array, _backward(call))

    def finish(rows: Any) -> Any:
        return _expert_major(backend, xp, outgoing, received, rows, handle.world, handle.experts_per_rank)

    return _run(MOE_REDISPATCH_STATIC.name, call, issue, finish)


def _combine(call: Call, arguments: dict[str, Any]) -> Any:
    backend, grp, handle, y = call.backend, call.group, arguments["handle"], arguments["y"]
    xp = array_namespace(y)
    if _in_host_memory(y) and not records_gradient(y, handle.weights):
        return _combine_on_host(call, y, handle)
    outgoing = source_major(xp, y, handle.world, handle.experts_per_rank)

    def issue() -> Pending:
        if call.check:
            verify(MOE_COMBINE_STATIC, call)
        return _transfer(backend, backend.to_native(outgoing), grp, not call.sync_op, call.sync_op)

    returned = _functional(MOE_COMBINE_STATIC.name, call, outgoing, _backward(call))
    return _run(
        MOE_COMBINE_STATIC.name,
        call,
        issue,
        lambda back: sum_slots(xp, returned(back), handle.layout, handle.weights),
    )


# -- on the host with no gradient: the big rows in the backend's workspace ----------------------
#
# Fresh host arrays of many megabytes fault in page by page on every call (see the workspace), so
# where nothing records a gradient the rows sent, received and sent back go through buffers the
# backend lends, as the dynamic mode's do, and combine sums with its slot-by-slot sum. The layout
# and its arithmetic are the array-API functions above either way; only where the rows land differs.


def _in_host_memory(x: Any) -> bool:
    """Whether ``x`` lives in host memory (numpy, or a CPU tensor)."""
    return library_of(x) == "numpy" or (library_of(x) == "torch" and x.device.type == "cpu")


class _Outgoing:
    """A dispatch's send buffer: ``array`` (x's library, what autograd sees) and ``native``
    (what the transfer sends). On the host with no gradient, gathered into a buffer the
    backend lends (given back by :meth:`sent`); else :func:`send_rows`'s array."""

    def __init__(self, backend: Backend, xp: Any, x: Any, layout: StaticLayout) -> None:
        self.backend, self.lent = backend, None
        if not _in_host_memory(x) or records_gradient(x):
            self.array = send_rows(xp, x, layout)
            self.native = backend.to_native(self.array)
            return
        native = backend.to_native(x)
        rows = layout.row_tokens.shape[0]
        self.native, self.lent = backend.scratch_rows(native, rows)
        buffer = host_view(self.native)
        if x.shape[0]:
            backend.take_rows(native, np.asarray(layout.row_tokens), self.native)
            buffer[~np.asarray(layout.filled)] = 0
        else:
            buffer[...] = 0
        self.array = x  # nothing to attach: no gradient is recorded

    def sent(self, result: Any) -> Any:
        """The transfer's result, once the send buffer is given back."""
        self.backend.give_back(self.lent)
        return result


def _expert_major(
    backend: Backend, xp: Any, outgoing: _Outgoing, received: Any, rows: Any, world: int, experts: int
) -> Any:
    """The received rows (native) as ``(E, W * C, ...)`` in the caller's library: on the host with
    no gradient, copied into rows the backend makes (lent until they are garbage)."""
    if outgoing.lent is None or world == 1 or experts == 1:
        return expert_major(xp, received(rows), world, experts)
    out = backend.empty_rows(rows, rows.shape[0])
    capacity = rows.shape[0] // (world * experts)
    _swap_blocks(host_view(out), host_view(rows), (world, experts, capacity))
    return received(out).reshape(experts, world * capacity, *rows.shape[1:])


def _swap_blocks(out: np.ndarray, rows: np.ndarray, grid: tuple[int, int, int]) -> None:
    """``out`` filled with ``rows`` (host views) whose ``(a, b, C)`` blocks of rows (``grid``)
    are read as ``(b, a, C)``: the permutation between source-major and expert-major."""
    a, b, capacity = grid
    width = math.prod(rows.shape[1:])
    out.reshape(b, a, capacity, width)[...] = rows.reshape(a, b, capacity, width).transpose(1, 0, 2, 3)


def _combine_on_host(call: Call, y: Any, handle: StaticHandle) -> Any:
    """combine_static on the host with no gradient: y's blocks copied into a lent buffer by
    destination rank, sent back into lent rows followed by a zero row (which dropped slots
    read), and summed slot by slot as moe.combine sums (:func:`unicoll.eager.moe.sum_slots`)."""
    backend, grp, library = call.backend, call.group, library_of(y)
    world, experts = handle.world, handle.experts_per_rank
    native = backend.to_native(y)
    rows = world * experts * handle.capacity
    routing = _host_routing(handle.layout, rows)

    def issue() -> Pending:
        if call.check:
            verify(MOE_COMBINE_STATIC, call)
        staged, staged_lent = backend.scratch_rows(_rows_of(native), rows)
        _swap_blocks(host_view(staged), host_view(_rows_of(native)), (experts, world, handle.capacity))
        back, back_lent = backend.scratch_rows(staged, rows + 1)
        host_view(back)[rows:] = 0
        splits = _even(rows, world)
        pending = backend.alltoall_single(back[:rows], staged, splits, splits, grp, not call.sync_op, call.sync_op)

        def done() -> tuple[Any, tuple[Any, ...]]:
            pending.finish()
            return back, (staged_lent, back_lent)

        return Pending(pending.works, done)

    def finish(result: tuple[Any, tuple[Any, ...]]) -> Any:
        back, lent = result
        native_weights = kept = None
        if handle.weights is not None:
            native_weights = backend.to_native(handle.weights)
            kept = host_as(routing.kept, native_weights)
        try:
            return backend.from_native(moe_sum_slots(backend, back, routing, native_weights, kept), library)
        finally:
            backend.give_back(*lent)

    return _run(MOE_COMBINE_STATIC.name, call, issue, finish)


def _rows_of(native: Any) -> Any:
    """``(E, W * C, ...)`` blocks as rows (a view): ``(E * W * C, ...)``."""
    return native.reshape(native.shape[0] * native.shape[1], *native.shape[2:])


def _host_routing(layout: StaticLayout, rows: int) -> Routing:
    """The static layout as the dynamic mode's :class:`~unicoll.routing.Routing` over the
    ``rows`` rows sent back: each kept slot's row, a dropped slot's the zero row after them."""
    kept = np.asarray(layout.kept).reshape(-1)
    slot_rows = np.where(kept, np.asarray(layout.slot_rows), rows)
    tokens, k = layout.kept.shape
    return Routing(np.asarray(layout.sent), np.asarray(layout.row_tokens), slot_rows, not kept.all(), k)


def _backward(call: Call) -> Any:
    """The backward of a call's transfer: the even all-to-all back (alltoall_single's backward
    with the same W equal blocks both ways)."""
    backend, grp = call.backend, call.group

    def backward(grad: Any) -> Any:
        splits = _even(grad.shape[0], grp.world_size)
        return alltoall_single_backward(backend, grp, grad, splits, splits)

    return backward


def _refuse_drops(backend: Backend, group: Group, layout: StaticLayout, capacity: int) -> None:
    """overflow='error': every rank's dropped slots (beyond the capacity) on the host, then the
    same ValueError on every rank if any rank dropped one."""
    demand = np.asarray(on_host(layout.demand), dtype=np.int64)
    over = int(np.maximum(demand - capacity, 0).sum())
    worst = int(demand.argmax()) if demand.size else 0
    mine = np.array([over, worst, int(demand.max()) if demand.size else 0], np.int64)
    every = backend.gather_ints(mine, group)
    for c, (dropped, expert, wanted) in enumerate(every.tolist()):
        if dropped:
            raise bad_input(
                MOE_DISPATCH_STATIC.name,
                "capacity",
                f"room for every slot (overflow='error'): at least {max(r[2] for r in every.tolist())}",
                f"{capacity}: rank {c} routes {wanted} slots to expert {expert} "
                f"({dropped} of its slots would be dropped)",
            )
