"""unicoll.moe on real processes: gradients against a dense single-process top-k MoE, and the
edges (every slot dropped, tokenless ranks, duplicate experts in a token's slots, a handle
reused with no count exchange, asynchronous calls, what a handle keeps, a handle after
finalize). The whole-world conformance cases are in helpers/conformance.py; check mode's
disagreements in helpers/worlds.py; bad arguments in test_validation.py."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

import unicoll as uc

E, H, K = 2, 3, 2


def _topk_layer(x, router, experts, capacity, rank, world):
    """This rank's tokens through a top-2 MoE layer on every rank's experts, with unicoll.moe;
    slot 1 of token 0 dropped and token 1 routed twice to one expert."""
    weights, ids = torch.topk(torch.softmax(x @ router, dim=-1), K, dim=-1)
    ids = ids.clone()
    ids[0, 1] = -1
    ids[1, 1] = ids[1, 0]
    rows, rows_per_expert, handle = uc.moe.dispatch(x, ids, weights, experts_per_rank=E, capacity=capacity)
    outputs = torch.cat([part @ w for part, w in zip(rows.split(rows_per_expert), experts)])
    return uc.moe.combine(torch.tanh(outputs), handle), ids, weights


def _dense_layer(x, router, every_expert, ids, capacity):
    """The same layer on one process, holding every expert: y[t] = sum_j w[t, j] tanh(x[t] @ W[ids[t, j]])
    over the kept slots (capacity: the first slots of each expert, in token order)."""
    weights = torch.topk(torch.softmax(x @ router, dim=-1), K, dim=-1).values
    taken: dict[int, int] = {}
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(K):
            expert = int(ids[t, j])
            if expert < 0 or (capacity is not None and taken.get(expert, 0) >= capacity):
                continue
            taken[expert] = taken.get(expert, 0) + 1
            y = y.index_add(0, torch.tensor([t]), (weights[t, j] * torch.tanh(x[t] @ every_expert[expert]))[None])
    return y


def dense_gradients(rank: int) -> str:
    for capacity in (None, 1):
        _compare_with_dense(rank, capacity)
    return "ok"


def _compare_with_dense(rank: int, capacity: int | None) -> None:
    world = uc.get_world_size()
    seeds = torch.Generator().manual_seed(7)
    router = torch.randn(H, world * E, generator=seeds, dtype=torch.float64)
    every_expert = torch.randn(world * E, H, H, generator=seeds, dtype=torch.float64)
    tokens = torch.randn(5 + rank, H, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    scale = torch.arange(1.0, 1.0 + tokens.numel(), dtype=torch.float64).reshape(tokens.shape)

    x, r = tokens.clone().requires_grad_(), router.clone().requires_grad_()
    mine = every_expert[rank * E : (rank + 1) * E].clone().requires_grad_()
    y, ids, weights = _topk_layer(x, r, mine, capacity, rank, world)
    weights.retain_grad()
    (y * scale).sum().backward()

    x_ref, r_ref = tokens.clone().requires_grad_(), router.clone().requires_grad_()
    all_ref = every_expert.clone().requires_grad_()
    y_ref = _dense_layer(x_ref, r_ref, all_ref, ids, capacity)
    (y_ref * scale).sum().backward()

    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(r.grad, r_ref.grad)  # through topk_weights
    assert weights.grad is not None and weights.grad[0, 1] == 0  # a dropped slot's weight has no effect
    every_share = uc.all_gather(None, all_ref.grad[None]).sum(0)  # each expert's gradient from every rank
    torch.testing.assert_close(mine.grad, every_share[rank * E : (rank + 1) * E])


def two_ranks(rank: int) -> dict[str, object]:
    """One world for the whole module: the gradients, then the edges (which end the session)."""
    return {"gradients": dense_gradients(rank), **edges(rank)}


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, object]]:
    return uc.testing.spawn(two_ranks, 2, backend="gloo")


def test_gradients_match_a_dense_topk_moe(outcomes) -> None:
    """Without and with a capacity of 1 (which drops token 1's second slot, a duplicate)."""
    assert [o["gradients"] for o in outcomes] == ["ok", "ok"]


def edges(rank: int) -> dict[str, object]:
    world = uc.get_world_size()
    x = np.arange(8, dtype=np.float32).reshape(4, 2) + 100 * rank
    seen: dict[str, object] = {}

    # every slot dropped on every rank: nothing moves, every token's result is zero
    rows, per_expert, handle = uc.moe.dispatch(x, np.full((4, 2), -1), experts_per_rank=E)
    seen["all dropped"] = (rows.shape, per_expert, uc.moe.combine(rows, handle).tolist())

    # rank 1 has no tokens; rank 0 sends its token 0 twice to expert 1 of rank 1 (a duplicate slot)
    ids = np.array([[3, 3], [0, -1], [1, 2], [-1, -1]]) if rank == 0 else np.zeros((0, 2), np.int64)
    mine = x if rank == 0 else x[:0]
    weights = np.where(ids < 0, np.nan, 0.5).astype(np.float32)  # a dropped slot's weight plays no part
    rows, per_expert, handle = uc.moe.dispatch(mine, ids, weights, experts_per_rank=E)
    seen["duplicates"] = (rows[:, 1].tolist(), per_expert, uc.moe.combine(rows * 2, handle)[:, 1].tolist())

    # the handle serves a second layer (redispatch, combine) and the backward passes without exchanging counts
    backend = uc.runtime.state("test").backend
    exchanges = []
    real = backend.exchange_ints
    backend.exchange_ints = lambda values, group: exchanges.append(1) or real(values, group)
    try:
        xt = torch.tensor(mine, requires_grad=True)
        rows, per_expert, handle = uc.moe.dispatch(xt, torch.from_numpy(ids), experts_per_rank=E)
        first = uc.moe.combine(rows * 3, handle)
        second = uc.moe.combine(uc.moe.redispatch(xt * 5, handle), handle)  # a second layer, same routing
        (first + second).sum().backward()
        seen["exchanges"] = len(exchanges)
        seen["reuse"] = (first[:, 0].tolist(), second[:, 0].tolist(), xt.grad[:, 0].tolist())
    finally:
        backend.exchange_ints = real

    # sync_op=False: the tuple and the combined rows come from Task.wait()
    task = uc.moe.dispatch(x, np.array([[(rank + 1) % world * E]] * 4), experts_per_rank=E, sync_op=False)
    assert isinstance(task, uc.Task)
    rows, per_expert, handle = task.wait()
    combined = uc.moe.combine(rows, handle, sync_op=False)
    assert isinstance(combined, uc.Task)
    seen["async"] = (rows[:, 0].tolist(), per_expert, np.array_equal(combined.wait(), x))

    # capacity 0 drops everything; the handle keeps the weights and nothing else of the caller's
    tokens, ids, weights = x.copy(), np.zeros((4, 1), np.int64), np.ones((4, 1), np.float32)
    refs = [weakref.ref(a) for a in (tokens, ids, weights)]
    rows, per_expert, handle = uc.moe.dispatch(tokens, ids, weights, experts_per_rank=E, capacity=0)
    del tokens, ids, weights
    gc.collect()
    seen["kept alive"] = [ref() is not None for ref in refs]
    seen["capacity 0"] = (rows.shape[0], uc.moe.combine(rows, handle).tolist())

    uc.finalize()
    with pytest.raises(
        ValueError, match=r"moe\.combine: handle: expected a handle of the running session, got one that"
    ):
        uc.moe.combine(rows, handle)
    seen["after finalize"] = refs[2]() is None  # the ended session let go of the weights
    return seen


def test_edges(outcomes) -> None:
    r0, r1 = outcomes
    assert r0["all dropped"] == r1["all dropped"] == ((0, 2), [0, 0], [[0.0, 0.0]] * 4)
    # rank 0's experts get tokens 1 and 2; rank 1's experts 2, 3 token 2 and token 0 twice (column 1: 5 | 1 1)
    assert r0["duplicates"] == ([3.0, 5.0], [1, 1], [2.0, 3.0, 10.0, 0.0])
    assert r1["duplicates"] == ([5.0, 1.0, 1.0], [1, 2], [])
    assert r0["exchanges"] == r1["exchanges"] == 1
    assert r0["reuse"] == ([0.0, 6.0, 24.0, 0.0], [0.0, 10.0, 40.0, 0.0], [16.0, 8.0, 16.0, 0.0])
    assert r1["reuse"] == ([], [], [])
    assert r0["async"] == ([100.0, 102.0, 104.0, 106.0], [4, 0], True)
    assert r1["async"] == ([0.0, 2.0, 4.0, 6.0], [4, 0], True)
    for r in (r0, r1):
        assert r["kept alive"] == [False, False, True]
        assert r["capacity 0"] == (0, [[0.0, 0.0]] * 4)
        assert r["after finalize"] is True


def test_routing_docstring_examples() -> None:
    import doctest

    from unicoll import routing

    assert doctest.testmod(routing, extraglobs={"np": np}).failed == 0
