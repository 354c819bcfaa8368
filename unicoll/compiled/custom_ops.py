"""unicoll's operators on torch tensors as ``torch.library`` custom ops (the ``unicoll``
namespace), which torch.compile records in a graph as one node each; the traced forms that
record them are in :mod:`unicoll.compiled.traced`.

- an op's real implementation is the eager operator itself, so a call from compiled code is
  validated, checked (check mode) and reported exactly as an eager call, at run time;
- its fake implementation gives the output's shape without communicating: the rows of an
  operator whose counts are tensors are a new dynamic size (torch's
  ``capture_dynamic_output_shape_ops``), the rows given where they are known;
- its backward (``torch.library.register_autograd``) is the backward collective of the eager
  operator, itself one of these ops;
- the group travels as an int: its :attr:`~unicoll.Group.number`, or :data:`WORLD`.

Importing this module registers the ops, for CPU and CUDA tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import runtime
from ..backends.layout import moe_plan
from ..counts import even_split
from ..eager import device_once, moe, ops, static_moe
from ..eager.once_choice import COMPILED
from ..group import Group, group_numbered
from ..spec import SPECS
from . import locked

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


def _traced_schema(op: str, extras: tuple[str, ...] = (), returns: str = "Tensor") -> str:
    """The schema of the custom op of the operator ``op``: its spec's parameters, in order, each
    as its kind's schema type (:attr:`unicoll.kinds.Kind.schema`), but the outputs filled in
    place and ``sync_op`` (a traced call returns new tensors, synchronously); then ``extras``
    (what the op's fake implementation or its refusals need beside them)."""
    params = [f"{p.kind.schema} {p.name}" for p in SPECS[op].params if p.kind.schema and p.name != "sync_op"]
    return f"({', '.join([*params, *extras])}) -> {returns}"


_ROWS = "SymInt? rows"
"""The rows promised to the fake implementation, where the counts say them (a list of ints)."""


def _op(name: str, schema: str) -> Callable[[Callable[..., Any]], Any]:
    """The decorator that makes a function the custom op ``unicoll::<name>`` of ``schema``, as
    every op here is: it changes none of its arguments, runs on CPU and CUDA tensors, and
    carries :data:`_TAGS`."""
    return torch.library.custom_op(
        f"unicoll::{name}", mutates_args=(), device_types=_DEVICES, tags=_TAGS, schema=schema
    )


# -- the custom ops --------------------------------------------------------------------------


@_op("exchange_counts", _traced_schema("exchange_counts"))
def _exchange_counts(local_count: torch.Tensor, group: int) -> torch.Tensor:
    """The eager exchange_counts."""
    return locked.exchange_counts(local_count, group_of(group))


@_exchange_counts.register_fake
def _exchange_counts_fake(local_count: torch.Tensor, group: int) -> torch.Tensor:
    """The global counts have the local counts' shape."""
    return torch.empty_like(local_count)


@_op("global_scatter", _traced_schema("global_scatter", (_ROWS,)))
def _global_scatter(
    x: torch.Tensor,
    local_count: torch.Tensor,
    global_count: torch.Tensor,
    group: int,
    use_calc_stream: bool,
    rows: int | None,
) -> torch.Tensor:
    """The eager global_scatter, with the rows promised to the fake implementation where given."""
    result = locked.global_scatter(x.detach(), local_count, global_count, group_of(group), True, use_calc_stream)
    return _rows_as_promised(result, rows, "global_scatter")


@_op("global_gather", _traced_schema("global_gather", (_ROWS,)))
def _global_gather(
    x: torch.Tensor,
    local_count: torch.Tensor,
    global_count: torch.Tensor,
    group: int,
    use_calc_stream: bool,
    rows: int | None,
) -> torch.Tensor:
    """The eager global_gather, with the rows promised to the fake implementation where given."""
    result = locked.global_gather(x.detach(), local_count, global_count, group_of(group), True, use_calc_stream)
    return _rows_as_promised(result, rows, "global_gather")


@_global_scatter.register_fake
@_global_gather.register_fake
def _moe_fake(
    x: torch.Tensor,
    local_count: torch.Tensor,
    global_count: torch.Tensor,
    group: int,
    use_calc_stream: bool,
    rows: int | None,
) -> torch.Tensor:
    """The output: the rows given, or a new dynamic size, and x's trailing shape."""
    return x.new_empty((_new_rows(rows), *x.shape[1:]))


def _save_moe(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    """Keep what the backward collective needs: the counts, the group and the input's rows."""
    x, local_count, global_count, group, _, _ = inputs
    ctx.save_for_backward(local_count, global_count)
    ctx.group, ctx.rows = group, x.shape[0]


_MOE_BACKWARD_SCHEMA = "(Tensor grad, Tensor local_count, Tensor global_count, int group, SymInt rows) -> Tensor"


def _moe_backward(
    op: str, grad: torch.Tensor, local_count: torch.Tensor, global_count: torch.Tensor, group: int
) -> Any:
    """The eager backward of global_scatter or global_gather (``op``), with the forward's plan."""
    world = world_size(group, f"{op} (backward)")
    plan = moe_plan(_host_counts(local_count), _host_counts(global_count), world)
    backward = ops.global_scatter_backward if op == "global_scatter" else ops.global_gather_backward
    return _run_backward(op, group, grad, backward, plan)


@_op("global_scatter_backward", _MOE_BACKWARD_SCHEMA)
def _global_scatter_grad(
    grad: torch.Tensor, local_count: torch.Tensor, global_count: torch.Tensor, group: int, rows: int
) -> torch.Tensor:
    """global_scatter's eager backward (:func:`unicoll.eager.ops.global_scatter_backward`)."""
    return _moe_backward("global_scatter", grad, local_count, global_count, group)


@_op("global_gather_backward", _MOE_BACKWARD_SCHEMA)
def _global_gather_grad(
    grad: torch.Tensor, local_count: torch.Tensor, global_count: torch.Tensor, group: int, rows: int
) -> torch.Tensor:
    """global_gather's eager backward (:func:`unicoll.eager.ops.global_gather_backward`)."""
    return _moe_backward("global_gather", grad, local_count, global_count, group)


@_global_scatter_grad.register_fake
@_global_gather_grad.register_fake
def _moe_grad_fake(
    grad: torch.Tensor, local_count: torch.Tensor, global_count: torch.Tensor, group: int, rows: int
) -> torch.Tensor:
    """The input's gradient: the forward input's rows."""
    return grad.new_empty((rows, *grad.shape[1:]))


def _global_scatter_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    """global_scatter's eager backward, as a custom op."""
    local_count, global_count = ctx.saved_tensors
    dx = torch.ops.unicoll.global_scatter_backward(grad, local_count, global_count, ctx.group, ctx.rows)
    return dx, None, None, None, None, None


def _global_gather_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    """global_gather's eager backward, as a custom op."""
    local_count, global_count = ctx.saved_tensors
    dx = torch.ops.unicoll.global_gather_backward(grad, local_count, global_count, ctx.group, ctx.rows)
    return dx, None, None, None, None, None


_global_scatter.register_autograd(_global_scatter_backward, setup_context=_save_moe)
_global_gather.register_autograd(_global_gather_backward, setup_context=_save_moe)


@_op("alltoall_single", _traced_schema("alltoall_single", (_ROWS,), "(Tensor, Tensor)"))
def _alltoall_single(
    in_tensor: torch.Tensor,
    out_split_sizes: torch.Tensor | None,
    in_split_sizes: torch.Tensor | None,
    group: int,
    use_calc_stream: bool,
    rows: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output, and the split sizes received (exchanged where only ``in_split_sizes`` is given)."""
    result, received = locked.alltoall_single_and_splits(
        in_tensor.detach(), out_split_sizes, in_split_sizes, group_of(group), use_calc_stream
    )
    return _rows_as_promised(result, rows, "alltoall_single"), torch.tensor(received, dtype=torch.int64)


@_alltoall_single.register_fake
def _alltoall_single_fake(
    in_tensor: torch.Tensor,
    out_split_sizes: torch.Tensor | None,
    in_split_sizes: torch.Tensor | None,
    group: int,
    use_calc_stream: bool,
    rows: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output (the rows given, in_tensor's rows for an even split both ways, else a new
    dynamic size) and one received split size per rank."""
    if rows is None and out_split_sizes is None and in_split_sizes is None:
        rows = in_tensor.shape[0]  # an even split both ways: as many rows as were sent
    return in_tensor.new_empty((_new_rows(rows), *in_tensor.shape[1:])), _splits(group, "alltoall_single")


def _save_alltoall(ctx: Any, inputs: tuple, output: tuple) -> None:
    """Keep the split sizes sent (None for an even split) and received, the group and the rows."""
    in_tensor, _, in_split_sizes, group, _, _ = inputs
    _, received = output
    ctx.save_for_backward(in_split_sizes, received)
    ctx.group, ctx.rows = group, in_tensor.shape[0]


@_op("alltoall_single_backward", "(Tensor grad, Tensor? sent, Tensor received, int group, SymInt rows) -> Tensor")
def _alltoall_single_grad(
    grad: torch.Tensor, sent: torch.Tensor | None, received: torch.Tensor, group: int, rows: int
) -> torch.Tensor:
    """alltoall_single's eager backward (:func:`unicoll.eager.ops.alltoall_single_backward`); the
    forward's even split where it was given no sizes."""
    received_rows = _host_ints(received)
    sent_rows = even_split(rows, len(received_rows)) if sent is None else _host_ints(sent)
    return _run_backward("alltoall_single", group, grad, ops.alltoall_single_backward, sent_rows, received_rows)


@_alltoall_single_grad.register_fake
def _alltoall_single_grad_fake(
    grad: torch.Tensor, sent: torch.Tensor | None, received: torch.Tensor, group: int, rows: int
) -> torch.Tensor:
    """The input's gradient: the forward input's rows."""
    return grad.new_empty((rows, *grad.shape[1:]))


def _alltoall_single_backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple:
    """alltoall_single's eager backward, as a custom op."""
    sent, received = ctx.saved_tensors
    return (
        torch.ops.unicoll.alltoall_single_backward(grad, sent, received, ctx.group, ctx.rows),
        None,
        None,
        None,
        None,
        None,
    )


_alltoall_single.register_autograd(_alltoall_single_backward, setup_context=_save_alltoall)


@_op("all_gather", _traced_schema("all_gather", returns="(Tensor, Tensor)"))
def _all_gather(tensor: torch.Tensor, group: int, use_calc_stream: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's rows concatenated, and the rows each rank sent."""
    result, rows = locked.all_gather_and_rows(tensor.detach(), group_of(group), use_calc_stream)
    return result, torch.tensor(rows, dtype=torch.int64)


@_all_gather.register_fake
def _all_gather_fake(tensor: torch.Tensor, group: int, use_calc_stream: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered rows (a new dynamic size) and one row count per rank."""
    return tensor.new_empty((_new_rows(None), *tensor.shape[1:])), _splits(group, "all_gather")


def _save_all_gather(ctx: Any, inputs: tuple, output: tuple) -> None:
    """Keep the rows each rank sent, the group and this rank's rows."""
    tensor, group, _ = inputs
    _, rows = output
    ctx.save_for_backward(rows)
    ctx.group, ctx.rows = group, tensor.shape[0]


@_op("all_gather_backward", "(Tensor grad, Tensor rows, int group, SymInt mine) -> Tensor")
def _all_gather_grad(grad: torch.Tensor, rows: torch.Tensor, group: int, mine: int) -> torch.Tensor:
    """all_gather's eager backward (:func:`unicoll.eager.ops.all_gather_backward`)."""
    return _run_backward("all_gather", group, grad, ops.all_gather_backward, _host_ints(rows))


@_all_gather_grad.register_fake
def _all_gather_grad_fake(grad: torch.Tensor, rows: torch.Tensor, group: int, mine: int) -> torch.Tensor:
    """The input's gradient: this rank's rows."""
    return grad.new_empty((mine, *grad.shape[1:]))


def _all_gather_backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple:
    """all_gather's eager backward, as a custom op."""
    (rows,) = ctx.saved_tensors
    return torch.ops.unicoll.all_gather_backward(grad, rows, ctx.group, ctx.rows), None, None


_all_gather.register_autograd(_all_gather_backward, setup_context=_save_all_gather)


# -- the reductions and broadcast: functional ops, copied back into the tensor where in place --

_AUTOGRAD_STATE = "str state"
"""The caller's tensor's :func:`unicoll.eager.ops.autograd_state` while tracing: the op refuses what eager refuses."""


@_op("all_reduce", _traced_schema("all_reduce", (_AUTOGRAD_STATE,)))
def _all_reduce(tensor: torch.Tensor, op: str, group: int, use_calc_stream: bool, state: str) -> torch.Tensor:
    """The eager all_reduce, into a copy of ``tensor`` (validated and refused as the call on it)."""
    return locked.all_reduce_copy(tensor, op, group_of(group), use_calc_stream, state)


@_all_reduce.register_fake
def _all_reduce_fake(tensor: torch.Tensor, op: str, group: int, use_calc_stream: bool, state: str) -> torch.Tensor:
    """The reduction has the tensor's shape."""
    return torch.empty_like(tensor)


def _save_reduction(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    """Keep the reduction and the group."""
    ctx.op, ctx.group = inputs[1], inputs[2]


@_op("all_reduce_backward", "(Tensor grad, str op, int group) -> Tensor")
def _all_reduce_grad(grad: torch.Tensor, op: str, group: int) -> torch.Tensor:
    """all_reduce's eager backward (:func:`unicoll.eager.ops.all_reduce_backward`)."""
    return _run_backward("all_reduce", group, grad, ops.all_reduce_backward, op)


@_all_reduce_grad.register_fake
def _all_reduce_grad_fake(grad: torch.Tensor, op: str, group: int) -> torch.Tensor:
    """The gradient's shape."""
    return torch.empty_like(grad)


def _all_reduce_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    """all_reduce's eager backward, as a custom op."""
    return torch.ops.unicoll.all_reduce_backward(grad, ctx.op, ctx.group), None, None, None, None


_all_reduce.register_autograd(_all_reduce_backward, setup_context=_save_reduction)


@_op("broadcast", _traced_schema("broadcast", (_AUTOGRAD_STATE,)))
def _broadcast(tensor: torch.Tensor, src: int, group: int, use_calc_stream: bool, state: str) -> torch.Tensor:
    """The eager broadcast, into a copy of ``tensor`` (validated and refused as the call on it)."""
    return locked.broadcast_copy(tensor, src, group_of(group), use_calc_stream, state)


@_broadcast.register_fake
def _broadcast_fake(tensor: torch.Tensor, src: int, group: int, use_calc_stream: bool, state: str) -> torch.Tensor:
    """The broadcast tensor has the tensor's shape."""
    return torch.empty_like(tensor)


@_op("broadcast_backward", "(Tensor grad, int src, int group) -> Tensor")
def _broadcast_grad(grad: torch.Tensor, src: int, group: int) -> torch.Tensor:
    """broadcast's eager backward (:func:`unicoll.eager.ops.broadcast_backward`)."""
    return _run_backward("broadcast", group, grad, ops.broadcast_backward, src)


@_broadcast_grad.register_fake
def _broadcast_grad_fake(grad: torch.Tensor, src: int, group: int) -> torch.Tensor:
    """The gradient's shape."""
    return torch.empty_like(grad)


def _save_broadcast(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    """Keep the source and the group."""
    _, ctx.src, ctx.group, _, _ = inputs


def _broadcast_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    """broadcast's eager backward, as a custom op."""
    return torch.ops.unicoll.broadcast_backward(grad, ctx.src, ctx.group), None, None, None, None


_broadcast.register_autograd(_broadcast_backward, setup_context=_save_broadcast)


@_op("reduce_scatter", _traced_schema("reduce_scatter", (_AUTOGRAD_STATE,)))
def _reduce_scatter(
    tensor: torch.Tensor, op: str, split_sizes: torch.Tensor | None, group: int, use_calc_stream: bool, state: str
) -> torch.Tensor:
    """The eager reduce_scatter (out=None), refused as the call on the caller's tensor."""
    return locked.reduce_scatter_of(tensor.detach(), op, split_sizes, group_of(group), use_calc_stream, state)


@_reduce_scatter.register_fake
def _reduce_scatter_fake(
    tensor: torch.Tensor, op: str, split_sizes: torch.Tensor | None, group: int, use_calc_stream: bool, state: str
) -> torch.Tensor:
    """This rank's block: an even share of the rows without split sizes, else a new dynamic size."""
    rows = tensor.shape[0] // world_size(group, "reduce_scatter") if split_sizes is None else None
    return tensor.new_empty((_new_rows(rows), *tensor.shape[1:]))


@_op("reduce_scatter_backward", "(Tensor grad, str op, Tensor? split_sizes, int group, SymInt rows) -> Tensor")
def _reduce_scatter_grad(
    grad: torch.Tensor, op: str, split_sizes: torch.Tensor | None, group: int, rows: int
) -> torch.Tensor:
    """reduce_scatter's eager backward (:func:`unicoll.eager.ops.reduce_scatter_backward`); the
    forward's even split where it was given no sizes."""
    world = world_size(group, "reduce_scatter (backward)")
    blocks = even_split(rows, world) if split_sizes is None else _host_ints(split_sizes)
    return _run_backward("reduce_scatter", group, grad, ops.reduce_scatter_backward, op, blocks)


@_reduce_scatter_grad.register_fake
def _reduce_scatter_grad_fake(
    grad: torch.Tensor, op: str, split_sizes: torch.Tensor | None, group: int, rows: int
) -> torch.Tensor:
    """The input's gradient: the forward input's rows."""
    return grad.new_empty((rows, *grad.shape[1:]))


def _save_reduce_scatter(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    """Keep the split sizes, the reduction, the group and the input's rows."""
    tensor, ctx.op, split_sizes, ctx.group, _, _ = inputs
    ctx.save_for_backward(split_sizes)
    ctx.rows = tensor.shape[0]


def _reduce_scatter_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    """reduce_scatter's eager backward, as a custom op."""
    (split_sizes,) = ctx.saved_tensors
    dx = torch.ops.unicoll.reduce_scatter_backward(grad, ctx.op, split_sizes, ctx.group, ctx.rows)
    return dx, None, None, None, None, None


_reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_save_reduce_scatter)


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
    the layout of that follows (:func:`_once_layout`; else five empty tensors and no size)."""
    weights = None if topk_weights is None else topk_weights.detach()
    local_count, global_count, send_tokens, slot_rows = locked.moe_layout(
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
    received = locked.exchange_counts(sent, group_of(group))
    rows = int(local_count.sum())
    meta = locked.global_scatter(found.meta[:rows].reshape(-1, 1), local_count, global_count, group_of(group), True)
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


CUSTOM_OPS = (
    "exchange_counts", "global_scatter", "global_gather", "alltoall_single", "all_gather",
    "all_reduce", "broadcast", "reduce_scatter", "moe_layout", "moe_check", "moe_check_static", "moe_check_blocks",
    "global_scatter_backward", "global_gather_backward", "alltoall_single_backward", "all_gather_backward",
    "all_reduce_backward", "broadcast_backward", "reduce_scatter_backward",
)  # fmt: skip
"""The ops of the ``unicoll`` namespace: each traced operator's (:data:`unicoll.face.TRACED_FORMS`)
forward and, for a data operator, backward; unicoll.moe's layout and checks. tests/compile holds
this list against the table and the specs."""

for _name in CUSTOM_OPS:
    # a collective runs on every rank even where its result goes unused, and a check raises:
    # never dead code to the compiler (AOT autograd would drop it; the other ranks would wait)
    torch.fx.node.has_side_effect(getattr(torch.ops.unicoll, _name).default)
