"""The MoE step on the device path (a device backend's code: torch-nccl's transport driving gloo,
on CPU tensors): the same results and gradients as the host path, bit for bit, and the host
reads it would make on a GPU counted (tests/helpers/sync_counter.py): one per dynamic
dispatch, none in combine, redispatch, any backward or the static mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import unicoll as uc
from helpers.gpu_backends import params, restart_on_the_device_path
from helpers.sync_counter import SyncCounter

E, K, DIM = 3, 2, 4
TOKENS = (6, 0)  # rank 1 has no tokens


def on_the_device_path() -> None:
    """Restart this rank on torch-nccl's transport driving gloo: the device path on CPU tensors."""
    restart_on_the_device_path("nccl-device")


def _inputs(rank: int, world: int, capacity: int | None, step: int) -> tuple:
    rng = np.random.default_rng([step, rank])
    tokens = TOKENS[rank]
    ids = torch.from_numpy(rng.integers(-1, world * E, (tokens, K)))
    x = torch.from_numpy(rng.standard_normal((tokens, DIM))).requires_grad_()
    h = torch.from_numpy(rng.standard_normal((tokens, DIM))).requires_grad_()
    w = torch.from_numpy(rng.random((tokens, K))).requires_grad_()
    scale = torch.arange(1.0, E + 1, dtype=torch.float64).requires_grad_()
    return ids, x, h, w, scale


def _experts(rows: torch.Tensor, rows_per_expert: list[int], scale: torch.Tensor) -> torch.Tensor:
    return rows * torch.repeat_interleave(scale, torch.tensor(rows_per_expert), output_size=rows.shape[0])[:, None]


def _step(rank: int, world: int, capacity: int | None, reads: SyncCounter | None) -> dict[str, object]:
    """Two layers on one routing (dispatch, then redispatch), combined, and the backward pass;
    with ``reads``, the host reads of each part counted."""
    ids, x, h, w, scale = _inputs(rank, world, capacity, 0)
    counted: dict[str, int] = {}

    def part(name: str, run):  # noqa: ANN001, ANN202
        before = 0 if reads is None else reads.total
        result = run()
        counted[name] = 0 if reads is None else reads.total - before
        return result

    rows, rows_per_expert, handle = part("dispatch", lambda: uc.moe.dispatch(x, ids, w, experts_per_rank=E,
                                                                             capacity=capacity))  # fmt: skip
    rows2 = part("redispatch", lambda: uc.moe.redispatch(h, handle))
    y = _experts(rows + rows2, rows_per_expert, scale)
    out = part("combine", lambda: uc.moe.combine(y, handle))
    part("backward", lambda: (out * out).sum().backward())
    return {"out": out.detach().numpy().copy(), "rows": rows.detach().numpy().copy(), "rows_per_expert":
            rows_per_expert, "grads": [a.grad.numpy().copy() for a in (x, h, w, scale)], "reads": counted}  # fmt: skip


def _static_step(rank: int, world: int, reads: SyncCounter) -> dict[str, int]:
    ids, x, h, w, scale = _inputs(rank, world, 2, 1)
    before = reads.total
    rows, counts, handle = uc.moe.dispatch_static(x, ids, w, experts_per_rank=E, capacity=2)
    rows = rows + uc.moe.redispatch_static(h, handle)
    out = uc.moe.combine_static(rows * scale[:, None, None], handle)
    (out * out).sum().backward()
    return {"static": reads.total - before}


def both_paths(rank: int) -> dict[str, object]:
    """The step on the host path (gloo), then on the device path with its reads counted."""
    world = uc.get_world_size()
    capacities = (None, 1)
    host = [_step(rank, world, capacity, None) for capacity in capacities]
    on_the_device_path()
    report: dict[str, object] = {}
    with SyncCounter() as reads:
        device = [_step(rank, world, capacity, reads) for capacity in capacities]
        report.update(_static_step(rank, world, reads))
    report["kinds"] = dict(reads.kinds)
    for capacity, want, got in zip(capacities, host, device):
        for name in ("out", "rows"):
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name}, capacity {capacity}")
        assert got["rows_per_expert"] == want["rows_per_expert"]
        for mine, theirs in zip(got["grads"], want["grads"]):
            np.testing.assert_array_equal(mine, theirs, err_msg=f"gradients, capacity {capacity}")
        report[f"reads, capacity {capacity}"] = got["reads"]
    return report


def device_world(rank: int) -> dict[str, object]:
    """One world of 2 ranks for this module: the step on both paths (the rank then stays on the
    device path), a planted read, ids out of range, the compiled steps."""
    report = both_paths(rank)
    report.update(planted=planted(rank), bad_ids=bad_ids(rank), compiled=compiled_reads(rank))
    return report


@pytest.fixture(scope="module")
def reports() -> list[dict[str, object]]:
    return uc.testing.spawn(device_world, 2, backend="gloo", timeout=240)


def test_the_device_path_gives_the_host_path_s_results_bit_for_bit(reports) -> None:
    assert len(reports) == 2


def test_one_host_read_per_dispatch_and_none_elsewhere(reports) -> None:
    for report in reports:
        for capacity in (None, 1):
            reads = report[f"reads, capacity {capacity}"]
            assert reads == {"dispatch": 1, "redispatch": 0, "combine": 0, "backward": 0}, report
        assert report["static"] == 0, report


def planted(rank: int) -> dict[str, int]:
    """The counter itself: an ``.item()`` planted in the device routing is counted."""
    from unicoll.eager import moe

    ids, x, _, w, _ = _inputs(rank, uc.get_world_size(), None, 2)
    routing = moe.device_routing

    def with_a_read(xp, topk_idx, experts, capacity):  # noqa: ANN001, ANN202
        topk_idx.max().item() if topk_idx.numel() else topk_idx.sum().item()
        return routing(xp, topk_idx, experts, capacity)

    counts = {}
    for name, route in (("clean", routing), ("planted", with_a_read)):
        moe.device_routing = route
        with SyncCounter() as reads:
            uc.moe.dispatch(x, ids, w, experts_per_rank=E)
        counts[name] = reads.total
    moe.device_routing = routing
    return counts


def test_the_counter_catches_a_planted_read(reports) -> None:
    assert [report["planted"] for report in reports] == [{"clean": 1, "planted": 2}] * 2
    with SyncCounter() as reads:
        t = torch.arange(4)
        t.sum().item()
        t[t > 1].tolist()
    assert reads.kinds == {"aten._local_scalar_dense.default": 1, "aten.index.Tensor with a boolean mask": 1,
                           "Tensor.tolist": 1}  # fmt: skip
    planted_in_compiled = torch.compile(lambda a: a * a.sum().item(), backend="aot_eager")
    with torch.profiler.profile() as profile:
        planted_in_compiled(torch.ones(3))
    assert sum(event.name in _READ_OPS for event in profile.events()) == 1


def bad_ids(rank: int) -> list[str]:
    """Ids out of range on one rank, on the device path: read with the counts, refused on every
    rank before any row moves; the next dispatch runs."""
    world = uc.get_world_size()
    ids, x, _, w, _ = _inputs(rank, world, None, 3)
    seen = []
    for wrong in (world * E, -2):
        bad = ids.clone()
        if rank == 0:
            bad[1, 1] = wrong
        try:
            uc.moe.dispatch(x, bad, w, experts_per_rank=E)
            seen.append("no error")
        except ValueError as exc:
            seen.append(str(exc))
    rows, _, handle = uc.moe.dispatch(x, ids, w, experts_per_rank=E)
    uc.moe.combine(rows, handle)
    return seen


def test_ids_out_of_range_are_refused_on_every_rank(reports) -> None:
    reports = [report["bad_ids"] for report in reports]
    expected = "moe.dispatch: topk_idx: expected expert ids from -1 (a dropped slot) to W * experts_per_rank - 1"
    assert reports[0] == [f"{expected}, got 6 at [1, 1] (W * experts_per_rank = 6)",
                          f"{expected}, got -2 at [1, 1] (W * experts_per_rank = 6)"]  # fmt: skip
    for other in reports[1:]:
        assert other == [f"{message} on rank 0" for message in reports[0]]


_READ_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::bincount", "aten::masked_select",
             "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim", "aten::repeat_interleave"}  # fmt: skip
"""The operations a profile shows that read device memory on the host (an ``.item()``
shows as ``_local_scalar_dense``, as does a ``.tolist()`` in compiled code; torch.compile runs no TorchDispatchMode, so compiled code is
counted from a profile instead)."""


def compiled_reads(rank: int) -> dict[str, int]:
    """The same steps compiled (aot_eager: the forward and backward graphs run as aten operations),
    on the device path: the declared reads (``read_ints``) and any other read the profile shows."""
    world = uc.get_world_size()
    backend = uc.runtime.state("test").backend
    declared = []
    read_ints = backend.read_ints
    backend.read_ints = lambda values: declared.append(1) or read_ints(values)

    def dynamic(x, h, ids, w, scale):  # noqa: ANN001, ANN202
        rows, rows_per_expert, handle = uc.moe.dispatch(x, ids, w, experts_per_rank=E)
        rows = rows + uc.moe.redispatch(h, handle)
        y = torch.cat([part * scale[e] for e, part in enumerate(torch.split(rows, rows_per_expert))])
        return uc.moe.combine(y, handle)

    def static(x, h, ids, w, scale):  # noqa: ANN001, ANN202
        rows, _, handle = uc.moe.dispatch_static(x, ids, w, experts_per_rank=E, capacity=2)
        rows = rows + uc.moe.redispatch_static(h, handle)
        return uc.moe.combine_static(rows * scale[:, None, None], handle)

    counted = {}
    for name, step in (("dynamic", dynamic), ("static", static)):
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        for n in range(2):  # the first call compiles; the second replays with a new routing
            ids, x, h, w, scale = _inputs(rank, world, None, 10 + n)
            del declared[:]
            with torch.profiler.profile() as profile:
                out = compiled(x, h, ids, w, scale)
                (out * out).sum().backward()
            counted[name] = len(declared)
            counted[f"{name}, other reads"] = sum(event.name in _READ_OPS for event in profile.events())
            want = step(x.detach(), h.detach(), ids, w.detach(), scale.detach())
            torch.testing.assert_close(out, want, rtol=0, atol=0)
    return counted


def test_compiled_code_reads_once_per_dispatch_and_nowhere_else(reports) -> None:
    expected = {"dynamic": 1, "dynamic, other reads": 0, "static": 0, "static, other reads": 0}
    assert [report["compiled"] for report in reports] == [expected] * 2


# -- CUDA (where a GPU is lent) ---------------------------------------------------------------


def _cuda_inputs(rank: int, capacity: int | None) -> list[torch.Tensor]:
    """:func:`_inputs` as CUDA tensors (copied there before the watch begins: an upload waits)."""
    return [a.detach().cuda().requires_grad_(a.requires_grad) for a in _inputs(rank, 1, capacity, 0)]


def _cuda_step(inputs: list[torch.Tensor], capacity: int | None) -> list[torch.Tensor]:
    """The step of :func:`_step` on CUDA tensors: its output and gradients."""
    ids, x, h, w, scale = inputs
    rows, rows_per_expert, handle = uc.moe.dispatch(x, ids, w, experts_per_rank=E, capacity=capacity)
    rows = rows + uc.moe.redispatch(h, handle)
    y = torch.cat([part * scale[e] for e, part in enumerate(torch.split(rows, rows_per_expert))])
    out = uc.moe.combine(y, handle)
    (out * out).sum().backward()
    return [out.detach(), x.grad, h.grad, w.grad, scale.grad]


def dynamic_on_cuda(rank: int) -> dict[str, object]:
    """On CUDA, one rank: dispatch (capacity none and 1), redispatch, combine and the backward
    pass under ``torch.cuda.set_sync_debug_mode("error")`` (any host synchronization raises but
    the one each dispatch declares, which ``read_ints`` allows), equal to the same step run
    without it."""
    torch.cuda.set_device(0)
    capacities = (None, 1)
    plain = [_cuda_step(_cuda_inputs(rank, capacity), capacity) for capacity in capacities]
    inputs = [_cuda_inputs(rank, capacity) for capacity in capacities]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        watched = [_cuda_step(step_inputs, capacity) for step_inputs, capacity in zip(inputs, capacities)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"same": [torch.equal(a, b) for got, want in zip(watched, plain) for a, b in zip(got, want)]}


@pytest.mark.parametrize("backend", params())
def test_the_dynamic_step_reads_once_per_dispatch_on_a_gpu(backend: str) -> None:
    (report,) = uc.testing.spawn(dynamic_on_cuda, 1, backend=backend, timeout=300)
    assert report["same"] == [True] * 10
