"""Expert parallelism for the torch models people already have: one call shards every MoE
block's experts over a group and routes their tokens through :mod:`unicoll.moe`
(docs/expert_parallel.md).

A model's MoE block keeps its router, its shared experts and its experts' own code: only the
block's ``experts`` module is replaced, by an :class:`ExpertParallel` that holds this rank's
slice of the experts (:func:`sharded_experts`) and, given the block's ``(hidden, top_k_index,
top_k_weights)`` (transformers' experts interface), dispatches the tokens to their experts'
ranks, runs the local experts on the rows it received (the wrapped module's own forward, each
row with its local expert's id and weight 1), and combines the outputs, weighed by
``top_k_weights``. :func:`expert_parallel` does it for every MoE block of a model;
:func:`replicated_parameters` names the parameters every rank holds a copy of, and
:func:`all_reduce_gradients` (after the backward pass) or a :class:`GradientReducer` (while it
runs) sums their gradients (combine's backward already sums the experts' own over the ranks).

Imported on its own (``import unicoll.nn``): ``import unicoll`` does not load it, nor torch.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from . import moe
from .eager.agreed import all_reduce_agreed
from .face import all_gather, all_reduce
from .group import Group
from .runtime import get_rank, get_world_size, new_group

__all__ = [
    "ExpertParallel",
    "GradientReducer",
    "all_reduce_gradients",
    "capacity",
    "expert_parallel",
    "replicated_parameters",
    "sharded_experts",
]


def _expert_count(experts: nn.Module) -> int:
    """The experts an experts module holds: a list's length, else its ``num_experts``."""
    if isinstance(experts, nn.ModuleList):
        return len(experts)
    count = getattr(experts, "num_experts", None)
    if not isinstance(count, int) or count < 1:
        raise TypeError(
            f"unicoll.nn: experts: expected an nn.ModuleList of experts or a module with num_experts (an int) whose "
            f"parameters hold one slice per expert in dimension 0, got {type(experts).__name__}"
        )
    return count


def sharded_experts(experts: nn.Module, group: Group | None = None) -> nn.Module:
    """This rank's experts of ``experts``, in place: the consecutive slice ``rank * E .. (rank +
    1) * E - 1`` of its experts (``E`` = the experts over the group's size, which must divide
    them): the entries of an ``nn.ModuleList``, or dimension 0 of every parameter of a module
    whose ``num_experts`` it holds (transformers' fused experts: ``gate_up_proj``,
    ``down_proj``), whose ``num_experts`` becomes ``E``. The other experts' memory is let go.
    Returns ``experts``."""
    total, world, rank = _expert_count(experts), get_world_size(group), get_rank(group)
    if total % world:
        raise ValueError(
            f"unicoll.nn: experts: expected a number of experts divisible by the group's {world} ranks, got {total}"
        )
    local = total // world
    mine = slice(rank * local, (rank + 1) * local)
    if isinstance(experts, nn.ModuleList):
        kept = list(experts[mine])
        for index in range(len(experts) - 1, -1, -1):
            del experts[index]
        experts.extend(kept)
        return experts
    for name, parameter in list(experts.named_parameters(recurse=False)):
        if parameter.shape[:1] != (total,):
            raise ValueError(
                f"unicoll.nn: experts.{name}: expected one slice per expert in dimension 0 ({total}), "
                f"got shape {tuple(parameter.shape)}"
            )
        setattr(experts, name, nn.Parameter(parameter.detach()[mine].clone(), parameter.requires_grad))
    experts.num_experts = local
    return experts


def capacity(
    tokens: int, topk: int, experts_per_rank: int, *, factor: float | None = None, group: Group | None = None
) -> int:
    """A capacity for :func:`unicoll.moe.dispatch_static` (rows each rank sends each expert at
    most), the same on every rank of ``group``: ``ceil(factor * T * k / experts)`` with a
    capacity ``factor`` (T: the most ``tokens`` any rank passes, ``experts``: the group's),
    else the drop-free one, T (a token's k slots go to k different experts, as a top-k router
    picks them). Reads the ranks' token counts with one all-reduce (on the host)."""
    most = all_reduce(torch.tensor([tokens], dtype=torch.int64), "max", group)
    largest = int(most.item())
    if factor is None:
        return largest
    return math.ceil(factor * largest * topk / (experts_per_rank * get_world_size(group)))


_ROUNDINGS = {"eager": "in order", "batched_mm": "summed", "grouped_mm": "summed"}
"""transformers' experts implementations and how each sums a token's weighted outputs: each
product rounded to the rows' dtype and added in it, expert by expert (``"in order"``), or the
products summed by ``sum(dim=1)`` and rounded once (``"summed"``)."""


def _model_rounding(experts: nn.Module) -> str:
    """How the model's own experts code sums (:data:`_ROUNDINGS`), from its config."""
    implementation = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    if implementation not in _ROUNDINGS:
        raise ValueError(
            "unicoll.nn.ExpertParallel: rounding: expected 'model' only for transformers' experts with "
            f"config._experts_implementation one of {sorted(_ROUNDINGS)}, got {type(experts).__name__} with "
            f"{implementation!r}"
        )
    return _ROUNDINGS[implementation]


class ExpertParallel(nn.Module):
    """An experts module over a group: called as transformers' experts are, ``(hidden (T, H),
    top_k_index (T, k) global expert ids, top_k_weights (T, k))``, it returns each token's
    weighted sum of its experts' outputs ``(T, H)``, computed by this rank's ``experts``
    (:func:`sharded_experts`) on the rows :func:`unicoll.moe.dispatch` brought them.

    ``static``: the static-shape mode (:func:`unicoll.moe.dispatch_static`), with ``capacity``
    rows per (rank, expert) block, or, where it is None, ``ceil(capacity_factor * T * k / experts)``
    (T: this call's tokens; every rank must pass as many). ``max_tokens_per_rank``: passed on
    to the static dispatch.

    ``rounding``: ``"combine"`` weighs and sums in :func:`unicoll.moe.combine` (float32 at
    least, rounded once: docs/semantics.md); ``"model"`` computes it as transformers' experts
    code of ``config._experts_implementation`` does, bit for bit: each slot's output comes back
    on its own (dispatched and combined as a token of one slot, so each token's row travels
    once per slot) and the source weighs it in the dtype torch promotes the rows and weights to,
    then, for ``"eager"``, rounds each product to the rows' dtype and adds them in it in
    ascending expert order, or, for ``"batched_mm"`` and ``"grouped_mm"``, sums the products
    with ``sum(dim=1)`` and rounds once.
    """

    def __init__(
        self,
        experts: nn.Module,
        group: Group | None = None,
        *,
        static: bool = False,
        capacity: int | None = None,
        capacity_factor: float = 1.25,
        max_tokens_per_rank: int | None = None,
        rounding: str = "combine",
    ) -> None:
        super().__init__()
        self.experts = experts
        self.group = group
        self.static, self.capacity, self.capacity_factor = static, capacity, capacity_factor
        self.max_tokens_per_rank = max_tokens_per_rank
        self.experts_per_rank = _expert_count(experts)
        if rounding not in ("combine", "model"):
            raise ValueError(f"unicoll.nn.ExpertParallel: rounding: expected 'combine' or 'model', got {rounding!r}")
        self.summing = None if rounding == "combine" else _model_rounding(experts)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Dispatch, the local experts, combine (see the class)."""
        if self.summing is not None:
            return self._as_the_model(hidden, top_k_index, top_k_weights)
        if self.static:
            capacity = self._capacity(*top_k_index.shape)
            return self._static(hidden, top_k_index, top_k_weights, capacity, self.max_tokens_per_rank)
        return self._dynamic(hidden, top_k_index, top_k_weights)

    def _capacity(self, tokens: int, k: int) -> int:
        """The static mode's rows per (rank, expert) block for ``tokens`` tokens of ``k`` slots."""
        if self.capacity is not None:
            return self.capacity
        return math.ceil(self.capacity_factor * tokens * k / (self.experts_per_rank * get_world_size(self.group)))

    def _dynamic(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor | None
    ) -> torch.Tensor:
        rows, rows_per_expert, handle = moe.dispatch(
            hidden, top_k_index, top_k_weights, experts_per_rank=self.experts_per_rank, group=self.group
        )
        return moe.combine(self._local(rows, handle.local_expert_ids(), rows_per_expert), handle)

    def _static(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor | None, capacity: int,
        bound: int | None,
    ) -> torch.Tensor:  # fmt: skip
        experts = self.experts_per_rank
        rows, _, handle = moe.dispatch_static(
            hidden, top_k_index, top_k_weights, experts_per_rank=experts, capacity=capacity, group=self.group,
            max_tokens_per_rank=bound,
        )  # fmt: skip
        flat = rows.reshape(-1, rows.shape[-1])
        ids = torch.arange(experts, device=rows.device).repeat_interleave(rows.shape[1])
        y = self._local(flat, ids, [rows.shape[1]] * experts)
        return moe.combine_static(y.reshape(experts, rows.shape[1], -1), handle)

    def _as_the_model(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """``rounding="model"``: every slot's output back on its own, weighed and summed here
        as the model's experts code does (see the class)."""
        tokens, k = top_k_index.shape
        if self.summing == "in order":  # the model adds expert by expert, lowest id first
            top_k_index, order = torch.sort(top_k_index, dim=1, stable=True)
            top_k_weights = top_k_weights.gather(1, order)
        slots = top_k_index.reshape(-1, 1)
        alone = hidden.repeat_interleave(k, dim=0)  # row t * k + j: token t for its slot j
        if self.static:  # the weighted step's capacity (as many rows per block); T * k tokens: no bound
            per_slot = self._static(alone, slots, None, self._capacity(tokens, k), None)
        else:
            per_slot = self._dynamic(alone, slots, None)
        products = per_slot.reshape(tokens, k, -1) * top_k_weights.unsqueeze(-1)
        if self.summing == "summed":
            return products.sum(dim=1).to(hidden.dtype)
        out = torch.zeros_like(hidden)
        kept = (top_k_index >= 0).unsqueeze(-1)
        for j in range(k):
            out = torch.where(kept[:, j], out + products[:, j].to(hidden.dtype), out)
        return out

    def _local(self, rows: torch.Tensor, ids: torch.Tensor, rows_per_expert: list[int]) -> torch.Tensor:
        """Each row's output of its local expert ``ids``, by the wrapped module's own code: a
        list's expert per run of rows, else the module called with k = 1 and weight 1."""
        if isinstance(self.experts, nn.ModuleList):
            parts = torch.split(rows, rows_per_expert)
            return torch.cat([expert(part) for expert, part in zip(self.experts, parts)])
        ones = torch.ones((rows.shape[0], 1), dtype=rows.dtype, device=rows.device)
        return self.experts(rows, ids.reshape(-1, 1), ones)


def expert_parallel(model: nn.Module, group: Group | None = None, **options: Any) -> nn.Module:
    """``model`` made expert-parallel over ``group``, in place: the ``experts`` module of every
    MoE block (a module with an ``experts`` attribute holding an ``nn.ModuleList`` or a module
    with ``num_experts``, which the block calls as transformers' experts are called, ``(hidden,
    top_k_index, top_k_weights)``: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, OLMoE...)
    sharded (:func:`sharded_experts`) and wrapped in an :class:`ExpertParallel` (``options``:
    its keyword arguments). A block that indexes its list of experts itself is not of this
    kind. Every rank must start from the same parameters (the same seed, or weights loaded
    alike). Returns ``model``; ValueError where it holds no MoE block."""
    blocks = [m for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module)]
    blocks = [m for m in blocks if not isinstance(m.experts, ExpertParallel)]
    if not blocks:
        raise ValueError(
            f"unicoll.nn.expert_parallel: model: expected a model with MoE blocks, got {type(model).__name__}"
        )
    for block in blocks:
        block.experts = ExpertParallel(sharded_experts(block.experts, group), group, **options)
    return model


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model`` that every rank holds a copy of: all but its
    :class:`ExpertParallel` experts', whose gradients combine's backward already sums over the
    ranks. Their gradients are each rank's own until :func:`all_reduce_gradients` or a
    :class:`GradientReducer` sums them."""
    experts = {id(p) for m in model.modules() if isinstance(m, ExpertParallel) for p in m.parameters()}
    return [p for p in model.parameters() if id(p) not in experts]


class _Bucket:
    """Parameters of one dtype and device whose gradients travel as one flat all-reduce: the
    gradients in order, then one element per parameter, 1 where this rank has its gradient,
    so that after the sum a parameter no rank has a gradient for is told from one whose
    gradients sum to zero (and a rank without one still gets the others')."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.waiting = len(params)
        """The gradients the running backward pass has yet to accumulate."""
        self.task: Any = None
        """The flat all-reduce in flight (a Task), None before it is issued."""
        self.flat: torch.Tensor | None = None

    @torch.no_grad()
    def packed(self) -> torch.Tensor:
        """The flat buffer of this rank's gradients and their presence."""
        first, total = self.params[0], sum(self.sizes)
        flat = torch.zeros(total + len(self.params), dtype=first.dtype, device=first.device)
        offset = 0
        for index, (p, size) in enumerate(zip(self.params, self.sizes)):
            if p.grad is not None:
                flat[offset : offset + size] = p.grad.reshape(-1)
                flat[total + index] = 1
            offset += size
        return flat

    @torch.no_grad()
    def unpack(self, flat: torch.Tensor) -> None:
        """The summed ``flat`` back into the gradients: a parameter that no rank had a
        gradient for keeps None."""
        total = sum(self.sizes)
        present = (flat[total:] > 0).tolist()
        offset = 0
        for p, size, some in zip(self.params, self.sizes, present):
            summed = flat[offset : offset + size].view_as(p)
            offset += size
            if not some:
                continue
            if p.grad is None:
                p.grad = summed.clone()
            else:
                p.grad.copy_(summed)


def _buckets(parameters: Iterable[nn.Parameter], limit: int) -> list[_Bucket]:
    """``parameters`` that require grad (each once), in runs of one dtype and device of at
    most ``limit`` bytes each (a larger parameter alone), in their order."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in dict.fromkeys(p for p in parameters if p.requires_grad):
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > limit or (p.dtype, p.device) != (buckets[-1][0].dtype, buckets[-1][0].device):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return [_Bucket(params) for params in buckets if params]


def _gradient_op(op: str, where: str) -> str:
    if op not in ("sum", "avg"):
        raise ValueError(f"{where}: op: expected 'sum' or 'avg', got {op!r}")
    return op


def all_reduce_gradients(
    parameters: Iterable[nn.Parameter], group: Group | None = None, *, op: str = "sum", bucket_mib: float = 25
) -> None:
    """Sum (``op``: or ``"avg"``) the gradients of ``parameters`` over ``group``, in place,
    after the backward pass: in flat buckets of at most ``bucket_mib`` MiB (one all-reduce
    each, parameters of one dtype and device per bucket). A parameter that no rank has a
    gradient for keeps None; one that some ranks lack gets the others' sum (``avg``: divided
    by all the ranks). Every rank passes the same parameters. :class:`GradientReducer` sums
    them while the backward pass runs. For data and expert parallelism together, pass
    :func:`replicated_parameters` and scale each rank's loss as docs/expert_parallel.md says."""
    op = _gradient_op(op, "unicoll.nn.all_reduce_gradients")
    for bucket in _buckets(parameters, int(bucket_mib * 2**20)):
        flat = bucket.packed()
        bucket.unpack(all_reduce(flat, op, group))


class GradientReducer:
    """Sums the gradients of ``parameters`` over ``group`` while the backward pass runs: each
    flat bucket (as :func:`all_reduce_gradients` makes them, the parameters taken last to
    first, the order backward reaches them) is issued as soon as backward has accumulated all
    of its gradients and every bucket before it is issued, and :meth:`finish`, called after
    each backward pass, issues the rest, waits and writes the sums into the gradients.

    The buckets travel on a group of their own (made here with :func:`unicoll.new_group`, so
    every rank of the world builds the reducer at the same point), issued without the per-call
    handshake: their layout is compared across the ranks once, here (ValueError on every rank
    where it differs), and a bucket's presence marks tell the ranks' missing gradients apart, so
    what every rank issues agrees by construction, and issuing from a backward hook never waits
    for a peer that is inside the model's own collectives. A second backward pass before
    :meth:`finish` raises; for gradient accumulation, run the earlier micro-batches'
    backward passes inside :meth:`accumulating`. :meth:`close` removes the hooks.

    >>> reducer = GradientReducer(replicated_parameters(model))  # doctest: +SKIP
    >>> loss.backward(); reducer.finish(); optimizer.step()      # doctest: +SKIP
    """

    def __init__(
        self, parameters: Iterable[nn.Parameter], group: Group | None = None, *, op: str = "sum",
        bucket_mib: float = 25,
    ) -> None:  # fmt: skip
        self._op = _gradient_op(op, "unicoll.nn.GradientReducer")
        self._buckets = _buckets(reversed(list(parameters)), int(bucket_mib * 2**20))
        ranks = range(get_world_size()) if group is None else group.ranks
        self._group = new_group(list(ranks))
        _compare_layout(self._buckets, self._group)
        self._next = 0
        self._paused = False
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._accumulated, index))
            for index, bucket in enumerate(self._buckets)
            for p in bucket.params
        ]

    def _accumulated(self, index: int, _: nn.Parameter) -> None:
        """Backward accumulated one of bucket ``index``'s gradients: issue the buckets now ready."""
        if self._paused:
            return
        bucket = self._buckets[index]
        if bucket.task is not None:
            raise RuntimeError(
                "unicoll.nn.GradientReducer: a gradient accumulated again after its bucket was issued: call finish() "
                "after each backward pass (run earlier micro-batches inside accumulating())"
            )
        bucket.waiting -= 1
        while self._next < len(self._buckets) and self._buckets[self._next].waiting == 0:
            self._issue(self._buckets[self._next])
            self._next += 1

    def _issue(self, bucket: _Bucket) -> None:
        bucket.flat = bucket.packed()
        bucket.task = all_reduce_agreed(bucket.flat, self._op, self._group)

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """Within: backward passes accumulate gradients without issuing any bucket (the
        micro-batches before the last of a step)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def finish(self) -> None:
        """Issue the buckets not yet issued, wait for every bucket and write the sums into the
        gradients; ready for the next backward pass (also where a wait raised)."""
        try:
            for bucket in self._buckets[self._next :]:
                self._issue(bucket)
            for bucket in self._buckets:
                bucket.unpack(bucket.task.wait())
        finally:
            for bucket in self._buckets:
                bucket.task, bucket.flat, bucket.waiting = None, None, len(bucket.params)
            self._next = 0

    def close(self) -> None:
        """Remove the backward hooks: the parameters' gradients are the ranks' own again."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _compare_layout(buckets: list[_Bucket], group: Group) -> None:
    """ValueError on every rank of ``group`` unless every rank's buckets hold as many
    elements of the same dtypes."""
    layout = ";".join(f"{sum(b.sizes) + len(b.params)}:{b.params[0].dtype}" for b in buckets)
    digest = np.frombuffer(hashlib.sha256(layout.encode()).digest()[:8], dtype=np.int64)
    everyone = all_gather(None, digest, group)
    if len(set(everyone.tolist())) > 1:
        raise ValueError(
            "unicoll.nn.GradientReducer: parameters: expected the same parameters (sizes and dtypes, in order) on "
            f"every rank of the group, got layouts that differ: {len(buckets)} buckets here ({layout[:200]})"
        )
