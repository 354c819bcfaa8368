"""Gradients through every operator's functional form, against the whole-world reference.

Each rank takes ``loss = sum(y * w)`` with its own random ``w``, so the input gradient on
every rank is the operator's backward applied to every rank's ``w``; the reference computes
that with numpy on the whole world.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import unicoll as uc
from unicoll import reference

WORLD = 3
OPS = ("global_scatter", "global_gather", "alltoall_single", "all_gather")


def _world_inputs(op: str, world: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    experts = 2
    local = rng.integers(0, 4, (world, world * experts))
    local[0] = 0  # a rank that sends nothing
    glob = np.stack(reference.global_counts(list(local)))
    splits = rng.integers(0, 4, (world, world))
    rows = rng.integers(0, 4, world)
    if op == "global_scatter":
        xs_rows, ys = local.sum(1), reference.global_scatter
    elif op == "global_gather":
        xs_rows, ys = glob.sum(1), reference.global_gather
    elif op == "alltoall_single":
        xs_rows, ys = splits.sum(1), None
    else:
        xs_rows, ys = rows, None
    xs = [rng.standard_normal((int(n), 2)) for n in xs_rows]
    if op in ("global_scatter", "global_gather"):
        outs = ys(xs, list(local))
        ws = [rng.standard_normal(o.shape) for o in outs]
        back = reference.global_gather if op == "global_scatter" else reference.global_scatter
        grads = back(ws, list(local))
    elif op == "alltoall_single":
        outs = reference.alltoall_single(xs, list(splits))
        ws = [rng.standard_normal(o.shape) for o in outs]
        grads = reference.alltoall_single(ws, list(splits.T))
    else:
        outs = reference.all_gather(xs)
        ws = [rng.standard_normal(o.shape) for o in outs]
        grads = reference.all_gather_backward(ws, rows.tolist())
    return dict(xs=xs, ws=ws, grads=grads, local=local, glob=glob, splits=splits)


def _forward(op: str, x: torch.Tensor, a: dict, r: int, sync: bool):
    kw = {} if sync else dict(sync_op=False, use_calc_stream=False)
    if op == "global_scatter":
        y = uc.global_scatter(x, a["local"][r], a["glob"][r], **kw)
    elif op == "global_gather":
        y = uc.global_gather(x, a["local"][r], a["glob"][r], **kw)
    elif op == "alltoall_single":
        y = uc.alltoall_single(None, x, a["splits"][:, r], a["splits"][r], **kw)
    else:
        y = uc.all_gather(None, x, **kw)
    return y if sync else y.wait()


def gradients(rank: int, device: str = "cpu") -> dict[str, str]:
    """Each operator, sync and async: this rank's input gradient against the reference."""
    world = uc.get_world_size()
    report = {}
    for index, op in enumerate(OPS):
        for sync in (True, False):
            a = _world_inputs(op, world, seed=index)
            x = torch.tensor(a["xs"][rank], device=device, requires_grad=True)
            y = _forward(op, x, a, rank, sync)
            assert y.grad_fn is not None, f"{op}: result has no grad_fn"
            assert y.device == x.device, f"{op}: result on {y.device}"
            (y * torch.tensor(a["ws"][rank], device=device)).sum().backward()
            torch.testing.assert_close(x.grad, torch.tensor(a["grads"][rank], device=device))
            report[f"{op}-{'sync' if sync else 'async'}"] = "ok"
    return report


def test_gradients_match_the_reference() -> None:
    reports = uc.testing.spawn(gradients, WORLD, backend="gloo")
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


def test_round_trip_gradient() -> None:
    for grads in uc.testing.spawn(round_trip_gradient, 2, backend="gloo"):
        assert grads == pytest.approx([18.0] * len(grads))


def test_no_graph_without_requires_grad() -> None:
    uc.init("gloo")
    try:
        assert uc.global_scatter(torch.ones(2, 1), [2], [2]).grad_fn is None
        with torch.no_grad():
            assert uc.all_gather(None, torch.ones(2, 1, requires_grad=True)).grad_fn is None
    finally:
        uc.finalize()
