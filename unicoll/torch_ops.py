"""unicoll's operators on torch tensors as ``torch.library`` custom ops, for torch.compile.

While torch.compile traces a call to a public operator, :func:`unicoll.tracing.hand_off`
hands it to the function of the same name here. That function records the call as one custom
op of the ``unicoll`` namespace, which the compiled graph runs as a whole:

- the op's real implementation is the eager operator itself, so a call from compiled code is
  validated, checked (check mode) and reported exactly as an eager call, at run time;
- its fake implementation gives the output's shape without communicating: the rows of an
  operator whose counts are tensors are a new dynamic size (torch's
  ``capture_dynamic_output_shape_ops``), the rows given where they are known;
- its backward (``torch.library.register_autograd``) is the backward collective of the eager
  operator, itself one of these ops;
- the group travels as an int: its :attr:`~unicoll.Group.number`, or :data:`WORLD`.

What cannot be traced (``sync_op=False``, outputs filled in place, arrays of other libraries,
arguments of unexpected types) runs the eager operator behind one graph break whose reason
says why (``torch.compiler.disable``); docs/compile.md lists the cases. Importing this module
registers the ops, for CPU and CUDA tensors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import moe, ops, runtime
from .backends.layout import MoePlan
from .group import Group, group_numbered
from .routing import Handle, Routing

WORLD = -1
"""The group number of the world of the running session (``group=None``)."""

_DEVICES = ("cpu", "cuda")

_TAGS = (torch.Tag.nondeterministic_seeded,)
"""A collective's result depends on the other ranks: torch must neither run the op on constant
inputs while it traces (fake tensors' constant propagation) nor recompute it in the backward."""


def _group(number: int) -> Group | None:
    """The group a schema's ``number`` names: None (the world, resolved by the operator) for
    :data:`WORLD`; ValueError for a group that no longer lives."""
    if number == WORLD:
        return None
    group = group_numbered(number)
    if group is None:
        raise ValueError(f"group: expected the number of a live unicoll.Group, got {number}, a group since freed")
    return group


def _world_size(number: int, op: str) -> int:
    """The size of the group a schema's ``number`` names (for the fake implementations)."""
    group = _group(number)
    return runtime.state(op).world.world_size if group is None else group.world_size


def _position(number: int, op: str) -> int:
    """This rank's position in the group a schema's ``number`` names."""
    group = _group(number)
    return runtime.state(op).world.rank if group is None else group.rank


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
    return torch.empty((_world_size(number, op),), dtype=torch.int64)


# -- the custom ops --------------------------------------------------------------------------


@torch.library.custom_op(
    "unicoll::exchange_counts",
    mutates_args=(),
    device_types=_DEVICES,
    tags=_TAGS,
    schema="(Tensor local_count, int group) -> Tensor",
)
def _exchange_counts(local_count: torch.Tensor, group: int) -> torch.Tensor:
    """The eager exchange_counts."""
    return ops.exchange_counts(local_count, _group(group))


@_exchange_counts.register_fake
def _exchange_counts_fake(local_count: torch.Tensor, group: int) -> torch.Tensor:
    """The global counts have the local counts' shape."""
    return torch.empty_like(local_count)


_MOE_SCHEMA = (
    "(Tensor x, Tensor local_count, Tensor global_count, int group, bool use_calc_stream, SymInt? rows) -> Tensor"
)


@torch.library.custom_op(
    "unicoll::global_scatter", mutates_args=(), device_types=_DEVICES, tags=_TAGS, schema=_MOE_SCHEMA
)
def _global_scatter(
    x: torch.Tensor,
    local_count: torch.Tensor,
    global_count: torch.Tensor,
    group: int,
    use_calc_stream: bool,
    rows: int | None,
) -> torch.Tensor:
    """The eager global_scatter, with the rows promised to the fake implementation where given."""
    result = ops.global_scatter(x.detach(), local_count, global_count, _group(group), True, use_calc_stream)
    return _rows_as_promised(result, rows, "global_scatter")


@torch.library.custom_op(
    "unicoll::global_gather", mutates_args=(), device_types=_DEVICES, tags=_TAGS, schema=_MOE_SCHEMA
)
def _global_gather(
    x: torch.Tensor,
    local_count: torch.Tensor,
    global_count: torch.Tensor,
    group: int,
    use_calc_stream: bool,
    rows: int | None,
) -> torch.Tensor:
    """The eager global_gather, with the rows promised to the fake implementation where given."""
    result = ops.global_gather(x.detach(), local_count, global_count, _group(group), True, use_calc_stream)
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


def _global_scatter_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    """global_gather of the output gradient with the same counts."""
    local_count, global_count = ctx.saved_tensors
    dx = torch.ops.unicoll.global_gather(grad.contiguous(), local_count, global_count, ctx.group, False, ctx.rows)
    return dx, None, None, None, None, None


def _global_gather_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    """global_scatter of the output gradient with the same counts."""
    local_count, global_count = ctx.saved_tensors
    dx = torch.ops.unicoll.global_scatter(grad.contiguous(), local_count, global_count, ctx.group, False, ctx.rows)
    return dx, None, None, None, None, None


_global_scatter.register_autograd(_global_scatter_backward, setup_context=_save_moe)
_global_gather.register_autograd(_global_gather_backward, setup_context=_save_moe)


@torch.library.custom_op(
    "unicoll::alltoall_single",
    mutates_args=(),
    device_types=_DEVICES,
    tags=_TAGS,
    schema="(Tensor in_tensor, Tensor? out_split_sizes, Tensor? in_split_sizes, int group, bool use_calc_stream, "
    "SymInt? rows) -> (Tensor, Tensor)",
)
def _alltoall_single(
    in_tensor: torch.Tensor,
    out_split_sizes: torch.Tensor | None,
    in_split_sizes: torch.Tensor | None,
    group: int,
    use_calc_stream: bool,
    rows: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output, and the split sizes received (exchanged where only ``in_split_sizes`` is given)."""
    result, received = ops.alltoall_single_and_splits(
        in_tensor.detach(), out_split_sizes, in_split_sizes, _group(group), use_calc_stream
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


def _alltoall_single_backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple:
    """The gradient goes back the way the rows came: the split sizes swapped (an even split
    of the input where no sizes were given)."""
    sent, received = ctx.saved_tensors
    if sent is None:
        sent = torch.full_like(received, ctx.rows // received.shape[0])
    dx, _ = torch.ops.unicoll.alltoall_single(grad.contiguous(), sent, received, ctx.group, False, ctx.rows)
    return dx, None, None, None, None, None


_alltoall_single.register_autograd(_alltoall_single_backward, setup_context=_save_alltoall)


@torch.library.custom_op(
    "unicoll::all_gather",
    mutates_args=(),
    device_types=_DEVICES,
    tags=_TAGS,
    schema="(Tensor tensor, int group, bool use_calc_stream) -> (Tensor, Tensor)",
)
def _all_gather(tensor: torch.Tensor, group: int, use_calc_stream: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's rows concatenated, and the rows each rank sent."""
    result, rows = ops.all_gather_and_rows(tensor.detach(), _group(group), use_calc_stream)
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


def _all_gather_backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple:
    """Each rank gets every rank's gradient of its rows, summed (a reduce-scatter)."""
    (rows,) = ctx.saved_tensors
    world = rows.shape[0]
    mine = torch.full_like(rows, ctx.rows)
    received, _ = torch.ops.unicoll.alltoall_single(grad.contiguous(), mine, rows, ctx.group, False, world * ctx.rows)
    return received.reshape(world, ctx.rows, *grad.shape[1:]).sum(0), None, None


_all_gather.register_autograd(_all_gather_backward, setup_context=_save_all_gather)


# -- the reductions and broadcast: functional ops, copied back into the tensor where in place --

_AUTOGRAD_STATE = "str state"
"""The caller's tensor's :func:`unicoll.ops.autograd_state` while tracing: the op refuses what eager refuses."""


@torch.library.custom_op(
    "unicoll::all_reduce",
    mutates_args=(),
    device_types=_DEVICES,
    tags=_TAGS,
    schema=f"(Tensor tensor, str op, int group, bool use_calc_stream, {_AUTOGRAD_STATE}) -> Tensor",
)
def _all_reduce(tensor: torch.Tensor, op: str, group: int, use_calc_stream: bool, state: str) -> torch.Tensor:
    """The eager all_reduce, into a copy of ``tensor`` (validated and refused as the call on it)."""
    return ops.all_reduce_copy(tensor, op, _group(group), use_calc_stream, state)


@_all_reduce.register_fake
def _all_reduce_fake(tensor: torch.Tensor, op: str, group: int, use_calc_stream: bool, state: str) -> torch.Tensor:
    """The reduction has the tensor's shape."""
    return torch.empty_like(tensor)


def _save_reduction(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    """Keep the reduction and the group."""
    ctx.op, ctx.group = inputs[1], inputs[2]


def _all_reduce_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    """The same reduction (sum or avg) of the gradient."""
    return torch.ops.unicoll.all_reduce(grad.contiguous(), ctx.op, ctx.group, False, "none"), None, None, None, None


_all_reduce.register_autograd(_all_reduce_backward, setup_context=_save_reduction)


@torch.library.custom_op(
    "unicoll::broadcast",
    mutates_args=(),
    device_types=_DEVICES,
    tags=_TAGS,
    schema=f"(Tensor tensor, int src, int group, bool use_calc_stream, {_AUTOGRAD_STATE}) -> Tensor",
)
def _broadcast(tensor: torch.Tensor, src: int, group: int, use_calc_stream: bool, state: str) -> torch.Tensor:
    """The eager broadcast, into a copy of ``tensor`` (validated and refused as the call on it)."""
    return ops.broadcast_copy(tensor, src, _group(group), use_calc_stream, state)


@_broadcast.register_fake
def _broadcast_fake(tensor: torch.Tensor, src: int, group: int, use_calc_stream: bool, state: str) -> torch.Tensor:
    """The broadcast tensor has the tensor's shape."""
    return torch.empty_like(tensor)


def _save_broadcast(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    """Keep the source, the group and this rank's position in it."""
    _, ctx.src, ctx.group, _, _ = inputs
    ctx.position = _position(ctx.group, "broadcast")


def _broadcast_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    """Every rank's gradient summed on the source, zero elsewhere (every rank takes part)."""
    total = torch.ops.unicoll.all_reduce(grad.contiguous(), "sum", ctx.group, False, "none")
    return (total if ctx.position == ctx.src else torch.zeros_like(total)), None, None, None, None


_broadcast.register_autograd(_broadcast_backward, setup_context=_save_broadcast)


@torch.library.custom_op(
    "unicoll::reduce_scatter",
    mutates_args=(),
    device_types=_DEVICES,
    tags=_TAGS,
    schema="(Tensor tensor, str op, Tensor? split_sizes, int group, bool use_calc_stream, "
    f"{_AUTOGRAD_STATE}) -> Tensor",
)
def _reduce_scatter(
    tensor: torch.Tensor, op: str, split_sizes: torch.Tensor | None, group: int, use_calc_stream: bool, state: str
) -> torch.Tensor:
    """The eager reduce_scatter (out=None), refused as the call on the caller's tensor."""
    return ops.reduce_scatter_of(tensor.detach(), op, split_sizes, _group(group), use_calc_stream, state)


@_reduce_scatter.register_fake
def _reduce_scatter_fake(
    tensor: torch.Tensor, op: str, split_sizes: torch.Tensor | None, group: int, use_calc_stream: bool, state: str
) -> torch.Tensor:
    """This rank's block: an even share of the rows without split sizes, else a new dynamic size."""
    rows = tensor.shape[0] // _world_size(group, "reduce_scatter") if split_sizes is None else None
    return tensor.new_empty((_new_rows(rows), *tensor.shape[1:]))


def _save_reduce_scatter(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    """Keep the split sizes, the reduction, the group, its size and the input's rows."""
    tensor, ctx.op, split_sizes, ctx.group, _, _ = inputs
    ctx.save_for_backward(split_sizes)
    ctx.world, ctx.rows = _world_size(ctx.group, "reduce_scatter"), tensor.shape[0]


def _reduce_scatter_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    """Every rank's block gradient, gathered in rank order (an all-to-all of this rank's block
    to every rank), divided by the group size for avg."""
    (split_sizes,) = ctx.saved_tensors
    world = ctx.world
    mine = torch.full((world,), grad.shape[0], dtype=torch.int64)
    blocks = torch.full((world,), ctx.rows // world, dtype=torch.int64) if split_sizes is None else split_sizes
    sent = grad.contiguous().repeat(world, *([1] * (grad.dim() - 1)))
    gathered, _ = torch.ops.unicoll.alltoall_single(sent, blocks, mine, ctx.group, False, ctx.rows)
    return (gathered / world if ctx.op == "avg" else gathered), None, None, None, None, None


_reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_save_reduce_scatter)


# -- unicoll.moe: the layout as tensors; the rows move with global_scatter and global_gather --


@torch.library.custom_op(
    "unicoll::moe_layout",
    mutates_args=(),
    device_types=_DEVICES,
    tags=_TAGS,
    schema="(Tensor x, Tensor topk_idx, Tensor? topk_weights, int experts_per_rank, int group, int? capacity) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
)
def _moe_layout(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None,
    experts_per_rank: int,
    group: int,
    capacity: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe.dispatch's validation, check and count exchange: the counts sent and received (host
    int64), the token of each row sent and each slot's row (int64 on x's device)."""
    weights = None if topk_weights is None else topk_weights.detach()
    local_count, global_count, send_tokens, slot_rows = moe.layout(
        x.detach(), topk_idx, weights, experts_per_rank, _group(group), capacity
    )
    on_x = functools.partial(torch.as_tensor, device=x.device)
    return torch.from_numpy(local_count), torch.from_numpy(global_count), on_x(send_tokens), on_x(slot_rows)


@_moe_layout.register_fake
def _moe_layout_fake(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None,
    experts_per_rank: int,
    group: int,
    capacity: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Counts of one size per global expert; the rows sent (a new dynamic size); one row per slot."""
    experts = _world_size(group, "moe.dispatch") * experts_per_rank
    counts = torch.empty((experts,), dtype=torch.int64)
    send_tokens = x.new_empty((_new_rows(None),), dtype=torch.int64)
    return counts, torch.empty_like(counts), send_tokens, x.new_empty((topk_idx.numel(),), dtype=torch.int64)


@torch.library.custom_op(
    "unicoll::moe_check",
    mutates_args=(),
    device_types=_DEVICES,
    tags=_TAGS,
    schema="(Tensor rows, Tensor send_tokens, SymInt tokens, SymInt received, bool weighted, str op) -> ()",
)
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


CUSTOM_OPS = (
    "exchange_counts", "global_scatter", "global_gather", "alltoall_single", "all_gather",
    "all_reduce", "broadcast", "reduce_scatter", "moe_layout", "moe_check",
)  # fmt: skip
"""The ops of the ``unicoll`` namespace."""

for _op in CUSTOM_OPS:
    # a collective runs on every rank even where its result goes unused, and a check raises:
    # never dead code to the compiler (AOT autograd would drop it; the other ranks would wait)
    torch.fx.node.has_side_effect(getattr(torch.ops.unicoll, _op).default)


# -- what runs eagerly, behind one graph break ------------------------------------------------


def _eagerly(reason: str) -> Callable[..., Any]:
    """A function that calls an operator eagerly, which torch.compile does not trace: one graph
    break, whose reason reads ``unicoll: <reason>; the call runs eagerly``."""

    @torch.compiler.disable(reason=f"unicoll: {reason}; the call runs eagerly")
    def run(op: Callable[..., Any], *args: Any) -> Any:
        """``op(*args)``, eagerly."""
        return op(*args)

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

_scalars_off = _eagerly(
    "moe.dispatch returns rows_per_expert as host ints, which torch.compile traces only with "
    "torch._dynamo.config.capture_scalar_outputs = True"
)
_eager_handle = _eagerly("a moe.Handle made by an eager moe.dispatch keeps its layout on the host")

_UNTRACEABLE = object()
"""What :func:`_number` and :func:`_counts` return for a value that is not traced."""


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
    None as None; anything else :data:`_UNTRACEABLE`."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    if type(value) in (list, tuple) and all(type(v) is int for v in value):
        return torch.tensor(value, dtype=torch.int64)
    return _UNTRACEABLE


def _flags(sync_op: Any, use_calc_stream: Any = True) -> bool:
    """Whether the flags are traced: ``sync_op=True`` and a bool ``use_calc_stream``."""
    return sync_op is True and type(use_calc_stream) is bool


def _autograd_state(tensor: torch.Tensor) -> str:
    """:func:`unicoll.ops.autograd_state` of a tensor, as Dynamo traces it (a constant of the graph)."""
    if not (tensor.requires_grad and torch.is_grad_enabled()):
        return "none"
    if tensor.is_leaf:
        return "a leaf"
    base = tensor._base
    return "a view of a leaf" if base is not None and base.is_leaf else "recorded"


def _copied_back(tensor: torch.Tensor, result: torch.Tensor, state: str) -> torch.Tensor:
    """``tensor`` holding ``result`` (autograd records the copy). A tensor that autograd does not
    let change in place is left alone: the op raises eager's error when it runs."""
    if state in ("none", "recorded"):
        tensor.copy_(result)
    return tensor


def _traced(*values: Any) -> bool:
    """Whether none of ``values`` is :data:`_UNTRACEABLE`."""
    return all(v is not _UNTRACEABLE for v in values)


def _total(value: Any) -> int | None:
    """The rows that counts given as a list of non-negative ints add up to, known while
    tracing; None for counts in a tensor (or a list the eager operator will refuse)."""
    if type(value) in (list, tuple) and all(type(v) is int and v >= 0 for v in value):
        return sum(value)
    return None


# -- the traced forms of the public operators (same signatures) --------------------------------


def exchange_counts(local_count: Any, group: Group | None = None) -> Any:
    """:func:`unicoll.exchange_counts` as traced: counts given as a tensor become one op."""
    number = _number(group)
    if not isinstance(local_count, torch.Tensor) or not _traced(number):
        return _untraced(ops.exchange_counts, local_count, group)
    return torch.ops.unicoll.exchange_counts(local_count, number)


def _moe(
    op: Callable[..., Any],
    traced_op: Callable[..., Any],
    output_counts: str,
    args: tuple[Any, Any, Any, Group | None, bool, bool],
) -> Any:
    """global_scatter or global_gather (``op``) as ``traced_op``, whose output has the rows of
    its ``output_counts`` ("local_count" or "global_count")."""
    x, local_count, global_count, group, sync_op, use_calc_stream = args
    if sync_op is False:
        return _as_task(op, *args)
    number, lc, gc = _number(group), _counts(local_count), _counts(global_count)
    flags_ok = sync_op is True and type(use_calc_stream) is bool
    if not isinstance(x, torch.Tensor) or not flags_ok or not _traced(number, lc, gc) or lc is None or gc is None:
        return _untraced(op, *args)
    rows = _total(local_count if output_counts == "local_count" else global_count)
    return traced_op(x, lc, gc, number, use_calc_stream, rows)


def global_scatter(
    x: Any,
    local_count: Any,
    global_count: Any,
    group: Group | None = None,
    sync_op: bool = True,
    use_calc_stream: bool = True,
) -> Any:
    """:func:`unicoll.global_scatter` as traced: one op, whose output rows are a dynamic size
    (``sum(global_count)`` for counts in a list)."""
    args = (x, local_count, global_count, group, sync_op, use_calc_stream)
    return _moe(ops.global_scatter, torch.ops.unicoll.global_scatter, "global_count", args)


def global_gather(
    x: Any,
    local_count: Any,
    global_count: Any,
    group: Group | None = None,
    sync_op: bool = True,
    use_calc_stream: bool = True,
) -> Any:
    """:func:`unicoll.global_gather` as traced: one op, whose output rows are a dynamic size
    (``sum(local_count)`` for counts in a list)."""
    args = (x, local_count, global_count, group, sync_op, use_calc_stream)
    return _moe(ops.global_gather, torch.ops.unicoll.global_gather, "local_count", args)


def alltoall_single(
    out_tensor: Any,
    in_tensor: Any,
    out_split_sizes: Any = None,
    in_split_sizes: Any = None,
    group: Group | None = None,
    sync_op: bool = True,
    use_calc_stream: bool = False,
) -> Any:
    """:func:`unicoll.alltoall_single` as traced, for ``out_tensor=None``: one op, whose
    output rows are a dynamic size (those of ``in_tensor`` when no split sizes are given,
    ``sum(out_split_sizes)`` for a list)."""
    args = (out_tensor, in_tensor, out_split_sizes, in_split_sizes, group, sync_op, use_calc_stream)
    if out_tensor is not None:
        return _in_place(ops.alltoall_single, *args)
    if sync_op is False:
        return _as_task(ops.alltoall_single, *args)
    number, out_splits, in_splits = _number(group), _counts(out_split_sizes), _counts(in_split_sizes)
    flags_ok = sync_op is True and type(use_calc_stream) is bool
    if not isinstance(in_tensor, torch.Tensor) or not flags_ok or not _traced(number, out_splits, in_splits):
        return _untraced(ops.alltoall_single, *args)
    rows = _total(out_split_sizes)
    result, _ = torch.ops.unicoll.alltoall_single(in_tensor, out_splits, in_splits, number, use_calc_stream, rows)
    return result


def all_gather(
    tensor_or_tensor_list: Any,
    tensor: Any,
    group: Group | None = None,
    sync_op: bool = True,
    use_calc_stream: bool = False,
) -> Any:
    """:func:`unicoll.all_gather` as traced, for ``tensor_or_tensor_list=None`` (the
    concatenated form): one op, whose output rows are a dynamic size."""
    args = (tensor_or_tensor_list, tensor, group, sync_op, use_calc_stream)
    if tensor_or_tensor_list is not None:
        return _in_place(ops.all_gather, *args)
    if sync_op is False:
        return _as_task(ops.all_gather, *args)
    number = _number(group)
    flags_ok = sync_op is True and type(use_calc_stream) is bool
    if not isinstance(tensor, torch.Tensor) or not flags_ok or not _traced(number):
        return _untraced(ops.all_gather, *args)
    result, _ = torch.ops.unicoll.all_gather(tensor, number, use_calc_stream)
    return result


def all_reduce(
    tensor: Any,
    op: str = "sum",
    group: Group | None = None,
    sync_op: bool = True,
    use_calc_stream: bool = False,
) -> Any:
    """:func:`unicoll.all_reduce` as traced: one functional op, whose result is copied back into
    ``tensor`` (which is returned)."""
    args = (tensor, op, group, sync_op, use_calc_stream)
    if sync_op is False:
        return _as_task(ops.all_reduce, *args)
    number = _number(group)
    traced = _traced(number) and type(op) is str and _flags(sync_op, use_calc_stream)
    if not isinstance(tensor, torch.Tensor) or not traced:
        return _untraced(ops.all_reduce, *args)
    state = _autograd_state(tensor)
    return _copied_back(tensor, torch.ops.unicoll.all_reduce(tensor, op, number, use_calc_stream, state), state)


def broadcast(
    tensor: Any,
    src: int,
    group: Group | None = None,
    sync_op: bool = True,
    use_calc_stream: bool = False,
) -> Any:
    """:func:`unicoll.broadcast` as traced: one functional op, whose result is copied back into
    ``tensor`` (which is returned)."""
    args = (tensor, src, group, sync_op, use_calc_stream)
    if sync_op is False:
        return _as_task(ops.broadcast, *args)
    number = _number(group)
    traced = _traced(number) and type(src) is int and _flags(sync_op, use_calc_stream)
    if not isinstance(tensor, torch.Tensor) or not traced:
        return _untraced(ops.broadcast, *args)
    state = _autograd_state(tensor)
    return _copied_back(tensor, torch.ops.unicoll.broadcast(tensor, src, number, use_calc_stream, state), state)


def reduce_scatter(
    out: Any | None,
    tensor: Any,
    op: str = "sum",
    split_sizes: Any = None,
    group: Group | None = None,
    sync_op: bool = True,
    use_calc_stream: bool = False,
) -> Any:
    """:func:`unicoll.reduce_scatter` as traced, for ``out=None``: one op, whose output rows are
    an even share of ``tensor``'s without split sizes, else a dynamic size."""
    args = (out, tensor, op, split_sizes, group, sync_op, use_calc_stream)
    if out is not None:
        return _in_place(ops.reduce_scatter, *args)
    if sync_op is False:
        return _as_task(ops.reduce_scatter, *args)
    number, splits = _number(group), _counts(split_sizes)
    traced = _traced(number, splits) and type(op) is str and _flags(sync_op, use_calc_stream)
    if not isinstance(tensor, torch.Tensor) or not traced:
        return _untraced(ops.reduce_scatter, *args)
    state = _autograd_state(tensor)
    return torch.ops.unicoll.reduce_scatter(tensor, op, splits, number, use_calc_stream, state)


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

    @property
    def weighted(self) -> bool:
        """Whether dispatch was given ``topk_weights``."""
        return self.weights is not None


def _with_handle(op: Callable[..., Any], rows: Any, handle: TracedHandle, sync_op: Any) -> Any:
    """``op`` (the eager moe.redispatch or moe.combine) of ``rows`` with the :class:`~unicoll.moe.Handle`
    of a traced handle's layout: for the calls that run eagerly (``sync_op=False``)."""
    send_tokens, slot_rows = handle.send_tokens.cpu().numpy(), handle.slot_rows.cpu().numpy()
    dropped = bool((slot_rows == send_tokens.size).any())
    routing = Routing(handle.local_count.numpy(), send_tokens, slot_rows, dropped)
    group = _group(handle.group)
    if group is None:
        group = runtime.state(f"moe.{op.__name__}").world
    kept = None
    if dropped and handle.weights is not None:
        kept = (handle.slot_rows < send_tokens.size).reshape(handle.tokens, handle.topk)
    shape = (handle.tokens, handle.topk)
    global_count = handle.global_count.numpy()
    plan = MoePlan(routing.local_count, global_count, group.world_size)
    eager = Handle(routing, global_count, plan, group, shape, handle.weights, handle.send_tokens,
                   handle.slot_rows, kept, like=handle.send_tokens)  # fmt: skip
    return op(rows, eager, sync_op=sync_op)


def moe_dispatch(
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
    ``unicoll::global_scatter``; rows_per_expert are unbacked sizes (``.tolist()``), whose sum
    is the rows' size; the handle is a :class:`TracedHandle`."""
    eager = functools.partial(
        moe.dispatch, x, topk_idx, topk_weights, experts_per_rank=experts_per_rank, group=group, sync_op=sync_op,
        capacity=capacity,
    )  # fmt: skip
    if sync_op is False:
        return _as_task(eager)
    number = _number(group)
    tensors = isinstance(x, torch.Tensor) and isinstance(topk_idx, torch.Tensor)
    weights_ok = topk_weights is None or isinstance(topk_weights, torch.Tensor)
    sizes_ok = type(experts_per_rank) is int and (capacity is None or type(capacity) is int)
    if not tensors or not weights_ok or not sizes_ok or not _flags(sync_op) or not _traced(number):
        return _untraced(eager)
    if not torch._dynamo.config.capture_scalar_outputs:
        return _scalars_off(eager)
    local_count, global_count, send_tokens, slot_rows = torch.ops.unicoll.moe_layout(
        x, topk_idx, topk_weights, experts_per_rank, number, capacity
    )
    rows_per_expert = global_count.view(-1, experts_per_rank).sum(0).tolist()
    for rows in rows_per_expert:
        torch._check(rows >= 0)
    received = torch.ops.unicoll.global_scatter(
        x.index_select(0, send_tokens), local_count, global_count, number, True, sum(rows_per_expert)
    )
    tokens, topk = topk_idx.shape
    handle = TracedHandle(
        local_count, global_count, send_tokens, slot_rows, topk_weights, number, tokens, topk, rows_per_expert
    )
    return received, rows_per_expert, handle


def moe_redispatch(x: Any, handle: Any, *, sync_op: bool = True) -> Any:
    """:func:`unicoll.moe.redispatch` as traced, for a :class:`TracedHandle`: the rows taken by
    ``index_select`` and sent by ``unicoll::global_scatter``."""
    if not isinstance(handle, TracedHandle):
        return _eager_handle(functools.partial(moe.redispatch, x, handle, sync_op=sync_op))
    if sync_op is False:
        return _as_task(_with_handle, moe.redispatch, x, handle, sync_op)
    if not isinstance(x, torch.Tensor) or not _flags(sync_op):
        return _untraced(_with_handle, moe.redispatch, x, handle, sync_op)
    received = sum(handle.rows_per_expert)
    torch.ops.unicoll.moe_check(x, handle.send_tokens, handle.tokens, received, handle.weighted, "moe.redispatch")
    sent = x.index_select(0, handle.send_tokens)
    return torch.ops.unicoll.global_scatter(sent, handle.local_count, handle.global_count, handle.group, True, received)


def moe_combine(y: Any, handle: Any, *, sync_op: bool = True) -> Any:
    """:func:`unicoll.moe.combine` as traced, for a :class:`TracedHandle`: the rows sent back by
    ``unicoll::global_gather``, then each token's slots weighted and summed as eager does (a
    zero row read by dropped slots, whose weights count as zero)."""
    if not isinstance(handle, TracedHandle):
        return _eager_handle(functools.partial(moe.combine, y, handle, sync_op=sync_op))
    if sync_op is False:
        return _as_task(_with_handle, moe.combine, y, handle, sync_op)
    if not isinstance(y, torch.Tensor) or not _flags(sync_op):
        return _untraced(_with_handle, moe.combine, y, handle, sync_op)
    sent = handle.send_tokens.shape[0]
    received = sum(handle.rows_per_expert)
    torch.ops.unicoll.moe_check(y, handle.send_tokens, handle.tokens, received, handle.weighted, "moe.combine")
    back = torch.ops.unicoll.global_gather(y, handle.local_count, handle.global_count, handle.group, True, sent)
    tokens, k, trailing = handle.tokens, handle.topk, tuple(y.shape[1:])
    back = torch.cat([back, back.new_zeros((1, *trailing))])
    rows = back.index_select(0, handle.slot_rows).reshape(tokens, k, *trailing)
    if handle.weights is None:
        out = rows.reshape(tokens, *trailing) if k == 1 else rows.sum(1)
    else:
        kept = handle.slot_rows.reshape(tokens, k) < sent
        weights = torch.where(kept, handle.weights, torch.zeros_like(handle.weights))
        common = torch.promote_types(weights.dtype, rows.dtype)
        flat = rows.reshape(tokens, k, math.prod(trailing)).to(common)
        out = torch.bmm(weights.reshape(tokens, 1, k).to(common), flat).reshape(tokens, *trailing)
    return out if out.dtype == back.dtype else out.to(back.dtype)
