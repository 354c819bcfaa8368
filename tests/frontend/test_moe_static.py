"""The static-shape MoE mode across ranks, beyond the conformance matrix's values: gradients
against the whole world computed on one process, redispatch, a sub-group, Tasks, check mode,
overflow='error', bad input, and a handle outliving its session."""

from __future__ import annotations

import array_api_compat.torch as xtorch
import numpy as np
import pytest
import torch

import unicoll as uc
from helpers.gpu_backends import restart_on_the_device_path
from helpers.several import SESSION, Case, share
from helpers.static_world import world_combine, world_dispatch

E, K, C, DIM = 2, 2, 2, 3
TOKENS = (5, 0, 4)  # rank 1 has no tokens


def _inputs(world: int, step: int) -> tuple[list, list, list]:
    """Every rank's tokens, expert ids (dropped slots, and more slots per expert than C) and weights."""
    rng = np.random.default_rng(step)
    tokens = TOKENS[:world]
    ids = [torch.from_numpy(rng.integers(-1, world * E, (t, K))) for t in tokens]
    xs = [torch.from_numpy(rng.standard_normal((t, DIM))) for t in tokens]
    weights = [torch.from_numpy(rng.random((t, K))) for t in tokens]
    return xs, ids, weights


def _expert(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A stand-in for the experts: row-wise, a different scale per expert."""
    return rows * scale.reshape(-1, 1, 1) + 1


def _grad(a: torch.Tensor) -> torch.Tensor:
    """``a``'s gradient, zeros where autograd left it None (a rank without tokens)."""
    return torch.zeros_like(a) if a.grad is None else a.grad


def _gradients(rank: int) -> list[str]:
    """Two routings: one dispatch_static, one redispatch_static of other rows of the same tokens,
    combine_static of each; outputs and gradients (x, the experts' scale, the weights) against
    the whole world on one process; a dropped slot's weight gets exactly zero."""
    world, failures = uc.get_world_size(), []
    for step in range(2):
        xs, ids, weights = _inputs(world, step)
        x, w = xs[rank].clone().requires_grad_(), weights[rank].clone().requires_grad_()
        h2 = (2 * xs[rank]).requires_grad_()
        scale = torch.arange(1.0, E + 1, dtype=torch.float64).requires_grad_()
        rows, counts, handle = uc.moe.dispatch_static(x, ids[rank], w, experts_per_rank=E, capacity=C)
        again = uc.moe.redispatch_static(h2, handle)
        out = uc.moe.combine_static(_expert(rows, scale), handle) + uc.moe.combine_static(again, handle)
        out.backward(torch.ones_like(out))
        mine = [_grad(a) for a in (x, h2, w, scale)]

        whole = [a.clone().requires_grad_() for a in xs]
        twice = [(2 * a).requires_grad_() for a in xs]
        ws = [a.clone().requires_grad_() for a in weights]
        scales = [torch.arange(1.0, E + 1, dtype=torch.float64).requires_grad_() for _ in range(world)]
        layouts, wrows, wcounts, _ = world_dispatch(xtorch, whole, ids, E, C)
        _, wagain, _, _ = world_dispatch(xtorch, twice, ids, E, C)
        outs = world_combine(xtorch, [_expert(r, s) for r, s in zip(wrows, scales)], layouts, ws, E, C)
        outs2 = world_combine(xtorch, wagain, layouts, ws, E, C)
        sum(o.sum() + o2.sum() for o, o2 in zip(outs, outs2)).backward()
        theirs = [_grad(a) for a in (whole[rank], twice[rank], ws[rank], scales[rank])]
        for name, a, b in zip(("x", "redispatched x", "weights", "expert"), mine, theirs):
            if not torch.allclose(a, b, rtol=1e-12, atol=1e-12):
                failures.append(f"step {step}, rank {rank}: gradient to {name} {a} != {b}")
        if not torch.allclose(out, outs[rank] + outs2[rank], rtol=1e-12):
            failures.append(f"step {step}, rank {rank}: output differs")
        if not torch.equal(counts, wcounts[rank]):
            failures.append(f"step {step}, rank {rank}: counts {counts} != {wcounts[rank]}")
        if counts.device != x.device or counts.dtype != torch.int64 or rows.shape != (E, world * C, DIM):
            failures.append(f"counts {counts.dtype} on {counts.device}, rows {tuple(rows.shape)}")
        dropped = ~handle.kept
        if dropped.any() and not torch.equal(mine[2][dropped], torch.zeros_like(mine[2][dropped])):
            failures.append(f"rank {rank}: a dropped slot's weight got gradient {mine[2][dropped]}")
    return failures


def _tasks_and_groups(rank: int) -> list[str]:
    """sync_op=False on every operator, two dispatches in flight waited in reverse order, and a
    sub-group of all ranks but rank 0 (positions differ from ranks), in numpy."""
    world, failures = uc.get_world_size(), []
    xs, ids, _ = _inputs(world, 5)
    first = uc.moe.dispatch_static(xs[rank].numpy(), ids[rank].numpy(), experts_per_rank=E, capacity=C, sync_op=False)
    second = uc.moe.dispatch_static(xs[rank].numpy(), ids[rank].numpy(), experts_per_rank=E, capacity=1, sync_op=False)
    rows1, _, handle = second.wait()
    rows0, counts0, handle0 = first.wait()
    _, wrows, wcounts, _ = world_dispatch(xtorch, xs, ids, E, C)
    _, wrows1, _, _ = world_dispatch(xtorch, xs, ids, E, 1)
    if not (np.array_equal(rows0, wrows[rank].numpy()) and np.array_equal(rows1, wrows1[rank].numpy())):
        failures.append(f"rank {rank}: rows of the Tasks differ")
    if not isinstance(counts0, np.ndarray) or not np.array_equal(counts0, wcounts[rank].numpy()):
        failures.append(f"rank {rank}: counts {counts0!r}")
    back = uc.moe.combine_static(rows0, handle0, sync_op=False).wait()
    again = uc.moe.redispatch_static(xs[rank].numpy(), handle0, sync_op=False).wait()
    layouts, _, _, _ = world_dispatch(xtorch, xs, ids, E, C)
    want = world_combine(xtorch, wrows, layouts, None, E, C)[rank].numpy()
    if not np.allclose(back, want) or not np.array_equal(again, rows0):
        failures.append(f"rank {rank}: combine or redispatch of a Task differ")
    failures += _large_steps(rank, world)
    sub = uc.new_group(list(range(1, world)))
    if sub.is_member:
        size, position = sub.world_size, sub.rank
        sxs, sids, _ = _inputs(size, 6)
        got, counts, h = uc.moe.dispatch_static(
            sxs[position], sids[position], experts_per_rank=E, capacity=C, group=sub
        )
        _, srows, scounts, _ = world_dispatch(xtorch, sxs, sids, E, C)
        if not (torch.equal(got, srows[position]) and torch.equal(counts, scounts[position])):
            failures.append(f"rank {rank}: the sub-group's rows differ")
        if h.world != size or uc.moe.combine_static(got, h).shape != sxs[position].shape:
            failures.append(f"rank {rank}: the sub-group's handle or combine")
    return failures


def _draw(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens (600 x 256 float32: steps of more than a megabyte), ids and weights."""
    rng = np.random.default_rng([step, rank])
    ids = torch.from_numpy(rng.integers(-1, 3 * E, (600, K)))
    return torch.from_numpy(rng.standard_normal((600, 256), np.float32)), ids, torch.from_numpy(rng.random((600, K)))


def _large_steps(rank: int, world: int) -> list[str]:
    """Steps through the backend's workspace, numpy and torch, a new routing and capacity each;
    every result checked after the last step, so reused memory cannot corrupt a live one. The
    slots the capacity drops weigh inf and the blocks' padding holds nan when combine runs:
    neither may reach a result (combine sums these steps one slot at a time into lent rows)."""
    kept, failures = [], []
    for step, convert in enumerate((lambda a: a.numpy(), lambda a: a, lambda a: a.numpy())):
        x, ids, w = _draw(step, rank)
        ids = ids % (world * E)  # ids for this world (and no dropped slot but the capacity's)
        capacity = 300 - 50 * step
        rows, counts, handle = uc.moe.dispatch_static(
            convert(x), convert(ids), convert(w), experts_per_rank=E, capacity=capacity
        )
        w[~torch.as_tensor(handle.kept)] = float("inf")  # w shares memory with what dispatch was given
        y = torch.as_tensor(rows) * 2
        padding = torch.arange(capacity)[None, None, :] >= torch.as_tensor(counts)[:, :, None]  # (E, W, C)
        y.view(E, world, capacity, -1)[padding] = float("nan")
        kept.append((step, capacity, rows, counts, uc.moe.combine_static(convert(y), handle)))
    for step, capacity, rows, counts, out in kept:
        xs, ids, ws = zip(*(_draw(step, r) for r in range(world)))
        layouts, wrows, wcounts, _ = world_dispatch(xtorch, xs, [i % (world * E) for i in ids], E, capacity)
        want = world_combine(xtorch, [2 * r for r in wrows], layouts, ws, E, capacity)[rank]
        same = np.array_equal(np.asarray(rows), wrows[rank].numpy())
        if not same or not np.array_equal(np.asarray(counts), wcounts[rank].numpy()):
            failures.append(f"rank {rank}: large step {step}: rows or counts differ")
        if not np.allclose(np.asarray(out), want.numpy(), rtol=1e-5, atol=1e-5):
            failures.append(f"rank {rank}: large step {step}: combine differs")
    return failures


def _errors(rank: int) -> dict[str, str]:
    """What check mode and overflow='error' raise, on every rank alike."""
    world = uc.get_world_size()
    xs, ids, _ = _inputs(world, 7)
    seen = {}

    def caught(name: str, call) -> None:
        try:
            call()
            seen[name] = "no error"
        except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
            seen[name] = f"{type(exc).__name__}: {exc}"

    x, i = xs[rank], ids[rank]
    caught("capacity", lambda: uc.moe.dispatch_static(x, i, experts_per_rank=E, capacity=C + rank))
    bad = i.clone()
    if rank == world - 1 and bad.numel():
        bad[0, 0] = world * E
    caught("id", lambda: uc.moe.dispatch_static(x, bad, experts_per_rank=E, capacity=C))
    caught("overflow", lambda: uc.moe.dispatch_static(x, i, experts_per_rank=E, capacity=1, overflow="error"))
    caught("room", lambda: uc.moe.dispatch_static(x, i, experts_per_rank=E, capacity=2 * K * 5, overflow="error"))
    _, _, handle = uc.moe.dispatch_static(x, i, experts_per_rank=E, capacity=C)
    caught("combine shape", lambda: uc.moe.combine_static(torch.zeros(E, C, DIM, dtype=x.dtype), handle))
    caught("ids dtype", lambda: uc.moe.dispatch_static(x, i.double(), experts_per_rank=E, capacity=C))
    caught("ids place", lambda: uc.moe.dispatch_static(x, i.numpy(), experts_per_rank=E, capacity=C))
    caught("handle", lambda: uc.moe.combine_static(x, "not a handle"))
    for name, bad in (("capacity -1", dict(capacity=-1)), ("capacity None", dict(capacity=None)),
                      ("overflow value", dict(overflow="raise")), ("overflow type", dict(overflow=1))):  # fmt: skip
        caught(name, lambda bad=bad: uc.moe.dispatch_static(x, i, **{"experts_per_rank": E, "capacity": C, **bad}))
    uc.finalize()
    caught("ended", lambda: uc.moe.combine_static(torch.zeros(E, world * C, DIM, dtype=x.dtype), handle))
    uc.init()
    return seen


SIZES = {"gloo": 3, "mpi": 2}
"""The world size of each backend's shared world (helpers/several.py) for the cases below."""

WHOLE_WORLD = {
    backend: share(
        backend, size, [Case("static: gradients", _gradients), Case("static: tasks and groups", _tasks_and_groups)]
    )
    for backend, size in SIZES.items()
}


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_gradients_redispatch_tasks_and_groups_match_the_whole_world(backend: str) -> None:
    for name in ("static: gradients", "static: tasks and groups"):
        assert SESSION.results(WHOLE_WORLD[backend], name) == [[]] * SIZES[backend], name


def _capacities_disagree(rank: int) -> str:
    """Each rank computes its capacity from its own tokens (a likely mistake), outside check
    mode: on a host backend the capacities travel beside the counts, so every rank raises the
    same error before a row moves, then the world goes on."""
    x = torch.ones(4 + rank, 3)
    ids = torch.zeros(4 + rank, K, dtype=torch.int64)
    try:
        uc.moe.dispatch_static(x, ids, experts_per_rank=E, capacity=2 + rank)
    except uc.CrossRankMismatchError as exc:
        message = str(exc)
    else:
        message = "no error"
    rows, _, _ = uc.moe.dispatch_static(x, ids, experts_per_rank=E, capacity=2)
    return message if rows.shape == (E, uc.get_world_size() * 2, 3) else "the next call failed"


CAPACITIES = {backend: share(backend, size, [Case("static: capacities disagree", _capacities_disagree)])
              for backend, size in SIZES.items()}  # fmt: skip


@pytest.mark.parametrize(("backend", "world", "handshake"), [("gloo", 3, "1"), ("mpi", 2, "1"), ("gloo", 2, "0")])
def test_ranks_with_different_capacities_get_the_same_error(backend: str, world: int, handshake: str) -> None:
    """The handshake finds it first (the shared worlds keep it on); without it, the capacities
    told beside the counts do."""
    if handshake == "1":
        messages = SESSION.results(CAPACITIES[backend], "static: capacities disagree")
    else:
        messages = uc.testing.spawn(_capacities_disagree, world, backend=backend, env={"UNICOLL_HANDSHAKE": "0"})
    told = ", ".join(f"rank {c}: {2 + c}" for c in range(world))
    expected = {
        "1": "moe.dispatch_static: ranks disagree: rank 0 passes capacity=2 but rank 1 passes 3",
        "0": f"moe.dispatch_static: capacity: expected the same capacity on every rank, got {told}",
    }
    assert messages == [expected[handshake]] * world


def _on_the_device_path(rank: int) -> list[str]:
    """Restart this rank on torch-nccl's transport driving gloo, then run the tests above: the
    device path (even all-to-alls of whole blocks, padding included, and the array-API layout
    and sums, with their gradients), which a host backend does not take."""
    restart_on_the_device_path("nccl-static")
    return _gradients(rank) + _tasks_and_groups(rank)


def test_the_device_path_matches_the_whole_world_on_the_host() -> None:
    assert uc.testing.spawn(_on_the_device_path, 3, backend="gloo") == [[]] * 3


def test_check_mode_and_overflow_error_fail_on_every_rank_alike() -> None:
    reports = uc.testing.spawn(_errors, 3, backend="gloo", env={"UNICOLL_CHECK": "1"})
    for name in reports[0]:
        assert len({r[name] for r in reports}) == 1 or name in ("ids place", "handle", "ended", "ids dtype"), name
    first = reports[0]
    assert "CrossRankMismatchError" in first["capacity"] and "capacity" in first["capacity"]
    assert f"expert id {3 * E}" in first["id"] and "rank 2" in first["id"]
    assert first["overflow"].startswith("ValueError: moe.dispatch_static: capacity")
    assert "would be dropped" in first["overflow"]
    assert first["room"] == "no error"
    assert first["combine shape"].startswith("ValueError: moe.dispatch_static") is False
    assert "moe.combine_static" in first["combine shape"] and "y" in first["combine shape"]
    for report in reports:
        assert report["ids dtype"].startswith("TypeError: moe.dispatch_static: topk_idx")
        assert report["ids place"].startswith("TypeError: moe.dispatch_static: topk_idx")
        assert report["handle"].startswith("TypeError: moe.combine_static: handle")
        assert report["ended"].startswith("ValueError: moe.combine_static: handle")
        assert report["capacity -1"] == "ValueError: moe.dispatch_static: capacity: expected a non-negative int, got -1"
        assert report["capacity None"] == "TypeError: moe.dispatch_static: capacity: expected an int, got NoneType"
        assert report["overflow value"] == (
            "ValueError: moe.dispatch_static: overflow: expected one of 'drop', 'error', got 'raise'"
        )
        assert report["overflow type"].startswith(
            "TypeError: moe.dispatch_static: overflow: expected one of the strings"
        )
