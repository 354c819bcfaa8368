"""``unicoll.moe``'s operators, eagerly: top-k ``dispatch``, ``redispatch`` and ``combine``.

dispatch routes the tokens (:func:`unicoll.routing.route`: the send order, the counts, each
slot's row, the capacity), exchanges the counts and moves the rows with the backend's
``global_scatter``; combine moves them back with ``global_gather`` and sums each token's slots,
weighted, in the caller's library (so autograd follows). The public operators and their
documentation are :mod:`unicoll.moe`'s; the semantics are in docs/semantics.md.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import numpy as np
from array_api_compat import array_namespace, device

from ..arrays import describe, library_of
from ..backends.base import Pending
from ..backends.layout import moe_plan
from ..check import call_number, verify
from ..errors import bad_input, translated
from ..group import Group
from ..routing import Handle, route
from ..spec import MOE_COMBINE, MOE_DISPATCH, MOE_REDISPATCH, Call
from ..task import Task
from ..validate import prepare
from .ops import _functional, _run, global_gather_backward, global_scatter_backward


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
    arguments = dict(x=x, handle=handle, sync_op=sync_op, group=_handle_group(MOE_REDISPATCH.name, handle))
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
    arguments = dict(y=y, handle=handle, sync_op=sync_op, group=_handle_group(MOE_COMBINE.name, handle))
    return _combine(prepare(MOE_COMBINE, arguments), arguments)


def layout(
    x: Any, topk_idx: Any, topk_weights: Any, experts_per_rank: int, group: Group | None, capacity: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`dispatch`'s validation, check and counts exchange, without sending the rows: the
    counts sent and received, the send order (each row's token) and each slot's row, as host
    int64 arrays (see :class:`~unicoll.routing.Routing`), from which a caller that keeps the
    layout in arrays of its own sends the rows with ``global_scatter``."""
    arguments = dict(x=x, topk_idx=topk_idx, topk_weights=topk_weights, experts_per_rank=experts_per_rank,
                     group=group, sync_op=True, capacity=capacity)  # fmt: skip
    call = prepare(MOE_DISPATCH, arguments)
    routing = route(call.topk_idx, call.W * call.experts_per_rank, call.capacity)
    with translated(MOE_DISPATCH.name, call.group, call.timeout):
        if call.check:
            verify(MOE_DISPATCH, call)
        global_count = call.backend.exchange_ints(routing.local_count.copy(), call.group)
    return routing.local_count, global_count, routing.send_tokens, routing.slot_rows


def check_rows(op: str, rows: Any, like: Any, tokens: int, received: int, weighted: bool) -> None:
    """Check the rows given to ``op`` (moe.redispatch's x or moe.combine's y) against a handle
    of ``tokens`` tokens, ``received`` rows and x's place ``like``, raising eager's error where
    its rules fail, for a caller whose handle is kept in arrays of its own."""
    spec = MOE_REDISPATCH if op == MOE_REDISPATCH.name else MOE_COMBINE
    handle = SimpleNamespace(tokens=tokens, received=received, weighted=weighted, library=library_of(like),
                             device=getattr(like, "device", None))  # fmt: skip
    call = SimpleNamespace(**{spec.params[0].name: rows, "handle": handle})
    for rule in spec.rules:
        given = rule.check(call)
        if given is not None:
            raise bad_input(spec.name, rule.param, rule.expected, given, rule.error)


def _handle_group(op: str, handle: Any) -> Group:
    """The group of a usable handle; TypeError for anything but a handle, ValueError once its
    session ended (checked before the call is read: the handle's group is the call's)."""
    if not isinstance(handle, Handle):
        raise bad_input(op, "handle", "a handle returned by moe.dispatch", describe(handle), TypeError)
    if handle.ended is not None:
        raise bad_input(
            op, "handle", "a handle of the running session", f"one that can no longer be used: {handle.ended}"
        )
    return handle.group


def _dispatch(call: Call, arguments: dict[str, Any]) -> Any:
    """The arrays come from ``arguments``, as from every remembered call (:func:`unicoll.validate.prepare`)."""
    backend, grp, x, weights = call.backend, call.group, arguments["x"], arguments["topk_weights"]
    routing = route(call.topk_idx, call.W * call.experts_per_rank, call.capacity)
    local_count, shape = routing.local_count, call.topk_idx.shape
    slot_rows = _like(routing.slot_rows, x)
    kept = None
    if routing.dropped and weights is not None:
        kept = _like((routing.slot_rows < routing.send_tokens.size).reshape(shape), x)
    send_tokens = _like(routing.send_tokens, x)
    sent = _take(x, send_tokens)  # in x's library: autograd sums each token's slots
    plan, number = None, -1

    def issue() -> Pending:
        nonlocal plan, number
        if call.check:
            verify(MOE_DISPATCH, call)
            number = call_number(grp)
        plan = moe_plan(local_count, backend.exchange_ints(local_count.copy(), grp), grp.world_size)
        native = backend.to_native(sent)
        return backend.global_scatter(native, plan, grp, not call.sync_op, call.sync_op)

    def backward(grad: Any) -> Any:  # the plan is made when the call is issued
        return global_scatter_backward(backend, grp, grad, plan)

    received = _functional(MOE_DISPATCH.name, call, sent, backward)

    def finish(result: Any) -> tuple[Any, list[int], Handle]:
        handle = Handle(routing, plan, grp, shape, weights, send_tokens, slot_rows, kept, x, dispatch_number=number)
        return received(result), handle.rows_per_expert, handle

    return _run(MOE_DISPATCH.name, call, issue, finish)


def _redispatch(call: Call, arguments: dict[str, Any]) -> Any:
    backend, grp, handle = call.backend, call.group, arguments["handle"]
    plan = handle.plan
    sent = _take(arguments["x"], handle.send_tokens)

    def issue() -> Pending:
        if call.check:
            verify(MOE_REDISPATCH, call)
        native = backend.to_native(sent)
        return backend.global_scatter(native, plan, grp, not call.sync_op, call.sync_op)

    backward = functools.partial(global_scatter_backward, backend, grp, plan=plan)
    return _run(MOE_REDISPATCH.name, call, issue, _functional(MOE_REDISPATCH.name, call, sent, backward))


def _combine(call: Call, arguments: dict[str, Any]) -> Any:
    backend, grp, y, handle = call.backend, call.group, arguments["y"], arguments["handle"]
    plan = handle.plan

    def issue() -> Pending:
        if call.check:
            verify(MOE_COMBINE, call)
        native = backend.to_native(y)
        return backend.global_gather(native, plan, grp, not call.sync_op, call.sync_op)

    backward = functools.partial(global_gather_backward, backend, grp, plan=plan)
    returned = _functional(MOE_COMBINE.name, call, y, backward)
    weights, slot_rows, kept = handle.weights, handle.slot_rows, handle.kept

    def finish(result: Any) -> Any:
        return _sum_slots(returned(result), handle, weights, slot_rows, kept)

    return _run(MOE_COMBINE.name, call, issue, finish)


def _sum_slots(back: Any, handle: Handle, weights: Any, slot_rows: Any, kept: Any) -> Any:
    """Each token's rows (``back``, in send order) weighted and summed over its k slots, in
    back's library (so torch's autograd follows), as back's dtype. Weighted: one batched
    ``(1, k) @ (k, row)`` product per token, in the promoted dtype of rows and weights."""
    tokens, k, trailing = handle.tokens, handle.topk, tuple(back.shape[1:])
    if handle.dropped:  # dropped slots read a zero row
        xp = array_namespace(back)
        back = xp.concat([back, xp.zeros((1, *trailing), dtype=back.dtype, device=device(back))], axis=0)
    rows = _take(back, slot_rows).reshape(tokens, k, *trailing)
    if weights is None:
        out = rows.reshape(tokens, *trailing) if k == 1 else rows.sum(1)
    else:
        if kept is not None:  # a dropped slot contributes zero whatever its weight (inf, nan)
            xp = array_namespace(weights)
            weights = xp.where(kept, weights, xp.zeros_like(weights))
        flat = rows.reshape(tokens, k, math.prod(trailing))
        out = _matmul(weights.reshape(tokens, 1, k), flat).reshape(tokens, *trailing)
    if out.dtype == back.dtype:
        return out
    return out.to(back.dtype) if library_of(out) == "torch" else out.astype(back.dtype)


def _matmul(a: Any, b: Any) -> Any:
    """Batched ``a @ b`` in the promoted dtype of the two (torch does not promote by itself)."""
    if library_of(a) != "torch":
        return a @ b
    import torch  # loaded already: a is a tensor

    common = torch.promote_types(a.dtype, b.dtype)
    return torch.bmm(a.to(common), b.to(common))


def _like(host: np.ndarray, x: Any) -> Any:
    """A host array as an array of ``x``'s library on ``x``'s device (numpy: itself)."""
    library = library_of(x)
    if library == "numpy":
        return host
    if library == "torch":
        import torch  # loaded already: x is a tensor

        return torch.from_numpy(host).to(x.device)
    import cupy  # loaded already: x is a cupy array

    with x.device:
        return cupy.asarray(host)


def _take(x: Any, index: Any) -> Any:
    """The rows ``x[index]`` as a new array (``index`` from :func:`_like`)."""
    return x.index_select(0, index) if library_of(x) == "torch" else x.take(index, axis=0)
