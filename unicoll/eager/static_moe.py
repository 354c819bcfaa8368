"""``unicoll.moe``'s static-shape operators, eagerly: ``dispatch_static``, ``redispatch_static``
and ``combine_static``.

On a device backend (NCCL) the layout (:mod:`unicoll.static_layout`) is computed where the
router's ids are, with array-API operations, so nothing is read to the host; the rows and the
counts travel as even all-to-alls (``W`` blocks of ``E * C`` rows, and of ``2 * E`` counts),
whose shapes the call's arguments fix. Gradients: the gathers, the padding and the weighted sum
are the array library's own differentiable operations, and the transfer's backward is
alltoall_single's (the even all-to-all back). On a host backend, where reading a count waits
for nothing, the same layout sends only the valid rows (:mod:`unicoll.eager.static_host`). The
semantics are in docs/semantics.md.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from array_api_compat import array_namespace

from .. import runtime
from ..arrays import library_of
from ..backends.base import Backend, Pending
from ..check import call_number, count_call, verify
from ..counts import on_host
from ..errors import translated
from ..group import Group
from ..spec import MOE_COMBINE_STATIC, MOE_DISPATCH_STATIC, MOE_REDISPATCH_STATIC, Call
from ..static_layout import (
    StaticHandle,
    dispatch_arrived,
    dispatch_outgoing,
    expert_major,
    send_rows,
    source_major,
    sum_slots,
)
from ..task import Task
from ..validate import prepare, read_only
from . import static_host
from .moe import check_handled, handle_group
from .ops import _functional, _run, alltoall_single_backward
from .static_host import refuse_drops


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
    the arguments' shapes, and nothing on a device is read to the host: no synchronization,
    and torch.compile traces it without dynamic shapes (on gloo and mpi, whose arrays are in
    host memory, only the valid rows travel). Each rank sends each expert at most
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


def check_dispatch(
    x: Any, topk_idx: Any, topk_weights: Any, experts_per_rank: int, capacity: int, group: Group | None
) -> None:
    """moe.dispatch_static's arguments read and checked by its spec, eager's errors raised, for
    a caller that runs the step itself (torch.compile's traced form); in check mode the ranks
    then compare it as the dispatch it is (its transfers are compared as what they are too)."""
    arguments = dict(x=x, topk_idx=topk_idx, topk_weights=topk_weights, experts_per_rank=experts_per_rank,
                     capacity=capacity, group=group, sync_op=True, overflow="drop")  # fmt: skip
    call = read_only(MOE_DISPATCH_STATIC, arguments)
    if call.check:
        count_call(call.group)
        with translated(MOE_DISPATCH_STATIC.name, call.group, call.timeout):
            verify(MOE_DISPATCH_STATIC, call, topk_idx=topk_idx)


def check_blocks(
    op: str, rows: Any, like: Any, tokens: int, blocks: tuple[int, int, int], weighted: bool, group: Group | None
) -> None:
    """The rows given to ``op`` (moe.redispatch_static's x, moe.combine_static's y) on
    ``group`` checked by its spec against a handle of ``tokens`` tokens, ``blocks`` (experts per
    rank, W, capacity) and x's place ``like``: eager's errors, for a caller whose handle is
    traced; in check mode the ranks then compare it as the call it is (the handles' blocks)."""
    spec = MOE_REDISPATCH_STATIC if op == MOE_REDISPATCH_STATIC.name else MOE_COMBINE_STATIC
    experts_per_rank, world, capacity = blocks
    check_handled(spec, rows, like, tokens=tokens, weighted=weighted, experts_per_rank=experts_per_rank, world=world,
                  capacity=capacity)  # fmt: skip
    state = runtime.state(op)
    if not state.check:
        return
    grp = runtime.resolve_group(group, op)
    call = Call(W=grp.world_size, group=grp, backend=state.backend, timeout=state.timeout, compare=True, check=True)
    call.handle = SimpleNamespace(dispatch_number=-1, experts_per_rank=experts_per_rank, capacity=capacity)
    setattr(call, spec.params[0].name, rows)
    count_call(grp)
    with translated(op, grp, state.timeout):
        verify(spec, call)


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
    if call.backend.host_memory:
        return static_host.dispatch(call, arguments)
    backend, grp, x, weights = call.backend, call.group, arguments["x"], arguments["topk_weights"]
    world, experts, capacity = call.W, call.experts_per_rank, call.capacity
    xp = array_namespace(x)
    out = dispatch_outgoing(xp, x, arguments["topk_idx"], world, experts, capacity)
    layout, number = out.layout, -1

    def issue() -> Pending:
        nonlocal number
        if call.compare:
            verify(MOE_DISPATCH_STATIC, call, topk_idx=arguments["topk_idx"])
            number = call_number(grp)
        if call.overflow == "error":
            refuse_drops(backend, grp, on_host(layout.demand), capacity)
        rows = _transfer(backend, backend.to_native(out.rows), grp, not call.sync_op, call.sync_op)
        got = _transfer(backend, backend.to_native(out.counts), grp, not call.sync_op, call.sync_op)
        return Pending(rows.works + got.works, lambda: (rows.finish(), got.finish()))

    received = _functional(MOE_DISPATCH_STATIC.name, call, out.rows, _backward(call))

    def finish(result: tuple[Any, Any]) -> tuple[Any, Any, StaticHandle]:
        rows, got = result
        arrived = dispatch_arrived(xp, received(rows), backend.from_native(got, library_of(x)), world, experts)
        handle = StaticHandle.of_blocks(grp, experts, capacity, weights, x, layout, arrived, number)
        return arrived.rows, arrived.counts, handle

    return _run(MOE_DISPATCH_STATIC.name, call, issue, finish)


def _redispatch(call: Call, arguments: dict[str, Any]) -> Any:
    if call.backend.host_memory:
        return static_host.redispatch(call, arguments)
    backend, grp, handle, x = call.backend, call.group, arguments["handle"], arguments["x"]
    xp = array_namespace(x)
    outgoing = send_rows(xp, x, handle.layout)

    def issue() -> Pending:
        if call.compare:
            verify(MOE_REDISPATCH_STATIC, call)
        return _transfer(backend, backend.to_native(outgoing), grp, not call.sync_op, call.sync_op)

    received = _functional(MOE_REDISPATCH_STATIC.name, call, outgoing, _backward(call))

    def finish(rows: Any) -> Any:
        return expert_major(xp, received(rows), handle.world, handle.experts_per_rank)

    return _run(MOE_REDISPATCH_STATIC.name, call, issue, finish)


def _combine(call: Call, arguments: dict[str, Any]) -> Any:
    if call.backend.host_memory:
        return static_host.combine(call, arguments)
    backend, grp, handle, y = call.backend, call.group, arguments["handle"], arguments["y"]
    xp = array_namespace(y)
    outgoing = source_major(xp, y, handle.world, handle.experts_per_rank)

    def issue() -> Pending:
        if call.compare:
            verify(MOE_COMBINE_STATIC, call)
        return _transfer(backend, backend.to_native(outgoing), grp, not call.sync_op, call.sync_op)

    returned = _functional(MOE_COMBINE_STATIC.name, call, outgoing, _backward(call))
    return _run(
        MOE_COMBINE_STATIC.name,
        call,
        issue,
        lambda back: sum_slots(xp, returned(back), handle.layout, handle.weights),
    )


def _backward(call: Call) -> Any:
    """The backward of a call's transfer: the even all-to-all back (alltoall_single's backward
    with the same W equal blocks both ways)."""
    backend, grp = call.backend, call.group

    def backward(grad: Any) -> Any:
        splits = _even(grad.shape[0], grp.world_size)
        return alltoall_single_backward(backend, grp, grad, splits, splits)

    return backward
