"""Gradients through every operator's functional form, against the whole-world reference.

Each rank takes ``loss = sum(y * w)`` with its own random ``w``, so the input gradient on
every rank is the operator's backward applied to every rank's ``w``; the reference computes
that with numpy on the whole world. The multi-rank cases run in the session's shared gloo
worlds (helpers/several.py).
"""

from __future__ import annotations

import pytest
import torch

import unicoll as uc
from helpers.gradients import OPS, gradients
from helpers.several import SESSION, Case, share

WORLD = 3


def test_gradients_match_the_reference() -> None:
    reports = SESSION.results(GRADIENTS, "autograd: gradients")
    assert all(len(r) == 2 * len(OPS) and set(r.values()) == {"ok"} for r in reports)


def round_trip_gradient(rank: int) -> list[float]:
    """An MoE layer's shape: scatter, a per-row function, gather; d/dx of sum(gather(scatter(x))^2)."""
    lc = torch.tensor([[2, 1, 0, 3], [1, 1, 2, 0]][rank])
    gc = uc.exchange_counts(lc)
    x = (torch.arange(1.0, float(lc.sum()) + 1) + 10 * rank).reshape(-1, 1).requires_grad_()
    y = uc.global_gather(uc.global_scatter(x, lc, gc) * 3.0, lc, gc)
    y.pow(2).sum().backward()
    torch.testing.assert_close(y.detach(), 3.0 * x.detach())
    return (x.grad / x.detach()).flatten().tolist()  # d(9 x^2)/dx / x == 18


GRADIENTS = share("gloo", WORLD, [Case("autograd: gradients", gradients)])
ROUND_TRIP = share("gloo", 2, [Case("autograd: round trip", round_trip_gradient)])


def test_round_trip_gradient() -> None:
    for grads in SESSION.results(ROUND_TRIP, "autograd: round trip"):
        assert grads == pytest.approx([18.0] * len(grads))


def experts_that_skip_every_row(rank: int) -> dict:
    """Both ranks route every token to rank 0's expert, so rank 1's receive no row, and rank 1's
    experts, as transformers' eager experts code does, skip an expert without rows: its outputs
    are made without the rows (zeros). Per mode (dynamic, static) and weights (none, given): x's
    and the weights' gradients, and whether the combine's result records a gradient. Before,
    rank 1 skipped combine's and dispatch's backward collectives (its result recorded none
    unweighted; weighted, dispatch's node was never reached) and rank 0 waited for them."""
    got = {}
    for mode in ("dynamic", "static"):
        for weighted in (False, True):
            ids = torch.zeros(4, 1, dtype=torch.int64)
            x = torch.arange(8.0).reshape(4, 2).requires_grad_()
            w = torch.full((4, 1), 2.0, requires_grad=True) if weighted else None
            if mode == "static":
                rows, _, handle = uc.moe.dispatch_static(x, ids, w, experts_per_rank=1, capacity=4)
            else:
                rows, _, handle = uc.moe.dispatch(x, ids, w, experts_per_rank=1)
            y = (
                torch.zeros(*rows.shape[:-1], 3)
                if rank == 1
                else rows.sum(-1, keepdim=True).expand(*rows.shape[:-1], 3)
            )
            out = uc.moe.combine_static(y, handle) if mode == "static" else uc.moe.combine(y, handle)
            recorded = out.requires_grad
            out.sum().backward()
            got[mode, weighted] = (recorded, x.grad.tolist(), None if w is None else w.grad.tolist())
    return got


SKIPPED = {backend: share(backend, 2, [Case("autograd: skipped rows", experts_that_skip_every_row)])
           for backend in ("gloo", "mpi")}  # fmt: skip


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_experts_that_skip_every_row_still_take_part_in_the_backward_pass(backend: str) -> None:
    reports = SESSION.results(SKIPPED[backend], "autograd: skipped rows")
    for rank, report in enumerate(reports):
        for (mode, weighted), (recorded, x_grad, w_grad) in report.items():
            scale = 2.0 if weighted else 1.0
            assert recorded, (rank, mode, weighted)
            assert x_grad == [[3 * scale] * 2] * 4, (rank, mode, weighted)  # 3 outputs, each the row's sum
            assert w_grad == (None if not weighted else [[3.0 * (4 * t + 1)] for t in range(4)]), (rank, mode)


def test_no_graph_without_requires_grad() -> None:
    uc.init("gloo")
    try:
        assert uc.global_scatter(torch.ones(2, 1), [2], [2]).grad_fn is None
        with torch.no_grad():
            assert uc.all_gather(None, torch.ones(2, 1, requires_grad=True)).grad_fn is None
    finally:
        uc.finalize()


def test_every_data_operator_has_a_gradient_case() -> None:
    """helpers.gradients.OPS covers every operator of the backends' tables (the specs), and the
    top-k operators as "moe"."""
    from unicoll.spec import OPS as SPEC_OPS

    assert set(OPS) == {*SPEC_OPS, "moe"}
