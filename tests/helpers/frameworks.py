"""Cases for Paddle tensors and JAX arrays on real processes: every differentiable operator's
gradient through the library's own autograd against the whole-world reference (the inputs of
helpers.gradients), docs/semantics.md's worked examples written with Paddle tensors, a small
top-k MoE layer trained with JAX inside jax.jit against a dense single-process model, and the
errors of jitted steps, with the rank program of a world whose peer exits mid-step."""

from __future__ import annotations

import json
import os

import numpy as np

import unicoll as uc
from helpers.gradients import OPS, _moe_world, _world_inputs, expected_gradient, forward

# -- Paddle ------------------------------------------------------------------------------------


def paddle_gradients(rank: int) -> dict[str, str]:
    """Each operator, sync and async, on paddle.Tensor: the result's type and this rank's
    gradient (Paddle's backward()) against the reference; moe.dispatch and combine to the
    tokens and the weights."""
    import paddle

    world, report = uc.get_world_size(), {}
    for index, op in enumerate(OPS):
        for sync in (True, False):
            name = f"{op}-{'sync' if sync else 'async'}"
            if op == "moe":
                a = _moe_world(world, index)
                x = paddle.to_tensor(a["xs"][rank], stop_gradient=False)
                w = paddle.to_tensor(a["weights"][rank], stop_gradient=False)
                ids = paddle.to_tensor(a["ids"][rank])
                dispatched = uc.moe.dispatch(x, ids, w, experts_per_rank=a["experts"], sync_op=sync)
                rows, _, handle = dispatched if sync else dispatched.wait()
                factors = paddle.arange(1, rows.shape[0] + 1, dtype=rows.dtype).reshape([-1, 1])
                combined = uc.moe.combine(rows * factors, handle, sync_op=sync)
                out = combined if sync else combined.wait()
                (out * paddle.to_tensor(a["ws"][rank])).sum().backward()
                np.testing.assert_allclose(out.numpy(), a["outs"][rank], rtol=1e-6, atol=1e-9)
                np.testing.assert_allclose(x.grad.numpy(), a["grads_x"][rank], rtol=1e-6, atol=1e-9)
                np.testing.assert_allclose(w.grad.numpy(), a["grads_w"][rank], rtol=1e-6, atol=1e-9)
                report[name] = "ok"
                continue
            a = _world_inputs(op, world, seed=index)
            x = paddle.to_tensor(a["xs"][rank], stop_gradient=False)
            y = forward(op, x, a, rank, sync, paddle.concat)
            assert isinstance(y, paddle.Tensor) and not y.stop_gradient, f"{name}: {type(y)} records no gradient"
            (y * paddle.to_tensor(a["ws"][rank])).sum().backward()
            expected = expected_gradient(a, op, sync, rank, world)
            np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-6, atol=1e-9, err_msg=name)
            report[name] = "ok"
    return report


# docs/semantics.md, global_scatter's worked example: W=2, n_expert=2, values are row labels
X = [[0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0, 14.0]]
LOCAL = [[1, 0, 2, 1], [0, 2, 1, 2]]
GLOBAL = [[1, 0, 0, 2], [2, 1, 1, 2]]
SCATTERED = [[0.0, 10.0, 11.0], [1.0, 2.0, 12.0, 3.0, 13.0, 14.0]]


def paddle_worked_examples(rank: int) -> dict[str, list]:
    """docs/semantics.md's examples with paddle.Tensor: global_scatter and global_gather with
    n_expert=2 (values, and the gradient of a doubled round trip: 2 everywhere), and
    alltoall_single with split sizes and without (even), into a given tensor and a new one."""
    import paddle

    x = paddle.to_tensor([[v] for v in X[rank]], stop_gradient=False)
    local = paddle.to_tensor(LOCAL[rank], dtype="int64")
    glob = uc.exchange_counts(local)
    y = uc.global_scatter(x, local, glob)
    back = uc.global_gather(y * 2, local, glob)
    back.sum().backward()
    leaf = paddle.to_tensor(X[rank], stop_gradient=False)
    splits = [[1, 3], [2, 3]][rank]  # rank r sends splits[c] rows to rank c
    received = [[1, 2], [3, 3]][rank]
    uneven = uc.alltoall_single(None, leaf, out_split_sizes=received, in_split_sizes=splits)
    (uneven * 3).sum().backward()
    even_in = paddle.arange(4, dtype="float32") + 10 * rank
    even_out = paddle.zeros([4])
    returned = uc.alltoall_single(even_out, even_in)
    return dict(
        global_count=glob.numpy().tolist(),
        scattered=y.numpy().ravel().tolist(),
        types=[type(t).__name__ for t in (glob, y, back, uneven, returned)],
        gathered=back.numpy().ravel().tolist(),
        grad=x.grad.numpy().ravel().tolist(),
        uneven=uneven.numpy().tolist(),
        uneven_grad=leaf.grad.numpy().tolist(),
        even=even_out.numpy().tolist(),
        filled_in_place=returned is even_out,
    )


def raised(call) -> str:
    """The error ``call()`` raised, as ``Type: message``, or "returned"."""
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "returned"


def paddle_errors_and_in_place(rank: int) -> dict[str, object]:
    """Bad Paddle calls, each refused before anything is sent (the messages they raise); an
    all_reduce that fills the caller's tensor, recorded in Paddle's autograd; a Task whose
    wait() hands back a Paddle tensor."""
    import jax
    import paddle
    import torch

    x = paddle.ones([4, 2])
    leaf = paddle.ones([3], dtype="float32")
    leaf.stop_gradient = False
    torch_ids = torch.zeros((4, 1), dtype=torch.int64)
    seen: dict[str, object] = {
        "float counts": raised(lambda: uc.global_scatter(x, paddle.ones([1]).expand([4]), [4])),
        "scalar x": raised(lambda: uc.global_scatter(paddle.to_tensor(1.0), [1], [1])),
        "leaf in place": raised(lambda: uc.all_reduce(leaf)),
        "two libraries": raised(lambda: uc.global_scatter(x, jax.device_put(np.array([4])), [4])),
        "torch ids": raised(lambda: uc.moe.dispatch_static(x, torch_ids, experts_per_rank=1, capacity=4)),
        "missing": raised(lambda: uc.moe.dispatch(x, paddle.zeros([4, 1], dtype="int64"))),
        "twice": raised(lambda: uc.all_reduce(x, tensor=x)),
        "unknown": raised(lambda: uc.alltoall_single(None, x, splits=[2, 2])),
    }
    with paddle.no_grad():
        seen["no_grad is leaf"] = uc.all_reduce(leaf) is leaf
    seen["no_grad values"] = leaf.numpy().tolist()
    grown = paddle.to_tensor([1.0, 2.0], stop_gradient=False)
    y = grown * 3
    seen["in place is y"] = uc.all_reduce(y) is y
    seen["in place values"] = y.numpy().tolist()
    (y * y).sum().backward()
    seen["in place grad"] = grown.grad.numpy().tolist()
    seen["saved, then written"] = {}  # a tensor a backward saved, then written by an operator
    for name, write in {
        "all_reduce": lambda buf: uc.all_reduce(buf),
        "broadcast": lambda buf: uc.broadcast(buf, 1),
        "alltoall_single": lambda buf: uc.alltoall_single(buf, paddle.ones([2])),
        "all_gather": lambda buf: uc.all_gather([buf, paddle.zeros([2])], paddle.ones([2])),
        "saved non-leaf": lambda buf: uc.all_reduce(buf),
    }.items():
        a = paddle.to_tensor([1.0, 2.0], stop_gradient=False)
        buf = paddle.to_tensor([3.0, 3.0], stop_gradient=name != "saved non-leaf") * 1.0
        loss = (a * buf).sum()
        write(buf)
        seen["saved, then written"][name] = raised(loss.backward)
    gathered = uc.all_gather(None, paddle.to_tensor([[rank, 6]], dtype="int32"), sync_op=False).wait()
    seen["task"] = (type(gathered).__name__, str(gathered.dtype), gathered.numpy().tolist())
    return seen


def paddle_backward_twice(rank: int) -> dict[str, object]:
    """backward(retain_graph=True) twice through all_gather: the first gradient, the second
    backward's error (Paddle 3.3.1's PyLayer crashes the process there unless refused), and a
    new graph's gradient after it."""
    import paddle

    x = paddle.ones([2], dtype="float32")
    x.stop_gradient = False
    loss = (uc.all_gather(None, x * 1.0) * 2.0).sum()
    loss.backward(retain_graph=True)
    seen: dict[str, object] = {"first": x.grad.numpy().tolist()}
    seen["second"] = raised(lambda: loss.backward(retain_graph=True))
    x.clear_gradient()
    (uc.all_gather(None, x * 1.0) * 3.0).sum().backward()
    seen["after"] = x.grad.numpy().tolist()
    return seen


# -- JAX ---------------------------------------------------------------------------------------


def _placed(values, dtype):
    """``values`` as a jax.Array of ``dtype``, cast by numpy and placed (``jnp.asarray`` with a
    dtype compiles a conversion once per shape: milliseconds apiece)."""
    import jax

    return jax.device_put(np.asarray(values, dtype))


def jax_gradients(rank: int) -> dict[str, str]:
    """Each operator on jax.Array differentiated (custom_vjp; the operators under jax.vjp,
    moe.dispatch and combine under jax.grad): values and this rank's gradient against the
    reference; moe.dispatch and combine to the tokens and the weights."""
    import jax
    import jax.numpy as jnp

    world, report = uc.get_world_size(), {}
    for index, op in enumerate(OPS):
        if op == "moe":
            a = _moe_world(world, index)
            ids, ws = _placed(a["ids"][rank], np.int32), _placed(a["ws"][rank], np.float32)

            def loss(x, w, ids=ids, a=a, ws=ws):
                rows, _, handle = uc.moe.dispatch(x, ids, w, experts_per_rank=a["experts"])
                factors = jnp.arange(1, rows.shape[0] + 1, dtype=rows.dtype)[:, None]
                return (uc.moe.combine(rows * factors, handle) * ws).sum()

            x, w = (_placed(a[key][rank], np.float32) for key in ("xs", "weights"))
            grad_x, grad_w = jax.grad(loss, argnums=(0, 1))(x, w)
            np.testing.assert_allclose(np.asarray(grad_x), a["grads_x"][rank], rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(np.asarray(grad_w), a["grads_w"][rank], rtol=1e-4, atol=1e-5)
            report[op] = "ok"
            continue
        a = _world_inputs(op, world, seed=index)
        x, ws = _placed(a["xs"][rank], np.float32), _placed(a["ws"][rank], np.float32)
        # the gradient of (y * ws).sum(): the pullback of ws (jax.grad's own way, without the
        # product and the sum, whose compiles for each shape cost more than the call)
        y, pullback = jax.vjp(lambda x, op=op, a=a: forward(op, x, a, rank, True, jnp.concatenate), x)
        assert isinstance(y, jax.Array), f"{op}: {type(y).__name__}"
        (grad,) = pullback(ws)
        expected = expected_gradient(a, op, True, rank, world)
        np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-4, atol=1e-5, err_msg=op)
        report[op] = "ok"
    return report


def jax_static_in_jit(rank: int) -> str:
    """dispatch_static and combine_static inside jax.jit, and jax.grad through them, equal the
    eager calls (values, counts and gradients), with drops (capacity 2; jax_moe_training runs
    the capacity that drops nothing inside jax.jit, against the dense model)."""
    import jax
    import jax.numpy as jnp

    world, experts, tokens, k, hidden = uc.get_world_size(), 2, 6, 2, 3
    rng = np.random.default_rng(rank)
    x = _placed(rng.standard_normal((tokens, hidden)), np.float32)
    ids = _placed(np.where(rng.random((tokens, k)) < 0.2, -1, rng.integers(0, world * experts, (tokens, k))), np.int32)
    w = _placed(rng.random((tokens, k)), np.float32)
    capacity = 2  # drops some slots

    def step(x, w):
        rows, counts, handle = uc.moe.dispatch_static(x, ids, w, experts_per_rank=experts, capacity=capacity)
        again = uc.moe.redispatch_static(x * 2, handle)
        out = uc.moe.combine_static(jnp.tanh(rows) * 2 + again, handle)
        return (out**2).sum(), (rows, counts, out)

    eager, jitted = step(x, w), jax.jit(step)(x, w)
    for got, want in zip(jax.tree_util.tree_leaves(jitted), jax.tree_util.tree_leaves(eager)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    grads_eager = jax.grad(lambda x, w: step(x, w)[0], argnums=(0, 1))(x, w)
    grads_jit = jax.jit(jax.grad(lambda x, w: step(x, w)[0], argnums=(0, 1)))(x, w)
    for got, want in zip(grads_jit, grads_eager):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    return "ok"


def _moe_layer(xp, x, router, experts, ids_and_weights):
    """The dense layer: each token's top-k experts (``experts``: (experts, hidden, hidden)),
    weighted by the router's probabilities."""
    ids, weights = ids_and_weights
    outputs = xp.einsum("th,ehd->ted", x, experts)  # every expert on every token
    picked = xp.take_along_axis(outputs, ids[:, :, None], axis=1)
    return (picked * weights[:, :, None]).sum(1)


def _route(x, router, k):
    import jax

    probs = jax.nn.softmax(x @ router, axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    return ids, weights


def jax_moe_training(rank: int, steps: int = 3) -> dict[str, list]:
    """A top-2 MoE layer (E=2 experts per rank, a replicated router) trained ``steps`` SGD steps
    inside jax.jit on every rank, and the same layer dense in this process on every rank's
    tokens: the losses, the router and this rank's experts after training."""
    import jax
    import jax.numpy as jnp

    world, experts_per_rank, tokens, hidden, k, lr = uc.get_world_size(), 2, 8, 4, 2, 0.1
    total = world * experts_per_rank
    init = np.random.default_rng(0)
    router = _placed(init.standard_normal((hidden, total)), np.float32)
    all_experts = _placed(init.standard_normal((total, hidden, hidden)) / 2, np.float32)
    xs = [_placed(np.random.default_rng(100 + r).standard_normal((tokens, hidden)), np.float32)
          for r in range(world)]  # fmt: skip
    targets = [jnp.tanh(x[:, ::-1]) for x in xs]
    mine = slice(rank * experts_per_rank, (rank + 1) * experts_per_rank)

    def loss(router, experts, x, target):
        ids, weights = _route(x, router, k)
        rows, _, handle = uc.moe.dispatch_static(x, ids, weights, experts_per_rank=experts_per_rank,
                                                 capacity=tokens * k)  # fmt: skip
        out = uc.moe.combine_static(jnp.einsum("ech,ehd->ecd", rows, experts), handle)
        return ((out - target) ** 2).sum()

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    r_par, e_par, losses = router, all_experts[mine], []
    for _ in range(steps):
        value, (g_router, g_experts) = step(r_par, e_par, xs[rank], targets[rank])
        g_router = uc.all_reduce(g_router)  # the replicated router: every rank's tokens' gradient
        losses.append(float(uc.all_reduce(value[None])[0]))
        r_par, e_par = r_par - lr * g_router, e_par - lr * g_experts

    def dense_loss(router, experts):
        x, target = jnp.concatenate(xs), jnp.concatenate(targets)
        return ((_moe_layer(jnp, x, router, experts, _route(x, router, k)) - target) ** 2).sum()

    dense_step = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1)))
    d_router, d_experts, dense_losses = router, all_experts, []
    for _ in range(steps):
        value, (g_router, g_experts) = dense_step(d_router, d_experts)
        dense_losses.append(float(value))
        d_router, d_experts = d_router - lr * g_router, d_experts - lr * g_experts
    return dict(losses=losses, dense_losses=dense_losses, router=np.asarray(r_par).tolist(),
                dense_router=np.asarray(d_router).tolist(), experts=np.asarray(e_par).tolist(),
                dense_experts=np.asarray(d_experts[mine]).tolist())  # fmt: skip


def jax_refusals(rank: int) -> dict[str, object]:
    """JAX arrays are never filled in place (an in-place operator returns a new array), ids of
    the wrong dtype and operators inside jax.jit other than the static MoE ones are refused."""
    import jax
    import jax.numpy as jnp

    x = jnp.arange(4.0)
    y = uc.all_reduce(x)
    return {
        "filled": raised(lambda: uc.alltoall_single(jnp.zeros(4), x)),
        "all_reduce": (isinstance(y, jax.Array) and y is not x, np.asarray(y).tolist(), np.asarray(x).tolist()),
        "float ids": raised(
            lambda: uc.moe.dispatch_static(x[:, None], jnp.zeros((4, 1)), experts_per_rank=1, capacity=4)
        ),
        "jit": raised(lambda: jax.jit(lambda x: uc.global_scatter(x, [4], [4]))(x)),
    }


def _caught(call, error: type[Exception]) -> str:
    """``call()`` inside uc.moe.jit_errors(): the ``error`` it raised, as ``Type: message (from
    the type of its cause)``, or "returned"."""
    try:
        with uc.moe.jit_errors():
            call()
    except error as exc:
        return f"{type(exc).__name__}: {exc} (from {type(exc.__cause__).__name__})"
    return "returned"


def jax_jit_errors(rank: int) -> dict[str, str]:
    """overflow="error" inside jax.jit: what the jitted step raises by itself (JAX's error), and
    inside uc.moe.jit_errors() (the eager call's ValueError); a step that succeeds there returns."""
    import jax

    x, ids = _placed(np.ones((4, 2)), np.float32), _placed(np.zeros((4, 1)), np.int32)
    step = jax.jit(lambda x: uc.moe.dispatch_static(x, ids, experts_per_rank=1, capacity=2, overflow="error")[0])
    roomy = jax.jit(lambda x: uc.moe.dispatch_static(x, ids, experts_per_rank=1, capacity=4, overflow="error")[0])
    return {
        "eager": raised(lambda: uc.moe.dispatch_static(x, ids, experts_per_rank=1, capacity=2, overflow="error")),
        "jit": raised(lambda: step(x)).split(":")[0],
        "caught": _caught(lambda: step(x), ValueError),
        "roomy": _caught(lambda: roomy(x), ValueError),
    }


def jax_jit_ended_session(rank: int, backend: str) -> dict[str, str]:
    """A jitted step traced in a session that finalize() ended, inside uc.moe.jit_errors(): run
    before init() and after it, then traced again (jax.clear_caches())."""
    import jax

    x, ids = _placed(np.ones((4, 2)), np.float32), _placed(np.zeros((4, 1)), np.int32)
    step = jax.jit(lambda x: uc.moe.dispatch_static(x, ids, experts_per_rank=1, capacity=4)[1])
    step(x)
    uc.finalize()
    seen = {"finalized": _caught(lambda: step(x), uc.NotInitializedError)}
    uc.init(backend)
    seen["ended"] = _caught(lambda: step(x), ValueError)
    jax.clear_caches()
    seen["traced again"] = str(np.asarray(step(x)).tolist())
    return seen


def jax_devices_and_a_lost_peer() -> None:
    """The program of each rank of a gloo world of 2 with two JAX CPU devices
    (``XLA_FLAGS=--xla_force_host_platform_device_count=2``): what an operator and a gradient
    on ``cpu:1`` come back on, a sharded array's error, where a traced array is taken to live
    (JAX's default device: a GPU machine's jitted step is checked against its concrete arrays
    there); then rank 1 exits after the dispatch of
    a jitted top-1 step, and rank 0's step, inside uc.moe.jit_errors(), catches PeerLostError.
    Each rank prints one JSON line."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from unicoll.libraries.jax import _placement as placement

    uc.init()
    rank, (_, second) = uc.get_rank(), jax.devices()
    x1 = jax.device_put(np.arange(4.0, dtype=np.float32), second)
    sharded = jax.device_put(x1, NamedSharding(Mesh(np.array(jax.devices()), ("a",)), PartitionSpec("a")))
    grad = jax.grad(lambda x: (uc.all_gather(None, x) * 2.0).sum())(x1)
    seen: dict[str, object] = {
        "rank": rank,
        "all_reduce": str(uc.all_reduce(x1).devices()),
        "grad": (str(grad.devices()), np.asarray(grad).tolist()),
        "sharded": raised(lambda: uc.all_reduce(sharded)),
    }
    traced: list[object] = []
    with jax.default_device(second):
        jax.jit(lambda x: traced.append(placement(x)) or x)(np.ones(2, np.float32))
    seen["traced"] = str(traced)
    x, ids = _placed(np.ones((4, 2)), np.float32), _placed(np.zeros((4, 1)), np.int32)
    if rank == 1:
        jax.jit(lambda x: uc.moe.dispatch_static(x, ids, experts_per_rank=1, capacity=4)[0])(x).block_until_ready()
        print(json.dumps(seen), flush=True)
        os._exit(0)

    def step(x):
        rows, _, handle = uc.moe.dispatch_static(x, ids, experts_per_rank=1, capacity=4)
        return uc.moe.combine_static(rows * 2.0, handle)

    try:
        with uc.moe.jit_errors():
            jax.jit(step)(x)
    except uc.PeerLostError as exc:
        seen["step"] = f"{type(exc).__name__}: {exc} (from {type(exc.__cause__).__name__})"
    print(json.dumps(seen), flush=True)


def jax_on_the_gpu(rank: int) -> dict[str, object]:
    """JAX arrays on this rank's GPU (JAX's default device there) through a GPU backend: an
    eager call's result stays on the GPU, and every gradient and the static operators inside
    jax.jit check as on the host (the cases above, with JAX's default device a GPU)."""
    import jax

    if jax.default_backend() != "gpu":
        return {"skip": f"JAX {jax.__version__} has no GPU here (default backend {jax.default_backend()!r})"}
    x = _placed(np.arange(6.0).reshape(3, 2), np.float32)
    y = uc.all_reduce(x)
    return {
        "all_reduce": (np.asarray(y).tolist(), sorted(d.platform for d in y.devices())),
        "gradients": jax_gradients(rank),
        "static in jit": jax_static_in_jit(rank),
    }
