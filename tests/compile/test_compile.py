"""torch.compile of code that calls unicoll: the operators trace as custom ops (unicoll.compiled.traced, unicoll.compiled.custom_ops).

A top-2 MoE layer compiles forward and backward with ``fullgraph=True`` on 2 and 3 gloo ranks,
once for six inputs of different routing and sizes, and matches eager exactly in float64 (on 2
ranks also written with ``unicoll.moe``);
every operator traces with no graph break and its compiled gradient is eager's; what cannot
be traced runs eagerly behind one graph break that says why; bad input raises eager's errors
from compiled code. Many cases run inside each spawned world, to keep the suite fast.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
from collections.abc import Iterator

import pytest
import torch

import unicoll as uc
from helpers.background import Worlds
from helpers.gpu_backends import params
from helpers.moe import moe_layer, moe_topk_layer, parameters, step
from unicoll.eager.once_choice import ONCE_ENV_VAR
from unicoll.spec import OPS as SPEC_OPS

FLAGS = {"capture_dynamic_output_shape_ops": True}  # docs/compile.md's settings
OPS = (
    "exchange_counts", "global_scatter", "global_gather", "alltoall_single", "all_gather",
    "all_reduce", "reduce", "broadcast", "reduce_scatter", "moe_layout",
)  # fmt: skip
BACKWARDS = tuple(name for name in SPEC_OPS if name != "alltoall")  # alltoall's is alltoall_single's
TOKENS = (5, 8, 3, 11, 6, 9)  # six inputs; rank r has r more tokens, and its own routing


def _flags_on() -> None:
    """The Dynamo settings of docs/compile.md, for the rest of a spawned rank's life."""
    import torch._dynamo

    for name, value in FLAGS.items():
        setattr(torch._dynamo.config, name, value)


def _counting_aot_eager(compiled: list) -> object:
    """aot_eager, counting the graphs Dynamo hands it."""
    import torch._dynamo

    def backend(gm, example_inputs):
        compiled.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    return backend


def compiled_moe_matches_eager(
    rank: int, world: int, device: str = "cpu", layer: object = moe_layer
) -> tuple[list[bool], int]:
    """Eager and compiled (fullgraph, aot_eager) MoE steps of ``layer`` on six inputs: whether
    each output and every gradient are equal (on CPU bit for bit; on CUDA, whose accumulating
    index kernels use atomics, within 1e-12), and how many graphs were compiled."""
    import torch._dynamo

    if device == "cpu":
        alike = torch.equal
    else:
        alike = functools.partial(torch.allclose, rtol=1e-12, atol=1e-12)

    _flags_on()
    compiled: list = []
    weights = [p.detach().to(device).requires_grad_() for p in parameters(rank, 4, 3, 2, world)]
    eager = functools.partial(layer, world=world)
    layer = torch.compile(eager, fullgraph=True, backend=_counting_aot_eager(compiled))
    same = []
    for i, tokens in enumerate(TOKENS):
        seed = torch.Generator().manual_seed(100 * i + rank)
        x = torch.randn(tokens + rank, 4, generator=seed, dtype=torch.float64).to(device).requires_grad_()
        torch._dynamo.mark_dynamic(x, 0)  # the number of tokens varies, as in training
        out, grads = step(eager, x, weights)
        out_c, grads_c = step(layer, x, weights)
        same.append(all(alike(a, b) for a, b in zip([out, *grads], [out_c, *grads_c])))
    return same, len(compiled)


def _inputs(rank: int) -> dict:
    """Per-rank inputs for every operator (world of 2): uneven counts, splits and rows."""
    local_count = torch.tensor([[2, 1, 0, 3], [1, 1, 2, 0]][rank])
    in_splits = torch.tensor([[1, 3], [4, 0]][rank])
    x = (torch.arange(12.0, dtype=torch.float64).reshape(6, 2) + 100 * rank)[: int(local_count.sum())]
    return {"local_count": local_count, "in_splits": in_splits, "x": x}


def _each_op(rank: int) -> dict:
    """One function per operator (and per way of giving alltoall_single's split sizes), taking
    ``x`` and returning a float tensor that depends on it (for gradients)."""
    inputs = _inputs(rank)
    lc, splits = inputs["local_count"], inputs["in_splits"]
    gc = uc.exchange_counts(lc)
    received = uc.exchange_counts(splits)
    routing = torch.tensor([[[0, 3], [2, 1], [1, 1], [3, 0]], [[2, 0], [0, 1], [3, 2], [1, 3]]][rank])

    def dispatch_redispatch_and_combine(x):
        rows, rows_per_expert, handle = uc.moe.dispatch(x[:4], routing, x[:4].softmax(-1), experts_per_rank=2)
        rows = rows * uc.moe.redispatch(x[:4].flip(0)[:, :1], handle)
        parts = torch.split(rows, rows_per_expert)
        return uc.moe.combine(torch.cat([part * (e + 2.0) for e, part in enumerate(parts)]), handle)

    return {
        "exchange_counts": lambda x: x.sum() * uc.exchange_counts(lc),
        "global_scatter": lambda x: uc.global_scatter(x, lc, gc),
        "global_gather": lambda x: uc.global_gather(uc.global_scatter(x, lc, gc) * 3.0, lc, gc),
        "alltoall_single": lambda x: uc.alltoall_single(None, x[:4], received, splits),
        "alltoall_single, sizes exchanged": lambda x: uc.alltoall_single(None, x[:4], None, splits),
        "alltoall_single, even": lambda x: uc.alltoall_single(None, x[:4]),
        "all_gather": lambda x: uc.all_gather(None, x[: 1 + 2 * rank]),
        "all_reduce": lambda x: uc.all_reduce(x[:4] * (rank + 2)),
        "all_reduce, avg": lambda x: uc.all_reduce(x[:4] * (rank + 2), op="avg") + x[:4],
        "broadcast": lambda x: uc.broadcast(x[:4] * (rank + 2), src=1),
        "reduce": lambda x: uc.reduce(x[:4] * (rank + 2), dst=1),
        "reduce, avg": lambda x: uc.reduce(x[:4] * (rank + 2), 0, "avg") + x[:4],
        "reduce_scatter": lambda x: uc.reduce_scatter(None, x[:4] * (rank + 2), split_sizes=torch.tensor([3, 1])),
        "reduce_scatter, even, avg": lambda x: uc.reduce_scatter(None, x[:4], "avg"),
        "moe_layout, dispatch, redispatch and combine": dispatch_redispatch_and_combine,
    }


def _every_op_traces(rank: int) -> dict:
    """Each operator compiled alone (fullgraph: a graph break raises, with its reason) and run:
    the custom ops of its graph, then whether the outputs and the gradients equal eager's."""
    import torch._functorch.config

    x = _inputs(rank)["x"]
    each = _each_op(rank)

    def every(x):
        return [fn(x) for fn in each.values()]

    def loss(outputs):
        return sum((out * torch.arange(1.0, out.numel() + 1).reshape(out.shape)).sum() for out in outputs)

    eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch._functorch.config.donated_buffer = False  # this rank's only graphs whose backward runs more than once
    expected, got, ours = every(eager_x), [], {}
    for name, fn in each.items():
        graphs: list = []
        got.append(torch.compile(fn, fullgraph=True, backend=_counting_aot_eager(graphs))(compiled_x))
        targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
        ours[name] = sorted(t.split(".")[1] for t in targets if t.startswith("unicoll."))
    gradients = {}
    for i, name in enumerate(each):  # each operator's own gradient, bit for bit (float64)
        (eager_grad,) = torch.autograd.grad(loss([expected[i]]), eager_x, retain_graph=True)
        (compiled_grad,) = torch.autograd.grad(loss([got[i]]), compiled_x, retain_graph=True)
        gradients[name] = torch.equal(eager_grad, compiled_grad)
    loss(expected).backward()
    with _counting_backwards() as compiled_calls:
        loss(got).backward()
    same = all(torch.equal(a, b) for a, b in zip(expected, got)) and torch.equal(eager_x.grad, compiled_x.grad)
    # Compiled code sends every slot's row (the once-per-rank form is eager's alone so far): its
    # backward functions are counted against eager's in that form.
    plain_x = x.clone().requires_grad_()
    os.environ[ONCE_ENV_VAR] = "0"
    try:
        plain = every(plain_x)
    finally:
        del os.environ[ONCE_ENV_VAR]
    with _counting_backwards() as eager_calls:
        loss(plain).backward()
    return {"ours": ours, "same": same, "gradients": gradients, "backward calls": (eager_calls, compiled_calls)}


@contextlib.contextmanager
def _counting_backwards() -> Iterator[collections.Counter]:
    """Count the calls of each operator's backward (unicoll.eager.ops.<op>_backward) in this
    thread, however eager autograd or a compiled backward op reached it (a profile hook sees
    every call of its code)."""
    from unicoll.eager import ops

    codes = {getattr(ops, f"{name}_backward").__code__: name for name in BACKWARDS}
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg) -> None:
        if event == "call" and frame.f_code in codes:
            calls[codes[frame.f_code]] += 1

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)


def _mismatch_caught(rank: int) -> str:
    """Check mode from compiled code: rank 1 expects a row that rank 1 does not send itself."""
    local_count, global_count = torch.tensor([1, 1]), torch.tensor([1, 1 + rank])
    scatter = torch.compile(lambda x: uc.global_scatter(x, local_count, global_count), fullgraph=True, backend="eager")
    with pytest.raises(uc.CrossRankMismatchError) as caught:
        scatter(torch.ones(2, 1))
    return str(caught.value)


def _static_mismatch_caught(rank: int) -> str:
    """Check mode from compiled code sees a static dispatch as one: rank 1 routes a slot to an
    expert that does not exist (which the static mode would drop silently)."""
    ids = torch.tensor([[0], [1 + 3 * rank]])
    dispatch = torch.compile(lambda x: uc.moe.dispatch_static(x, ids, experts_per_rank=1, capacity=2)[0],
                             fullgraph=True, backend="eager")  # fmt: skip
    with pytest.raises(uc.CrossRankMismatchError) as caught:
        dispatch(torch.ones(2, 1))
    return str(caught.value)


def _static_combine_mismatch_caught(rank: int) -> str:
    """Check mode from compiled code sees a static combine as one: the ranks combine the blocks
    of two different dispatches (capacity 2 on rank 0, 3 on rank 1)."""
    ids = torch.tensor([[0], [1]])

    def step(x):
        dispatched = [uc.moe.dispatch_static(x, ids, experts_per_rank=1, capacity=c) for c in (2, 3)]
        rows, _, handle = dispatched[rank]
        return uc.moe.combine_static(rows, handle)

    with pytest.raises(uc.CrossRankMismatchError) as caught:
        torch.compile(step, fullgraph=True, backend="eager")(torch.ones(2, 1))
    return str(caught.value)


def two_ranks(rank: int) -> dict:
    """Everything the world of two checks (check mode on): the MoE layer, every operator, and
    mismatches that check mode finds."""
    _flags_on()
    assert uc.is_initialized()
    moe, each_op = compiled_moe_matches_eager(rank, 2), _every_op_traces(rank)
    moe_topk = compiled_moe_matches_eager(rank, 2, layer=moe_topk_layer)
    mismatches = {"mismatch": _mismatch_caught(rank), "static mismatch": _static_mismatch_caught(rank),
                  "static combine mismatch": _static_combine_mismatch_caught(rank)}  # fmt: skip
    return {"moe": moe, "moe_topk": moe_topk, "ops": each_op, **mismatches}


SPAWNED = {
    "two": ((two_ranks, 2), {"backend": "gloo", "env": {"UNICOLL_CHECK": "1"}, "timeout": 300}),
    "three": ((compiled_moe_matches_eager, 3, 3), {"backend": "gloo", "timeout": 300}),
}
"""The module's spawned worlds by key: ``uc.testing.spawn``'s arguments, positional and named."""


@pytest.fixture(scope="module", autouse=True)
def worlds() -> Worlds:
    """The spawned worlds, started on a thread at the module's first test, one after the other,
    while the tests that compile in this process (one core) run; the tests that read the worlds
    come last."""
    started = Worlds()
    for key, (args, kwargs) in SPAWNED.items():
        started.start(key, *args, **kwargs)
    return started


def _results(worlds: Worlds, key: str) -> list:
    args, kwargs = SPAWNED[key]
    return worlds.results(key, *args, **kwargs)


# -- one process, a world of one ------------------------------------------------------------


@pytest.fixture
def world_of_one(clean_env) -> None:
    import torch._dynamo

    uc.init("gloo")
    with torch._dynamo.config.patch(FLAGS):
        yield
    torch._dynamo.reset()


HAND_WRITTEN = ("moe_layout", "moe_check", "moe_check_static", "moe_check_blocks")  # unicoll.moe's layout and checks


def _namespace() -> set[str]:
    """Every op of the ``unicoll`` namespace (registered by importing the compile floor)."""
    from unicoll.compiled import custom_ops  # noqa: F401  (registers the ops)

    return {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("unicoll::")}


def test_ops_are_generated_from_the_specs_for_cpu_and_cuda() -> None:
    """Each spec that traces gets its op and, with a gradient, its backward op; the rest of the
    namespace is unicoll.moe's hand-written layout and checks."""
    from unicoll.spec import SPECS

    traced = {name for name, spec in SPECS.items() if spec.traced is not None}
    backward = {f"{name}_backward" for name in traced if SPECS[name].traced.backward is not None}
    assert traced == set(OPS) - {"moe_layout"}
    assert backward == {f"{name}_backward" for name in BACKWARDS}
    assert _namespace() == {*traced, *backward, *HAND_WRITTEN}
    for op in _namespace():
        for key in ("CPU", "CUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"unicoll::{op}", key), (op, key)


SCHEMA_EXTRAS = {"rows": "Optional[int]", "autograd": "str"}  # rows promised to the fake; how autograd saw the array


def _parsed(schema_type: str) -> str:
    """A schema type as torch prints a parsed argument's (``Tensor?`` is ``Optional[Tensor]``)."""
    return str(torch._C.parse_schema(f"f({schema_type} a) -> ()").arguments[0].type)


def test_custom_op_schemas_are_the_specs_parameters() -> None:
    """Each traced operator's custom op takes its spec's parameters, in order and of the types
    their kinds say (:attr:`unicoll.kinds.Kind.schema`), but the outputs filled in place (kinds
    without a schema type) and sync_op; then only the rows promised to the fake implementation
    and how autograd saw the array. Every kind a traced data operator takes has a type or is an
    output filled in place. Its backward op takes the gradient, then what the spec says the
    backward needs (the plan as the counts it comes from), the group and the rows."""
    from unicoll.compiled import custom_ops  # noqa: F401  (registers the ops)
    from unicoll.spec import SPECS

    for name, spec in SPECS.items():
        if spec.traced is None:
            continue
        params = spec.params
        assert all(p.kind.schema is not None or p.kind.fills for p in params), name
        expected = [(p.name, _parsed(p.kind.schema)) for p in params if p.kind.schema and p.name != "sync_op"]
        schema = getattr(torch.ops.unicoll, name).default._schema
        got = [(a.name, str(a.type)) for a in schema.arguments]
        assert got[: len(expected)] == expected, (name, got, expected)
        assert all(SCHEMA_EXTRAS.get(arg) == kind for arg, kind in got[len(expected) :]), (name, got)
        assert len(schema.returns) == 1 + len(spec.traced.learns), name
        if spec.traced.backward is not None:
            backward = getattr(torch.ops.unicoll, f"{name}_backward").default._schema
            names = [a.name for a in backward.arguments]
            needs = [n for need in spec.traced.backward for n in (spec.counted if need == "plan" else (need,))]
            assert names == ["grad", *needs, "group", "rows"], (name, names)


def test_what_cannot_be_traced_runs_eagerly_behind_one_break(world_of_one) -> None:
    from torch._dynamo.utils import counters  # Dynamo is imported by the tests that compile, not at collection

    x = torch.arange(6.0).reshape(3, 2)

    def as_task(x):
        return uc.alltoall_single(None, x * 2, sync_op=False)

    def in_place(x):
        out = torch.empty_like(x)
        uc.alltoall_single(out, x * 2)
        return out + 1

    def numpy_array(x):
        return x + torch.from_numpy(uc.all_gather(None, x.numpy() * 2))

    def reduce_scatter_into(x):
        out = torch.empty_like(x)
        uc.reduce_scatter(out, x * 2)
        return out + 1

    def alltoall_lists(x):
        return torch.cat(uc.alltoall([], [x * 2])) + 1  # a world of one: one array for the one rank

    def dispatch_as_task(x):
        return uc.moe.dispatch(x * 2, torch.tensor([[0], [0], [-1]]), experts_per_rank=1, sync_op=False)

    by_row = torch.tensor([[2.0], [0.0], [2.0]])  # the slot of token 1 is dropped
    _, _, eager_handle = uc.moe.dispatch(x, torch.tensor([[0], [0], [0]]), experts_per_rank=1)

    def combine_eager_handle(x):
        return uc.moe.combine(x * 2, eager_handle) + 1

    def combine_as_task(x):
        rows, _, handle = uc.moe.dispatch(x * 2, torch.tensor([[0], [-1], [0]]), experts_per_rank=1)
        return uc.moe.combine(rows, handle, sync_op=False)

    for fn, reason, check in [
        (as_task, "sync_op=False returns a Task", lambda r: torch.equal(r.wait(), x * 2)),
        (in_place, "an output filled in place", lambda r: torch.equal(r, x * 2 + 1)),
        (reduce_scatter_into, "an output filled in place", lambda r: torch.equal(r, x * 2 + 1)),
        (numpy_array, "only torch tensors, counts as int tensors", lambda r: torch.equal(r, x * 3)),
        (alltoall_lists, "this operator has no traced form", lambda r: torch.equal(r, x * 2 + 1)),
        (dispatch_as_task, "sync_op=False returns a Task", lambda r: torch.equal(r.wait()[0], x[:2] * 2)),
        (combine_as_task, "sync_op=False returns a Task", lambda r: torch.equal(r.wait(), x * by_row)),
        (combine_eager_handle, "a moe.Handle made by an eager moe.dispatch", lambda r: torch.equal(r, x * 2 + 1)),
    ]:
        counters.clear()
        assert check(torch.compile(fn, backend="eager")(x))
        (only,) = counters["graph_break"]  # the one reason it broke for (counted once per Dynamo attempt)
        assert reason in only and "the call runs eagerly" in only, only
        torch._dynamo.reset()  # forget that compilation, which fell back
        with pytest.raises(torch._dynamo.exc.Unsupported, match=reason):
            torch.compile(fn, fullgraph=True, backend="eager")(x)


def test_moe_dispatch_traces_without_capture_scalar_outputs(world_of_one) -> None:
    """rows_per_expert come from the layout op as sizes, not read out of a tensor: the dynamic
    MoE step compiles in one graph without ``capture_scalar_outputs`` and equals eager."""

    def step(x, ids, w):
        rows, rows_per_expert, handle = uc.moe.dispatch(x, ids, w, experts_per_rank=3)
        y = torch.cat([part * (e + 1) for e, part in enumerate(torch.split(rows, rows_per_expert))])
        return uc.moe.combine(y, handle)

    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(10, 4, generator=gen), torch.rand(10, 2, generator=gen)
    ids = torch.randint(-1, 3, (10, 2), generator=gen)
    with torch._dynamo.config.patch(capture_scalar_outputs=False):
        compiled = torch.compile(step, fullgraph=True, backend="eager")
        assert torch.equal(compiled(x, ids, w), step(x, ids, w))


def test_the_faces_test_for_dynamo_is_a_constant_while_it_traces(world_of_one) -> None:
    """The public face asks on every call whether Dynamo is imported; while Dynamo traces, the
    answer is a constant and reads no ``sys.modules``, which Dynamo reads by wrapping each key
    (this module's worlds took about a third longer to trace before)."""
    from unicoll.arrays import dynamo_imported

    def plus_one_if_imported(x):
        return x + 1 if dynamo_imported() else x

    torch.compile(lambda x: uc.all_reduce(x * 2), fullgraph=True, backend="eager")(torch.ones(2))  # a traced call
    explained = torch._dynamo.explain(plus_one_if_imported)(torch.ones(2))
    assert [str(guard).splitlines()[0] for guard in explained.out_guards if "modules" in str(guard)] == []
    assert explained.graph_count == 1 and explained.graph_break_count == 0


def test_a_traced_call_reads_no_sys_modules(world_of_one) -> None:
    """Nor do the functions a traced call goes through (each took Dynamo 40 to 90 ms a read):
    the array functions' test of each array, torch's description's test for autograd and its
    batched matrix product (moe.combine's weighted sum)."""
    x = torch.ones(4, 2, requires_grad=True)
    ids, weights = torch.tensor([[0], [1], [0], [1]]), torch.ones(4, 1)

    def step(x):
        rows, _, handle = uc.moe.dispatch(x, ids, weights, experts_per_rank=2)
        return uc.broadcast(x * 1, 0) + uc.alltoall_single(None, x) + uc.moe.combine(rows * 2, handle)

    torch.compile(step, fullgraph=True, backend="eager")(x)  # what is bound on first use, bound
    explained = torch._dynamo.explain(step)(x)
    assert [str(guard).splitlines()[0] for guard in explained.out_guards if "modules" in str(guard)] == []
    assert explained.graph_count == 1 and explained.graph_break_count == 0


def test_unicolls_internals_are_never_traced(world_of_one) -> None:
    """Where Dynamo gives up on a frame and runs it, Dynamo still watches the functions it calls:
    the eager operator called from there must run untraced, not be traced frame by frame."""
    import importlib
    import os

    def counts_in_a_list(x):
        return x + int(uc.exchange_counts([3])[0])  # exchange_counts of a list runs eagerly

    x = torch.ones(2)
    explained = torch._dynamo.explain(counts_in_a_list)(x)
    internals = (os.path.dirname(uc.__file__), os.path.dirname(importlib.import_module("unicoll.backends").__file__))
    traced_inside = [
        f"{frame.filename}:{frame.lineno}"
        for reason in explained.break_reasons
        for frame in reason.user_stack
        if frame.filename.startswith(internals) and not frame.filename.endswith(("face.py", "traced.py"))
    ]
    assert traced_inside == []
    assert torch.equal(torch.compile(counts_in_a_list, backend="eager")(x), x + 3)


def _dispatched(x: torch.Tensor, weights: torch.Tensor | None = None) -> tuple:
    """``moe.dispatch`` of 3 tokens to the one expert of a world of one."""
    return uc.moe.dispatch(x, torch.tensor([[0], [0], [0]]), weights, experts_per_rank=1)


def _static_dispatched(x: torch.Tensor) -> tuple:
    """``moe.dispatch_static`` of 3 tokens to the one expert of a world of one, 2 rows a block."""
    return uc.moe.dispatch_static(x, torch.tensor([[0], [0], [-1]]), experts_per_rank=1, capacity=2)


BAD_TRACED_CALLS = [
    (lambda x: uc.global_scatter(x, torch.tensor([4, -1]), torch.tensor([3])), ValueError),
    (lambda x: uc.global_scatter(x, torch.tensor([3.0]), torch.tensor([3])), TypeError),
    (lambda x: uc.global_gather(x, [3], [2]), ValueError),
    (lambda x: uc.alltoall_single(None, x, in_split_sizes=torch.tensor([1, 2])), ValueError),
    (lambda x: uc.exchange_counts(torch.tensor([[3]])), ValueError),
    (lambda x: uc.all_reduce(x * 2, op="mean"), ValueError),
    (lambda x: (uc.all_reduce(x * 2, op="mean"), x + 1)[1], ValueError),  # runs though its result goes unused
    (lambda x: (uc.global_gather(x, [3], [2]), x + 1)[1], ValueError),
    (lambda x: uc.all_reduce(x.t() * 2), ValueError),  # not contiguous
    (lambda x: uc.broadcast(x * 2, src=1), ValueError),
    (lambda x: uc.reduce_scatter(None, x * 2, split_sizes=torch.tensor([2])), ValueError),
    (lambda x: uc.moe.dispatch(x, torch.tensor([[0], [1], [0]]), experts_per_rank=1), ValueError),
    (
        lambda x: uc.moe.dispatch(
            x, torch.tensor([[0], [0], [0]]), torch.ones(3, 1, dtype=torch.int64), experts_per_rank=1
        ),
        TypeError,
    ),  # fmt: skip
    (lambda x: uc.moe.dispatch(x, torch.tensor([[0, 0], [0, 0]]), experts_per_rank=1), ValueError),
    (lambda x: uc.moe.redispatch(x[:2], _dispatched(x)[2]), ValueError),
    (lambda x: uc.moe.combine(_dispatched(x)[0][:2], _dispatched(x)[2]), ValueError),
    (lambda x: uc.moe.combine(_dispatched(x)[0] > 0, _dispatched(x)[2]), TypeError),
    (lambda x: uc.moe.combine(_dispatched(x)[0].long(), _dispatched(x, torch.ones(3, 1))[2]), TypeError),
    (lambda x: uc.moe.dispatch_static(x, torch.tensor([[0], [0]]), experts_per_rank=1, capacity=2), ValueError),
    (lambda x: uc.moe.dispatch_static(x, torch.zeros(3, 1, dtype=torch.int64), torch.ones(3, 1, dtype=torch.int64),
                                      experts_per_rank=1, capacity=2), TypeError),
    (lambda x: uc.moe.redispatch_static(x[:2], _static_dispatched(x)[2]), ValueError),
    (lambda x: uc.moe.combine_static(_static_dispatched(x)[0][:, :1], _static_dispatched(x)[2]), ValueError),
]  # fmt: skip


@pytest.mark.parametrize("bad", range(len(BAD_TRACED_CALLS)))
def test_bad_input_raises_eagers_error_from_compiled_code(world_of_one, bad: int) -> None:
    fn, error = BAD_TRACED_CALLS[bad]
    x = torch.ones(3, 2)
    with pytest.raises(error) as eager:
        fn(x)
    with pytest.raises(error) as compiled:
        torch.compile(fn, fullgraph=True, backend="eager")(x)
    assert str(compiled.value) == str(eager.value)


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.clone().requires_grad_()


GRAD_REFUSALS = [  # (function of an x that requires grad, whether it compiles under torch.no_grad())
    (lambda x: uc.all_reduce(x * 2, op="max"), True),
    (lambda x: uc.reduce_scatter(None, x * 2, op="prod"), True),
    (lambda x: uc.all_reduce(x), True),  # a leaf that requires grad, in place
    # a view of a leaf; under no_grad, torch's aot_eager refuses any in-place change of a view of an input
    (lambda x: uc.broadcast(x[1:], src=0), False),
    (lambda x: uc.reduce(x, dst=0), True),  # reduce: a leaf in place
    (lambda x: uc.reduce(x * 2, 0, "max"), True),
    # not contiguous and a view of a leaf: validation speaks first, as eager's does
    (lambda x: uc.all_reduce(x.t(), op="max"), False),
]


@pytest.mark.parametrize("bad", range(len(GRAD_REFUSALS)))
def test_what_autograd_cannot_record_raises_eagers_error_from_compiled_code(world_of_one, bad: int) -> None:
    fn, under_no_grad = GRAD_REFUSALS[bad]
    x = torch.arange(6.0).reshape(3, 2)
    with pytest.raises(ValueError) as eager:
        fn(_leaf(x))
    with pytest.raises(ValueError) as compiled:
        torch.compile(fn, fullgraph=True, backend="aot_eager")(_leaf(x))
    assert str(compiled.value) == str(eager.value)
    if under_no_grad:  # where autograd records nothing, the call runs
        with torch.no_grad():
            assert torch.equal(torch.compile(fn, fullgraph=True, backend="aot_eager")(_leaf(x)), fn(_leaf(x)))


def test_rows_are_known_while_tracing_where_the_counts_say_them(world_of_one) -> None:
    """Counts in lists (constants) and even splits give static rows; counts in tensors, and
    all_gather's rows, a new dynamic size."""
    traced = []

    def record(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and str(node.target).startswith("unicoll."):
                value = node.meta["example_value"]
                traced.append(str((value[0] if isinstance(value, tuple) else value).shape[0]))
        return gm

    x, three = torch.ones(3, 2), torch.tensor([3])
    for fn in [
        lambda x: uc.global_scatter(x, [3], [3]),
        lambda x: uc.global_gather(x, (3,), (3,)),
        lambda x: uc.alltoall_single(None, x, [3], [3]),
        lambda x: uc.alltoall_single(None, x),
        lambda x: uc.global_scatter(x, three, three),
        lambda x: uc.alltoall_single(None, x, three, three),
        lambda x: uc.all_gather(None, x),
    ]:
        assert torch.equal(torch.compile(fn, fullgraph=True, backend=record)(x), x)
    assert traced[:4] == ["3"] * 4
    assert all(size.startswith("u") for size in traced[4:]), traced


def test_the_groups_table_keeps_only_live_groups(world_of_one) -> None:
    import gc

    from unicoll.compiled.custom_ops import group_of
    from unicoll.group import group_numbered

    group = uc.new_group([0])
    number = group.number
    assert group_numbered(number) is group and group_of(number) is group
    del group
    gc.collect()
    assert group_numbered(number) is None
    with pytest.raises(ValueError, match=f"group: expected the number of a live unicoll.Group, got {number}"):
        group_of(number)


def test_a_group_of_an_ended_session_raises_in_compiled_code(world_of_one) -> None:
    group = uc.new_group([0])
    fn = torch.compile(lambda x, g: uc.all_gather(None, x, group=g), fullgraph=True, backend="aot_eager")
    x = torch.ones(2, 1)
    assert torch.equal(fn(x, group), x)
    uc.finalize()
    uc.init("gloo")
    with pytest.raises(ValueError, match="group: expected a group made since the last init"):
        fn(x, group)


def test_what_the_session_holds_between_calls_compiles_nothing_again(world_of_one) -> None:
    """The MoE step compiled once, then called with tasks, groups and handles made in between
    (each of which the session holds until it ends) and under verification (whose checks make
    a group of their own): no second compile. Before, a trace joined its handle to the
    session, which guarded the code on how many objects the session held."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def step(x, ids, weights):  # noqa: ANN001, ANN202
        rows, _, handle = uc.moe.dispatch_static(x, ids, weights, experts_per_rank=2, capacity=8)
        return uc.moe.combine_static(uc.all_reduce(rows * 2), handle)

    generator = torch.Generator().manual_seed(0)
    uc.finalize()
    uc.init("gloo", verify=True)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend=counter)
    kept = []
    for _ in range(3):
        x = torch.randn(4, 3, generator=generator, requires_grad=True)
        ids, weights = torch.randint(0, 2, (4, 2), generator=generator), torch.rand(4, 2, generator=generator)
        compiled(x, ids, weights).sum().backward()
        kept += [uc.all_reduce(torch.ones(1), sync_op=False), uc.new_group([0])]
        kept.append(uc.moe.dispatch_static(x.detach(), ids, weights, experts_per_rank=2, capacity=8)[2])
    assert counter.frame_count == 1
    for task in kept[::3]:
        task.wait()


# -- spawned worlds of 2 and 3 ranks --------------------------------------------------------


@pytest.fixture
def world_of_two(worlds: Worlds) -> list[dict]:
    return _results(worlds, "two")


def test_moe_layer_compiles_with_fullgraph_on_two_ranks(world_of_two) -> None:
    for report in world_of_two:
        assert report["moe"] == ([True] * len(TOKENS), 1)  # exact, and one graph for every routing and size


def test_moe_layer_written_with_unicoll_moe_compiles_with_fullgraph(world_of_two) -> None:
    for report in world_of_two:
        assert report["moe_topk"] == ([True] * len(TOKENS), 1)


def test_moe_layer_compiles_with_fullgraph_on_three_ranks(worlds: Worlds) -> None:
    for report in _results(worlds, "three"):
        assert report == ([True] * len(TOKENS), 1)


def test_check_mode_compares_the_ranks_calls_from_compiled_code(world_of_two) -> None:
    messages = {report["mismatch"] for report in world_of_two}
    assert len(messages) == 1 and "global_scatter: ranks disagree:" in messages.pop()
    static = {report["static mismatch"] for report in world_of_two}
    assert len(static) == 1, static
    assert "moe.dispatch_static: ranks disagree: rank 1 passes expert id 4 at topk_idx[1, 0]" in static.pop()
    combine = {report["static combine mismatch"] for report in world_of_two}
    assert len(combine) == 1, combine
    message = combine.pop()
    assert message.startswith("moe.combine_static: ranks disagree: rank 0's rows have trailing shape (4, 1)"), message


def test_every_operator_traces_without_a_break(world_of_two) -> None:
    for report in world_of_two:
        assert {name.split(",")[0] for name in report["ops"]["ours"]} == set(OPS)
        for name, ours in report["ops"]["ours"].items():
            assert name.split(",")[0] in ours, (name, ours)
        assert report["ops"]["same"]


def test_compiled_gradients_are_eagers_bit_for_bit_from_the_same_backward(world_of_two) -> None:
    """Each operator's gradient from compiled code equals eager's bit for bit (float64), and the
    compiled backward runs the same backward functions as eager autograd, as many times."""
    for report in world_of_two:
        assert report["ops"]["gradients"] == dict.fromkeys(report["ops"]["gradients"], True)
        eager_calls, compiled_calls = report["ops"]["backward calls"]
        assert set(eager_calls) == set(BACKWARDS)
        assert eager_calls == compiled_calls


# -- CUDA -------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", [moe_layer, moe_topk_layer], ids=["operators", "unicoll.moe"])
@pytest.mark.parametrize("backend", [p for p in params() if p.values[0] == "torch-nccl"])
def test_moe_layer_compiles_on_cuda(backend: str, layer: object) -> None:
    (report,) = uc.testing.spawn(compiled_moe_matches_eager, 1, 1, "cuda", layer, backend=backend, timeout=300)
    assert report == ([True] * len(TOKENS), 1)
