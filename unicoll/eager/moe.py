"""``unicoll.moe``'s operators, eagerly: top-k ``dispatch``, ``redispatch`` and ``combine``.

dispatch routes the tokens where the backend's arrays are: on a host backend on the host
(:func:`unicoll.routing.route`: the send order, the counts, each slot's row, the capacity), on
a device backend on the device (:mod:`unicoll.device_routing`, the counts read on the host
once). It exchanges the counts and moves the rows with the backend's ``moe_dispatch``, which
gathers them from x itself; combine moves them back with ``moe_combine``. On a host backend
they come back into rows the backend's workspace lends and each token's slots are summed into
its result one slot at a time (:func:`sum_slots`); where torch records a gradient, or on a
device backend, the slots are summed at once (:func:`sum_at_once`: one gather, torch's
differentiable operations). dispatch's backward is a combine without weights. The public
operators and their documentation are :mod:`unicoll.moe`'s; the semantics are in
docs/semantics.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
from array_api_compat import array_namespace, device

from ..arrays import describe, description_of, device_kind, library_of, place_of
from ..backends.base import Backend, Pending
from ..backends.blocks import with_zero_row
from ..backends.host import row_bytes
from ..backends.layout import MoePlan, Routing, moe_plan
from ..backends.once import weight_code
from ..check import call_number, verify
from ..counts import host_as, on_host
from ..device_routing import FAULTS, DeviceRouting, device_routing, expert_major_orders
from ..errors import bad_input, translated
from ..group import Group
from ..libraries.native import TORCH
from ..routing import Handle, route
from ..spec import IDS_EXPECTED, MOE_COMBINE, MOE_DISPATCH, MOE_REDISPATCH, Call, OpSpec, ids_out_of_range
from ..task import Task
from ..validate import prepare
from ..workspace import FROM_BYTES
from . import device_once, moe_once
from .device_once import DeviceOnce, Pairs
from .moe_once import OnceLayout
from .once_choice import COMPILED, COMPILED_PLAIN, OFF, OFFER_INTS, offer, once_mode, refuse_mixed
from .ops import _functional, _functional_linked, _run, global_gather_backward, global_scatter_backward, guarded


def dispatch(
    x: Any,
    topk_idx: Any,
    topk_weights: Any | None = None,
    *,
    experts_per_rank: int,
    group: Group | None = None,
    sync_op: bool = True,
    capacity: int | None = None,
) -> tuple[Any, list[int], Handle] | Task:
    """Send each token (row of ``x``) to its top-k experts; returns ``(rows, rows_per_expert, handle)``.

    ``topk_idx[t, j]`` is the global expert ``rank * experts_per_rank + e`` of token t's slot j,
    or -1 to drop it. ``rows`` holds what this rank's experts receive, expert-major, then
    source rank, then slot ``t * k + j`` (``global_scatter``'s layout); ``rows_per_expert[e]``
    (host ints) says how many rows expert e got, so ``rows`` splits on it. ``capacity``: each
    rank sends each expert at most that many rows, the lowest slots first. ``sync_op=False``
    returns a :class:`~unicoll.Task` whose ``wait()`` returns the same tuple.

    >>> # one rank, E=2: tokens x = [0, 1, 2], top-2 experts [[1, 0], [1, -1], [0, 1]]
    >>> rows, rows_per_expert, handle = uc.moe.dispatch(x, topk_idx, experts_per_rank=2)  # doctest: +SKIP
    >>> rows.tolist(), rows_per_expert                                                      # doctest: +SKIP
    ([0, 2, 0, 1, 2], [2, 3])
    """
    arguments = dict(x=x, topk_idx=topk_idx, topk_weights=topk_weights, experts_per_rank=experts_per_rank,
                     group=group, sync_op=sync_op, capacity=capacity)  # fmt: skip
    return _dispatch(prepare(MOE_DISPATCH, arguments), arguments)


def redispatch(x: Any, handle: Handle, *, sync_op: bool = True) -> Any | Task:
    """Send other rows of the same tokens along a handle's routing: a second layer's dispatch
    with no sort and no count exchange. Returns the rows, laid out as :func:`dispatch`'s were
    (``handle.rows_per_expert`` rows per local expert); :func:`combine` with the same handle
    brings the outputs back. ``x`` has one row per token of the handle's dispatch (its trailing
    shape may differ), in the library and on the device of the dispatched x.

    >>> rows, rows_per_expert, handle = uc.moe.dispatch(h1, topk_idx, w, experts_per_rank=2)  # doctest: +SKIP
    >>> rows2 = uc.moe.redispatch(h2, handle)                                                  # doctest: +SKIP
    """
    arguments = dict(x=x, handle=handle, sync_op=sync_op, group=handle_group(MOE_REDISPATCH.name, handle))
    return _redispatch(prepare(MOE_REDISPATCH, arguments), arguments)


def combine(y: Any, handle: Handle, *, sync_op: bool = True) -> Any | Task:
    """Send expert outputs back and sum each token's slots: ``out[t] = sum_j w[t, j] * y[row of (t, j)]``.

    ``y`` holds one output row per row that :func:`dispatch` returned, in the same order (its
    trailing shape may differ from x's). The weights are dispatch's ``topk_weights`` (1 without
    them); dropped slots contribute zero. The result has one row per token, y's dtype.

    >>> out = uc.moe.combine(rows * 10, handle)  # the example above; each expert multiplies by 10  # doctest: +SKIP
    >>> out.tolist()                                # doctest: +SKIP
    [0, 10, 40]
    """
    arguments = dict(y=y, handle=handle, sync_op=sync_op, group=handle_group(MOE_COMBINE.name, handle))
    return _combine(prepare(MOE_COMBINE, arguments), arguments)


def layout(
    x: Any,
    topk_idx: Any,
    topk_weights: Any,
    experts_per_rank: int,
    group: Group | None,
    capacity: int | None,
    once: bool = False,
) -> tuple[np.ndarray, np.ndarray, Any, Any]:
    """:func:`dispatch`'s validation, check and counts exchange, without sending the rows: the
    counts sent and received (host int64), the send order (each row's token) and each slot's
    row (see :class:`~unicoll.backends.layout.Routing`: host int64 on a host backend, on x's
    device on a device backend, which reads the counts on the host once), from which a caller
    that keeps the layout in arrays of its own sends the rows with ``global_scatter``.
    ``once``: the caller (a compiled step) sends each token once per rank; every rank must
    (:func:`unicoll.eager.once_choice.refuse_mixed`)."""
    arguments = dict(x=x, topk_idx=topk_idx, topk_weights=topk_weights, experts_per_rank=experts_per_rank,
                     group=group, sync_op=True, capacity=capacity)  # fmt: skip
    call = prepare(MOE_DISPATCH, arguments)
    exchanged = _routed(call, call.backend.to_native(x), topk_idx, None, COMPILED_ONCE if once else PLAIN_ONLY)
    with translated(MOE_DISPATCH.name, call.group, call.timeout):
        if call.compare:
            verify(MOE_DISPATCH, call)
        routing, plan, _ = exchanged()
    return routing.local_count, plan.received.reshape(-1), routing.send_tokens, routing.slot_rows


def check_rows(op: str, rows: Any, like: Any, tokens: int, received: int, weighted: bool) -> None:
    """Check the rows given to ``op`` (moe.redispatch's x or moe.combine's y) against a handle
    of ``tokens`` tokens, ``received`` rows and x's place ``like``, raising eager's error where
    its rules fail, for a caller whose handle is kept in arrays of its own."""
    spec = MOE_REDISPATCH if op == MOE_REDISPATCH.name else MOE_COMBINE
    check_handled(spec, rows, like, tokens=tokens, received=received, weighted=weighted)


def check_handled(spec: OpSpec, rows: Any, like: Any, **handle: Any) -> None:
    """The rules of ``spec`` (an operator of rows and a handle) checked against ``rows`` and a
    handle described by ``handle``'s fields and x's place ``like``, raising eager's error where
    one fails: for a caller whose handle is kept in arrays of its own, or traced."""
    described = SimpleNamespace(library=library_of(like), device=place_of(like), **handle)
    call = SimpleNamespace(**{spec.params[0].name: rows, "handle": described})
    for rule in spec.rules:
        given = rule.check(call)
        if given is not None:
            raise bad_input(spec.name, rule.param, rule.expected, given, rule.error)


def handle_group(op: str, handle: Any, kind: type = Handle, made_by: str = "moe.dispatch") -> Group:
    """The group of a usable handle of ``kind`` (which ``made_by`` returns); TypeError for
    anything else, ValueError once its session ended (checked before the call is read: the
    handle's group is the call's)."""
    if not isinstance(handle, kind):
        raise bad_input(op, "handle", f"a handle returned by {made_by}", describe(handle), TypeError)
    if handle.ended is not None:
        raise bad_input(
            op, "handle", "a handle of the running session", f"one that can no longer be used: {handle.ended}"
        )
    return handle.group


def _dispatch(call: Call, arguments: dict[str, Any]) -> Any:
    """The arrays come from ``arguments``, as from every remembered call (:func:`unicoll.validate.prepare`).
    The routing runs where the backend's arrays are (:func:`_routed`)."""
    backend, grp, x, weights = call.backend, call.group, arguments["x"], arguments["topk_weights"]
    native = backend.to_native(x)
    native_weights = None if weights is None else backend.to_native(weights)
    exchanged = _routed(call, native, arguments["topk_idx"], native_weights, EAGER_ONCE)
    routing: Routing | None = None
    plan: MoePlan | None = None
    once: OnceLayout | DeviceOnce | None = None
    number = -1

    def issue() -> Pending:
        nonlocal routing, plan, once, number
        if call.compare:
            verify(MOE_DISPATCH, call)
            number = call_number(grp)
        routing, plan, once = exchanged()
        if isinstance(once, DeviceOnce):
            return device_once.dispatch(backend, grp, native, once, not call.sync_op, call.sync_op)
        if once is not None:
            return moe_once.dispatch(backend, grp, native, once, plan, native_weights, not call.sync_op, call.sync_op)
        return backend.moe_dispatch(native, routing, plan, grp, not call.sync_op, call.sync_op)

    def backward(grad: Any) -> Any:  # the routing and plan are made when the call is issued
        return dispatch_backward(backend, grp, grad, plan, routing, once)

    received = _functional_linked(MOE_DISPATCH.name, call, x, backward)

    def finish(result: Any) -> tuple[Any, list[int], Handle]:
        handle = Handle(routing, plan, grp, weights, x, number, once, row_bytes(native))
        rows, handle.link = received(result)
        return rows, handle.rows_per_expert, handle

    return _run(MOE_DISPATCH.name, call, issue, finish)


def host_ids(topk_idx: Any) -> np.ndarray:
    """Validated expert ids on the host as int64 (a view where they are host int64 already)."""
    return np.asarray(on_host(topk_idx), dtype=np.int64)


EAGER_ONCE, PLAIN_ONLY, COMPILED_ONCE = "eager once", "plain only", "compiled once"
"""What a dispatch's routing offers its peers (:func:`_routed`): an eager dispatch may send each
token once per rank; a compiled step's graph sends one row per slot by a transfer of its own
after the layout, or each token once per rank."""

_COMPILED_MODES = {PLAIN_ONLY: COMPILED_PLAIN, COMPILED_ONCE: COMPILED}
"""The mode a compiled step's layout tells its peers, by form: an eager dispatch on another
rank, or a step compiled to the other form, is refused (:func:`~unicoll.eager.once_choice.refuse_mixed`)."""


def _routed(
    call: Call, native: Any, topk_idx: Any, weights: Any, form: str
) -> Callable[[], tuple[Routing, MoePlan, OnceLayout | DeviceOnce | None]]:
    """The routing of a dispatch, made now where the backend's arrays are: on the host for a
    host backend (:func:`_routed_on_host`), else on the device (:func:`_routed_on_device`;
    ``native``: x as the backend moves it); and how to exchange its counts, with what ``form``
    offers (``weights``: the dispatch's native weights, or None)."""
    if call.backend.host_memory:
        return _routed_on_host(call, native if form == EAGER_ONCE else None, weights, _COMPILED_MODES.get(form))
    return _routed_on_device(call, native, topk_idx, weights, form)


def _routed_on_host(
    call: Call, native: Any, weights: Any, compiled: int | None
) -> Callable[[], tuple[Routing, MoePlan, OnceLayout | None]]:
    """The routing of a host backend's dispatch, made now, and how to exchange its counts:
    which returns the routing, the plan of the rows' transfer and, where the ranks agree on it
    (:mod:`unicoll.eager.once_choice`, whose offer travels beside the counts), the layout that
    sends each token once per rank. ``native``: x as the backend moves it, or None for a caller
    who moves the rows itself; ``weights``: native, or None; ``compiled``: a compiled step's
    mode (:data:`_COMPILED_MODES`), None for an eager dispatch."""
    world, experts = call.W, call.experts_per_rank
    routing = route(host_ids(call.topk_idx), world * experts, call.capacity)
    moved = bool({"moe_dispatch", "moe_combine"} & call.backend.capabilities.moe)
    offered = offer(MOE_DISPATCH.name, routing, call.group.rank, world, native, weights, moved, compiled)

    def exchanged() -> tuple[Routing, MoePlan, OnceLayout | None]:
        told = np.concatenate([routing.local_count.reshape(world, experts), offered.told], axis=1)
        heard = call.backend.exchange_ints(told.reshape(-1), call.group).reshape(world, -1)
        refuse_mixed(MOE_DISPATCH.name, heard[:, experts:])
        plan = moe_plan(routing.local_count, np.ascontiguousarray(heard[:, :experts]).reshape(-1), world)
        return routing, plan, offered.agreed(heard[:, experts:], np.array(plan.recv, dtype=np.int64))

    return exchanged


def _routed_on_device(
    call: Call, native: Any, topk_idx: Any, weights: Any, form: str
) -> Callable[[], tuple[Routing, MoePlan, DeviceOnce | None]]:
    """The routing of a device backend's dispatch, made now where x is (``native``: x as the
    backend moves it; :func:`unicoll.device_routing.device_routing`), with its (token, rank)
    pairs where this eager dispatch offers to send each token once per rank
    (:func:`unicoll.eager.device_once.pairs`: torch tensors; ``weights``: native, or None), and
    how to exchange its counts there and read them in one copy (:func:`_counts_read`), with
    what ``form`` offers."""
    xp = array_namespace(native)
    ids = _ids_on(call.backend, topk_idx, native)
    experts = call.W * call.experts_per_rank
    found = device_routing(xp, ids, experts, call.capacity)
    pairs = None
    if form == EAGER_ONCE:
        code = 0 if weights is None else weight_code(str(weights.dtype).rsplit(".", 1)[-1])
        usable = native if code >= 0 and description_of(native) is TORCH else None  # its kernels are torch's
        moved = bool({"moe_dispatch", "moe_combine"} & call.backend.capabilities.moe)
        mode = once_mode(MOE_DISPATCH.name, call.W, ids.shape[1], usable, moved)
        if mode != OFF:
            import torch  # loaded: x is a tensor

            rank, size = call.group.rank, row_bytes(native)
            pairs = device_once.pairs(torch, ids, found.slot_rows, found.local_count, rank, call.W,
                                      call.experts_per_rank, size, code, mode)  # fmt: skip
    mode = _COMPILED_MODES.get(form, OFF)
    return functools.partial(_counts_read, call, xp, found, ids.shape, pairs, mode, row_bytes(native))


def _ids_on(backend: Backend, topk_idx: Any, native: Any) -> Any:
    """The router's ids as a native array on x's device (``native``: x as the backend moves it)."""
    ids = topk_idx if device_kind(topk_idx) == "cpu" else backend.to_native(topk_idx)
    if library_of(ids) == library_of(native) and place_of(ids) == place_of(native):
        return ids
    xp = array_namespace(native)
    return xp.asarray(on_host(ids), device=device(native))


def _mode_told(xp: Any, mode: int, world: int, like: Any) -> Any:
    """What a rank that makes no (token, rank) pairs tells each peer of the once form: ``mode`` alone."""
    told = [xp.zeros((world, 2), dtype=like.dtype, device=device(like))]
    told.append(xp.full((world, 1), mode, dtype=like.dtype, device=device(like)))
    told.append(xp.zeros((world, OFFER_INTS - 3), dtype=like.dtype, device=device(like)))
    return xp.concat(told, axis=1)


def _counts_read(
    call: Call, xp: Any, found: DeviceRouting, shape: tuple[int, int], pairs: Pairs | None, mode: int, size: int
) -> tuple[Routing, MoePlan, DeviceOnce | None]:
    """The counts of a routing on the device (``found``) exchanged on the device, with every
    rank's ids' range and its offer of the once form (``pairs``, or None: ``mode`` alone), then
    read on the host in one copy: the routing and plan of the rows' transfer, and the once layout where the
    ranks agree on it (rows of ``size`` bytes). Ids out of range on any rank raise the same
    ValueError on every rank here, before a row is sent."""
    backend, grp, world, experts = call.backend, call.group, call.W, call.experts_per_rank
    width = experts + FAULTS + OFFER_INTS
    counts = xp.reshape(found.local_count, (world, experts))
    faults = xp.broadcast_to(xp.reshape(found.faults, (1, FAULTS)), (world, FAULTS))
    offered = pairs.told if pairs is not None else _mode_told(xp, mode, world, counts)
    told = xp.reshape(xp.concat([counts, faults, offered], axis=1), (-1,))
    got = backend.exchange_native_ints(told, grp)
    both = backend.read_ints(xp.concat([told, got])).reshape(2, world, width)  # the one read
    _refuse_ids(both[1, :, experts : experts + FAULTS], shape, world * experts, grp.rank)
    refuse_mixed(MOE_DISPATCH.name, both[1, :, experts + FAULTS :])
    local_count, global_count = both[0, :, :experts].reshape(-1), both[1, :, :experts].reshape(-1)
    sent, received = int(local_count.sum()), int(global_count.sum())
    orders = None
    if world > 1 and experts > 1:
        orders = expert_major_orders(xp, xp.reshape(got, (world, width))[:, :experts], received)
    plan = MoePlan(local_count, global_count, world, orders=orders)
    dropped = sent < shape[0] * shape[1]
    routing = Routing(local_count, found.send_tokens[:sent], found.slot_rows, dropped, shape[1])
    once = None
    if pairs is not None:
        once = device_once.made(pairs, both[1, :, experts + FAULTS :], both[0, :, experts + FAULTS :], plan,
                                found.slot_rows, size)  # fmt: skip
    return routing, plan, once


def _refuse_ids(faults: np.ndarray, shape: tuple[int, int], experts: int, rank: int) -> None:
    """Every rank's ids' range (``faults``: ``(W, FAULTS)``, as each rank told), and the
    ValueError of moe.dispatch's rule for topk_idx on every rank where one rank's ids leave
    it: the rank itself names the id and its place, the others the rank."""
    for c, (lowest, highest, at_lowest, at_highest) in enumerate(faults.tolist()):
        given = ids_out_of_range(lowest, highest, at_lowest, at_highest, shape[1], experts)
        if given is not None:
            raise bad_input(MOE_DISPATCH.name, "topk_idx", IDS_EXPECTED, given if c == rank else f"{given} on rank {c}")


def _redispatch(call: Call, arguments: dict[str, Any]) -> Any:
    backend, grp, handle, x = call.backend, call.group, arguments["handle"], arguments["x"]
    plan, routing, once = handle.plan, handle.routing, handle.once

    def issue() -> Pending:
        if call.compare:
            verify(MOE_REDISPATCH, call)
        native = backend.to_native(x)
        if isinstance(once, DeviceOnce):
            return device_once.redispatch(backend, grp, native, once, not call.sync_op, call.sync_op)
        if once is not None:
            return moe_once.redispatch(backend, grp, native, once, not call.sync_op, call.sync_op)
        return backend.moe_dispatch(native, routing, plan, grp, not call.sync_op, call.sync_op)

    backward = functools.partial(dispatch_backward, backend, grp, plan=plan, routing=routing, once=once)
    return _run(MOE_REDISPATCH.name, call, issue, _functional(MOE_REDISPATCH.name, call, x, backward))


def dispatch_backward(
    backend: Backend,
    group: Group,
    grad: Any,
    plan: MoePlan | None,
    routing: Routing,
    once: OnceLayout | DeviceOnce | None = None,
) -> Any:
    """The rows' gradients sent back (global_scatter's backward, with the handle's counts) and
    each token's slots summed: a combine without weights (each token's once per rank, where
    the dispatch sent it so)."""
    if isinstance(once, DeviceOnce):
        return device_once.dispatch_backward(backend, group, grad, once, routing.tokens)
    if once is not None:
        back = moe_once.combine(backend, group, grad, once, False, False, True).finish()
        return moe_once.sum_at_source(once, back, routing.tokens, None)
    if not backend.host_memory:
        return _summed(backend.moe_combine(grad, routing, plan, group, False).finish(), routing, None)
    back, lent = _rows_back(backend, grad, routing)
    try:
        sent = global_scatter_backward(backend, group, grad, plan, _head(back, routing))
        return sum_slots(backend, sent if back is None else back, routing.slot_rows, routing.topk, None, None)
    finally:
        backend.give_back(lent)


def _combine(call: Call, arguments: dict[str, Any]) -> Any:
    handle = arguments["handle"]
    y = joined_to_dispatch(arguments["y"], handle)
    if handle.once is not None:
        return combine_once(MOE_COMBINE, call, y, handle.once, handle.routing, handle.weights)
    return combine_rows(MOE_COMBINE, call, y, handle.routing, handle.plan, handle.weights)


def joined_to_dispatch(y: Any, handle: Any) -> Any:
    """combine's rows ``y`` joined to the autograd node of the dispatch of ``handle`` (its
    :attr:`~unicoll.routing.SessionHandle.link`) where that dispatch recorded a gradient and
    grad mode is on: every rank's backward pass through combine then runs combine's and
    dispatch's backward collectives, whatever the experts made of the rows (rows an expert
    skipped, outputs made without them: the dispatch's gradient is then zeros). Else ``y``."""
    if handle.link is None:
        return y
    from .autograd import joined, needs_grad

    return joined(y, handle.link) if needs_grad(handle.link) else y


def combine_once(
    spec: OpSpec,
    call: Call,
    y: Any,
    once: OnceLayout | DeviceOnce,
    routing: Routing,
    weights: Any,
    shape: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None,
) -> Any:
    """The combine ``spec`` along a dispatch that sent each token once per rank (``once``, of
    ``routing``, weighed by the caller's ``weights`` or None): each token's rows summed on its
    expert ranks (weighted by the weights the ranks sent there: with dispatch's metadata on a
    host backend, now on a device backend), one row per rank back, and those summed on the
    source (:mod:`unicoll.eager.moe_once`, :mod:`unicoll.eager.device_once`); its backward
    sends the gradient back the same way and the weights' gradients of the slots summed
    remotely back from their ranks. ``shape``: for the static mode's blocks, how native ``y``
    gives its expert-major rows and how their gradient is laid back into blocks (None: y is
    those rows)."""
    backend, grp = call.backend, call.group
    library = library_of(y)
    recorded = records_gradient(y, weights)
    forward = call_number(grp) if call.compare and recorded else None  # this call's number: prepare counted it
    native_y = backend.to_native(y)
    rows = native_y if shape is None else shape[0](native_y)
    native_weights = None if weights is None else backend.to_native(weights)
    on_device = isinstance(once, DeviceOnce)
    kept = device_once.Weighed()

    def issue() -> Pending:
        if call.compare:
            verify(spec, call)
        if on_device:
            return device_once.combine(backend, grp, rows, once, native_weights, kept, not call.sync_op, call.sync_op)
        # the rows of a rank that sent weights are weighed here, whether this rank's own are
        return moe_once.combine(backend, grp, rows, once, True, not call.sync_op, call.sync_op)

    def finish(back: Any) -> Any:
        summed = device_once.sum_at_source if on_device else moe_once.sum_at_source
        result = backend.from_native(summed(once, back, routing.tokens, native_weights), library)
        if not recorded:
            return result
        from .autograd import attach_many

        version = y._version  # the expert rows the weights' gradients are taken from, as they were

        def backward(grad: Any) -> tuple[Any, Any]:
            refuse_rewritten(spec.name, y, version)
            if on_device:
                grad_y, grad_w = device_once.combine_backward(backend, grp, grad, once, rows, native_weights, kept)
            else:
                tokens, k = routing.tokens, routing.topk
                grad_y, grad_w = moe_once.combine_backward(
                    backend, grp, grad, once, tokens, k, rows, native_weights, back
                )
            return (grad_y if shape is None else shape[1](grad_y)), grad_w

        guarded_backward = guarded(spec.name, backend, grp, call.timeout, forward, backward)
        return attach_many((y, weights), result, guarded_backward)

    return _run(spec.name, call, issue, finish)


def refuse_rewritten(op: str, y: Any, version: int) -> None:
    """The backward of the combine ``op`` refusing, as torch's own operations refuse it and
    before anything is sent, expert rows ``y`` changed in place since the combine saw them
    (``version``: y's version counter then): its weights' gradients are taken from them."""
    if y._version != version:
        name = op.removeprefix("moe.")
        raise RuntimeError(
            f"{op} (backward): y was modified in place after {name}; its backward needs the rows as {name} saw "
            "them (clone y before changing it)"
        )


def combine_rows(spec: OpSpec, call: Call, y: Any, routing: Routing, plan: MoePlan, weights: Any) -> Any:
    """The combine ``spec`` (moe.combine, or the static mode's on the host) of expert rows
    ``y`` (``plan``'s expert-major side) along ``routing``, weighed by ``weights`` (or None):
    global_gather, then each token's slots summed."""
    backend, grp = call.backend, call.group
    if records_gradient(y, weights) or not backend.host_memory:
        return _combine_at_once(spec, call, y, routing, plan, weights)
    library = library_of(y)

    def issue() -> Pending:
        if call.compare:
            verify(spec, call)
        return _sent_back(backend, backend.to_native(y), plan, grp, not call.sync_op, call.sync_op, routing)

    def finish(result: tuple[Any, np.ndarray | None]) -> Any:
        back, lent = result
        native_weights = kept = None
        if weights is not None:
            native_weights = backend.to_native(weights)
            kept = host_as(routing.kept, native_weights) if routing.dropped else None
        try:
            out = sum_slots(backend, back, routing.slot_rows, routing.topk, native_weights, kept)
        finally:
            backend.give_back(lent)
        return backend.from_native(out, library)

    return _run(spec.name, call, issue, finish)


def _sent_back(
    backend: Backend, native: Any, plan: MoePlan, group: Group, async_op: bool, calc_stream: bool, routing: Routing
) -> Pending:
    """global_gather of the expert rows ``native`` into :func:`_rows_back`'s rows; its finish
    returns those rows and the buffer to give back (or None)."""
    back, lent = _rows_back(backend, native, routing)
    pending = backend.moe_combine(native, routing, plan, group, async_op, calc_stream, _head(back, routing))

    def finish() -> tuple[Any, np.ndarray | None]:
        sent = pending.finish()
        return sent if back is None else back, lent

    return Pending(pending.works, finish)


def _rows_back(backend: Backend, like: Any, routing: Routing) -> tuple[Any, np.ndarray | None]:
    """Rows like ``like``'s for the rows a dispatch sent, in send order, that the workspace
    lends, followed by one zero row (read by dropped slots) where a slot is dropped; and the
    buffer to give back (or None). (None, None) where no slot is dropped and the rows are
    fewer than :data:`~unicoll.workspace.FROM_BYTES`: the transfer makes its own rows then."""
    sent = routing.send_tokens.size
    if not routing.dropped and sent * row_bytes(like) < FROM_BYTES:
        return None, None
    back, lent = backend.scratch_rows(like, sent + routing.dropped)
    if routing.dropped:
        back[sent:] = 0
    return back, lent


def _head(back: Any, routing: Routing) -> Any:
    """The rows of :func:`_rows_back`'s ``back`` that the transfer fills (None for none)."""
    return None if back is None else back[: routing.send_tokens.size]


def sum_slots(backend: Backend, back: Any, slot_rows: np.ndarray, k: int, weights: Any, kept: Any) -> Any:
    """``out[t] = sum_j w[t, j] * back[slot_rows[t * k + j]]`` on the backend's native arrays,
    summed in slot order (``slot_rows``: host int64; w = 1 without ``weights``; a dropped slot
    reads a zero row of back and weighs zero where ``kept`` says so): one slot at a time, each
    slot's rows taken into one buffer of a row per token, so no array of k rows per token is
    made. Sums run in the promoted dtype of the rows and the weights, 2-byte floats in float32
    (one rounding at the end, as a matrix product rounds), and the result has back's dtype.
    Below :data:`~unicoll.workspace.FROM_BYTES` of rows, :func:`sum_at_once` (fewer calls)."""
    tokens = slot_rows.size // k
    if weights is None and k == 1:
        return backend.take_rows(back, slot_rows)
    if slot_rows.size * row_bytes(back) < FROM_BYTES:  # small: one gather costs less than k
        return sum_at_once(back, host_as(slot_rows, back), tokens, k, weights, kept)
    slots, description = np.ascontiguousarray(slot_rows.reshape(tokens, k).T), description_of(back)
    dtype = _sum_dtype(back, weights)
    apart = dtype != back.dtype  # summed in a wider dtype, then rounded into the result
    out, out_lent = _scratch_as(backend, back, tokens, dtype) if apart else (backend.empty_rows(back, tokens), None)
    rows, rows_lent = backend.scratch_rows(back, tokens)
    try:
        for j, slot in enumerate(slots):
            if j == 0 and weights is None:  # unweighted: the sum's dtype is back's
                backend.take_rows(back, slot, out)
                continue
            backend.take_rows(back, slot, rows)
            column = None if weights is None else _slot_weights(weights, kept, j, back.ndim)
            description.accumulate(out, rows, column, j == 0)
    finally:
        backend.give_back(rows_lent)
    if not apart:
        return out
    result = backend.empty_rows(back, tokens)
    result[...] = out
    backend.give_back(out_lent)
    return result


def _sum_dtype(back: Any, weights: Any) -> Any:
    """The dtype :func:`sum_slots` sums in (see there)."""
    xp = array_namespace(back)
    dtype = back.dtype if weights is None else xp.result_type(back, weights)
    if weights is not None and xp.isdtype(dtype, "real floating") and xp.finfo(dtype).bits == 16:
        return xp.float32
    return dtype


def _scratch_as(backend: Backend, like: Any, rows: int, dtype: Any) -> tuple[Any, np.ndarray | None]:
    """Scratch rows like ``like``'s but of ``dtype`` (:meth:`~unicoll.backends.base.Backend.scratch_rows`)."""
    xp = array_namespace(like)
    return backend.scratch_rows(xp.empty((0, *like.shape[1:]), dtype=dtype, device=device(like)), rows)


def _slot_weights(weights: Any, kept: Any, j: int, ndim: int) -> Any:
    """Slot j's weights as a column that broadcasts over a row of ``ndim - 1`` dimensions, zero
    where the slot is dropped (whatever the weight: inf, nan)."""
    column = weights[:, j]
    if kept is not None:
        xp = array_namespace(weights)
        column = xp.where(kept[:, j], column, xp.zeros_like(column))
    return column.reshape(column.shape[0], *([1] * (ndim - 1)))


def records_gradient(*arrays: Any) -> bool:
    """Whether a result made from ``arrays`` joins torch's autograd graph (one of them, a tensor,
    needs a gradient); None entries are skipped."""
    for array in arrays:
        if array is not None:
            description = description_of(array)
            if description.autograd and description.needs_grad(array):
                return True
    return False


def _combine_at_once(spec: OpSpec, call: Call, y: Any, routing: Routing, plan: MoePlan, weights: Any) -> Any:
    """combine where torch records a gradient, or on a device backend: the rows sent back by
    the backend's moe_combine (whose backward is global_scatter), then each token's slots
    weighted and summed at once (:func:`_summed`), by torch's own differentiable operations
    where it records a gradient, which keep the rows the weights' gradient needs."""
    backend, grp = call.backend, call.group

    def issue() -> Pending:
        if call.compare:
            verify(spec, call)
        return backend.moe_combine(backend.to_native(y), routing, plan, grp, not call.sync_op, call.sync_op)

    backward = functools.partial(global_gather_backward, backend, grp, plan=plan)
    returned = _functional(spec.name, call, y, backward)

    def finish(result: Any) -> Any:
        return _summed(returned(result), routing, weights)

    return _run(spec.name, call, issue, finish)


def _summed(back: Any, routing: Routing, weights: Any) -> Any:
    """Each token's rows (``back``, in send order) weighted and summed over its k slots at once
    (:func:`sum_at_once`: one gather, differentiable by torch), as back's dtype; the routing's
    index arrays are on back's device or on the host."""
    xp = array_namespace(back)
    kept = None
    if routing.dropped:  # dropped slots read a zero row
        back = with_zero_row(xp, back)
        kept = None if weights is None else host_as(routing.kept, weights)
    return sum_at_once(back, host_as(routing.slot_rows, back), routing.tokens, routing.topk, weights, kept)


def sum_at_once(back: Any, slot_rows: Any, tokens: int, k: int, weights: Any, kept: Any) -> Any:
    """:func:`sum_slots` with all k rows of every token taken at once (``slot_rows``: each
    slot's row of ``back``, in back's library and on its device) and summed by one batched
    ``(1, k) @ (k, row)`` product per token, in the promoted dtype of rows and weights (which
    torch's autograd follows, and torch.compile traces: the compiled moe.combine sums with it);
    the result has back's dtype."""
    trailing = tuple(back.shape[1:])
    description = description_of(back)
    rows = description.take_rows(back, slot_rows).reshape(tokens, k, *trailing)
    if weights is None:
        out = rows.reshape(tokens, *trailing) if k == 1 else rows.sum(1)
    else:
        if kept is not None:  # a dropped slot contributes zero whatever its weight (inf, nan)
            xp = array_namespace(weights)
            weights = xp.where(kept, weights, xp.zeros_like(weights))
        flat = rows.reshape(tokens, k, math.prod(trailing))
        out = description.matmul(weights.reshape(tokens, 1, k), flat).reshape(tokens, *trailing)
    return out if out.dtype == back.dtype else description.astype(out, back.dtype)
