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
