"""Tensors unicoll writes in place, as autograd sees them: every one is marked modified.

A tensor that autograd saved for a backward pass and that an operator then overwrites must
make that backward pass raise, as after ``x.add_(1)``, on every backend alike; before, the
version counter did not move and ``backward()`` silently used the new values. An output that
requires grad is refused before anything is sent (an output filled in place records no
gradient), and so are output lists autograd cannot fill. The cases run on 2 ranks of gloo and
mpi in the session's shared worlds (helpers/several.py).
"""

from __future__ import annotations

import pytest
import torch

import unicoll as uc
from helpers.several import SESSION, Case, share

STALE = "modified by an inplace operation"
"""What torch's backward says of a saved tensor that changed after it was saved."""


def _writers(rank: int) -> dict:
    """Each operator that writes a tensor the caller passed: ``write(buf)`` on both ranks."""
    x = torch.full((2, 1), float(rank + 1))
    return {
        "alltoall_single": lambda buf: uc.alltoall_single(buf, x),
        "alltoall (one array)": lambda buf: uc.alltoall(buf, x),
        "all_reduce": lambda buf: uc.all_reduce(buf),
        "broadcast": lambda buf: uc.broadcast(buf, 1),
        "reduce": lambda buf: uc.reduce(buf, 0),
        "all_gather (one array)": lambda buf: uc.all_gather(buf, x),
        "reduce_scatter": lambda buf: uc.reduce_scatter(buf, torch.ones(4, 1)),
        "all_reduce (async)": lambda buf: uc.all_reduce(buf, sync_op=False).wait(),
    }


def saved_then_written(rank: int) -> dict[str, str]:
    """For each operator: ``loss = (a * buf).sum()`` saves ``buf``; the operator overwrites it;
    ``loss.backward()`` must raise torch's error, never return the gradient of the new values."""
    outcomes = {}
    for name, write in _writers(rank).items():
        size = 4 if name.startswith("all_gather") else 2
        buf = torch.full((size, 1), 3.0)
        a = torch.ones(size, 1, requires_grad=True)
        loss = (a * buf).sum()
        write(buf)
        try:
            loss.backward()
        except RuntimeError as exc:
            outcomes[name] = "stale" if STALE in str(exc) else f"other error: {exc}"
        else:
            outcomes[name] = f"a.grad {a.grad.flatten().tolist()}"
    return outcomes


def outputs_that_require_grad(rank: int) -> dict[str, str]:
    """An output that requires grad, a leaf and not, refused before anything is sent (the next
    call is right on both ranks); the same output under torch.no_grad() is filled."""
    x = torch.full((2, 1), float(rank + 1))
    leaf = torch.zeros(2, 1, requires_grad=True)
    calls = {
        "alltoall_single leaf": lambda: uc.alltoall_single(leaf, x),
        "alltoall_single non-leaf": lambda: uc.alltoall_single(leaf * 1, x),
        "alltoall one array": lambda: uc.alltoall(leaf * 1, x),
        "all_gather one array": lambda: uc.all_gather(torch.zeros(4, 1, requires_grad=True) * 1, x),
        "reduce_scatter": lambda: uc.reduce_scatter(torch.zeros(1, 1, requires_grad=True), x),
        "alltoall list leaf": lambda: uc.alltoall([leaf[:1].detach().requires_grad_(), torch.zeros(1, 1)], x),
        "all_gather list leaf": lambda: uc.all_gather([torch.zeros(2, 1, requires_grad=True), torch.zeros(2, 1)], x),
        "alltoall list overlapping": lambda: uc.alltoall(list(torch.zeros(1, 1).expand(2, 1).split(1)), x),
        "all_gather list overlapping": lambda: uc.all_gather([torch.zeros(2, 1)] * 2, x),
    }
    outcomes = {}
    for name, call in calls.items():
        try:
            call()
        except ValueError as exc:
            outcomes[name] = str(exc)
        else:
            outcomes[name] = "accepted"
    assert uc.all_reduce(torch.ones(1)).item() == 2.0  # the ranks are in step
    with torch.no_grad():
        outcomes["under no_grad"] = str(uc.alltoall_single(leaf, x).flatten().tolist())
    return outcomes


WORLDS = {
    backend: share(
        backend,
        2,
        [
            Case("in place: saved then written", saved_then_written),
            Case("in place: outputs", outputs_that_require_grad),
        ],
    )
    for backend in ("gloo", "mpi")
}


@pytest.mark.parametrize("backend", WORLDS)
def test_a_saved_tensor_written_in_place_fails_backward(backend: str) -> None:
    for outcomes in SESSION.results(WORLDS[backend], "in place: saved then written"):
        assert outcomes == dict.fromkeys(outcomes, "stale")


@pytest.mark.parametrize("backend", WORLDS)
def test_outputs_that_require_grad_are_refused(backend: str) -> None:
    for outcomes in SESSION.results(WORLDS[backend], "in place: outputs"):
        assert outcomes.pop("under no_grad") == "[1.0, 2.0]"
        for name, message in outcomes.items():
            assert message != "accepted", name
            assert "that requires grad" in message or "overlapping entry" in message, (name, message)
        assert outcomes["alltoall_single leaf"].startswith("alltoall_single: out_tensor: expected a tensor that")
        assert outcomes["alltoall list leaf"].startswith("alltoall: out_tensor_or_tensor_list[0]: expected")
        assert outcomes["all_gather list overlapping"].startswith(
            "all_gather: tensor_or_tensor_list[1]: expected arrays that do not share memory"
        )
