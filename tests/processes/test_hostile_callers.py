"""Callers who get it wrong on one rank: disagreeing entry points and groups, two threads,
outputs that alias inputs. Each case ends in the right result or the same clear error on every
rank, and the world is still in step afterwards (a good call after each case lines up).

The cases of a backend that share a world size and a check setting run in the session's shared
world of them (helpers/several.py): each world costs more to start than its cases take."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

import unicoll as uc
from helpers.several import SESSION, Case, share
from helpers.signals import send, signal_path, wait_for
from unicoll import entry, reference

W = 3
X = np.arange(12, dtype=np.float32).reshape(6, 2)


def _in_step(rank: int) -> None:
    """A good call right after a case: it lines up only if no rank is left behind."""
    gathered = uc.all_gather(None, np.array([rank], np.int64))
    assert gathered.tolist() == list(range(uc.get_world_size()))


def _outcome(call) -> str:
    try:
        call()
    except Exception as exc:  # recorded, asserted in the parent
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _on_thread(name: str, call) -> str:
    """Run ``call`` on a new thread called ``name``; its outcome."""
    result: list[str] = []
    thread = threading.Thread(target=lambda: result.append(_outcome(call)), name=name)
    thread.start()
    thread.join()
    return result[0]


def disagreements(rank: int) -> dict[str, str]:
    """Entry points and groups that differ between rank 0 and the others."""
    seen = {}
    seen["new_group lists"] = _outcome(lambda: uc.new_group([0, 1] if rank == 0 else [1, 2]))
    _in_step(rank)
    seen["new_group invalid on one rank"] = _outcome(lambda: uc.new_group([5] if rank == 1 else [0, 2]))
    _in_step(rank)
    pair = uc.new_group([0, 2])  # agreeing lists still make a working group
    if rank != 1:
        assert uc.all_gather(None, np.array([rank]), group=pair).tolist() == [0, 2]
    if not uc.runtime.state("test").check:  # the rest would crash gloo without check mode
        return seen
    counts = [1, 2, 3] if rank == 0 else [1, 2, 3, 4, 5, 6]
    seen["exchange_counts lengths"] = _outcome(lambda: uc.exchange_counts(counts))
    _in_step(rank)
    seen["exchange_counts against barrier"] = _outcome(
        lambda: uc.exchange_counts([1, 2, 3]) if rank == 0 else uc.barrier()
    )
    _in_step(rank)
    seen["barrier against all_gather"] = _outcome(lambda: uc.barrier() if rank == 0 else uc.all_gather(None, X))
    _in_step(rank)
    seen["differently named threads"] = _on_thread(
        "worker" if rank == 0 else "MainThread", lambda: uc.alltoall_single(None, X)
    )
    _in_step(rank)
    if rank == 0:  # fails here, before anything is sent, and rank 0 goes on as if nothing happened
        seen["a rank skips a call"] = _outcome(lambda: uc.global_scatter(X[:5], [2] * 3, [2] * 3))
        seen["the call after the skip"] = _outcome(lambda: uc.alltoall_single(None, X))
    else:
        seen["a rank skips a call"] = _outcome(lambda: uc.global_scatter(X, [2] * 3, [2] * 3))
    _in_step(rank)
    return seen


CHECKED = "CrossRankMismatchError: {op}: ranks disagree: "
NEW_GROUP_MESSAGES = {
    "new_group lists": ["CrossRankMismatchError: new_group: ranks: expected the same ranks on every rank of the world, got [0, 1] on rank 0 and [1, 2] on rank 1"] * 3,
    "new_group invalid on one rank": [
        "CrossRankMismatchError: new_group: ranks: rank 1 passed an invalid list of ranks (see its error)",
        "ValueError: new_group: ranks: expected a non-empty list of world ranks in [0, 3), got [5]",
        "CrossRankMismatchError: new_group: ranks: rank 1 passed an invalid list of ranks (see its error)",
    ],
}  # fmt: skip


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
@pytest.mark.parametrize("check", [True, False], ids=["check", "no-check"])
def test_disagreements_end_in_the_same_error_on_every_rank(backend: str, check: bool) -> None:
    outcomes = _results(backend, check, "disagreements")
    for label, per_rank in NEW_GROUP_MESSAGES.items():  # new_group is compared, check mode or not
        assert [seen[label] for seen in outcomes] == per_rank, label
    if not check:
        return
    number = int(outcomes[1]["a rank skips a call"].split("collective number ")[1].split()[0])
    for rank, seen in enumerate(outcomes):
        assert seen["exchange_counts lengths"] == CHECKED.format(op="exchange_counts") + (
            "rank 0 passes 3 counts or sizes but rank 1 passes 6"
        )
        assert seen["exchange_counts against barrier"] == CHECKED.format(
            op="exchange_counts" if rank == 0 else "barrier"
        ) + ("rank 0 calls exchange_counts but rank 1 calls barrier")
        assert seen["barrier against all_gather"] == CHECKED.format(op="barrier" if rank == 0 else "all_gather") + (
            "rank 0 calls barrier but rank 1 calls all_gather"
        )
        assert seen["differently named threads"].startswith(
            CHECKED.format(op="alltoall_single") + "rank 0 and rank 1 issue it from differently named threads"
        ), seen["differently named threads"]
        if rank == 0:
            assert seen["a rank skips a call"] == (
                "ValueError: global_scatter: local_count: expected sum(local_count) equal to the number of rows "
                "of x, got sum(local_count)=6 for x with 5 rows"
            )
        after = seen["the call after the skip" if rank == 0 else "a rank skips a call"]
        assert after.startswith(
            CHECKED.format(op="alltoall_single" if rank == 0 else "global_scatter")
            + f"rank 0 is at its collective number {number} on this group but rank 1 at number {number - 1}: "
            "a rank skipped or added a call"
        ), after


def threads_at_once(rank: int, signal: str) -> dict[str, object]:
    """Rank 0's worker thread sits inside all_gather while rank 0's main thread tries to issue a
    collective: the main thread is refused at once, while the worker is still inside (the
    others' workers join only once rank 0 sends ``signal``, a path of helpers/signals.py)."""
    results: dict[str, object] = {}
    worker = threading.Thread(
        target=lambda: results.update(gathered=uc.all_gather(None, np.array([rank])).tolist()), name="worker"
    )
    if rank == 0:
        worker.start()
        while not entry._lock.locked():  # the worker is inside all_gather, which waits for its peers
            time.sleep(0.001)
        results["main"] = _outcome(lambda: uc.alltoall_single(None, X))
        results["worker_inside"] = worker.is_alive()
        send(signal)
    else:
        wait_for(signal)
        worker.start()
    worker.join()
    _in_step(rank)
    return results


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_second_thread_inside_an_operator_is_refused(backend: str) -> None:
    outcomes = _results(backend, True, "threads at once")
    assert all(seen["gathered"] == [0, 1, 2] for seen in outcomes)
    assert outcomes[0]["main"] == (
        "RuntimeError: alltoall_single: thread 'MainThread' called it while thread 'worker' is inside all_gather; "
        "unicoll's collectives must be issued from one thread at a time, in the same order on every rank"
    )
    assert outcomes[0]["worker_inside"], "refused only once the worker's all_gather was over"


def racing_threads(rank: int, calls: int) -> dict[str, int]:
    """Two threads issue all-to-alls at once with no coordination and retry when refused, so
    the ranks pair their calls in different orders. Every result is either right or an
    exception: count them, and any silently wrong one."""
    tally = {"right": 0, "wrong": 0, "errors": 0, "refused": 0}
    world = uc.get_world_size()
    pauses = random.Random(rank)

    def issue(thread: int) -> None:
        i = 0
        while i < calls:
            mine = np.full((world, 4), 1000 * thread + 10 * i + rank, np.int64)
            try:
                got = uc.alltoall_single(None, mine)
            except RuntimeError as exc:
                if "must be issued from one thread at a time" in str(exc):
                    tally["refused"] += 1  # nothing was sent: try again, as a careless program would
                    time.sleep(0)
                    continue
                tally["errors"] += 1  # the peers disagreed or timed out: stop
                return
            except ValueError:  # CrossRankMismatchError: stop
                tally["errors"] += 1
                return
            expected = [1000 * thread + 10 * i + c for c in range(world)]
            tally["right" if got[:, 0].tolist() == expected else "wrong"] += 1
            i += 1
            time.sleep(pauses.uniform(0, 1e-3))  # each rank lets the other thread in at other times

    threads = [threading.Thread(target=issue, args=(t,), name=f"issuer-{t}") for t in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return tally


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_racing_threads_in_check_mode_never_give_a_wrong_result(backend: str) -> None:
    env = {"UNICOLL_CHECK": "1", "UNICOLL_TIMEOUT": "3"}
    for tally in uc.testing.spawn(racing_threads, 2, 40, backend=backend, env=env, timeout=60):
        assert tally["wrong"] == 0, tally
        assert tally["right"] + tally["errors"] > 0, tally


def aliasing(rank: int) -> dict[str, bool]:
    """Outputs that are, or overlap, the input: staged through a copy, so the answer is right."""
    world = uc.get_world_size()
    n = 7 * world
    rows = [np.arange(16 * world, dtype=np.float64).reshape(8 * world, 2) + 1000 * r for r in range(world)]
    results = {}
    for library, make in (("numpy", np.copy), ("torch", lambda a: torch.from_numpy(a.copy()))):
        x = make(rows[rank])
        results[f"{library} alltoall_single(x, x)"] = np.array_equal(
            np.asarray(uc.alltoall_single(x, x)), reference.alltoall_single(rows)[rank]
        )
        out = make(np.zeros((8 * world, 2)))
        out[rank * 8 : (rank + 1) * 8] = make(rows[rank][:8])
        uc.all_gather(out, out[rank * 8 : (rank + 1) * 8])  # the in-place all_gather idiom
        results[f"{library} all_gather into its own input"] = np.array_equal(
            np.asarray(out), np.concatenate([r[:8] for r in rows])
        )
        x = make(rows[rank])
        got = uc.alltoall_single(x[world:], x[:n])  # out_tensor starts `world` rows into in_tensor
        results[f"{library} overlapping halves"] = np.array_equal(
            np.asarray(got), reference.alltoall_single([r[:n] for r in rows])[rank]
        )
        parts = [make(rows[rank][8 * c : 8 * c + 8]) for c in range(world)]
        got = uc.alltoall(parts, parts)  # the output list is the input list
        expected = reference.alltoall([[r[8 * c : 8 * c + 8] for c in range(world)] for r in rows])[rank]
        results[f"{library} alltoall(parts, parts)"] = got is parts and all(
            np.array_equal(np.asarray(a), b) for a, b in zip(got, expected)
        )
        x = make(rows[rank])
        results[f"{library} alltoall(x, x)"] = np.array_equal(
            np.asarray(uc.alltoall(x, x)), reference.alltoall_single(rows)[rank]
        )
    _in_step(rank)
    return results


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_outputs_that_alias_inputs_give_the_right_answer(backend: str) -> None:
    for results in _results(backend, False, "aliasing"):
        assert all(results.values()), results


def _case_names(check: bool) -> list[str]:
    """The cases of a world: the disagreements first, then the case that shares its setting."""
    return ["disagreements", "threads at once" if check else "aliasing"]


def _world_cases(backend: str, check: bool) -> list[Case]:
    functions = {"disagreements": disagreements, "threads at once": threads_at_once, "aliasing": aliasing}
    arguments = {"threads at once": (signal_path(f"threads-at-once-{backend}"),)}
    return [Case(f"hostile callers: {name}", functions[name], arguments.get(name, ())) for name in _case_names(check)]


#: Each backend's cases in the session's shared worlds of W ranks (helpers/several.py), in check
#: mode and not, by (backend, check mode).
WORLDS = {
    (backend, check): share(backend, W, _world_cases(backend, check), check=check)
    for backend in ("gloo", "mpi")
    for check in (True, False)
}


def _results(backend: str, check: bool, name: str) -> list:
    """Case ``name``'s results on each rank of the world of ``backend`` and ``check``."""
    return SESSION.results(WORLDS[backend, check], f"hostile callers: {name}")
