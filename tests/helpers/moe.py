"""A top-2 MoE layer written with unicoll, as a model would write it, for the torch.compile tests.

Router, top-2 choice, rows sorted by expert, ``exchange_counts``, ``global_scatter``, one small
FFN per local expert, ``global_gather``, rows unsorted and combined with their gate weights.
Every step is traceable with ``fullgraph=True``: the counts are tensors, the expert of each
received row comes from ``repeat_interleave`` with the known output size, and the rows go back
to their tokens by indexing, so no data-dependent size needs a guard.
"""

from __future__ import annotations

import torch

import unicoll as uc

TOP_K = 2


def moe_layer(
    x: torch.Tensor, router: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, world: int
) -> torch.Tensor:
    """The layer's output for tokens ``x`` (T, d): ``router`` (d, world*E) and this rank's
    experts ``w_in`` (E, d, f), ``w_out`` (E, f, d)."""
    experts = w_in.shape[0]
    gates, chosen = (x @ router).softmax(-1).topk(TOP_K, dim=-1)
    destination = chosen.reshape(-1)  # row t*TOP_K + k of the repeated tokens goes to expert destination[...]
    order = destination.argsort(stable=True)
    rows = x.repeat_interleave(TOP_K, dim=0)[order]
    local_count = torch.zeros(world * experts, dtype=torch.int64, device=x.device).scatter_add_(
        0, destination, torch.ones_like(destination)
    )
    global_count = uc.exchange_counts(local_count)
    received = uc.global_scatter(rows, local_count, global_count)
    per_expert = global_count.view(world, experts).sum(0)
    expert = torch.repeat_interleave(torch.arange(experts, device=x.device), per_expert, output_size=received.shape[0])
    hidden = torch.einsum("nd,ndf->nf", received, w_in[expert]).relu()
    done = torch.einsum("nf,nfd->nd", hidden, w_out[expert])
    back = uc.global_gather(done, local_count, global_count)
    mine = back[order.argsort()]
    return (mine.view(-1, TOP_K, x.shape[1]) * gates.unsqueeze(-1)).sum(1)


def moe_topk_layer(
    x: torch.Tensor, router: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, world: int
) -> torch.Tensor:
    """The same layer written with ``unicoll.moe``: ``dispatch`` with the gate weights (each rank
    sends each expert at most 3 rows, so larger inputs drop slots), one FFN per local expert on
    its part of the rows (split on ``rows_per_expert``), ``combine``."""
    experts = w_in.shape[0]
    gates, chosen = (x @ router).softmax(-1).topk(TOP_K, dim=-1)
    rows, rows_per_expert, handle = uc.moe.dispatch(x, chosen, gates, experts_per_rank=experts, capacity=3)
    parts = torch.split(rows, rows_per_expert)
    done = [(part @ w_in[e]).relu() @ w_out[e] for e, part in enumerate(parts)]
    return uc.moe.combine(torch.cat(done), handle)


def parameters(rank: int, dim: int, hidden: int, experts: int, world: int) -> list[torch.Tensor]:
    """The router (the same on every rank) and this rank's experts, float64, requiring grad."""
    shared = torch.Generator().manual_seed(0)
    own = torch.Generator().manual_seed(1000 + rank)
    router = torch.randn(dim, world * experts, generator=shared, dtype=torch.float64)
    w_in = torch.randn(experts, dim, hidden, generator=own, dtype=torch.float64) / dim**0.5
    w_out = torch.randn(experts, hidden, dim, generator=own, dtype=torch.float64) / hidden**0.5
    return [p.requires_grad_() for p in (router, w_in, w_out)]


def step(layer, x: torch.Tensor, params: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The output of ``layer`` and the gradients of ``sum(output * weights)`` for ``x`` (which
    requires grad) and ``params``."""
    out = layer(x, *params)
    weights = torch.arange(out.numel(), dtype=out.dtype, device=out.device).reshape(out.shape).cos()
    grads = torch.autograd.grad((out * weights).sum(), [x, *params])
    return out.detach(), list(grads)
