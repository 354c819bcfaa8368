"""Verification on CUDA (where a GPU is lent): every operator and the MoE step, checked on every
call, under ``torch.cuda.set_sync_debug_mode("error")`` (any host synchronization raises but the
one read of the gathered records each checked call declares, through ``read_ints``), with the
results of the same calls unverified. One rank: NCCL refuses two ranks on one GPU (the checks'
logic with two ranks runs over gloo, tests/processes/test_integrity.py)."""

from __future__ import annotations

import pytest
import torch

import unicoll as uc
from helpers.gpu_backends import params


def _inputs(step: int) -> tuple[torch.Tensor, ...]:
    """Rows, expert ids and weights on CUDA (made before the watch begins: an upload waits)."""
    generator = torch.Generator(device="cuda").manual_seed(step)
    x = torch.randn(6, 4, device="cuda", generator=generator)
    ids = torch.tensor([[0, 2], [1, -1], [2, 0], [1, 1], [0, 2], [2, 1]], device="cuda")
    return x, ids, torch.rand(6, 2, device="cuda", generator=generator)


def _calls(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> list[torch.Tensor]:
    """Each data operator once, and the MoE step with its backward pass."""
    tokens = x.clone().requires_grad_()
    rows, _, handle = uc.moe.dispatch(tokens, ids, weights, experts_per_rank=3)
    out = uc.moe.combine(rows * 2, handle)
    out.sum().backward()
    return [
        uc.alltoall_single(None, x),
        uc.all_gather(None, x),
        uc.all_reduce(x.clone()),
        uc.reduce_scatter(None, x.clone()),
        uc.broadcast(x.clone(), 0),
        out.detach(),
        tokens.grad,
    ]


def verified_on_cuda(rank: int, backend: str) -> dict[str, object]:
    torch.cuda.set_device(0)
    plain = _calls(*_inputs(0))
    uc.finalize()
    uc.init(backend, verify=True)
    _calls(*_inputs(1))  # the first calls build what later ones reuse (kernels, communicators)
    inputs = _inputs(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        checked = _calls(*inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"same": [torch.equal(a, b) for a, b in zip(checked, plain)]}


@pytest.mark.parametrize("backend", params())
def test_verified_calls_on_a_gpu_wait_only_to_read_their_records(backend: str) -> None:
    (report,) = uc.testing.spawn(verified_on_cuda, 1, backend, backend=backend, timeout=300)
    assert report["same"] == [True] * 7
