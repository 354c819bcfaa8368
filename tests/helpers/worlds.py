"""Worlds shared by test_reliability (gloo) and test_mpi: every check-mode mismatch, and
asynchronous operators waited for in another order than issued."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import unicoll as uc
from unicoll import reference

X = np.arange(12, dtype=np.float32).reshape(6, 2)

# (label, what rank 0 calls, what the other ranks call, the message every rank must see)
MISMATCHES = [
    ("dtype", lambda: uc.all_gather(None, X), lambda: uc.all_gather(None, X.astype(np.float64)),
     "all_gather: ranks disagree: rank 0 sends float32 rows but rank 1 sends float64"),
    ("trailing shape", lambda: uc.all_gather(None, X), lambda: uc.all_gather(None, X.reshape(6, 2, 1)),
     "rank 0's rows have trailing shape (2,) but rank 1's have (2, 1)"),
    ("operator", lambda: uc.all_gather(None, X), lambda: uc.alltoall_single(None, X),
     "rank 0 calls all_gather but rank 1 calls alltoall_single"),
    ("MoE against another operator", lambda: uc.global_scatter(X, [3, 3], [3, 3]), lambda: uc.all_gather(None, X),
     "rank 0 calls global_scatter but rank 1 calls all_gather"),
    ("experts per rank", lambda: uc.global_scatter(X, [3, 3], [3, 3]), lambda: uc.global_scatter(X, [1, 2, 1, 2], [1, 2, 1, 2]),
     "global_scatter: ranks disagree: rank 0 passes 4 counts or sizes but rank 1 passes 8"),
    ("split sizes", lambda: uc.alltoall_single(None, X, [2, 4], [2, 4]), lambda: uc.alltoall_single(None, X, [5, 1], [5, 1]),
     "alltoall_single: ranks disagree: rank 0 expects 4 row(s) from rank 1, but rank 1 sends 5"),
    ("alltoall rows", lambda: uc.alltoall([np.empty((2, 2), np.float32), np.empty((1, 2), np.float32)], [X[:2], X[2:]]),
     lambda: uc.alltoall([np.empty((4, 2), np.float32), np.empty((3, 2), np.float32)], [X[:3], X[3:]]),
     "alltoall: ranks disagree: rank 0 expects 1 row(s) from rank 1, but rank 1 sends 3"),
    ("alltoall against alltoall_single", lambda: uc.alltoall([], X), lambda: uc.alltoall_single(None, X),
     "rank 0 calls alltoall but rank 1 calls alltoall_single"),
    ("gather rows", lambda: uc.all_gather([np.empty((6, 2), np.float32), np.empty((5, 2), np.float32)], X),
     lambda: uc.all_gather([np.empty((6, 2), np.float32), np.empty((6, 2), np.float32)], X),
     "all_gather: ranks disagree: rank 0 expects 5 row(s) from rank 1, but rank 1 sends 6"),
    ("gather back", lambda: uc.global_gather(X, [2, 1, 1, 2], [3, 0, 2, 1]), lambda: uc.global_gather(X, [3, 0, 2, 1], [2, 1, 1, 2]),
     "global_gather: ranks disagree: rank 0 expects 2 row(s) back from rank 0 for expert 0, but rank 0 returns 3"),
    ("reduction", lambda: uc.all_reduce(X.copy()), lambda: uc.all_reduce(X.copy(), op="max"),
     "all_reduce: ranks disagree: rank 0 reduces with 'sum' over 6 rows but rank 1 reduces with 'max' over 6 rows"),
    ("all_reduce rows", lambda: uc.all_reduce(X.copy()), lambda: uc.all_reduce(X[:4].copy()),
     "rank 0 reduces with 'sum' over 6 rows but rank 1 reduces with 'sum' over 4 rows"),
    ("all_reduce dtype", lambda: uc.all_reduce(X.copy()), lambda: uc.all_reduce(X.astype(np.float64)),
     "all_reduce: ranks disagree: rank 0 sends float32 rows but rank 1 sends float64"),
    ("reduce_scatter blocks", lambda: uc.reduce_scatter(None, X, split_sizes=[2, 4]), lambda: uc.reduce_scatter(None, X),
     "reduce_scatter: ranks disagree: rank 0 reduces with 'sum' blocks of [2, 4] rows but rank 1 "
     "reduces with 'sum' blocks of [3, 3] rows"),
    ("broadcast source", lambda: uc.broadcast(X.copy(), 0), lambda: uc.broadcast(X.copy(), 1),
     "broadcast: ranks disagree: rank 0 broadcasts 6 rows from position 0 but rank 1 broadcasts 6 rows "
     "from position 1"),
    ("reduce destination", lambda: uc.reduce(X.copy(), 0), lambda: uc.reduce(X.copy(), 1),
     "reduce: ranks disagree: rank 0 passes tensor of 6 rows, op='sum', dst=0 but rank 1 passes tensor of 6 rows, "
     "op='sum', dst=1"),
    ("all_reduce against broadcast", lambda: uc.all_reduce(X.copy()), lambda: uc.broadcast(X.copy(), 0),
     "rank 0 calls all_reduce but rank 1 calls broadcast"),
    ("top-k experts per rank", lambda: uc.moe.dispatch(X, TO_EXPERT_0, experts_per_rank=1),
     lambda: uc.moe.dispatch(X, TO_EXPERT_0, experts_per_rank=2),
     "moe.dispatch: ranks disagree: rank 0 passes experts_per_rank=1 but rank 1 passes 2"),
    ("top-k capacity", lambda: uc.moe.dispatch(X, TO_EXPERT_0, experts_per_rank=1),
     lambda: uc.moe.dispatch(X, TO_EXPERT_0, experts_per_rank=1, capacity=2),
     "moe.dispatch: ranks disagree: rank 0 passes capacity=None but rank 1 passes 2"),
    ("top-k combine with another dispatch's handle", lambda: _combine_with_handle(0), lambda: _combine_with_handle(1),
     "moe.combine: ranks disagree: rank 0 passes the handle of the dispatch that was collective number"),
    ("top-k combine with another dispatch's handle of equal counts", lambda: _with_same_counts(uc.moe.combine, 0),
     lambda: _with_same_counts(uc.moe.combine, 1),
     "moe.combine: ranks disagree: rank 0 passes the handle of the dispatch that was collective number"),
    ("top-k redispatch with another dispatch's handle of equal counts", lambda: _with_same_counts(uc.moe.redispatch, 0),
     lambda: _with_same_counts(uc.moe.redispatch, 1),
     "moe.redispatch: ranks disagree: rank 0 passes the handle of the dispatch that was collective number"),
    ("a backward pass on one rank only", lambda: _layer_backward(skips=False), lambda: _layer_backward(skips=True),
     "rank 0 calls moe.combine (backward) but rank 1 calls all_gather"),
    ("the backward passes of two different calls", lambda: _two_backwards(first=0), lambda: _two_backwards(first=1),
     "alltoall_single (backward): ranks disagree: rank 0 is in the backward pass of its collective number"),
]  # fmt: skip

TO_EXPERT_0 = np.zeros((6, 1), np.int64)  # every token of X to expert 0 of rank 0 (E = 1)


def _combine_with_handle(which: int) -> None:
    """Two dispatches on every rank (to rank 0, to rank 1), then a combine with handle ``which``."""
    handles = [uc.moe.dispatch(X, TO_EXPERT_0 + rank, experts_per_rank=1)[2] for rank in (0, 1)]
    uc.moe.combine(np.zeros((handles[which].received, 2), np.float32), handles[which])


def _with_same_counts(op, which: int) -> None:
    """Two dispatches with the same routing (equal counts, as when capacity fills every
    expert), then ``op`` (combine or redispatch) with handle ``which``: before, check mode let it
    through and every rank got the other layer's rows."""
    handles = [uc.moe.dispatch(X + layer, TO_EXPERT_0, experts_per_rank=1)[2] for layer in (0, 1)]
    rows = handles[which].received if op is uc.moe.combine else len(X)
    op(np.zeros((rows, 2), np.float32), handles[which])


def _layer_backward(skips: bool) -> None:
    """A top-k layer's forward and backward, then the next collective; a rank that ``skips``
    takes no backward pass (its loss left alone), so rank 0's backward pairs with its next call
    (before: gloo aborted the process, mpi read the gradient as counts and stalled). (A rank
    whose experts skip every row still takes part: tests/frontend/test_autograd.py.)"""
    x = torch.tensor(X, requires_grad=True)
    gates = torch.ones(len(X), 1, requires_grad=True)
    rows, _, handle = uc.moe.dispatch(x, torch.from_numpy(TO_EXPERT_0), gates, experts_per_rank=1)
    out = uc.moe.combine(rows * 2, handle)
    if not skips:
        out.sum().backward()
    uc.all_gather(None, X)


def _two_backwards(first: int) -> None:
    """Two all-to-alls, then their backward passes in an order that differs across the ranks."""
    xs = [torch.tensor(X * (i + 1), requires_grad=True) for i in range(2)]
    ys = [uc.alltoall_single(None, x) for x in xs]
    torch.autograd.backward(ys[first].sum())
    torch.autograd.backward(ys[1 - first].sum())


def mismatches(rank: int) -> list[str]:
    seen = []
    for _, mine, others, _ in MISMATCHES:
        with pytest.raises(uc.CrossRankMismatchError) as info:
            (mine if rank == 0 else others)()
        seen.append(str(info.value))
        assert uc.all_gather(None, X).shape == (12, 2)  # the world is still in step
    return seen


def async_in_any_order(rank: int) -> str:
    world = uc.get_world_size()
    rng = np.random.default_rng(0)
    local = rng.integers(0, 4, (world, world * 2))
    xs = [rng.standard_normal((int(n), 3)) for n in local.sum(1)]
    glob = reference.global_counts(list(local))
    tasks = {
        "scatter": uc.global_scatter(xs[rank], local[rank], glob[rank], sync_op=False, use_calc_stream=False),
        "alltoall": uc.alltoall_single(None, torch.arange(4.0 * world) + rank, sync_op=False),
        "gather": uc.global_gather(
            reference.global_scatter(xs, list(local))[rank],
            local[rank],
            glob[rank],
            sync_op=False,
            use_calc_stream=False,
        ),
        "all_gather": uc.all_gather(np.empty(world, np.int64), np.array([rank]), sync_op=False),
        "all_reduce": uc.all_reduce(np.full(3, rank + 1.0), sync_op=False),
        "reduce_scatter": uc.reduce_scatter(
            None, np.arange(world * 2.0) + rank, split_sizes=[2] * world, sync_op=False
        ),
        "broadcast": uc.broadcast(torch.tensor([rank]), world - 1, sync_op=False),
    }
    expected = {
        "scatter": reference.global_scatter(xs, list(local))[rank],
        "alltoall": reference.alltoall_single([np.arange(4.0 * world) + r for r in range(world)])[rank],
        "gather": xs[rank],
        "all_gather": np.arange(world),
        "all_reduce": np.full(3, world * (world + 1) / 2),
        "reduce_scatter": world * np.arange(2 * rank, 2 * rank + 2) + world * (world - 1) / 2,
        "broadcast": np.array([world - 1]),
    }
    for name in ("broadcast", "all_gather", "gather", "reduce_scatter", "scatter", "alltoall", "all_reduce"):
        result = tasks[name].wait()
        assert tasks[name].is_completed()
        np.testing.assert_array_equal(np.asarray(result), expected[name], err_msg=name)
        assert tasks[name].wait() is result  # waiting again returns the same result
    return "ok"
