"""Every operator's functional form, sync and async, with its gradient against the whole-world
reference: run by test_autograd (gloo), test_mpi and test_gpu (CUDA)."""

from __future__ import annotations

import numpy as np
import torch

import unicoll as uc
from unicoll import reference

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
