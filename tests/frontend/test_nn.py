"""unicoll.nn's pieces apart from a model: sharding experts (a list, fused 3-D parameters, what
cannot be sharded), the replicated gradients' buckets on 2 ranks, and the handle's local
expert ids. Whole Hugging Face models: tests/frameworks/test_hf_expert_parallel.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import unicoll as uc
from helpers.several import SESSION, Case, share


class Fused(nn.Module):
    """Experts as transformers holds them: one 3-D parameter per weight, num_experts."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.up = nn.Parameter(torch.arange(experts * 6.0).reshape(experts, 3, 2))
        self.bias = nn.Parameter(torch.zeros(experts, 3))


def sharding(rank: int) -> dict:
    """What rank ``rank`` of 2 keeps of fused experts and of a list, and the errors."""
    import unicoll.nn as unn

    got = {}
    fused = unn.sharded_experts(Fused(4))
    got["fused"] = (fused.num_experts, fused.up[:, 0, 0].tolist(), tuple(fused.bias.shape))
    listed = unn.sharded_experts(nn.ModuleList([nn.Linear(1, 1) for _ in range(6)]))
    got["list"] = len(listed)
    for bad in (Fused(3), nn.Linear(2, 2)):
        with pytest.raises((ValueError, TypeError)) as caught:
            unn.sharded_experts(bad)
        got.setdefault("errors", []).append(str(caught.value))
    odd = Fused(4)
    odd.other = nn.Parameter(torch.zeros(5))
    with pytest.raises(ValueError) as caught:
        unn.sharded_experts(odd)
    got["errors"].append(str(caught.value))
    return got


def buckets(rank: int) -> dict:
    """Gradients of two dtypes, one parameter without a gradient, buckets of about 100 bytes:
    each gradient summed over the ranks, in place."""
    import unicoll.nn as unn

    params = [nn.Parameter(torch.zeros(n, dtype=dtype)) for n, dtype in
              ((10, torch.float32), (30, torch.float32), (4, torch.float64), (3, torch.float32))]  # fmt: skip
    for i, p in enumerate(params[:3] + params[3:]):
        p.grad = torch.full_like(p, float(rank + 1 + i))
    params.insert(1, nn.Parameter(torch.zeros(2)))  # no gradient on any rank: keeps None
    params.append(nn.Parameter(torch.zeros(2)))
    if rank == 1:  # a gradient on one rank only: every rank gets it
        params[-1].grad = torch.full((2,), 4.0)
    unn.all_reduce_gradients(params, bucket_mib=100 / 2**20)
    return {"grads": [None if p.grad is None else p.grad.unique().tolist() for p in params]}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def reducer(rank: int) -> dict:
    """GradientReducer against all_reduce_gradients on a copy of the model, sum and avg, three
    steps each (buckets of about 300 bytes: five), a parameter with a gradient on rank 0 only
    and one with none; how many buckets were in flight when backward returned; a second
    backward before finish(); two micro-batches through accumulating(); parameters that
    differ between the ranks."""
    import unicoll.nn as unn

    got: dict = {"worst": [], "in flight": [], "errors": []}
    for op in ("sum", "avg"):
        model, twin = _mlp(), _mlp()
        only_here, never = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
        # backward reaches the model's parameters first: only_here and never close the last bucket
        params = [only_here, never, *model.parameters()]
        twins = [nn.Parameter(torch.ones(3)), never, *twin.parameters()]
        overlapped = unn.GradientReducer(params, op=op, bucket_mib=300 / 2**20)
        for step in range(3):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).square().sum().backward()
            got["in flight"].append(sum(b.task is not None for b in overlapped._buckets))
            got["buckets"] = len(overlapped._buckets)
            if rank == 0:
                only_here.sum().backward()
            overlapped.finish()
            twin(x).square().sum().backward()
            if rank == 0:
                twins[0].sum().backward()
            unn.all_reduce_gradients(twins, op=op)
            pairs = [(only_here, twins[0]), *zip(params[2:], twins[2:])]
            got["worst"].append(max((a.grad - b.grad).abs().max().item() for a, b in pairs))
            got["never"] = never.grad
            for p in params + twins:
                p.grad = None
        overlapped.close()
    model = _mlp()
    overlapped = unn.GradientReducer(model.parameters())
    x = torch.ones(2, 8)
    model(x).sum().backward()
    try:
        model(x).sum().backward()
    except RuntimeError as error:
        got["errors"].append(str(error))
    overlapped.finish()
    for p in model.parameters():
        p.grad = None
    with overlapped.accumulating():
        model(x).sum().backward()
    model(2 * x).sum().backward()
    overlapped.finish()
    twin = _mlp()
    twin(x).sum().backward()
    twin(2 * x).sum().backward()
    unn.all_reduce_gradients(twin.parameters())
    got["accumulated"] = max(
        (a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), twin.parameters())
    )
    try:
        unn.GradientReducer(_mlp().parameters() if rank == 0 else nn.Linear(8, 2).parameters())
    except ValueError as error:
        got["errors"].append(str(error))
    return got


def expert_ids(rank: int) -> list:
    """Each dispatched row's local expert: rows_per_expert [2, 0, 1] on one rank and what it
    takes on the other."""
    ids = torch.tensor([[0, 2], [0, 3], [4, 5]]) if rank == 0 else torch.tensor([[1, 5]])
    rows, rows_per_expert, handle = uc.moe.dispatch(torch.ones(ids.shape[0], 2), ids, experts_per_rank=3)
    local = handle.local_expert_ids()
    numpy_handle = uc.moe.dispatch(np.ones((ids.shape[0], 2)), ids.numpy(), experts_per_rank=3)[2]
    return [rows_per_expert, local.tolist(), local.dtype == torch.int64, numpy_handle.local_expert_ids().tolist()]


def a_list_of_experts(rank: int) -> dict:
    """ExpertParallel around an nn.ModuleList of 4 Linear experts (2 per rank), top-2, in both
    modes, against the same experts computed densely on this rank: result, x's and the
    weights' gradients (float64)."""
    import unicoll.nn as unn

    torch.manual_seed(0)
    experts = nn.ModuleList([nn.Linear(3, 3).double() for _ in range(4)])
    dense = [nn.Linear(3, 3).double() for _ in range(4)]
    for d, e in zip(dense, experts):
        d.load_state_dict(e.state_dict())
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(5, 3, generator=generator, dtype=torch.float64, requires_grad=True)
    ids = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(5)])
    w = torch.rand(5, 2, generator=generator, dtype=torch.float64, requires_grad=True)
    want = sum(w[:, j : j + 1] * torch.stack([dense[i](x[t]) for t, i in enumerate(ids[:, j])]) for j in range(2))
    want.sum().backward()
    want_grads = (x.grad.clone(), w.grad.clone())
    layer = unn.sharded_experts(experts)
    got = {}
    for static in (False, True):
        x.grad = w.grad = None
        out = unn.ExpertParallel(layer, static=static, capacity=5)(x, ids, w)
        out.sum().backward()
        got[static] = [(out - want).abs().max().item(), (x.grad - want_grads[0]).abs().max().item(),
                       (w.grad - want_grads[1]).abs().max().item()]  # fmt: skip
    return got


def capacities(rank: int) -> list[int]:
    """Rank 0 has 10 tokens, rank 1 30: drop-free, and factors 1 and 1.25 at top-2 over 4
    experts per rank."""
    import unicoll.nn as unn

    tokens = 10 if rank == 0 else 30
    return [unn.capacity(tokens, 2, 4), unn.capacity(tokens, 2, 4, factor=1.0), unn.capacity(tokens, 2, 4, factor=1.25)]


NN = share("gloo", 2, [Case("nn: sharding", sharding), Case("nn: buckets", buckets), Case("nn: ids", expert_ids),
                       Case("nn: capacity", capacities), Case("nn: a list", a_list_of_experts),
                       Case("nn: reducer", reducer)])  # fmt: skip


def test_a_list_of_experts_runs_expert_parallel_like_the_dense_experts() -> None:
    for report in SESSION.results(NN, "nn: a list"):
        for static, differences in report.items():
            assert max(differences) < 1e-12, (static, differences)


def test_capacity_is_the_same_on_every_rank_from_the_largest_token_count() -> None:
    assert SESSION.results(NN, "nn: capacity") == [[30, 8, 10]] * 2  # ceil(30 * 2 / 8), ceil(1.25 * 60 / 8)


def test_experts_are_sharded_by_rank_and_refused_where_they_cannot_be() -> None:
    reports = SESSION.results(NN, "nn: sharding")
    assert [r["fused"] for r in reports] == [(2, [0.0, 6.0], (2, 3)), (2, [12.0, 18.0], (2, 3))]
    assert [r["list"] for r in reports] == [3, 3]
    errors = reports[0]["errors"]
    assert errors[0] == "unicoll.nn: experts: expected a number of experts divisible by the group's 2 ranks, got 3"
    assert errors[1].startswith(
        "unicoll.nn: experts: expected an nn.ModuleList of experts or a module with num_experts"
    )
    assert errors[2] == "unicoll.nn: experts.other: expected one slice per expert in dimension 0 (4), got shape (5,)"


def test_replicated_gradients_are_summed_in_buckets_skipping_those_without_one() -> None:
    reports = SESSION.results(NN, "nn: buckets")
    assert reports == [{"grads": [[3.0], None, [5.0], [7.0], [9.0], [4.0]]}] * 2  # (rank 1 + i) + (rank 2 + i)


def test_the_reducer_sums_while_backward_runs() -> None:
    for report in SESSION.results(NN, "nn: reducer"):
        assert report["worst"] == [0.0] * 6  # what all_reduce_gradients sums after backward, bit for bit
        assert report["never"] is None
        # every bucket issued inside backward but the last, whose only_here and never come later or not at all
        assert report["buckets"] == 6 and report["in flight"] == [5] * 6
        assert report["accumulated"] == 0.0
        assert report["errors"][0].startswith("unicoll.nn.GradientReducer: a gradient accumulated again after its")
        assert report["errors"][1].startswith(
            "unicoll.nn.GradientReducer: parameters: expected the same parameters (sizes and dtypes, in order) on "
            "every rank of the group, got layouts that differ"
        )


def test_the_handle_gives_each_row_s_local_expert() -> None:
    reports = SESSION.results(NN, "nn: ids")
    # rank 0 holds experts 0-2: rows from rank 0 (0, 0, 2) and rank 1 (1); rank 1 experts 3-5:
    # from rank 0 (3, 4, 5) and rank 1 (5)
    assert reports[0] == [[2, 1, 1], [0, 0, 1, 2], True, [0, 0, 1, 2]]
    assert reports[1] == [[1, 1, 2], [0, 1, 2, 2], True, [0, 1, 2, 2]]


def test_the_model_s_rounding_needs_transformers_experts() -> None:
    import unicoll.nn as unn

    with pytest.raises(ValueError) as caught:
        unn.ExpertParallel(nn.ModuleList([nn.Linear(2, 2)]), rounding="model")
    assert str(caught.value) == (
        "unicoll.nn.ExpertParallel: rounding: expected 'model' only for transformers' experts with "
        "config._experts_implementation one of ['batched_mm', 'eager', 'grouped_mm'], got ModuleList with None"
    )
    with pytest.raises(ValueError, match="rounding: expected 'combine' or 'model', got 'exact'"):
        unn.ExpertParallel(nn.ModuleList([nn.Linear(2, 2)]), rounding="exact")
