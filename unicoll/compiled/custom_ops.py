"""unicoll's operators on torch tensors as ``torch.library`` custom ops (the ``unicoll``
namespace), which torch.compile records in a graph as one node each; the traced forms that
record them are in :mod:`unicoll.compiled.traced`.

Each data operator whose spec traces (:attr:`unicoll.spec.OpSpec.traced`) gets its ops from
its spec, in one loop (:func:`_register`):

- the op's real implementation is the eager operator itself, so a call from compiled code is
  validated, checked (check mode) and reported exactly as an eager call, at run time; an
  operator that changes its array in place changes a copy, which the op returns;
- its fake implementation gives the output's shape without communicating: the rows the spec
  computes while tracing where the arguments say them, else a new dynamic size (torch's
  ``capture_dynamic_output_shape_ops``);
- its backward (``torch.library.register_autograd``) is the backward op ``<name>_backward``,
  which runs the eager operator's backward (``<name>_backward`` of :mod:`unicoll.eager.ops`)
  on what the spec says it needs;
- the group travels as an int: its :attr:`~unicoll.Group.number`, or :data:`WORLD`.

unicoll.moe's layout and checks are written out by hand below them.

Importing this module registers the ops, for CPU and CUDA tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import runtime
from ..eager import device_once, moe, ops, static_moe
from ..eager.once_choice import COMPILED
from ..entry import enter, exclusive_as, leave
from ..group import Group, group_numbered
from ..spec import SPECS, Call, OpSpec

WORLD = -1
"""The group number of the world of the running session (``group=None``)."""

_DEVICES = ("cpu", "cuda")

_TAGS = (torch.Tag.nondeterministic_seeded,)
"""A collective's result depends on the other ranks: torch must neither run the op on constant
inputs while it traces (fake tensors' constant propagation) nor recompute it in the backward."""


def group_of(number: int) -> Group | None:
    """The group a schema's ``number`` names: None (the world, resolved by the operator) for
    :data:`WORLD`; ValueError for a group that no longer lives."""
    if number == WORLD:
        return None
    group = group_numbered(number)
    if group is None:
        raise ValueError(f"group: expected the number of a live unicoll.Group, got {number}, a group since freed")
    return group


def world_size(number: int, op: str) -> int:
    """The size of the group a schema's ``number`` names (for the fake implementations)."""
    group = group_of(number)
    return runtime.state(op).world.world_size if group is None else group.world_size


def _rows_as_promised(result: torch.Tensor, rows: int | None, op: str) -> torch.Tensor:
    """``result``, checked to have the ``rows`` rows that the fake implementation promised."""
    if rows is not None and result.shape[0] != rows:
        raise ValueError(f"{op}: rows: expected {rows} rows of output, got {result.shape[0]}")
    return result


def _new_rows(rows: int | None) -> Any:
    """``rows`` where known, else a new dynamic size (data-dependent: from counts or an exchange)."""
    return torch.library.get_ctx().new_dynamic_size() if rows is None else rows


def _splits(number: int, op: str) -> torch.Tensor:
    """A fake host int64 tensor of one size per rank of the group."""
    return torch.empty((world_size(number, op),), dtype=torch.int64)


def _host_counts(t: torch.Tensor) -> np.ndarray:
    """A counts tensor (validated by its forward call) as a host int64 array."""
    return t.to("cpu", torch.int64).numpy()


def _host_ints(t: torch.Tensor) -> list[int]:
    """A counts tensor (validated by its forward call) as host ints."""
    return _host_counts(t).tolist()


_UNNUMBERED = -1
"""The forward collective number a compiled backward pass gives check mode: a compiled forward's
number is not kept, so every rank's compiled backward says this one."""


def _run_backward(op: str, group: int, grad: torch.Tensor, backward: Callable[..., Any], *saved: Any) -> torch.Tensor:
    """``backward`` (an eager ``*_backward`` of :mod:`unicoll.eager.ops`) of ``grad`` with what the
    forward call saved, run as eager autograd runs it (:func:`unicoll.eager.ops.guarded`): under
    the lock, its failures reported, and counted and compared across the ranks in check mode."""
    state = runtime.state(f"{op} (backward)")
    found = group_of(group)
    grp = state.world if found is None else found
    forward = _UNNUMBERED if state.compare else None

    def bound(native: Any) -> Any:
        return backward(state.backend, grp, native, *saved)

    return ops.guarded(op, state.backend, grp, state.timeout, forward, bound)(grad.contiguous())


def _op(name: str, schema: str) -> Callable[[Callable[..., Any]], Any]:
    """The decorator that makes a function the custom op ``unicoll::<name>`` of ``schema``, as
    every op here is: it changes none of its arguments, runs on CPU and CUDA tensors, carries
    :data:`_TAGS`, and is never dead code to the compiler (a collective runs on every rank even
    where its result goes unused, and a check raises: AOT autograd would drop it, and the
    other ranks would wait)."""
    register = torch.library.custom_op(
        f"unicoll::{name}", mutates_args=(), device_types=_DEVICES, tags=_TAGS, schema=schema
    )

    def decorate(fn: Callable[..., Any]) -> Any:
        op = register(fn)
        torch.fx.node.has_side_effect(getattr(torch.ops.unicoll, name).default)
        return op

    return decorate


# -- the data operators: one custom op and one backward op per spec that traces ---------------


def _inputs(spec: OpSpec) -> tuple[str, ...]:
    """The names of the custom op's inputs for ``spec``: its parameters that have a schema type
    but ``sync_op`` (a traced call is synchronous), then ``rows`` (promised to the fake
    implementation) where the spec computes them, and ``autograd`` (how autograd saw the
    array: :func:`unicoll.eager.ops.autograd_state`) where a call may be refused by it."""
    params = tuple(p.name for p in spec.params if p.kind.schema and p.name != "sync_op")
    extras = ("rows",) * (spec.traced.rows is not None) + ("autograd",) * spec.refuses_by_autograd
    return params + extras


def _schema(spec: OpSpec) -> str:
    """The custom op's schema: each input as its kind's schema type; the result, then each list
    the call learned for its backward (a host int64 tensor each)."""
    types = {p.name: p.kind.schema for p in spec.params} | {"rows": "SymInt?", "autograd": "str"}
    outputs = 1 + len(spec.traced.learns)
    returns = "Tensor" if outputs == 1 else f"({', '.join(['Tensor'] * outputs)})"
    return f"({', '.join(f'{types[name]} {name}' for name in _inputs(spec))}) -> {returns}"


def _saved(spec: OpSpec) -> tuple[str, ...]:
    """What the backward op takes between the gradient and the group: what the spec's backward
    needs, ``"plan"`` as the counts it is derived from."""
    return tuple(n for need in spec.traced.backward for n in (spec.counted if need == "plan" else (need,)))


def _backward_schema(spec: OpSpec) -> str:
    """The backward op's schema: the gradient, what the backward needs (a parameter as its
    kind's type, a learned list as a tensor), the group and the input's rows (None where the
    result had the input's whole shape)."""
    kinds = spec.kinds
    needs = [f"{kinds[n].schema if n in kinds else 'Tensor'} {n}" for n in _saved(spec)]
    return f"(Tensor grad, {', '.join([*needs, 'int group', 'SymInt? rows'])}) -> Tensor"


def _plan(spec: OpSpec, group: Group, counts: dict[str, np.ndarray]) -> Any:
    """The spec's plan (:attr:`~unicoll.spec.OpSpec.plan`) of a call of ``counts`` (host int64)
    on ``group``: what the eager operator derived, for its backward."""
    state = runtime.state(f"{spec.name} (backward)")
    call = Call(group.world_size, group, state.backend, state.timeout, False, False, **counts)
    return spec.plan(call)


def _forward(spec: OpSpec) -> Callable[..., Any]:
    """The implementation of ``spec``'s custom op: the eager operator under the lock, on its
    arguments by name (the group from its number, an output to fill None, an array changed in
    place a copy), synchronous, judged by how autograd saw the caller's array
    (:func:`unicoll.eager.ops.call_compiled`); returns the result, checked against the rows
    promised to the fake implementation, and the lists it learned as host int64 tensors."""
    names, traced = _inputs(spec), spec.traced
    in_place = any(p.kind.in_place for p in spec.params)
    outputs = {p.name: None for p in spec.params if p.kind.fills and not p.kind.in_place}
    synchronous = {"sync_op": True} if "sync_op" in spec.kinds else {}
    call = exclusive_as(spec.name)(ops.call_compiled)

    def forward(*args: Any) -> Any:
        values = dict(zip(names, args))
        autograd, rows = values.pop("autograd", "none"), values.pop("rows", None)
        arguments = {**outputs, **values, **synchronous, "group": group_of(values["group"])}
        array = values[traced.like].detach()
        arguments[traced.like] = array.clone() if in_place else array
        result, learned = call(spec, arguments, autograd)
        result = _rows_as_promised(result, rows, spec.name)
        if not traced.learns:
            return result
        return result, *(torch.tensor(learned[name], dtype=torch.int64) for name in traced.learns)

    return forward


def _fake(spec: OpSpec) -> Callable[..., Any]:
    """The fake implementation of ``spec``'s custom op: the result like the array it is like
    (its whole shape, or the rows promised, or a new dynamic size), one size per rank for each
    learned list."""
    names, traced = _inputs(spec), spec.traced

    def fake(*args: Any) -> Any:
        values = dict(zip(names, args))
        like = values[traced.like]
        if traced.rows is None:
            result = torch.empty_like(like)
        else:
            result = like.new_empty((_new_rows(values["rows"]), *like.shape[1:]))
        if not traced.learns:
            return result
        return result, *(_splits(values["group"], spec.name) for _ in traced.learns)

    return fake


def _backward_needs(spec: OpSpec, names: tuple[str, ...], group: int, saved: tuple) -> list[Any]:
    """What the eager backward takes after the gradient, from what the backward op was given
    (:func:`_saved`): counts as host int64 arrays (and the plan derived from them), learned
    lists as host ints, other values as they are."""
    host = {}
    for name, value in zip(names, saved):
        if isinstance(value, torch.Tensor):
            value = _host_counts(value) if name in spec.kinds else _host_ints(value)
        host[name] = value
    if "plan" in spec.traced.backward:
        grp = runtime.resolve_group(group_of(group), f"{spec.name} (backward)")
        host["plan"] = _plan(spec, grp, {name: host[name] for name in spec.counted})
    return [host[name] for name in spec.traced.backward]


def _register(spec: OpSpec) -> None:
    """Register ``spec``'s custom op (``unicoll::<name>``) and, for an operator with a gradient,
    its backward op (``unicoll::<name>_backward``, the eager ``<name>_backward``) and autograd."""
    names, traced = _inputs(spec), spec.traced
    op = _op(spec.name, _schema(spec))(_forward(spec))
    op.register_fake(_fake(spec))
    if traced.backward is None:
        return
    eager_backward = getattr(ops, f"{spec.name}_backward")
    saved_names = _saved(spec)

    def backward_impl(grad: torch.Tensor, *args: Any) -> torch.Tensor:
        *saved, group, _ = args
        needs = _backward_needs(spec, saved_names, group, tuple(saved))
        return _run_backward(spec.name, group, grad, eager_backward, *needs)

    def backward_fake(grad: torch.Tensor, *args: Any) -> torch.Tensor:
        rows = args[-1]
        return torch.empty_like(grad) if rows is None else grad.new_empty((rows, *grad.shape[1:]))

    _op(f"{spec.name}_backward", _backward_schema(spec))(backward_impl).register_fake(backward_fake)
    backward_op = getattr(torch.ops.unicoll, f"{spec.name}_backward")

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        values = dict(zip(names, inputs))
        values.update(zip(traced.learns, output[1:] if traced.learns else ()))
        needs = [values[name] for name in saved_names]
        ctx.tensor_at = [i for i, value in enumerate(needs) if isinstance(value, torch.Tensor)]
        ctx.save_for_backward(*(needs[i] for i in ctx.tensor_at))
        ctx.needs = [None if isinstance(value, torch.Tensor) else value for value in needs]
        ctx.group = values["group"]
        ctx.rows = None if traced.rows is None else values[traced.like].shape[0]

    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple:
        needs = list(ctx.needs)
        for i, tensor in zip(ctx.tensor_at, ctx.saved_tensors):
            needs[i] = tensor
        dx = backward_op(grad, *needs, ctx.group, ctx.rows)
        return tuple(dx if name == traced.like else None for name in names)

    op.register_autograd(backward, setup_context=setup_context)


for _spec in SPECS.values():
    if _spec.traced is not None:
        _register(_spec)


# -- unicoll.moe: the layout as tensors; the rows move with global_scatter and global_gather --


@_op(
    "moe_layout",
    "(Tensor x, Tensor topk_idx, Tensor? topk_weights, int experts_per_rank, int group, int? capacity, bool once) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, SymInt[])",
)
def _moe_layout(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None,
    experts_per_rank: int,
    group: int,
    capacity: int | None,
    once: bool,
) -> tuple[torch.Tensor, ...]:
    """moe.dispatch's validation, check and count exchange: the counts sent and received (host
    int64), the token of each row sent and each slot's row (int64 on x's device), and the rows
    each local expert receives (ints: the graph reads no tensor for them). ``once``: the step
    sends each token once per rank (every rank's must: the count exchange refuses a mix), and
    the layout of that follows (:func:`_once_layout`; else five empty tensors and no size).
    The whole layout runs under the lock, as one call of moe.dispatch (its exchanges are the
    eager operators')."""
    enter("moe.dispatch")
    try:
        weights = None if topk_weights is None else topk_weights.detach()
        local_count, global_count, send_tokens, slot_rows = moe.layout(
            x.detach(), topk_idx, weights, experts_per_rank, group_of(group), capacity, once
        )
        on_x = functools.partial(torch.as_tensor, device=x.device)
        rows_per_expert = global_count.reshape(-1, experts_per_rank).sum(0).tolist()
        counts = torch.from_numpy(local_count), torch.from_numpy(global_count)
        plain = *counts, on_x(send_tokens), on_x(slot_rows)
        if not once:
            return *plain, *_no_once_layout(x), rows_per_expert
        *layout, pairs_received = _once_layout(topk_idx.to(x.device), plain, experts_per_rank, group)
        return *plain, *layout, [*rows_per_expert, pairs_received]
    finally:
        leave()


def _no_once_layout(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """moe_layout's once outputs of a step that sends one row per slot: five empty tensors,
    the counts on the host, the indices on x's device."""
    host = [torch.empty(0, dtype=torch.int64) for _ in range(2)]  # outputs never alias each other
    return *host, *(x.new_empty(0, dtype=torch.int64) for _ in range(3))


def _once_layout(
    topk_idx: torch.Tensor, plain: tuple[torch.Tensor, ...], experts_per_rank: int, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The layout of a compiled step that sends each token once per rank, from the plain one
    (``plain``: moe_layout's four tensors): the (token, rank) pairs made where the tokens are
    (:func:`unicoll.eager.device_once.pairs`), their counts exchanged (host int64: sent to and
    received from each rank), each slot's metadata sent along the plain counts and read into
    each expert row's row among the token rows received; returned with the pairs' tokens, each
    plain row's slot and the token rows received."""
    local_count, global_count, _, slot_rows = plain
    grp = runtime.resolve_group(group_of(group), "moe.dispatch")
    found = device_once.pairs(torch, topk_idx, slot_rows, local_count.to(topk_idx.device), grp.rank,
                              grp.world_size, experts_per_rank, 0, 0, COMPILED)  # fmt: skip
    sent = found.told[:, 0].cpu()
    received = ops.exchange_counts(sent, group_of(group))
    rows = int(local_count.sum())
    meta = ops.global_scatter(found.meta[:rows].reshape(-1, 1), local_count, global_count, group_of(group), True)
    index = device_once.expansion_index(meta.reshape(-1), received.tolist())
    pair_token = found.pair_token[: int(sent.sum())]
    return sent, received, pair_token, index, found.row_slot[:rows], int(received.sum())


@_moe_layout.register_fake
def _moe_layout_fake(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None,
    experts_per_rank: int,
    group: int,
    capacity: int | None,
    once: bool,
) -> tuple[torch.Tensor, ...]:
    """Counts of one size per global expert; the rows sent (a new dynamic size); one row per
    slot; a new dynamic size per local expert; with ``once``, counts of one size per rank, the
    pairs sent, one index per row received, one slot per row sent and the token rows received
    (new dynamic sizes)."""
    world = world_size(group, "moe.dispatch")
    counts = torch.empty((world * experts_per_rank,), dtype=torch.int64)
    send_tokens = x.new_empty((_new_rows(None),), dtype=torch.int64)
    slot_rows = x.new_empty((topk_idx.numel(),), dtype=torch.int64)
    rows_per_expert = [_new_rows(None) for _ in range(experts_per_rank)]
    plain = counts, torch.empty_like(counts), send_tokens, slot_rows
    if not once:
        return *plain, *_no_once_layout(x), rows_per_expert
    per_rank = torch.empty((world,), dtype=torch.int64)
    index = x.new_empty((sum(rows_per_expert),), dtype=torch.int64)
    pair_token, row_slot = (x.new_empty((_new_rows(None),), dtype=torch.int64) for _ in range(2))
    sizes = [*rows_per_expert, _new_rows(None)]
    return *plain, per_rank, torch.empty_like(per_rank), pair_token, index, row_slot, sizes


@_op("moe_check", "(Tensor rows, Tensor send_tokens, SymInt tokens, SymInt received, bool weighted, str op) -> ()")
def _moe_check(
    rows: torch.Tensor, send_tokens: torch.Tensor, tokens: int, received: int, weighted: bool, op: str
) -> None:
    """Eager's checks of the rows given to moe.redispatch or moe.combine (``op``) against the
    handle (``send_tokens`` is on the dispatched x's device)."""
    moe.check_rows(op, rows, send_tokens, tokens, received, weighted)


@_moe_check.register_fake
def _moe_check_fake(
    rows: torch.Tensor, send_tokens: torch.Tensor, tokens: int, received: int, weighted: bool, op: str
) -> None:
    """Nothing comes out."""


@_op(
    "moe_check_static",
    "(Tensor x, Tensor topk_idx, Tensor? topk_weights, int experts_per_rank, int capacity, "
    "int? max_tokens_per_rank, int group) -> ()",
)
def _moe_check_static(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None,
    experts_per_rank: int,
    capacity: int,
    max_tokens_per_rank: int | None,
    group: int,
) -> None:
    """moe.dispatch_static's arguments checked by its spec: eager's errors, raised when the
    graph runs."""
    static_moe.check_dispatch(
        x, topk_idx, topk_weights, experts_per_rank, capacity, max_tokens_per_rank, group_of(group)
    )


@_moe_check_static.register_fake
def _moe_check_static_fake(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None,
    experts_per_rank: int,
    capacity: int,
    max_tokens_per_rank: int | None,
    group: int,
) -> None:
    """Nothing comes out."""


@_op(
    "moe_check_blocks",
    "(Tensor rows, Tensor like, SymInt tokens, int experts_per_rank, int world, int capacity, bool weighted, "
    "str op, int group) -> ()",
)
def _moe_check_blocks(
    rows: torch.Tensor,
    like: torch.Tensor,
    tokens: int,
    experts_per_rank: int,
    world: int,
    capacity: int,
    weighted: bool,
    op: str,
    group: int,
) -> None:
    """The rows given to moe.redispatch_static or moe.combine_static (``op``) checked by its
    spec against the handle (``like`` is on the dispatched x's device): eager's errors, raised
    when the graph runs; in check mode, the ranks' calls compared."""
    blocks = (experts_per_rank, world, capacity)
    static_moe.check_blocks(op, rows, like, tokens, blocks, weighted, group_of(group))


@_moe_check_blocks.register_fake
def _moe_check_blocks_fake(
    rows: torch.Tensor,
    like: torch.Tensor,
    tokens: int,
    experts_per_rank: int,
    world: int,
    capacity: int,
    weighted: bool,
    op: str,
    group: int,
) -> None:
    """Nothing comes out."""
