"""The traced forms of unicoll's public operators, for torch.compile.

While torch.compile traces a call to a public operator, the public face (:mod:`unicoll.face`)
hands it to :func:`traced_call`, which records it as custom ops of the ``unicoll`` namespace
(:mod:`unicoll.compiled.custom_ops`, registered when this module is imported): a data operator
whose spec traces as its one op (:func:`_operator`, the same for them all), unicoll.moe's
calls as its layout in tensors (``unicoll::moe_layout``, a :class:`TracedHandle`) around
``global_scatter`` and ``global_gather``, or the static layout around even all-to-alls.

What cannot be traced (``sync_op=False``, outputs filled in place, arrays of other libraries,
arguments of unexpected types) runs the eager operator behind one graph break whose reason
says why (``torch.compiler.disable``); docs/compile.md lists the cases.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import array_api_compat.torch as xpt
import torch

from .. import once_blocks, runtime
from ..arrays import dynamo_imported, traced_forms_loaded
from ..backends.layout import moe_plan
from ..eager.moe import sum_at_once
from ..eager.moe_once import sum_dtype
from ..eager.once_choice import ONCE_ENV_VAR
from ..eager.ops import autograd_state
from ..group import Group
from ..kinds import GROUP, Kind
from ..routing import Handle, Routing
from ..session import tracing_told_by
from ..spec import SPECS, OpSpec
from ..static_layout import StaticHandle, combine_blocks, dispatch_blocks, redispatch_blocks, static_layout
from .custom_ops import WORLD, group_of, world_size

# While Dynamo traces, it is imported: the face's test of every call reads no sys.modules then,
# and the array functions' test of every array reads a flag set here.
torch.compiler.assume_constant_result(dynamo_imported)
traced_forms_loaded()
tracing_told_by(torch.compiler.is_compiling)

# -- what runs eagerly, behind one graph break ------------------------------------------------


def _eagerly(reason: str) -> Callable[..., Any]:
    """A function that calls an operator eagerly, which torch.compile does not trace: one graph
    break, whose reason reads ``unicoll: <reason>; the call runs eagerly``."""

    @torch.compiler.disable(reason=f"unicoll: {reason}; the call runs eagerly")
    def run(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``op(*args, **kwargs)``, eagerly."""
        return op(*args, **kwargs)

    return run


_as_task = _eagerly("sync_op=False returns a Task, which torch.compile cannot trace")
_in_place = _eagerly(
    "an output filled in place (alltoall_single's out_tensor, reduce_scatter's out, all_gather's output array or list) "
    "cannot be traced"
)
_untraced = _eagerly(
    "only torch tensors, counts as int tensors or lists of ints, a unicoll.Group or None and bool flags "
    "are traced, on an initialized unicoll"
)

_eager_handle = _eagerly("a moe.Handle made by an eager moe.dispatch keeps its layout on the host")

_no_traced_form = _eagerly("this operator has no traced form (its arrays come and go in lists)")


def traced_call(name: str, eager: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """The call ``name(*args, **kwargs)`` of a public operator as torch.compile traces it
    (``eager``: the operator under the lock, for what runs eagerly): a data operator whose spec
    traces as its custom op, unicoll.moe's by their forms below, any other behind one graph
    break (``alltoall``: lists of arrays in and out)."""
    spec = SPECS[name]
    if spec.traced is not None:
        return _operator(spec, eager, args, kwargs)
    form = _MOE_FORMS.get(name)
    if form is None:
        return _no_traced_form(eager, *args, **kwargs)
    return form(eager, *args, **kwargs)


_UNTRACEABLE = object()
"""What :func:`_traced_value` returns for a value that is not traced."""


def _number(group: Any) -> Any:
    """The int that names ``group`` in a schema, or :data:`_UNTRACEABLE` (not a group, or
    unicoll not initialized: the eager operator raises its error)."""
    if not runtime.is_initialized():
        return _UNTRACEABLE
    if group is None:
        return WORLD
    return group.number if isinstance(group, Group) else _UNTRACEABLE


def _counts(value: Any) -> Any:
    """Counts as a tensor: a tensor as it is, a list or tuple of ints as a host int64 tensor;
    anything else :data:`_UNTRACEABLE`."""
    if isinstance(value, torch.Tensor):
        return value
    if type(value) in (list, tuple) and all(type(v) is int for v in value):
        return torch.tensor(value, dtype=torch.int64)
    return _UNTRACEABLE


_VALUE_TYPES = {"str": str, "int": int, "bool": bool}
"""The Python type of a value of each plain schema type (an int is not a bool)."""


def _traced_value(kind: Kind, value: Any) -> Any:
    """A parameter's value as its kind's schema type takes it (:attr:`unicoll.kinds.Kind.schema`),
    or :data:`_UNTRACEABLE`: the group as its number, counts as a tensor, an array as a torch
    tensor, a plain value of exactly its type; None where the type is optional."""
    if kind is GROUP:
        return _number(value)
    if value is None:
        return None if kind.schema.endswith("?") else _UNTRACEABLE
    if kind.holds_counts:
        return _counts(value)
    if kind.schema.startswith("Tensor"):
        return value if isinstance(value, torch.Tensor) else _UNTRACEABLE
    return value if type(value) is _VALUE_TYPES[kind.schema] else _UNTRACEABLE


def _operator(spec: OpSpec, eager: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """A data operator's call as traced: its custom op (``unicoll::<name>``) on the parameters
    that have a schema type, the rows the spec computes for the fake implementation and how
    autograd sees the array where that can refuse the call; the result of an operator that
    changes its array in place is copied back into it (autograd records the copy) and the array
    returned. An output to fill, ``sync_op=False`` or a value of another type runs ``eager``
    behind one graph break."""
    arguments = spec.bind(args, kwargs)
    if arguments is None:
        return _untraced(eager, *args, **kwargs)
    if any(p.kind.fills and not p.kind.in_place and arguments[p.name] is not None for p in spec.params):
        return _in_place(eager, *args, **kwargs)
    if arguments.get("sync_op", True) is False:
        return _as_task(eager, *args, **kwargs)
    values = [_traced_value(p.kind, arguments[p.name]) for p in spec.params if p.kind.schema and p.name != "sync_op"]
    if arguments.get("sync_op", True) is not True or any(v is _UNTRACEABLE for v in values):
        return _untraced(eager, *args, **kwargs)
    traced, array = spec.traced, arguments[spec.traced.like]
    if traced.rows is not None:
        group = arguments["group"]
        size = group.world_size if group is not None else runtime.state(spec.name).world.world_size
        values.append(traced.rows(arguments, size))
    state = autograd_state(array) if spec.refuses_by_autograd else "none"
    if spec.refuses_by_autograd:
        values.append(state)
    result = getattr(torch.ops.unicoll, spec.name)(*values)
    if traced.learns:
        result = result[0]
    if not any(p.kind.in_place for p in spec.params):
        return result
    if state in ("none", "recorded"):  # else autograd forbids the change: the op raised eager's error
        array.copy_(result)
    return array


def _traced(*values: Any) -> bool:
    """Whether none of ``values`` is :data:`_UNTRACEABLE`."""
    return all(v is not _UNTRACEABLE for v in values)


def _flags(sync_op: Any, use_calc_stream: Any = True) -> bool:
    """Whether the flags are traced: ``sync_op=True`` and a bool ``use_calc_stream``."""
    return sync_op is True and type(use_calc_stream) is bool


class TracedOnce(NamedTuple):
    """What a compiled dispatch that sends each token once per rank keeps beside its
    :class:`TracedHandle` (the once outputs of ``unicoll::moe_layout``)."""

    sent: torch.Tensor
    """The token rows sent to each rank (host int64)."""
    received: torch.Tensor
    """The token rows received from each rank (host int64)."""
    pair_token: torch.Tensor
    """The token of each row sent (int64, on x's device)."""
    index: torch.Tensor
    """Each expert row's row among the token rows received (int64, on x's device)."""
    row_slot: torch.Tensor
    """The slot of each row one row per slot would have sent (int64, on x's device)."""
    pairs_received: int
    """The token rows received (an unbacked size while tracing)."""


class TracedHandle(NamedTuple):
    """What :func:`unicoll.moe.dispatch` hands back in compiled code: the layout as tensors (the
    outputs of ``unicoll::moe_layout``), which :func:`moe_redispatch` and :func:`moe_combine`
    use, traced, within the same compiled code (a graph break in between carries it along)."""

    local_count: torch.Tensor
    """Rows sent to each global expert (host int64)."""
    global_count: torch.Tensor
    """Rows received from each rank for each local expert (host int64)."""
    send_tokens: torch.Tensor
    """The token of each row sent (int64, on x's device)."""
    slot_rows: torch.Tensor
    """Each slot's row among those sent, or the number of rows sent for a dropped slot."""
    weights: torch.Tensor | None
    """The caller's ``topk_weights`` (None without them)."""
    group: int
    """The group's number (:data:`WORLD` for the world)."""
    tokens: int
    """The tokens dispatched."""
    topk: int
    """The slots per token."""
    rows_per_expert: list[int]
    """The rows each local expert received (unbacked sizes while tracing)."""
    once: TracedOnce | None = None
    """How each token went once per rank, or None where one row per slot went."""
    link: torch.Tensor | None = None
    """The rows dispatch returned, which combine joins its rows to (:func:`moe_combine`)."""

    @property
    def weighted(self) -> bool:
        """Whether dispatch was given ``topk_weights``."""
        return self.weights is not None

    def local_expert_ids(self) -> torch.Tensor:
        """As :meth:`unicoll.moe.Handle.local_expert_ids`, traced: each row dispatch returned,
        its local expert (int64, on x's device)."""
        experts = len(self.rows_per_expert)
        per_expert = self.global_count.reshape(-1, experts).sum(0)
        ids = torch.repeat_interleave(torch.arange(experts), per_expert, output_size=sum(self.rows_per_expert))
        return ids.to(self.send_tokens.device)


def _with_handle(op: Callable[..., Any], rows: Any, handle: TracedHandle, sync_op: Any) -> Any:
    """``op`` (the eager moe.redispatch or moe.combine) of ``rows`` with the :class:`~unicoll.moe.Handle`
    of a traced handle's layout: for the calls that run eagerly (``sync_op=False``)."""
    send_tokens, slot_rows = handle.send_tokens.cpu().numpy(), handle.slot_rows.cpu().numpy()
    dropped = bool((slot_rows == send_tokens.size).any())
    routing = Routing(handle.local_count.numpy(), send_tokens, slot_rows, dropped, handle.topk)
    group = runtime.resolve_group(group_of(handle.group), f"moe.{op.__name__}")
    plan = moe_plan(routing.local_count, handle.global_count.numpy(), group.world_size)
    eager = Handle(routing, plan, group, handle.weights, like=handle.send_tokens)
    return op(rows, eager, sync_op=sync_op)


def moe_dispatch(
    eager: Callable[..., Any],
    x: Any,
    topk_idx: Any,
    topk_weights: Any | None = None,
    *,
    experts_per_rank: int,
    group: Group | None = None,
    sync_op: bool = True,
    capacity: int | None = None,
) -> Any:
    """:func:`unicoll.moe.dispatch` as traced: ``unicoll::moe_layout`` (validation, the layout
    and the counts' exchange), the rows taken by ``index_select`` and sent by
    ``unicoll::global_scatter``; rows_per_expert are unbacked sizes that the layout op returns
    (no tensor is read for them), whose sum is the rows' size; the handle is a
    :class:`TracedHandle`."""
    run_eagerly = functools.partial(
        eager, x, topk_idx, topk_weights, experts_per_rank=experts_per_rank, group=group, sync_op=sync_op,
        capacity=capacity,
    )  # fmt: skip
    if sync_op is False:
        return _as_task(run_eagerly)
    number = _number(group)
    tensors = isinstance(x, torch.Tensor) and isinstance(topk_idx, torch.Tensor)
    weights_ok = topk_weights is None or isinstance(topk_weights, torch.Tensor)
    sizes_ok = type(experts_per_rank) is int and (capacity is None or type(capacity) is int)
    if not tensors or not weights_ok or not sizes_ok or not _flags(sync_op) or not _traced(number):
        return _untraced(run_eagerly)
    once = _sends_once(x, topk_idx, number)
    *layout, sizes = torch.ops.unicoll.moe_layout(x, topk_idx, topk_weights, experts_per_rank, number, capacity, once)
    local_count, global_count, send_tokens, slot_rows = layout[:4]
    rows_per_expert = sizes[:experts_per_rank]
    tokens, topk = topk_idx.shape
    traced_once = TracedOnce(*layout[4:], sizes[experts_per_rank]) if once else None
    handle = TracedHandle(local_count, global_count, send_tokens, slot_rows, topk_weights, number, tokens, topk,
                          rows_per_expert, traced_once)  # fmt: skip
    if traced_once is not None:
        received = _once_rows(x, handle)
    else:
        received = torch.ops.unicoll.global_scatter(
            x.index_select(0, send_tokens), local_count, global_count, number, True, sum(rows_per_expert)
        )
    return received, rows_per_expert, handle._replace(link=received)


def _sends_once(x: torch.Tensor, topk_idx: torch.Tensor, number: int) -> bool:
    """Whether a compiled dispatch sends each token once per rank: where
    ``UNICOLL_MOE_ONCE=1`` when the step is compiled (a graph cannot take either form per call,
    so by default it sends one row per slot), over more than one rank, at top-k above 1, for
    rows of some bytes. Every rank's step must be compiled alike (the layout refuses a mix)."""
    if os.environ.get(ONCE_ENV_VAR) != "1" or topk_idx.ndim != 2 or topk_idx.shape[1] < 2:
        return False
    return world_size(number, "moe.dispatch") > 1 and math.prod(x.shape[1:]) > 0


def _once_rows(x: torch.Tensor, handle: TracedHandle) -> torch.Tensor:
    """The rows of x a once handle's dispatch (or redispatch) delivers: each token's row to each
    of its ranks by ``unicoll::global_scatter`` of one count per rank, expanded there into the
    expert rows by one gather; autograd follows both (dispatch's backward is a combine)."""
    once = handle.once
    sent = x.index_select(0, once.pair_token)
    arrived = torch.ops.unicoll.global_scatter(sent, once.sent, once.received, handle.group, True, once.pairs_received)
    return arrived.index_select(0, once.index)


def moe_redispatch(eager: Callable[..., Any], x: Any, handle: Any, *, sync_op: bool = True) -> Any:
    """:func:`unicoll.moe.redispatch` as traced, for a :class:`TracedHandle`: the rows taken by
    ``index_select`` and sent by ``unicoll::global_scatter``."""
    if not isinstance(handle, TracedHandle):
        return _eager_handle(functools.partial(eager, x, handle, sync_op=sync_op))
    if sync_op is False:
        return _as_task(_with_handle, eager, x, handle, sync_op)
    if not isinstance(x, torch.Tensor) or not _flags(sync_op):
        return _untraced(_with_handle, eager, x, handle, sync_op)
    received = sum(handle.rows_per_expert)
    torch.ops.unicoll.moe_check(x, handle.send_tokens, handle.tokens, received, handle.weighted, "moe.redispatch")
    if handle.once is not None:
        return _once_rows(x, handle)
    sent = x.index_select(0, handle.send_tokens)
    return torch.ops.unicoll.global_scatter(sent, handle.local_count, handle.global_count, handle.group, True, received)


def moe_combine(eager: Callable[..., Any], y: Any, handle: Any, *, sync_op: bool = True) -> Any:
    """:func:`unicoll.moe.combine` as traced, for a :class:`TracedHandle`: the rows sent back by
    ``unicoll::global_gather``, then each token's slots weighted and summed as eager does (a
    zero row read by dropped slots, whose weights count as zero)."""
    if not isinstance(handle, TracedHandle):
        return _eager_handle(functools.partial(eager, y, handle, sync_op=sync_op))
    if sync_op is False:
        return _as_task(_with_handle, eager, y, handle, sync_op)
    if not isinstance(y, torch.Tensor) or not _flags(sync_op):
        return _untraced(_with_handle, eager, y, handle, sync_op)
    sent = handle.send_tokens.shape[0]
    received = sum(handle.rows_per_expert)
    torch.ops.unicoll.moe_check(y, handle.send_tokens, handle.tokens, received, handle.weighted, "moe.combine")
    if handle.link is not None and handle.link.requires_grad:
        y = _joined(y, handle.link)
    if handle.once is not None:
        return _once_combine(y, handle)
    back = torch.ops.unicoll.global_gather(y, handle.local_count, handle.global_count, handle.group, True, sent)
    back = torch.cat([back, back.new_zeros((1, *y.shape[1:]))])
    weights = handle.weights
    if weights is not None:  # a dropped slot weighs zero: torch.where here, not array-api-compat's in the graph
        kept = handle.slot_rows.reshape(handle.tokens, handle.topk) < sent
        weights = torch.where(kept, weights, torch.zeros_like(weights))
    return sum_at_once(back, handle.slot_rows, handle.tokens, handle.topk, weights, None)


def _joined(y: torch.Tensor, link: torch.Tensor) -> torch.Tensor:
    """``y`` minus the sum of no rows of ``link``: the same values (``-0.0`` and NaN included),
    and a gradient path to ``link`` that the traced backward keeps, so every rank's backward
    runs dispatch's backward collective whatever the experts made of the rows (eager joins a
    node instead: :func:`unicoll.eager.moe.joined_to_dispatch`)."""
    return y - link[:0].sum().to(y.dtype)


def _once_combine(y: torch.Tensor, handle: TracedHandle) -> torch.Tensor:
    """combine along a once handle: each slot's weight (1 without weights: every rank's graph
    sends them) to its expert row by ``unicoll::global_scatter`` along the plain counts, each
    token's weighted rows summed there into one row per (token, rank), sent back by
    ``unicoll::global_gather`` of one count per rank and summed per token, in the promoted dtype
    of the rows and this rank's weights (2-byte floats in float32). Autograd follows it all:
    the weights' gradients come back along the counts they went by."""
    once, weights = handle.once, handle.weights
    dtype = sum_dtype(y.dtype, None if weights is None else weights.dtype)
    if weights is None:
        column = torch.ones((once.row_slot.shape[0], 1), dtype=torch.float64, device=y.device)
    else:
        column = weights.reshape(-1).index_select(0, once.row_slot).to(torch.float64).reshape(-1, 1)
    rows = sum(handle.rows_per_expert)
    there = torch.ops.unicoll.global_scatter(column, handle.local_count, handle.global_count, handle.group, True, rows)
    flat = y.reshape(y.shape[0], math.prod(y.shape[1:])).to(dtype) * there.to(dtype)
    summed = flat.new_zeros((once.pairs_received, flat.shape[1])).index_add(0, once.index, flat).to(y.dtype)
    sent = once.pair_token.shape[0]
    back = torch.ops.unicoll.global_gather(summed, once.sent, once.received, handle.group, True, sent).to(dtype)
    out = back.new_zeros((handle.tokens, back.shape[1])).index_add(0, once.pair_token, back)
    return out.to(y.dtype).reshape(handle.tokens, *y.shape[1:])


# -- the static-shape MoE operators: the layout traced on the array API, even all-to-alls ------


def _even_exchange(number: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The exchange of a static step on group ``number``: ``unicoll::alltoall_single`` of an
    array's rows in W equal blocks, whose output has the array's shape."""

    def exchange(rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.unicoll.alltoall_single(rows, None, None, number, True, rows.shape[0])[0]

    return exchange


def moe_dispatch_static(
    eager: Callable[..., Any],
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
) -> Any:
    """:func:`unicoll.moe.dispatch_static` as traced: the layout in the graph (array-API
    operations on torch), the rows and the counts sent by ``unicoll::alltoall_single`` in W equal
    blocks (with ``max_tokens_per_rank``, each token once per rank where that saves bytes:
    :mod:`unicoll.once_blocks`); every shape static, no value read on the host. The call is
    checked by its spec, as eager's is (``unicoll::moe_check_static``: eager's errors, raised
    when the compiled code runs), and the handle is eager's :class:`~unicoll.moe.StaticHandle`
    over the layout's tensors. ``overflow='error'`` (a host read) runs eagerly."""
    run_eagerly = functools.partial(
        eager, x, topk_idx, topk_weights, experts_per_rank=experts_per_rank,
        capacity=capacity, group=group, sync_op=sync_op, overflow=overflow, max_tokens_per_rank=max_tokens_per_rank,
    )  # fmt: skip
    if sync_op is False:
        return _as_task(run_eagerly)
    number = _number(group)
    tensors = isinstance(x, torch.Tensor) and isinstance(topk_idx, torch.Tensor) and topk_idx.ndim == 2
    weights_ok = topk_weights is None or isinstance(topk_weights, torch.Tensor)
    sizes_ok = type(experts_per_rank) is int and experts_per_rank > 0 and type(capacity) is int and capacity >= 0
    bound = max_tokens_per_rank
    bound_ok = bound is None or (type(bound) is int and bound >= 0)
    if not tensors or not weights_ok or not sizes_ok or not bound_ok or overflow != "drop" or not _traced(number):
        return _untraced(run_eagerly)
    torch.ops.unicoll.moe_check_static(x, topk_idx, topk_weights, experts_per_rank, capacity, bound, number)
    world = world_size(number, "moe.dispatch_static")
    grp = runtime.resolve_group(group_of(number), "moe.dispatch_static")
    if once_blocks.chosen(bound, world, experts_per_rank, capacity, x, topk_idx.shape[1]):
        layout = static_layout(xpt, topk_idx, world * experts_per_rank, capacity)
        arrived, once = once_blocks.dispatch_blocks(x, layout, world, bound, _even_exchange(number))
        handle = StaticHandle.of_blocks(grp, experts_per_rank, capacity, topk_weights, x, layout, arrived, once=once)
        return arrived.rows, arrived.counts, handle
    layout, arrived = dispatch_blocks(xpt, x, topk_idx, world, experts_per_rank, capacity, _even_exchange(number))
    handle = StaticHandle.of_blocks(grp, experts_per_rank, capacity, topk_weights, x, layout, arrived)
    return arrived.rows, arrived.counts, handle


def _static_handle(rows: Any, handle: Any, sync_op: Any) -> tuple[int, bool]:
    """The group number of a static handle, and whether a call with it traces: a handle of the
    running session."""
    if not (isinstance(handle, StaticHandle) and handle.ended is None):
        return WORLD, False
    number = _number(handle.group)
    return number, isinstance(rows, torch.Tensor) and _flags(sync_op) and _traced(number)


def _check_blocks(rows: torch.Tensor, handle: StaticHandle, op: str, number: int) -> None:
    """``unicoll::moe_check_blocks`` of the rows given to ``op`` against the handle, on the
    group numbered ``number``."""
    blocks = handle.experts_per_rank, handle.world, handle.capacity
    torch.ops.unicoll.moe_check_blocks(rows, handle.kept, handle.tokens, *blocks, handle.weighted, op, number)


def moe_redispatch_static(eager: Callable[..., Any], x: Any, handle: Any, *, sync_op: bool = True) -> Any:
    """:func:`unicoll.moe.redispatch_static` as traced: the rows gathered in the graph and sent
    by ``unicoll::alltoall_single`` in W equal blocks."""
    number, traced = _static_handle(x, handle, sync_op)
    if not traced:
        return _untraced(eager, x, handle, sync_op=sync_op)
    _check_blocks(x, handle, "moe.redispatch_static", number)
    if isinstance(handle.once, once_blocks.BlocksOnce):
        blocks = handle.experts_per_rank, handle.world * handle.capacity
        return once_blocks.redispatch_blocks(x, handle.once, blocks, _even_exchange(number))
    return redispatch_blocks(xpt, x, handle.layout, handle.world, handle.experts_per_rank, _even_exchange(number))


def moe_combine_static(eager: Callable[..., Any], y: Any, handle: Any, *, sync_op: bool = True) -> Any:
    """:func:`unicoll.moe.combine_static` as traced: the blocks sent back by
    ``unicoll::alltoall_single`` in W equal blocks, each token's kept slots weighed and summed in
    the graph."""
    number, traced = _static_handle(y, handle, sync_op)
    if not traced:
        return _untraced(eager, y, handle, sync_op=sync_op)
    _check_blocks(y, handle, "moe.combine_static", number)
    if isinstance(handle.once, once_blocks.BlocksOnce):
        return once_blocks.combine_blocks(y, handle.once, handle.weights, _even_exchange(number))
    return combine_blocks(
        xpt, y, handle.layout, handle.weights, handle.world, handle.experts_per_rank, _even_exchange(number)
    )


_MOE_FORMS: dict[str, Callable[..., Any]] = {
    "moe.dispatch": moe_dispatch,
    "moe.redispatch": moe_redispatch,
    "moe.combine": moe_combine,
    "moe.dispatch_static": moe_dispatch_static,
    "moe.redispatch_static": moe_redispatch_static,
    "moe.combine_static": moe_combine_static,
}
"""unicoll.moe's traced forms by the operators' names, each taking the operator under the lock
first (for what runs eagerly), then the call's arguments."""
