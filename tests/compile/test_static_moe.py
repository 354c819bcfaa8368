"""The static-shape MoE mode under torch.compile: a top-2 MoE layer written with
``moe.dispatch_static`` and ``moe.combine_static`` compiles with ``fullgraph=True``, static
shapes and without ``capture_scalar_outputs``; its forward and backward graphs read nothing to
the host (no ``aten._local_scalar_dense``, no data-dependent size), one compile serves every
routing, and outputs and gradients equal eager's. On a GPU (``gpu`` marker): no host
synchronization under ``torch.cuda.set_sync_debug_mode("error")``, and a CUDA graph captured
once and replayed with a new routing every replay."""

from __future__ import annotations

import pytest
import torch

import unicoll as uc
from helpers.gpu_backends import params
from helpers.moe import TOP_K, parameters

CAPACITY = 3
ROUTINGS = 4
TOKENS = 6


def static_layer(
    x: torch.Tensor, router: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, world: int
) -> torch.Tensor:
    """A top-2 MoE layer: router, top-2, ``dispatch_static`` with the gate weights (3 rows per
    block, so some slots drop), one FFN per local expert on its whole block (padding included:
    it is never read back), ``combine_static``; plus the valid counts, so they are an output."""
    gates, chosen = (x @ router).softmax(-1).topk(TOP_K, dim=-1)
    rows, counts, handle = uc.moe.dispatch_static(x, chosen, gates, experts_per_rank=w_in.shape[0], capacity=CAPACITY)
    hidden = torch.einsum("end,edf->enf", rows, w_in).relu()
    done = torch.einsum("enf,efd->end", hidden, w_out)
    return uc.moe.combine_static(done, handle) + 0 * counts.sum()


def _host_reads(graphs: list) -> list[str]:
    """The nodes of the AOT graphs that read a value to the host or have a size that depends on
    data (a symbolic size: with static shapes every size is an int)."""
    found = []
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in (
                torch.ops.aten._local_scalar_dense.default,
                torch.ops.aten.item.default,
            ):
                found.append(str(node))
            value = node.meta.get("val")
            shapes = [value.shape] if isinstance(value, torch.Tensor) else []
            if any(not isinstance(d, int) for shape in shapes for d in shape):
                found.append(f"{node}: shape {tuple(value.shape)}")
    return found


def compiled_static_layer(rank: int) -> dict:
    """Eager against compiled (fullgraph, static shapes, AOT autograd with inductor's partitioner,
    the graphs kept) over several routings: equal outputs and gradients, one compile, no host
    read, and unicoll's ops in each graph."""
    import torch._dynamo
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    assert torch._dynamo.config.capture_scalar_outputs is False
    world = uc.get_world_size()
    graphs: list = []
    frames = [0]

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    aot = aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=min_cut_rematerialization_partition)

    def backend(gm, example_inputs):
        frames[0] += 1
        return aot(gm, example_inputs)

    params = parameters(rank, 4, 3, 2, world)
    eager = lambda x, *p: static_layer(x, *p, world=world)  # noqa: E731
    compiled = torch.compile(eager, fullgraph=True, dynamic=False, backend=backend)
    same = []
    for i in range(ROUTINGS):
        x = torch.randn(TOKENS, 4, generator=torch.Generator().manual_seed(10 * i + rank), dtype=torch.float64)
        results = []
        for layer in (eager, compiled):
            xi = x.clone().requires_grad_()
            out = layer(xi, *params)
            weights = torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape).cos()
            grads = torch.autograd.grad((out * weights).sum(), [xi, *params])
            results.append([out.detach(), *grads])
        same.append(all(torch.equal(a, b) for a, b in zip(*results)))
    ours = [sorted(str(n.target) for n in gm.graph.nodes if str(n.target).startswith("unicoll.")) for gm in graphs]
    # an eager handle, made on gloo (its layout numpy arrays), in compiled code: the same sums
    x = torch.randn(TOKENS, 4, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    gates, chosen = (x @ params[0]).softmax(-1).topk(TOP_K, dim=-1)
    rows, _, handle = uc.moe.dispatch_static(x, chosen, gates, experts_per_rank=params[1].shape[0], capacity=CAPACITY)
    combine = torch.compile(lambda y, h: uc.moe.combine_static(2 * y, h), backend="eager")
    mixed = torch.equal(combine(rows, handle), uc.moe.combine_static(2 * rows, handle))
    return dict(same=same, frames=frames[0], graphs=len(graphs), host_reads=_host_reads(graphs), ours=ours,
                mixed=mixed)  # fmt: skip


def test_static_moe_layer_compiles_without_dynamic_shapes_or_host_reads() -> None:
    for report in uc.testing.spawn(compiled_static_layer, 2, backend="gloo", timeout=300):
        assert report["same"] == [True] * ROUTINGS
        assert report["frames"] == 1, "one compile for every routing"
        assert report["graphs"] == 2, "a forward and a backward graph"
        assert report["host_reads"] == []
        forward, backward = report["ours"]  # the checks; the rows, the counts and combine's rows; their way back
        assert sorted(forward) == sorted(["unicoll.moe_check_static.default", "unicoll.moe_check_blocks.default",
                                          *["unicoll.alltoall_single.default"] * 3])  # fmt: skip
        assert backward == ["unicoll.alltoall_single_backward.default"] * 2
        assert report["mixed"]


# -- CUDA (where a GPU is lent) ---------------------------------------------------------------


def static_on_cuda(rank: int) -> dict:
    """On CUDA: the static layer's forward and backward, eagerly, under
    ``torch.cuda.set_sync_debug_mode("error")`` (any host synchronization raises); then the
    layer captured once in a CUDA graph and replayed with new tokens, so a new routing, at every
    replay, each replay's output equal to eager's."""
    world = uc.get_world_size()
    params = [p.detach().cuda().requires_grad_() for p in parameters(rank, 4, 3, 2, world)]

    def layer(x: torch.Tensor) -> torch.Tensor:
        return static_layer(x, *params, world=world)

    seeds = [torch.Generator().manual_seed(10 * i + rank) for i in range(ROUTINGS)]
    xs = [torch.randn(TOKENS, 4, generator=g, dtype=torch.float64).cuda() for g in seeds]
    with torch.no_grad():
        eager = [layer(x) for x in xs]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in xs:
            tokens = x.clone().requires_grad_()
            torch.autograd.grad(layer(tokens).sum(), [tokens, *params])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    replays = []
    with torch.no_grad():
        tokens = xs[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up on a side stream before capturing, as torch asks
            for _ in range(2):
                layer(tokens)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layer(tokens)
        for x, want in zip(xs, eager):
            tokens.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            replays.append(torch.equal(captured, want))
    return dict(replays=replays)


@pytest.mark.parametrize("backend", [p for p in params() if p.values[0] == "torch-nccl"])
def test_static_moe_layer_needs_no_sync_and_replays_in_a_cuda_graph(backend: str) -> None:
    (report,) = uc.testing.spawn(static_on_cuda, 1, backend=backend, timeout=300)
    assert report["replays"] == [True] * ROUTINGS
