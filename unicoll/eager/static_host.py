"""The static-shape MoE operators on a host backend (gloo, mpi), eagerly: the same layout and
results as everywhere, with only the valid rows on the wire.

Where the arrays are in host memory, reading a count is no synchronization: nothing waits for a
device. So the slots are routed on the host as moe.dispatch routes them with a capacity
(:func:`unicoll.routing.route`: the same order and the same slots kept as the array-API layout
of :mod:`unicoll.static_layout`), the counts (``W`` blocks of ``1 + 2E``: the capacity, the rows
sent, the slots routed before the capacity; fixed size) travel first,
and the rows follow as moe.dispatch's ``global_scatter``/``global_gather`` with a *padded* plan
(:class:`~unicoll.backends.layout.MoePlan` with a capacity): each block's valid rows go straight
to their place among the ``(E, W * C)`` rows, the padding is written as zeros where they land
and never travels. Combine, the backward passes and a second layer's redispatch go the same
way, with moe.dispatch's sums and backward (one backward per operator). The device path, even
all-to-alls of whole blocks, is :mod:`unicoll.eager.static_moe`'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backends.base import Backend, Pending
from ..backends.layout import MoePlan, moe_plan
from ..check import call_number, verify
from ..counts import on_host
from ..errors import CrossRankMismatchError, bad_input
from ..group import Group
from ..routing import Routing, route
from ..spec import MOE_COMBINE_STATIC, MOE_DISPATCH_STATIC, MOE_REDISPATCH_STATIC, Call
from ..static_layout import HostRoute, StaticHandle
from .moe import combine_rows, dispatch_backward, host_as
from .ops import _functional, _run


def dispatch(call: Call, arguments: dict[str, Any]) -> Any:
    """moe.dispatch_static (validated ``call``) on a host backend (``Backend.host_memory``)."""
    backend, grp, x, weights = call.backend, call.group, arguments["x"], arguments["topk_weights"]
    world, experts, capacity = call.W, call.experts_per_rank, call.capacity
    ids = routed_ids(arguments["topk_idx"], world * experts)
    routing = route(ids, world * experts, capacity)
    demand = np.bincount(ids[ids >= 0], minlength=world * experts)
    told = np.concatenate(
        [np.full((world, 1), capacity), routing.local_count.reshape(world, experts), demand.reshape(world, experts)],
        axis=1,
    )
    plan: MoePlan | None = None
    got, number = told, -1

    def issue() -> Pending:
        nonlocal plan, got, number
        if call.compare:
            verify(MOE_DISPATCH_STATIC, call, topk_idx=arguments["topk_idx"])
            number = call_number(grp)
        if call.overflow == "error":
            refuse_drops(backend, grp, demand, capacity)
        got = backend.exchange_ints(told.reshape(-1), grp).reshape(world, 1 + 2 * experts)
        _same_capacity(got[:, 0], capacity)
        plan = moe_plan(routing.local_count, got[:, _halves(experts)[0]].reshape(-1), world, capacity)
        return _scatter(call, x, routing, plan)

    def backward(grad: Any) -> Any:  # the plan is made when the call is issued
        return dispatch_backward(backend, grp, rows_of(grad), plan, routing)

    received = _functional(MOE_DISPATCH_STATIC.name, call, x, backward)

    def finish(result: Any) -> tuple[Any, Any, StaticHandle]:
        rows = received(result.reshape(experts, world * capacity, *result.shape[1:]))
        valid, before = (host_as(np.ascontiguousarray(got[:, part].T), x) for part in _halves(experts))
        counts = (valid, before, host_as(demand, x))
        handle = StaticHandle(grp, experts, capacity, weights, x, counts, host_as(routing.kept, x),
                              HostRoute(routing, plan), number)  # fmt: skip
        return rows, valid, handle

    return _run(MOE_DISPATCH_STATIC.name, call, issue, finish)


def routed_ids(topk_idx: Any, experts: int) -> np.ndarray:
    """The router's ids on the host as int64, -1 for a dropped slot: -1 itself, or an id
    outside ``0 .. experts - 1``, which the static mode drops (check mode refuses it first)."""
    ids = np.asarray(on_host(topk_idx)).astype(np.int64, copy=False)
    outside = (ids < -1) | (ids >= experts)
    return np.where(outside, -1, ids) if outside.any() else ids


def _halves(experts: int) -> tuple[slice, slice]:
    """Where a rank's counts sit in the ``1 + 2E`` ints it tells each rank (its capacity first):
    the rows it sends each expert, and its slots routed there before the capacity."""
    return slice(1, 1 + experts), slice(1 + experts, 1 + 2 * experts)


def _same_capacity(theirs: np.ndarray, capacity: int) -> None:
    """Every rank's capacity, as it told this rank beside its counts, against this rank's: a
    rank that computed its own (from its own token count, say) would make blocks the others
    misread, so every rank raises the same error before any row moves."""
    if (theirs != capacity).any():
        told = ", ".join(f"rank {c}: {int(v)}" for c, v in enumerate(theirs))
        raise CrossRankMismatchError(
            f"{MOE_DISPATCH_STATIC.name}: capacity: expected the same capacity on every rank, got {told}"
        )


def redispatch(call: Call, arguments: dict[str, Any]) -> Any:
    """moe.redispatch_static on a host backend: the handle's routing and plan, no count exchange."""
    backend, grp, handle, x = call.backend, call.group, arguments["handle"], arguments["x"]
    routing, plan = handle.layout

    def issue() -> Pending:
        if call.compare:
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
    routing, plan = handle.layout
    return combine_rows(MOE_COMBINE_STATIC, call, rows_of(arguments["y"]), routing, plan, handle.weights)


def _scatter(call: Call, x: Any, routing: Routing, plan: MoePlan) -> Pending:
    """The valid rows of x (``routing``'s send order) to their places in the blocks (``plan``)."""
    native = call.backend.to_native(x)
    return call.backend.global_scatter(native, plan, call.group, not call.sync_op, call.sync_op, routing.send_tokens)


def rows_of(blocks: Any) -> Any:
    """``(E, W * C, ...)`` blocks as rows (a view): ``(E * W * C, ...)``."""
    return blocks.reshape(blocks.shape[0] * blocks.shape[1], *blocks.shape[2:])


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
