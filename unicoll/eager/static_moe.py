"""``unicoll.moe``'s static-shape operators, eagerly: ``dispatch_static``, ``redispatch_static``
and ``combine_static``.

The layout (:mod:`unicoll.static_layout`) is computed where the router's ids are, with
array-API operations, so nothing is read to the host, and the backend's entry points move the
rows: :meth:`~unicoll.backends.base.Backend.moe_dispatch_static` lays x's rows into blocks and
moves them with the counts, :meth:`~unicoll.backends.base.Backend.moe_combine_static` moves
blocks back as each slot's row, which the front end weighs and sums. Built in, a device backend
moves whole blocks by even all-to-alls whose shapes the arguments fix (given
``max_tokens_per_rank``, each token once per rank in shapes those fix:
:mod:`unicoll.eager.device_static_once`); a host backend, where reading a count waits for
nothing, sends only the valid rows. Gradients: dispatch's backward is
a combine of the gradient blocks, summed over each token's slots; combine's is a dispatch of the
slots' gradient rows; the weighted sum is the array library's own differentiable operations.
The semantics are in docs/semantics.md.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import numpy as np
from array_api_compat import array_namespace

from .. import runtime
from ..arrays import description_of, library_of
from ..backends.base import Backend, Pending
from ..backends.blocks import StaticLayout, counts_heard, weighted_sum
from ..backends.host import row_bytes
from ..check import call_number, count_call, verify
from ..counts import host_as, on_host
from ..errors import bad_input, translated
from ..group import Group
from ..libraries.native import TORCH
from ..routing import static_route
from ..spec import MOE_COMBINE_STATIC, MOE_DISPATCH_STATIC, MOE_REDISPATCH_STATIC, Call
from ..static_layout import Arrived, StaticHandle, static_layout
from ..task import Task
from ..validate import prepare, read_only
from . import static_once
from .moe import (
    check_handled,
    combine_once,
    dispatch_backward,
    handle_group,
    joined_to_dispatch,
    records_gradient,
    refuse_rewritten,
    sum_slots,
)
from .ops import _functional, _functional_linked, _run, guarded


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
    max_tokens_per_rank: int | None = None,
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
    :class:`~unicoll.Task` whose ``wait()`` returns the same tuple. With ``max_tokens_per_rank``
    (the same on every rank) a device backend and compiled code send each token once to each
    rank holding one of its kept slots, in fixed shapes, where that moves fewer bytes than the
    whole blocks (:mod:`unicoll.once_blocks`).

    >>> # W=1, E=2, capacity 2: tokens x = [1, 2, 3], top-2 experts [[1, 0], [1, -1], [0, 1]]
    >>> rows, counts, handle = uc.moe.dispatch_static(x, topk_idx, experts_per_rank=2, capacity=2)  # doctest: +SKIP
    >>> rows.tolist(), counts.tolist()                                                                # doctest: +SKIP
    ([[1, 3], [1, 2]], [[2], [2]])
    """
    arguments = dict(x=x, topk_idx=topk_idx, topk_weights=topk_weights, experts_per_rank=experts_per_rank,
                     capacity=capacity, group=group, sync_op=sync_op, overflow=overflow,
                     max_tokens_per_rank=max_tokens_per_rank)  # fmt: skip
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
    x: Any,
    topk_idx: Any,
    topk_weights: Any,
    experts_per_rank: int,
    capacity: int,
    max_tokens_per_rank: int | None,
    group: Group | None,
) -> None:
    """moe.dispatch_static's arguments read and checked by its spec, eager's errors raised, for
    a caller that runs the step itself (torch.compile's traced form); in check mode the ranks
    then compare it as the dispatch it is (its transfers are compared as what they are too)."""
    arguments = dict(x=x, topk_idx=topk_idx, topk_weights=topk_weights, experts_per_rank=experts_per_rank,
                     capacity=capacity, group=group, sync_op=True, overflow="drop",
                     max_tokens_per_rank=max_tokens_per_rank)  # fmt: skip
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


def _native(backend: Backend, layout: StaticLayout, like: Any) -> StaticLayout:
    """``layout`` as the backend takes it: on a host backend as it is (numpy), elsewhere as
    arrays of the backend's native library (the caller's arrays may be the other GPU
    library's, shared through DLPack)."""
    if backend.host_memory or library_of(layout.sent) == library_of(like):
        return layout
    return StaticLayout(*(backend.to_native(a) for a in layout))


def _layout(backend: Backend, topk_idx: Any, experts: int, capacity: int) -> StaticLayout:
    """The layout of ``topk_idx`` where the backend's arrays live: on a host backend numpy
    arrays from the host routing's send order (:func:`~unicoll.routing.static_route`, under a
    third of the array-API layout's time in numpy), which its transfers read as they are;
    elsewhere computed where the router's ids are, with array-API operations."""
    if backend.host_memory:
        return static_route(on_host(topk_idx), experts, capacity)
    return static_layout(array_namespace(topk_idx), topk_idx, experts, capacity)


def _dispatch(call: Call, arguments: dict[str, Any]) -> Any:
    """On a host backend whose static transfers are the built-in ones, the counts travel with
    the offer of the once form (:mod:`unicoll.eager.static_once`); on a device backend given
    ``max_tokens_per_rank``, each token once per rank in fixed shapes where that saves bytes
    (:mod:`unicoll.eager.device_static_once`); elsewhere the backend's static transfer moves
    the counts and the rows."""
    backend, grp, x, weights = call.backend, call.group, arguments["x"], arguments["topk_weights"]
    world, experts, capacity = call.W, call.experts_per_rank, call.capacity
    topk_idx = arguments["topk_idx"]
    layout = _layout(backend, topk_idx, world * experts, capacity)
    native_x = backend.to_native(x)
    native = _native(backend, layout, native_x)
    native_weights = None if weights is None else backend.to_native(weights)
    built_in = not {"moe_dispatch_static", "moe_combine_static"} & backend.capabilities.moe
    offered = None
    if backend.host_memory and built_in:
        offered = static_once.static_offer(layout, grp.rank, world, native_x, native_weights)
    bounded = built_in and not backend.host_memory and _sends_once(call, native_x, topk_idx)
    number, valid, once = -1, None, None

    def issue() -> Pending:
        nonlocal number, once
        if call.compare:
            verify(MOE_DISPATCH_STATIC, call, topk_idx=topk_idx)
            number = call_number(grp)
        if call.overflow == "error":
            refuse_drops(backend, grp, on_host(layout.demand), capacity)
        if bounded:
            from . import device_static_once

            bound = call.max_tokens_per_rank
            return device_static_once.dispatch(backend, grp, native_x, native, bound, not call.sync_op, call.sync_op)
        if offered is None:
            return backend.moe_dispatch_static(native_x, native, grp, not call.sync_op, call.sync_op)
        once, pending = static_once.dispatch(
            backend, grp, native_x, native, offered, native_weights, not call.sync_op, call.sync_op
        )
        return pending

    def backward(grad: Any) -> Any:  # valid and once are known once the dispatch finishes, before any backward
        if bounded:
            from . import device_static_once

            return device_static_once.dispatch_backward(backend, grp, grad, once)
        if once is not None:
            rows = static_once.valid_rows(backend, grad, once)
            return dispatch_backward(backend, grp, rows, None, once.routing, once.layout)
        return _slots_summed(backend, grp, grad, native, valid)

    received = _functional_linked(MOE_DISPATCH_STATIC.name, call, x, backward)

    def finish(result: tuple[Any, ...]) -> tuple[Any, Any, StaticHandle]:
        nonlocal valid, once
        blocks, heard, *kept = result
        once = kept[0] if kept else once
        _, valid, before = counts_heard(array_namespace(heard), heard, world, experts)
        library = library_of(x)
        rows, link = received(blocks)
        arrived = Arrived(rows, backend.from_native(valid, library), backend.from_native(before, library))
        handle = StaticHandle.of_blocks(grp, experts, capacity, weights, x, layout, arrived, number, once,
                                        row_bytes(native_x), not backend.host_memory)  # fmt: skip
        handle.link = link
        return arrived.rows, arrived.counts, handle

    return _run(MOE_DISPATCH_STATIC.name, call, issue, finish)


def _sends_once(call: Call, native_x: Any, topk_idx: Any) -> bool:
    """Whether a device backend's static dispatch sends each token once per rank: on torch
    tensors, where :func:`unicoll.once_blocks.chosen` says so."""
    if call.max_tokens_per_rank is None or description_of(native_x) is not TORCH:
        return False
    from ..once_blocks import chosen

    experts, capacity = call.experts_per_rank, call.capacity
    return chosen(call.max_tokens_per_rank, call.W, experts, capacity, native_x, topk_idx.shape[1])


def _slots_summed(backend: Backend, group: Group, grad: Any, layout: StaticLayout, valid: Any) -> Any:
    """dispatch's backward: the gradient blocks (native) sent back and summed over each token's
    slots (a combine without weights)."""
    back, index = backend.moe_combine_static(grad, layout, valid, group, False).finish()
    if backend.host_memory:
        return _summed_by_slot(backend, back, index, layout, None)
    slots = backend.take_rows(back, index)
    return weighted_sum(array_namespace(slots), slots, layout.kept, None)


def _summed_by_slot(backend: Backend, back: Any, index: Any, layout: StaticLayout, weights: Any) -> Any:
    """Each token's slots (``back[index]``,
    :meth:`~unicoll.backends.base.Backend.moe_combine_static`'s pair in host memory) weighed by
    ``weights`` (or 1) and summed one slot at a time into rows the workspace lends
    (:func:`~unicoll.eager.moe.sum_slots`); ``layout``: as the backend takes it."""
    native = None if weights is None else backend.to_native(weights)
    kept = None if weights is None else host_as(layout.kept, native)
    return sum_slots(backend, back, on_host(index), layout.kept.shape[1], native, kept)


def _placed(backend: Backend, group: Group, rows: Any, layout: StaticLayout, valid: Any) -> Any:
    """combine's backward: the slots' gradient rows (native) laid into the blocks of the
    dispatch, whose blocks' valid rows are known (``valid``)."""
    blocks, _ = backend.moe_dispatch_static(rows, layout, group, False, valid=valid).finish()
    return blocks


def _handled(backend: Backend, handle: StaticHandle, like: Any) -> tuple[StaticLayout, Any]:
    """A handle's layout and its blocks' valid rows as the backend's native arrays."""
    return _native(backend, handle.layout, like), backend.to_native(handle.valid)


def _redispatch(call: Call, arguments: dict[str, Any]) -> Any:
    backend, grp, handle, x = call.backend, call.group, arguments["handle"], arguments["x"]
    native_x = backend.to_native(x)
    layout, valid = _handled(backend, handle, native_x)
    once, blocks = handle.once, (handle.experts_per_rank, handle.world * handle.capacity)
    in_blocks = once is not None and not isinstance(once, static_once.StaticOnce)

    def issue() -> Pending:
        if call.compare:
            verify(MOE_REDISPATCH_STATIC, call)
        if in_blocks:
            from . import device_static_once

            return device_static_once.redispatch(backend, grp, native_x, once, blocks, not call.sync_op, call.sync_op)
        if once is not None:
            return static_once.redispatch(backend, grp, native_x, once, blocks, not call.sync_op, call.sync_op)
        return backend.moe_dispatch_static(native_x, layout, grp, not call.sync_op, call.sync_op, valid)

    def backward(grad: Any) -> Any:
        if in_blocks:
            from . import device_static_once

            return device_static_once.dispatch_backward(backend, grp, grad, once)
        if once is not None:
            rows = static_once.valid_rows(backend, grad, once)
            return dispatch_backward(backend, grp, rows, None, once.routing, once.layout)
        return _slots_summed(backend, grp, grad, layout, valid)

    received = _functional(MOE_REDISPATCH_STATIC.name, call, x, backward)
    return _run(MOE_REDISPATCH_STATIC.name, call, issue, lambda result: received(result[0]))


def _combine(call: Call, arguments: dict[str, Any]) -> Any:
    """The blocks sent back, then each token's slots weighed and summed: in host memory with
    no gradient recorded one slot at a time into rows the workspace lends
    (:func:`~unicoll.eager.moe.sum_slots`), else from each slot's row, made at once, whose
    gradient is a dispatch of the slots' gradient rows."""
    backend, grp, handle = call.backend, call.group, arguments["handle"]
    y, weights, once = joined_to_dispatch(arguments["y"], handle), handle.weights, handle.once
    if once is not None and not isinstance(once, static_once.StaticOnce):
        return _combine_once_blocks(call, y, handle)
    if once is not None:
        blocks = handle.experts_per_rank, handle.world * handle.capacity
        shape = (
            functools.partial(static_once.valid_rows, backend, once=once),
            lambda rows: static_once.placed(backend, rows, once, blocks),
        )
        return combine_once(MOE_COMBINE_STATIC, call, y, once.layout, once.routing, weights, shape)
    native_y = backend.to_native(y)
    layout, valid = _handled(backend, handle, native_y)
    by_slot = backend.host_memory and not records_gradient(y, weights)

    def issue() -> Pending:
        if call.compare:
            verify(MOE_COMBINE_STATIC, call)
        return backend.moe_combine_static(native_y, layout, valid, grp, not call.sync_op, call.sync_op)

    returned = _functional(MOE_COMBINE_STATIC.name, call, y, lambda grad: _placed(backend, grp, grad, layout, valid))

    def finish(result: tuple[Any, Any]) -> Any:
        back, index = result
        if by_slot:
            return backend.from_native(_summed_by_slot(backend, back, index, layout, weights), library_of(y))
        rows = returned(backend.take_rows(back, index))
        return weighted_sum(array_namespace(rows), rows, host_as(handle.layout.kept, rows), weights)

    return _run(MOE_COMBINE_STATIC.name, call, issue, finish)


def _combine_once_blocks(call: Call, y: Any, handle: StaticHandle) -> Any:
    """combine_static along a device dispatch that sent each token once per rank in fixed
    shapes (:mod:`unicoll.eager.device_static_once`), with its backward: every rank's backward
    runs the same two transfers, whatever its weights."""
    from . import device_static_once
    from .autograd import attach_many

    backend, grp, weights = call.backend, call.group, handle.weights
    recorded = records_gradient(y, weights)
    forward = call_number(grp) if call.compare and recorded else None  # this call's number: prepare counted it
    native_y = backend.to_native(y)
    native_weights = None if weights is None else backend.to_native(weights)
    combined = device_static_once.Combined(backend, grp, handle.once)

    def issue() -> Pending:
        if call.compare:
            verify(MOE_COMBINE_STATIC, call)
        return combined.issue(native_y, native_weights, not call.sync_op, call.sync_op)

    def finish(back: Any) -> Any:
        from ..once_blocks import summed_at_source

        result = backend.from_native(summed_at_source(back, handle.once.sent), library_of(y))
        if not recorded:
            return result
        version = y._version  # the blocks the weights' gradients are taken from, as they were

        def backward(grad: Any) -> tuple[Any, Any]:
            refuse_rewritten(MOE_COMBINE_STATIC.name, y, version)
            return combined.backward(grad, native_y, native_weights)

        return attach_many((y, weights), result, guarded(MOE_COMBINE_STATIC.name, backend, grp, call.timeout,
                                                         forward, backward))  # fmt: skip

    return _run(MOE_COMBINE_STATIC.name, call, issue, finish)


def refuse_drops(backend: Backend, group: Group, demand: np.ndarray, capacity: int) -> None:
    """overflow='error': every rank's dropped slots (beyond the capacity; ``demand``: its slots
    routed to each global expert, on the host), then the same ValueError on every rank if any
    rank dropped one."""
    demand = np.asarray(demand, dtype=np.int64)
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
