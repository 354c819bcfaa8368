"""Every operator's functional form, sync and async, with its gradient against the whole-world
reference (for unicoll.moe: to the tokens and to the weights): run by test_autograd (gloo),
test_mpi and test_gpu (CUDA)."""

from __future__ import annotations

import numpy as np
import torch

import unicoll as uc
from unicoll import reference

OPS = (
    "global_scatter",
    "global_gather",
    "alltoall_single",
    "alltoall",
    "all_gather",
    "all_reduce",
    "reduce",
    "reduce_scatter",
    "broadcast",
    "moe",
)

#: The reduction of all_reduce, reduce and reduce_scatter, synchronous and not: both differentiable ones.
REDUCTION = {("all_reduce", True): "sum", ("all_reduce", False): "avg", ("reduce", True): "avg",
             ("reduce", False): "sum", ("reduce_scatter", True): "avg", ("reduce_scatter", False): "sum"}  # fmt: skip


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
    elif op in ("alltoall_single", "alltoall"):
        xs_rows, ys = splits.sum(1), None
    elif op in ("all_reduce", "reduce", "broadcast"):
        xs_rows, ys = [int(rows[0])] * world, None
    elif op == "reduce_scatter":
        xs_rows, ys = [int(rows.sum())] * world, None
    else:
        xs_rows, ys = rows, None
    xs = [rng.standard_normal((int(n), 2)) for n in xs_rows]
    if op in ("global_scatter", "global_gather"):
        outs = ys(xs, list(local))
        ws = [rng.standard_normal(o.shape) for o in outs]
        back = reference.global_gather if op == "global_scatter" else reference.global_scatter
        grads = back(ws, list(local))
    elif op in ("alltoall_single", "alltoall"):  # alltoall: x's blocks as a list in, an empty list out
        outs = reference.alltoall_single(xs, list(splits))
        ws = [rng.standard_normal(o.shape) for o in outs]
        grads = reference.alltoall_single(ws, list(splits.T))
    elif op == "all_reduce":  # the gradient of a sum (avg: divided by W)
        ws = [rng.standard_normal(x.shape) for x in xs]
        grads = reference.all_reduce(ws, "sum")
    elif op == "reduce":  # to the middle rank: the gradient of a sum (avg: the middle rank's share divided by W)
        ws = [rng.standard_normal(x.shape) for x in xs]
        grads = reference.reduce_backward(ws, world // 2, "sum")
        return dict(xs=xs, ws=ws, grads=grads, grads_avg=reference.reduce_backward(ws, world // 2, "avg"))
    elif op == "reduce_scatter":
        ws = [rng.standard_normal((int(n), 2)) for n in rows]
        grads = reference.all_gather(ws)
    elif op == "broadcast":  # from the last rank: the sum of every rank's gradient there, zero elsewhere
        ws = [rng.standard_normal(x.shape) for x in xs]
        grads = [np.zeros_like(x) for x in xs[:-1]] + [reference.all_reduce(ws, "sum")[0]]
    else:
        outs = reference.all_gather(xs)
        ws = [rng.standard_normal(o.shape) for o in outs]
        grads = reference.all_gather_backward(ws, rows.tolist())
    return dict(xs=xs, ws=ws, grads=grads, local=local, glob=glob, splits=splits, rows=rows)


def expected_gradient(a: dict, op: str, sync: bool, rank: int, world: int) -> np.ndarray:
    """This rank's input gradient from the whole-world reference (:func:`_world_inputs`): for
    avg the sum's divided by W (reduce's has the avg of its own)."""
    avg = REDUCTION.get((op, sync)) == "avg"
    if op == "reduce":
        return a["grads_avg" if avg else "grads"][rank]
    return a["grads"][rank] / (world if avg else 1)


def forward(op: str, x, a: dict, r: int, sync: bool, concat=torch.cat):
    """The operator ``op`` on this rank's ``x`` (a torch tensor, or another library's array with
    that library's ``concat``), its result waited for when asynchronous."""
    kw = {} if sync else dict(sync_op=False, use_calc_stream=False)
    if op == "global_scatter":
        y = uc.global_scatter(x, a["local"][r], a["glob"][r], **kw)
    elif op == "global_gather":
        y = uc.global_gather(x, a["local"][r], a["glob"][r], **kw)
    elif op == "alltoall_single":
        y = uc.alltoall_single(None, x, a["splits"][:, r], a["splits"][r], **kw)
    elif op == "alltoall":  # the received list, concatenated: the gradient flows through its arrays
        offsets = np.cumsum([0, *a["splits"][r]]).tolist()
        received = uc.alltoall([], [x[offsets[c] : offsets[c + 1]] for c in range(len(offsets) - 1)], **kw)
        return concat(received if sync else received.wait())
    elif op == "all_reduce":  # in place: on a result of x, not on the leaf x
        y = uc.all_reduce(x * 1, REDUCTION[op, sync], **kw)
    elif op == "reduce":  # in place, on a result of x; dst: the middle rank
        y = uc.reduce(x * 1, len(a["xs"]) // 2, REDUCTION[op, sync], **kw)
    elif op == "reduce_scatter":
        y = uc.reduce_scatter(None, x, REDUCTION[op, sync], a["rows"], **kw)
    elif op == "broadcast":
        y = uc.broadcast(x * 1, len(a["xs"]) - 1, **kw)
    else:
        y = uc.all_gather(None, x, **kw)
    return y if sync else y.wait()


def _moe_world(world: int, seed: int) -> dict:
    """Top-2 routing (a fifth of the slots dropped, E = 2) and what moe.dispatch, experts that
    multiply the n-th row they receive by n, and moe.combine give, with the gradients of
    ``sum(out * ws)`` to x and to the weights, all from the whole-world reference: the
    gradient to x[t] is ``ws[t] * sum_j w[t, j] f(t, j)``, to w[t, j] it is
    ``f(t, j) * (x[t] . ws[t])``, with f(t, j) the factor slot (t, j)'s row met (0 if dropped)."""
    rng = np.random.default_rng(seed)
    experts, k = 2, 2
    tokens = rng.integers(0, 5, world)
    ids = [np.where(rng.random((t, k)) < 0.2, -1, rng.integers(0, world * experts, (t, k))) for t in tokens]
    xs = [rng.standard_normal((t, 2)) for t in tokens]
    weights = [rng.standard_normal((t, k)) for t in tokens]
    rows, _ = reference.moe_dispatch(xs, ids, experts)
    factors = [np.arange(1.0, len(r) + 1)[:, None] for r in rows]
    outs = reference.moe_combine([r * f for r, f in zip(rows, factors)], ids, experts, weights)
    ws = [rng.standard_normal(o.shape) for o in outs]
    per_slot = [
        np.concatenate([reference.moe_combine(factors, ids, experts, [np.eye(k)[[j] * t] for t in tokens])[r]
                        for j in range(k)], axis=1)
        for r in range(world)
    ]  # fmt: skip
    grads_x = [(s * w).sum(1, keepdims=True) * g for s, w, g in zip(per_slot, weights, ws)]
    grads_w = [s * (x * g).sum(1, keepdims=True) for s, x, g in zip(per_slot, xs, ws)]
    return dict(xs=xs, ids=ids, weights=weights, outs=outs, ws=ws, grads_x=grads_x, grads_w=grads_w, experts=experts)


def _moe_gradients(rank: int, world: int, device: str, sync: bool, seed: int) -> None:
    """dispatch, experts, combine (sync or async): the output and both gradients against the reference."""
    a = _moe_world(world, seed)
    tensor = lambda v: torch.tensor(v, device=device)  # noqa: E731
    x, w = tensor(a["xs"][rank]).requires_grad_(), tensor(a["weights"][rank]).requires_grad_()
    dispatched = uc.moe.dispatch(x, tensor(a["ids"][rank]), w, experts_per_rank=a["experts"], sync_op=sync)
    rows, _, handle = dispatched if sync else dispatched.wait()
    factors = torch.arange(1.0, rows.shape[0] + 1, device=device, dtype=rows.dtype)[:, None]
    combined = uc.moe.combine(rows * factors, handle, sync_op=sync)
    out = combined if sync else combined.wait()
    (out * tensor(a["ws"][rank])).sum().backward()
    torch.testing.assert_close(out, tensor(a["outs"][rank]))
    torch.testing.assert_close(x.grad, tensor(a["grads_x"][rank]))
    torch.testing.assert_close(w.grad, tensor(a["grads_w"][rank]))


def gradients(rank: int, device: str = "cpu") -> dict[str, str]:
    """Each operator, sync and async: this rank's input gradient against the reference."""
    world = uc.get_world_size()
    report = {}
    for index, op in enumerate(OPS):
        for sync in (True, False):
            if op == "moe":
                _moe_gradients(rank, world, device, sync, seed=index)
                report[f"{op}-{'sync' if sync else 'async'}"] = "ok"
                continue
            a = _world_inputs(op, world, seed=index)
            x = torch.tensor(a["xs"][rank], device=device, requires_grad=True)
            y = forward(op, x, a, rank, sync)
            assert y.grad_fn is not None, f"{op}: result has no grad_fn"
            assert y.device == x.device, f"{op}: result on {y.device}"
            (y * torch.tensor(a["ws"][rank], device=device)).sum().backward()
            expected = expected_gradient(a, op, sync, rank, world)
            torch.testing.assert_close(x.grad, torch.tensor(expected, device=device))
            report[f"{op}-{'sync' if sync else 'async'}"] = "ok"
    return report
