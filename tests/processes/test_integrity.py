"""Verification (``init(verify=...)``) on real worlds of 2 ranks, gloo, mpi and a GPU backend's
logic over gloo (torch-nccl's transport, its checksums through the array API): clean calls give
the unverified results, and a block that a transport changed (helpers/corrupting.py, a plugin
backend) raises the same IntegrityError on every rank, naming the operator, the ranks and
the call, whatever the kind of corruption, the operator, the direction (forward, backward)
or the way the call completes (at once, a Task)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

import unicoll as uc
from helpers import corrupting
from helpers.cpu_backends import BACKENDS
from helpers.several import SESSION, Case, share
from helpers.sync_counter import SyncCounter
from unicoll import checksums

W = 2

DEVICE_PATH = "device-path"
"""torch-nccl's transport driving gloo, its checksums through the array API as on a device."""

BASES = [*BACKENDS, DEVICE_PATH]

_HOST_NUMBERS = checksums.host_numbers


def _init(base: str, verify: float = 1.0) -> None:
    """A new session on ``base`` behind the corrupting transport, verified at ``verify``."""
    uc.finalize()
    corrupting.register()
    if base == DEVICE_PATH:  # the checksums as a device runs them: no numpy view of the rows
        checksums.host_numbers = lambda x: None
    uc.init(f"corrupting-{base}", verify=verify)


def _back_to(base: str) -> None:
    """The world's own session again, for the cases after this one."""
    assert not corrupting.armed()
    uc.finalize()
    checksums.host_numbers = _HOST_NUMBERS
    uc.init("gloo" if base == DEVICE_PATH else base)


def _outcome(fn) -> str:
    """``"ok"``, or the IntegrityError's message (any other exception propagates)."""
    try:
        fn()
    except uc.IntegrityError as exc:
        return str(exc)
    return "ok"


def _rows(rank: int) -> torch.Tensor:
    """Four rows of 3 floats per rank, a NaN among them (two rows to each peer)."""
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3) + 100 * rank
    x[0, 1] = float("nan")
    x[2, 1] = float("nan")
    return x


def _clean_calls(rank: int, base: str) -> dict:
    """Every operator, both MoE modes and their backward passes under verification: the
    results as plain ones."""
    _init(base)
    x = _rows(rank)
    ids = torch.tensor([[0, 3], [1, 2], [3, -1], [2, 0]])
    weights = torch.full((4, 2), 0.5)
    results = {
        "backend": uc.get_backend(),
        "alltoall_single": uc.alltoall_single(None, x).tolist(),
        "task": uc.alltoall_single(None, x, sync_op=False).wait().tolist(),
        "all_gather": uc.all_gather(None, x[: rank + 1]).tolist(),
        "all_reduce": uc.all_reduce(torch.ones(5) * (rank + 1)).tolist(),
        "avg": uc.all_reduce(torch.full((3, 2), 0.1 * (rank + 1), dtype=torch.float64), op="avg").tolist(),
        "ints": uc.all_reduce(np.full(4, 2**62, dtype=np.int64)).tolist(),
        "reduce_scatter": uc.reduce_scatter(None, torch.arange(4.0) + rank).tolist(),
        "broadcast": uc.broadcast(x.clone(), 1).tolist(),
    }
    if base == DEVICE_PATH:  # the host reads a GPU would make: the one of the gathered records, no upload
        calls = {
            "alltoall_single": lambda: uc.alltoall_single(None, x),
            "all_reduce": lambda: uc.all_reduce(x),
            "uneven all_gather": lambda: uc.all_gather(None, x[: rank + 1]),
            "moe.dispatch": lambda: uc.moe.dispatch(x, ids, weights, experts_per_rank=2),
        }
        for name, call in calls.items():
            with SyncCounter(uploads=True) as reads:
                call()
            results[f"reads: {name}"] = dict(reads.kinds)
    y = torch.randn(4, 3, requires_grad=True, generator=torch.Generator().manual_seed(rank))
    rows, _, handle = uc.moe.dispatch(y, ids, weights, experts_per_rank=2)
    uc.moe.combine(rows * 2, handle).sum().backward()
    results["dynamic grad"] = y.grad.tolist()
    y.grad = None
    blocks, _, static = uc.moe.dispatch_static(y, ids, weights, experts_per_rank=2, capacity=4)
    uc.moe.combine_static(blocks * 2, static).sum().backward()
    results["static grad"] = y.grad.tolist()
    _back_to(base)
    return results


def _plain(rank: int) -> dict:
    """What :func:`_clean_calls` computes, by hand."""
    peer = 1 - rank
    mine, theirs = _rows(rank), _rows(peer)
    exchanged = [mine, theirs] if rank == 0 else [theirs, mine]
    return {
        "alltoall_single": torch.cat([exchanged[0][2 * rank : 2 * rank + 2], exchanged[1][2 * rank : 2 * rank + 2]]),
        "all_gather": torch.cat([_rows(0)[:1], _rows(1)[:2]]),
        "broadcast": _rows(1),
    }


def _corrupted(rank: int, base: str) -> dict:
    """Each kind of corruption on each operator and direction; the outcome on this rank."""
    _init(base)
    x = _rows(rank)
    outcomes = {}
    for kind in corrupting.KINDS:
        corrupting.arm(kind, source=0, receiver=1)
        outcomes[f"alltoall_single: {kind}"] = _outcome(lambda: uc.alltoall_single(None, x))
    outcomes["after the errors"] = uc.alltoall_single(None, x).tolist()
    corrupting.arm("bit", source=0, receiver=1)
    task = uc.alltoall_single(None, x, sync_op=False)
    outcomes["task"] = _outcome(task.wait)
    outcomes["task again"] = _outcome(task.wait)  # the same error, not the rows
    corrupting.arm("bit", source=0, receiver=0)
    outcomes["all_gather"] = _outcome(lambda: uc.all_gather(None, x))
    corrupting.arm("bit", source=1, receiver=0)
    outcomes["broadcast"] = _outcome(lambda: uc.broadcast(x.clone(), 1))
    corrupting.arm("bit", source=0, receiver=1)
    outcomes["all_reduce"] = _outcome(lambda: uc.all_reduce(torch.arange(8.0)))
    ids = torch.tensor([[0, 3], [1, 2], [3, -1], [2, 0]])
    weights = torch.full((4, 2), 0.5)
    y = (torch.arange(12.0).reshape(4, 3) + 10 * rank).requires_grad_()
    corrupting.arm("swapped rows", source=1, receiver=0)
    outcomes["moe.dispatch"] = _outcome(lambda: uc.moe.dispatch(y, ids, weights, experts_per_rank=2))
    rows, _, handle = uc.moe.dispatch(y, ids, weights, experts_per_rank=2)
    combined = uc.moe.combine(rows * 2, handle)
    corrupting.arm("zeros", source=0, receiver=1)
    outcomes["backward"] = _outcome(lambda: combined.sum().backward())
    corrupting.arm("bit", source=1, receiver=0)
    outcomes["moe.dispatch_static"] = _outcome(
        lambda: uc.moe.dispatch_static(y, ids, weights, experts_per_rank=2, capacity=4)
    )
    _back_to(base)
    return outcomes


def _orders(rank: int, base: str) -> dict:
    """Tasks waited for in other orders and at other places on the two ranks (legal without
    verification): the checks' exchanges pair up all the same (their own group, issued in the
    calls' order), so every result is the verified one; a dropped task, a polled one, and a
    corrupted one whose check began at a later call and raised at its wait."""
    _init(base)
    x = _rows(rank)
    got = {}
    moved, summed = uc.alltoall_single(None, x, sync_op=False), uc.all_reduce(torch.ones(3) * (rank + 1), sync_op=False)
    first, second = (moved, summed) if rank == 0 else (summed, moved)
    first.wait(), second.wait()
    got["other orders"] = [moved.wait().tolist(), summed.wait().tolist()]
    pair = uc.new_group([0, 1])
    for name, group in (("before and after a call", None), ("across groups", pair)):
        task = uc.alltoall_single(None, x, sync_op=False)
        early = task.wait() if rank == 0 else None
        reduced = uc.all_reduce(torch.ones(2), group=group)
        late = task.wait() if rank == 1 else early
        got[name] = [late.tolist(), reduced.tolist()]
    uc.alltoall_single(None, x, sync_op=False)  # dropped
    got["after a dropped task"] = uc.alltoall_single(None, x).tolist()
    polled = uc.alltoall_single(None, x, sync_op=False)
    deadline = time.monotonic() + 60
    while not polled.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    got["polled"] = polled.wait(timeout=0).tolist()
    corrupting.arm("bit", source=0, receiver=1)
    corrupted = uc.alltoall_single(None, x, sync_op=False)
    uc.barrier()  # starts the check
    got["checked at a later call"] = _outcome(corrupted.wait)
    _back_to(base)
    return got


def _hostile(rank: int, base: str) -> dict:
    """Verification against hostile callers: sums that overflow or hold NaN (legal, never an
    IntegrityError), a task waited for on another thread while this one calls, a rank that
    raises between a checked task's issue and its wait, and a forked child."""
    _init(base)
    got = {
        "overflow": uc.all_reduce(torch.full((4,), 3e38)).tolist(),
        "nan": uc.all_reduce(torch.tensor([float("nan"), 1.0])).tolist(),
        "ints wrap": uc.all_reduce(torch.full((2,), 2**62, dtype=torch.int64)).tolist(),
    }
    x = _rows(rank)
    task = uc.alltoall_single(None, x, sync_op=False)
    waited = {}
    thread = threading.Thread(target=lambda: waited.update(rows=task.wait()))
    thread.start()
    got["beside the thread"] = uc.all_reduce(torch.ones(2)).tolist()  # starts the task's check on this thread
    thread.join(60)
    got["waited on a thread"] = waited["rows"].tolist()
    task = uc.alltoall_single(None, x, sync_op=False)
    try:
        if rank == 1:
            raise KeyError("a bug between issue and wait")
        task.wait()
    except KeyError:
        pass
    # rank 1 never waited for it: its check starts at the next call that blocks, and rank 0's wait returned
    got["after a rank raised"] = uc.alltoall_single(None, x).tolist()
    pid = os.fork()
    if pid == 0:  # the child may not touch the parent's transport: a clean error, then it exits
        try:
            uc.alltoall_single(None, x)
        except RuntimeError as exc:
            os._exit(0 if "fork" in str(exc) else 2)
        os._exit(3)
    got["child"] = os.waitpid(pid, 0)[1]
    got["after the fork"] = uc.alltoall_single(None, x).tolist()
    _back_to(base)
    return got


def _sampled(rank: int, base: str) -> list:
    """At a share of 0.5, calls 0, 2, 4 are checked (the same on every rank), 1 and 3 are not."""
    _init(base, verify=0.5)
    x = _rows(rank)
    seen = []
    for _ in range(4):
        corrupting.arm("bit", source=0, receiver=1)
        seen.append(_outcome(lambda: uc.alltoall_single(None, x)) != "ok")
    _back_to(base)
    return seen


CASES = ("clean calls", "corrupted", "orders", "hostile", "sampled")


def _name(case: str, base: str) -> str:
    return f"integrity: {case} ({base})"


WORLDS = {
    base: share(
        "gloo" if base == DEVICE_PATH else base,
        W,
        [
            Case(_name(case, base), fn, (base,))
            for case, fn in zip(CASES, (_clean_calls, _corrupted, _orders, _hostile, _sampled))
        ],
        last=True,
    )
    for base in ("gloo", "mpi", DEVICE_PATH)
}


def _results(base: str, case: str) -> list:
    return SESSION.results(WORLDS[base], _name(case, base))


@pytest.mark.parametrize("backend", BASES)
def test_verified_calls_give_the_plain_results(backend: str) -> None:
    results = _results(backend, "clean calls")
    assert {got["backend"] for got in results} == {
        "corrupting-torch-nccl" if backend == DEVICE_PATH else f"corrupting-{backend}"
    }
    for rank, got in enumerate(results):
        plain = _plain(rank)
        for name in ("alltoall_single", "all_gather", "broadcast"):
            assert torch.equal(torch.tensor(got[name]).nan_to_num(-1), plain[name].nan_to_num(-1)), name
        assert torch.equal(torch.tensor(got["task"]).nan_to_num(-1), plain["alltoall_single"].nan_to_num(-1))
        assert got["all_reduce"] == [3.0] * 5
        assert np.allclose(got["avg"], 0.15)
        assert got["ints"] == [-(2**63)] * 4  # wrapped, as the transport sums them
        assert got["reduce_scatter"] == [[1.0, 3.0], [5.0, 7.0]][rank]
        if backend == DEVICE_PATH:  # one read per checked call, after the call's own read of counts (if any)
            reads = {name[len("reads: ") :]: kinds for name, kinds in got.items() if name.startswith("reads: ")}
            assert {name: sum(kinds.values()) for name, kinds in reads.items()} == {
                "alltoall_single": 1,
                "all_reduce": 1,
                "uneven all_gather": 2,
                "moe.dispatch": 2,
            }, reads
    for got in results:  # each token's gradient: 2 * 0.5 per kept slot
        assert got["dynamic grad"] == [[2.0] * 3, [2.0] * 3, [1.0] * 3, [2.0] * 3]
        assert got["static grad"] == got["dynamic grad"]


@pytest.mark.parametrize("backend", BASES)
def test_each_kind_of_corruption_raises_on_every_rank(backend: str) -> None:
    results = _results(backend, "corrupted")
    for kind in corrupting.KINDS:
        messages = [got[f"alltoall_single: {kind}"] for got in results]
        assert messages[0] == messages[1] != "ok", kind  # the same error on both ranks
        assert "alltoall_single on Group(ranks=[0, 1])" in messages[0]
        assert "the block rank 0 sent to rank 1 arrived different" in messages[0]
        assert ", call " in messages[0]
    for rank, got in enumerate(results):  # the session goes on after the errors, with the right rows
        after = torch.tensor(got["after the errors"]).nan_to_num(-1)
        assert torch.equal(after, _plain(rank)["alltoall_single"].nan_to_num(-1))
    for name, says in {
        "task": "rank 0 sent to rank 1",
        "task again": "rank 0 sent to rank 1",
        "all_gather": "rank 0 sent to rank 0",
        "broadcast": "rank 1 sent to rank 0",
        "all_reduce": "rank 1's result differs from rank 0's",
        "moe.dispatch": "moe.dispatch on",
        "backward": "(backward)",
        "moe.dispatch_static": "moe.dispatch_static on",
    }.items():
        messages = [got[name] for got in results]
        assert messages[0] == messages[1] != "ok", name
        assert says in messages[0], (name, messages[0])


@pytest.mark.parametrize("backend", BASES)
def test_tasks_waited_in_other_orders_and_places_are_checked(backend: str) -> None:
    results = _results(backend, "orders")
    for rank, got in enumerate(results):
        moved = _plain(rank)["alltoall_single"].nan_to_num(-1)
        assert torch.equal(torch.tensor(got["other orders"][0]).nan_to_num(-1), moved)
        assert got["other orders"][1] == [3.0] * 3
        for name in ("before and after a call", "across groups"):
            assert torch.equal(torch.tensor(got[name][0]).nan_to_num(-1), moved), name
            assert got[name][1] == [2.0, 2.0], name
        for name in ("after a dropped task", "polled"):
            assert torch.equal(torch.tensor(got[name]).nan_to_num(-1), moved), name
    messages = [got["checked at a later call"] for got in results]
    assert messages[0] == messages[1] != "ok"
    assert "the block rank 0 sent to rank 1 arrived different" in messages[0]


@pytest.mark.parametrize("backend", BASES)
def test_hostile_callers_get_the_results_or_clean_errors(backend: str) -> None:
    results = _results(backend, "hostile")
    for rank, got in enumerate(results):
        moved = _plain(rank)["alltoall_single"].nan_to_num(-1)
        assert got["overflow"] == [float("inf")] * 4
        assert np.isnan(got["nan"][0]) and got["nan"][1] == 2.0
        assert got["ints wrap"] == [-(2**63)] * 2
        assert got["beside the thread"] == [2.0, 2.0]
        for name in ("waited on a thread", "after a rank raised", "after the fork"):
            assert torch.equal(torch.tensor(got[name]).nan_to_num(-1), moved), name
        assert got["child"] == 0  # the forked child got the fork's error, not a transfer


@pytest.mark.parametrize("backend", BASES)
def test_the_sample_is_the_same_calls_on_every_rank(backend: str) -> None:
    results = _results(backend, "sampled")
    assert results[0] == results[1] == [True, False, True, False]


def _settings_disagree(rank: int) -> str:
    """Rank 0 starts with verification on, rank 1 with it off (timeout 3 s): the error each gets."""
    uc.finalize()
    try:
        uc.init("gloo", verify=rank == 0, timeout=3)
        uc.alltoall_single(None, torch.ones(2, 1))
    except uc.CommunicationError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def test_ranks_that_disagree_on_verification_get_clean_errors() -> None:
    started = time.monotonic()
    verifying, plain = uc.testing.spawn(_settings_disagree, 2, backend="gloo", timeout=60)
    assert verifying.startswith("CollectiveTimeoutError: init on backend 'gloo' (rank 0 of 2)"), verifying
    assert "start every rank with verification on, or every rank with it off" in verifying
    assert plain.startswith("CollectiveTimeoutError: alltoall_single on Group(ranks=[0, 1])"), plain
    assert time.monotonic() - started < 45
