"""PaddlePaddle's own MoE layer (``paddle.incubate.distributed.models.moe.MoELayer``) on any
unicoll backend: gloo and MPI on CPUs included, where Paddle's own collectives and MoE kernels
run only on GPUs (docs/libraries.md, "Paddle's MoELayer").

Inside :func:`routed`, the layer's ``global_scatter`` / ``global_gather`` (and those of
``paddle.distributed.utils.moe_utils``) are unicoll's, its count exchange is
:func:`unicoll.exchange_counts`, and on CPU tensors the five MoE kernels its gates call
(``number_count``, ``assign_pos``, ``limit_by_capacity``, ``prune_gate_by_capacity``,
``random_routing``) are computed here, in numpy, as Paddle's CUDA kernels define them (where
a kernel's order depends on its threads' races, in token order). Tensors on a GPU keep
Paddle's kernels. The layer's ``moe_group`` is a :class:`MoEGroup`.

>>> import unicoll.paddle_moe as upm                                                # doctest: +SKIP
>>> with upm.routed():                                                               # doctest: +SKIP
...     layer = MoELayer(d_model, my_experts, gate={"type": "gshard"}, moe_group=upm.MoEGroup())
...     loss = layer(x).sum(); loss.backward()

Imported on its own (``import unicoll.paddle_moe``): ``import unicoll`` does not load it.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from .face import exchange_counts, global_gather, global_scatter
from .group import Group
from .runtime import get_rank, get_world_size

__all__ = ["MoEGroup", "routed"]


class MoEGroup:
    """A ``moe_group`` for Paddle's ``MoELayer`` and its gates over a unicoll group (None: the
    world): the ``nranks``, ``rank`` and ``is_member()`` they read, and the unicoll ``group``
    the routed calls run over."""

    def __init__(self, group: Group | None = None) -> None:
        self.group = group
        self.nranks = get_world_size(group)
        self.rank = get_rank(group)

    def is_member(self) -> bool:
        """Whether this process is one of the group's ranks."""
        return self.group is None or self.group.is_member()

    def __repr__(self) -> str:
        return f"MoEGroup({self.group!r}, nranks={self.nranks}, rank={self.rank})"


def _group(name: str, group: Any) -> Group | None:
    """The unicoll group a routed call runs over: ``group`` itself, a :class:`MoEGroup`'s, or
    the world for None; TypeError naming ``name`` for a Paddle group, which unicoll cannot use."""
    if group is None or isinstance(group, Group):
        return group
    if isinstance(group, MoEGroup):
        return group.group
    raise TypeError(
        f"{name}: group: expected None, a unicoll.paddle_moe.MoEGroup or a unicoll Group (inside "
        f"unicoll.paddle_moe.routed()), got {type(group).__name__}"
    )


def _flat(counts: Any) -> Any:
    """Counts as one dimension (the layer reshapes its global counts to (ranks, experts) in place)."""
    return counts.reshape([-1])


def _global_scatter(
    x: Any, local_count: Any, global_count: Any, group: Any = None, use_calc_stream: bool = True
) -> Any:
    """Paddle's ``global_scatter`` as unicoll's (Paddle's signature; its counts flattened)."""
    return global_scatter(x, _flat(local_count), _flat(global_count), _group("global_scatter", group),
                          use_calc_stream=use_calc_stream)  # fmt: skip


def _global_gather(x: Any, local_count: Any, global_count: Any, group: Any = None, use_calc_stream: bool = True) -> Any:
    """Paddle's ``global_gather`` as unicoll's (Paddle's signature; its counts flattened)."""
    return global_gather(x, _flat(local_count), _flat(global_count), _group("global_gather", group),
                         use_calc_stream=use_calc_stream)  # fmt: skip


def _alltoall(counts: Any, group: Any = None, use_calc_stream: bool = True) -> Any:
    """The count exchange of Paddle's MoE utilities: each rank's counts per global expert in,
    the counts every rank sends to this rank's experts out."""
    return exchange_counts(_flat(counts), _group("exchange_counts", group))


def _local_gather(x: Any, pos: Any, out_batch_size: int, maybe_overlap: bool = True) -> Any:
    """Rows ``out[pos[i]] += x[i]`` into ``out_batch_size`` zero rows, summed in x's dtype
    (float32 for 2-byte floats): the layer's own overwrites where ``pos`` repeats a row, and
    it does for top_k > 1 (each token's slots' input gradients), so a token kept one slot's."""
    paddle = _paddle()
    wide = x.dtype in (paddle.float16, paddle.bfloat16)
    out = paddle.zeros([out_batch_size, x.shape[-1]], dtype="float32" if wide else x.dtype)
    if pos.shape[0]:
        out = paddle.scatter(out, pos, paddle.cast(x, "float32") if wide else x, overwrite=False)
    return paddle.cast(out, x.dtype) if wide else out


def _on_cpu(x: Any) -> bool:
    return bool(x.place.is_cpu_place())


def _host(x: Any) -> np.ndarray:
    return np.asarray(x.numpy()).reshape(-1)


def number_count(numbers: Any, upper_range: int) -> np.ndarray:
    """How many of ``numbers`` equal each of ``0 .. upper_range - 1`` (the others, ``-1`` for a
    dropped slot, not counted)."""
    flat = numbers.reshape(-1)
    return np.bincount(flat[(flat >= 0) & (flat < upper_range)], minlength=upper_range).astype(numbers.dtype)


def _order_by_value(values: np.ndarray) -> np.ndarray:
    """The positions of the non-negative ``values``, by value, ties in position order."""
    kept = np.flatnonzero(values >= 0)
    return kept[np.argsort(values[kept], kind="stable")]


def assign_pos(numbers: np.ndarray, cum_count: np.ndarray) -> np.ndarray:
    """Each expert's slots, as the positions in ``numbers`` of its id, grouped by expert
    (``cum_count``: the running sum of the counts). Paddle's kernel fills an expert's group
    from its end in the order its threads run; here in position order, so an expert's slots
    come last to first, as Paddle documents the kernel's result (``[2, 0, 3, 1]`` for
    ``[[0, 2], [0, 2]]``)."""
    flat = numbers.reshape(-1)
    order = _order_by_value(flat)
    if order.size != (int(cum_count[-1]) if cum_count.size else 0):
        raise ValueError(
            f"assign_pos: cum_count: expected a last entry of {order.size} (the kept slots), got {cum_count[-1]}"
        )
    starts = np.concatenate(([0], cum_count[:-1]))
    out = np.empty(order.size, dtype=cum_count.dtype)
    for expert in np.unique(flat[order]):
        mine = order[flat[order] == expert]
        out[starts[expert] : starts[expert] + mine.size] = mine[::-1]
    return out


def limit_by_capacity(expert_count: np.ndarray, capacity: np.ndarray, n_worker: int) -> np.ndarray:
    """``expert_count`` (n_worker * experts, worker-major) cut so that each expert's counts sum
    to at most its ``capacity``, the workers served in order (``[1, 2, 2, 8, 3, 6]`` with
    capacity 5 over 2 workers: ``[1, 2, 2, 4, 3, 3]``)."""
    counts = expert_count.reshape(n_worker, -1)
    before = np.cumsum(counts, axis=0) - counts  # what the workers ahead of each took
    return np.clip(capacity.reshape(1, -1) - before, 0, counts).astype(expert_count.dtype).reshape(-1)


def prune_gate_by_capacity(gate_idx: np.ndarray, expert_count: np.ndarray) -> np.ndarray:
    """``gate_idx`` with each expert's slots beyond its ``expert_count`` set to ``-1``, the first
    in position order kept (Paddle's kernel keeps whichever threads come first)."""
    flat = gate_idx.reshape(-1).copy()
    order = _order_by_value(flat)
    experts = flat[order]
    starts = np.searchsorted(experts, experts)  # the first position of each slot's expert in `order`
    beyond = (np.arange(order.size) - starts) >= expert_count[experts]
    flat[order[beyond]] = -1
    return flat.reshape(gate_idx.shape)


def random_routing(topk_idx: np.ndarray, topk_value: np.ndarray, prob: np.ndarray, topk: int = 2) -> np.ndarray:
    """``topk_idx`` with its last slot dropped (``-1``) for each token ``i`` where ``topk *
    topk_value[i, topk - 1] < prob[i]`` (GShard's random routing)."""
    out = topk_idx.copy()
    out[topk * topk_value[:, topk - 1] < prob.reshape(-1), topk - 1] = -1
    return out


def _number_count(numbers: Any, upper_range: int, *, paddle_op: Callable[..., Any]) -> Any:
    if not _on_cpu(numbers):
        return paddle_op(numbers, upper_range)
    return _paddle().to_tensor(number_count(_host(numbers), upper_range))


def _assign_pos(x: Any, cum_count: Any, *, paddle_op: Callable[..., Any]) -> Any:
    if not _on_cpu(x):
        return paddle_op(x, cum_count)
    return _paddle().to_tensor(assign_pos(_host(x), _host(cum_count)))


def _limit_by_capacity(expert_count: Any, capacity: Any, n_worker: int, *, paddle_op: Callable[..., Any]) -> Any:
    if not _on_cpu(expert_count):
        return paddle_op(expert_count, capacity, n_worker)
    return _paddle().to_tensor(limit_by_capacity(_host(expert_count), _host(capacity), n_worker))


def _prune_gate_by_capacity(gate_idx: Any, expert_count: Any, n_expert: int, n_worker: int, *,
                            paddle_op: Callable[..., Any]) -> Any:  # fmt: skip
    if not _on_cpu(gate_idx):
        return paddle_op(gate_idx, expert_count, n_expert, n_worker)
    pruned = prune_gate_by_capacity(gate_idx.numpy(), _host(expert_count))
    return _paddle().to_tensor(pruned)


def _random_routing(topk_idx: Any, topk_value: Any, prob: Any, topk: int = 2, *, paddle_op: Callable[..., Any]) -> Any:
    if not _on_cpu(topk_idx):
        return paddle_op(topk_idx, topk_value, prob, topk)
    return _paddle().to_tensor(random_routing(topk_idx.numpy(), topk_value.numpy(), prob.numpy(), topk))


def _paddle() -> Any:
    return importlib.import_module("paddle")


def _no_version_check() -> None:
    """Paddle's NCCL version check, which the layer makes when built over several ranks: not
    needed where unicoll carries the rows."""


_ROUTES = (
    ("paddle.incubate.distributed.models.moe.moe_layer", "global_scatter", _global_scatter),
    ("paddle.incubate.distributed.models.moe.moe_layer", "global_gather", _global_gather),
    ("paddle.incubate.distributed.models.moe.moe_layer", "check_nccl_version_for_p2p", _no_version_check),
    ("paddle.incubate.distributed.models.moe.moe_layer", "_local_gather", _local_gather),
    ("paddle.distributed.utils.moe_utils", "global_scatter", _global_scatter),
    ("paddle.distributed.utils.moe_utils", "global_gather", _global_gather),
    ("paddle.incubate.distributed.models.moe.utils", "_alltoall", _alltoall),
)
"""(module, name, unicoll's replacement): the names the layer and its gates call, and the
layer's local gather, whose own form drops all but one slot's input gradient per token."""

_KERNELS = (
    ("paddle.incubate.distributed.models.moe.utils", "_number_count", _number_count),
    ("paddle.incubate.distributed.models.moe.utils", "_assign_pos", _assign_pos),
    ("paddle.incubate.distributed.models.moe.utils", "_limit_by_capacity", _limit_by_capacity),
    ("paddle.incubate.distributed.models.moe.utils", "_prune_gate_by_capacity", _prune_gate_by_capacity),
    ("paddle.distributed.models.moe.utils", "_random_routing", _random_routing),
)
"""(module, name, CPU form): Paddle's MoE kernels, computed here for CPU tensors and handed
to Paddle's own (``paddle_op``) for the others."""


@contextmanager
def routed() -> Iterator[None]:
    """Within: Paddle's MoE layer and its gates run through unicoll (see the module), on the
    backend :func:`unicoll.init` chose. Build the layer inside too (a layer over several
    ranks checks Paddle's NCCL version when built). Paddle's names are restored on leaving,
    and nested uses restore in turn."""
    saved = []
    try:
        for module_name, name, replacement in _ROUTES:
            module = importlib.import_module(module_name)
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, replacement)
        for module_name, name, cpu_form in _KERNELS:
            module = importlib.import_module(module_name)
            original = getattr(module, name)
            saved.append((module, name, original))
            setattr(module, name, functools.partial(cpu_form, paddle_op=original))
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)
