"""The static-shape MoE operators on a host backend (gloo, mpi), eagerly: the same layout and
results as everywhere, with only the valid rows on the wire.

Where the arrays are in host memory, reading a count is no synchronization: nothing waits for a
device. So the layout (:func:`unicoll.static_layout.static_layout`, the one array-API routing)
is computed on the host, the counts (``W`` blocks of ``2E``, fixed size) travel first, and the
rows follow as the dynamic mode's ``global_scatter``/``global_gather`` with a *padded* plan
(:class:`~unicoll.backends.layout.MoePlan` with a capacity): each block's valid rows go straight
to their place among the ``(E, W * C)`` rows, the padding is written as zeros where they land
and never travels. Combine, the backward passes and a second layer's redispatch go the same
way, with the dynamic mode's sums and backward (one backward per operator). The device path,
even all-to-alls of whole blocks, is :mod:`unicoll.eager.static_moe`'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from array_api_compat import array_namespace

from ..backends.base import Backend, Pending
from ..backends.layout import MoePlan, moe_plan
from ..check import call_number, verify
from ..counts import on_host
from ..errors import bad_input
from ..group import Group
from ..routing import Routing
from ..spec import MOE_COMBINE_STATIC, MOE_DISPATCH_STATIC, MOE_REDISPATCH_STATIC, Call
from ..static_layout import HostRoute, StaticHandle, StaticLayout, counts_in, counts_out, static_layout
from .moe import combine_rows, dispatch_backward, host_as
from .ops import _functional, _run


def dispatch(call: Call, arguments: dict[str, Any]) -> Any:
    """moe.dispatch_static (validated ``call``) on a host backend (``Backend.host_memory``)."""
    backend, grp, x, weights = call.backend, call.group, arguments["x"], arguments["topk_weights"]
    world, experts, capacity = call.W, call.experts_per_rank, call.capacity
    ids = np.asarray(on_host(arguments["topk_idx"]))
    xp = array_namespace(ids)  # array-api-compat's numpy, loaded on first use
    layout = static_layout(xp, ids, world * experts, capacity)
    routing = packed_routing(layout)
    told = counts_out(xp, layout, world, experts)
    plan: MoePlan | None = None
    got, number = told, -1

    def issue() -> Pending:
        nonlocal plan, got, number
        if call.check:
            verify(MOE_DISPATCH_STATIC, call, topk_idx=arguments["topk_idx"])
            number = call_number(grp)
        if call.overflow == "error":
            refuse_drops(backend, grp, layout, capacity)
        got = backend.exchange_ints(told, grp)
        valid, _ = counts_in(xp, got, world, experts)
        plan = moe_plan(layout.sent, np.ascontiguousarray(valid.T).reshape(-1), world, capacity)
        return _scatter(call, x, routing, plan)

    def backward(grad: Any) -> Any:  # the plan is made when the call is issued
        return dispatch_backward(backend, grp, rows_of(grad), plan, routing)

    received = _functional(MOE_DISPATCH_STATIC.name, call, x, backward)

    def finish(result: Any) -> tuple[Any, Any, StaticHandle]:
        rows = received(result.reshape(experts, world * capacity, *result.shape[1:]))
        valid, before = (host_as(np.ascontiguousarray(c), x) for c in counts_in(xp, got, world, experts))
        handle = StaticHandle(layout, grp, experts, capacity, weights, x, valid, before,
                              host_as(layout.demand, x), HostRoute(routing, plan), number)  # fmt: skip
        return rows, valid, handle

    return _run(MOE_DISPATCH_STATIC.name, call, issue, finish)


def redispatch(call: Call, arguments: dict[str, Any]) -> Any:
    """moe.redispatch_static on a host backend: the handle's routing and plan, no count exchange."""
    backend, grp, handle, x = call.backend, call.group, arguments["handle"], arguments["x"]
    routing, plan = handle.host

    def issue() -> Pending:
        if call.check:
            verify(MOE_REDISPATCH_STATIC, call)
        return _scatter(call, x, routing, plan)

    received = _functional(
        MOE_REDISPATCH_STATIC.name, call, x, lambda grad: dispatch_backward(backend, grp, rows_of(grad), plan, routing)
    )
    shape = (handle.experts_per_rank, handle.world * handle.capacity)
    return _run(MOE_REDISPATCH_STATIC.name, call, issue, lambda rows: received(rows.reshape(*shape, *rows.shape[1:])))


def combine(call: Call, arguments: dict[str, Any]) -> Any:
    """moe.combine_static on a host backend: moe.combine's transfer and sums over y's blocks."""
    handle = arguments["handle"]
    routing, plan = handle.host
    return combine_rows(MOE_COMBINE_STATIC, call, rows_of(arguments["y"]), routing, plan, handle.weights)


def packed_routing(layout: StaticLayout) -> Routing:
    """A host static layout as the dynamic mode's :class:`~unicoll.routing.Routing`: the
    filled rows of the send buffer, in its order (by global expert, then slot), and each kept
    slot's place among them (a dropped slot's: one past them)."""
    filled = layout.filled
    send_tokens = layout.row_tokens[filled]
    place = np.cumsum(filled) - 1
    kept = layout.kept.reshape(-1)
    slot_rows = np.full(kept.shape, send_tokens.size, dtype=np.int64)
    slot_rows[kept] = place[layout.slot_rows[kept]]
    return Routing(layout.sent, send_tokens, slot_rows, not kept.all(), layout.kept.shape[1])


def _scatter(call: Call, x: Any, routing: Routing, plan: MoePlan) -> Pending:
    """The valid rows of x (``routing``'s send order) to their places in the blocks (``plan``)."""
    native = call.backend.to_native(x)
    return call.backend.global_scatter(native, plan, call.group, not call.sync_op, call.sync_op, routing.send_tokens)


def rows_of(blocks: Any) -> Any:
    """``(E, W * C, ...)`` blocks as rows (a view): ``(E * W * C, ...)``."""
    return blocks.reshape(blocks.shape[0] * blocks.shape[1], *blocks.shape[2:])


def refuse_drops(backend: Backend, group: Group, layout: StaticLayout, capacity: int) -> None:
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
