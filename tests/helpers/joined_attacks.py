"""Hostile callers on the joined libraries' path (Paddle tensors, JAX arrays), on real
processes: a training loop with new routing every step whose results stay right and whose
resident memory stays flat, a second thread refused while the first is inside an operator,
outputs that alias inputs, a dropped Task, and a graph and a handle of an ended session."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import numpy as np

import unicoll as uc
from helpers.frameworks import raised
from helpers.signals import send, wait_for
from unicoll import carry, entry
from unicoll.arrays import library_of

SOAK_STEPS, SOAK_WARMUP = 40, 10
TOKENS, HIDDEN, K, EXPERTS = 512, 128, 2, 2


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def _routing(rng: np.random.Generator, world: int) -> tuple[np.ndarray, ...]:
    """New tokens, top-k expert ids (a fifth of the slots dropped, -1) and weights."""
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    ids = np.where(rng.random((TOKENS, K)) < 0.2, -1, rng.integers(0, world * EXPERTS, (TOKENS, K)))
    weights = rng.random((TOKENS, K)).astype(np.float32)
    return x, ids, weights


def _expected_grads(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, ...]:
    """The gradients of ``sum(g * combine(2 * dispatch(x, ids, weights)))``: each kept slot
    adds ``2 w`` times its token, so x gets ``2 g sum(w)`` and each kept weight ``2 x.g``."""
    kept = ids >= 0
    grad_x = 2 * (weights * kept).sum(1, keepdims=True) * g
    grad_w = 2 * kept * (x * g).sum(1, keepdims=True)
    return grad_x, grad_w


def _paddle_step(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, ...]:
    import paddle

    xt = paddle.to_tensor(x, stop_gradient=False)
    wt = paddle.to_tensor(weights, stop_gradient=False)
    rows, _, handle = uc.moe.dispatch(xt, paddle.to_tensor(ids), wt, experts_per_rank=EXPERTS)
    (uc.moe.combine(rows * 2.0, handle) * paddle.to_tensor(g)).sum().backward()
    return xt.grad.numpy(), wt.grad.numpy()


def _jax_step(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, ...]:
    import jax

    ids_j, g_j = jax.device_put(ids.astype(np.int32)), jax.device_put(g)

    def loss(xj, wj):
        rows, _, handle = uc.moe.dispatch(xj, ids_j, wj, experts_per_rank=EXPERTS)
        return (uc.moe.combine(rows, handle) * 2.0 * g_j).sum()  # rows vary in shape: no arithmetic on them

    grads = jax.grad(loss, argnums=(0, 1))(jax.device_put(x), jax.device_put(weights))
    return tuple(np.asarray(grad) for grad in grads)


def soak(rank: int, library: str) -> dict[str, int]:
    """Top-2 dispatch and combine with new tokens and routing every step, differentiated by the
    library's own autograd: every gradient right, resident memory flat, and no handle's
    weights kept once the step's graph is gone."""
    step_of = {"paddle": _paddle_step, "jax": _jax_step}[library]
    rng = np.random.default_rng(7 + rank)
    world = uc.get_world_size()
    g = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    baseline = peak = right = 0
    for step in range(SOAK_STEPS):
        x, ids, weights = _routing(rng, world)
        grads = step_of(x, ids, weights, g)
        for got, expected in zip(grads, _expected_grads(x, ids, weights, g)):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4, err_msg=f"step {step}")
        right += 1
        if step == SOAK_WARMUP:
            baseline = _rss_bytes()
        elif step > SOAK_WARMUP:
            peak = max(peak, _rss_bytes())
    gc.collect()
    return {"right": right, "growth": peak - baseline, "handles_kept": len(carry._handle_weights)}


def _array(library: str, values: list[float]):
    """``values`` as a float32 array of ``library``."""
    if library == "paddle":
        import paddle

        return paddle.to_tensor(np.asarray(values, np.float32))
    import jax

    return jax.device_put(np.asarray(values, np.float32))


def threads(rank: int, library: str, signal: str) -> dict[str, object]:
    """Rank 0's worker thread sits inside all_gather of the library's arrays while rank 0's main
    thread calls alltoall_single on them: refused at once, while the worker is still inside (its
    peers' workers join only once rank 0 sends ``signal``, a path of helpers/signals.py), naming
    both threads; the worker's result is right."""
    results: dict[str, object] = {}

    def gather() -> None:
        gathered = uc.all_gather(None, _array(library, [float(rank)]))
        results["gathered"] = (library_of(gathered), np.asarray(gathered).tolist())

    worker = threading.Thread(target=gather, name="worker")
    if rank == 0:
        worker.start()
        while not entry._lock.locked():  # the worker is inside all_gather, which waits for its peers
            time.sleep(0.001)
        results["main"] = raised(lambda: uc.alltoall_single(None, _array(library, [1.0, 2.0])))
        results["worker_inside"] = worker.is_alive()
        send(signal)
    else:
        wait_for(signal)
        worker.start()
    worker.join()
    return results


def aliasing_and_tasks(rank: int) -> dict[str, object]:
    """Paddle: an output that is the input gives the right answer; a Task dropped unwaited
    leaves the next call right; a Task's wait() hands back the caller's tensor."""
    import paddle

    world = uc.get_world_size()
    x = paddle.to_tensor(np.arange(world * 2, dtype=np.float32) + 100 * rank)
    expected = np.concatenate(
        [np.arange(2 * rank, 2 * rank + 2, dtype=np.float32) + 100 * peer for peer in range(world)]
    )
    same = uc.alltoall_single(x, x)
    task = uc.all_reduce(paddle.ones([3]), sync_op=False)
    del task
    gc.collect()
    y = paddle.full([3], float(rank + 1))
    waited = uc.all_reduce(y, sync_op=False).wait()
    return {
        "aliased_is_x": same is x,
        "aliased_right": x.numpy().tolist() == expected.tolist(),
        "after_dropped_task": y.numpy().tolist(),
        "waited_is_y": waited is y,
    }


def stale_session(rank: int, backend: str) -> dict[str, str]:
    """A Paddle graph and a handle made in a session that finalize() ended: backward() and
    combine raise the ended session's error; the new session's calls are right."""
    import paddle

    x = paddle.to_tensor(np.ones((4, 2), np.float32), stop_gradient=False)
    ids = paddle.to_tensor(np.zeros((4, 1), np.int64))
    rows, _, handle = uc.moe.dispatch(x, ids, experts_per_rank=1)
    graph = uc.all_reduce(x * 1.0)
    uc.finalize()
    uc.init(backend)
    seen = {
        "backward": raised(lambda: graph.sum().backward()),
        "combine": raised(lambda: uc.moe.combine(rows, handle)),
        "after": np.asarray(uc.all_reduce(paddle.ones([2])).numpy()).tolist(),
    }
    return seen


def disagreement(rank: int, library: str) -> dict[str, object]:
    """In check mode: ranks whose counts disagree (rank 1 expects one row more from rank 0
    than rank 0 sends) get the same error on every rank, before anything is sent; NaN and inf
    pass through a max; the next call is right."""
    world, experts = uc.get_world_size(), 2
    local = np.ones(world * experts, np.int64)
    glob = np.asarray(uc.exchange_counts(local))
    if rank == 1:
        glob[0] += 1
    x = _array(library, [float(v) for v in range(int(local.sum()) * 2)]).reshape(-1, 2)
    return {
        "mismatch": raised(lambda: uc.global_scatter(x, local, glob)).split(":")[0],
        "nan max": np.asarray(uc.all_reduce(_array(library, [np.nan, 1.0, np.inf]), op="max")).tolist(),
        "after": np.asarray(uc.all_reduce(_array(library, [1.0]))).tolist(),
    }
