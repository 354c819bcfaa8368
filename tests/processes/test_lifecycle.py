"""A process's life around unicoll: children forked from an initialized rank, and init() again
after finalize() while groups, tasks and autograd graphs of the old session are still held.

The fork tests run this file as the script of a 2-rank world (``unicoll run -n 2
tests/processes/test_lifecycle.py BACKEND``, ``--mpi`` for mpi): rank 0 forks three children that each
try unicoll, report what they got as one JSON line and exit in their own way; the parent
reports how each child exited and what its collectives returned afterwards.

The init-again cases run last in the session's shared worlds (helpers/several.py): a world
costs more to start than these cases take.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from functools import partial

import numpy as np
import pytest
import torch

import unicoll as uc
from unicoll import registry

EXITS = {"return": 0, "sys.exit": 3, "raise": 1}  # how each child ends, and the status it must end with
OPERATORS_AND_QUERIES = (
    "all_gather",
    "alltoall_single",
    "global_scatter",
    "global_gather",
    "exchange_counts",
    "barrier",
    "new_group",
    "get_rank",
    "get_world_size",
    "get_backend",
)
CHILD_WATCH_S = 10.0  # a child not gone by then hangs: it is killed and reported as "hung"
WORLD_TIMEOUT_S = 60  # the fork test's UNICOLL_TIMEOUT: a child's refusals come long before it, even on busy cores


def _skip_unless_usable(backend: str) -> None:
    """Skip the test where ``backend`` cannot run (probed here, not at import: probing mpi
    initializes MPI, which the gloo ranks of this file run as a script must not have)."""
    reason = registry.registered()[backend].probe()
    if reason is not None:
        pytest.skip(f"backend {backend} is not usable here: {reason}")


# -- forked children -------------------------------------------------------------------------


def _outcome(call) -> str:
    """What ``call()`` did: ``"ok"``, or the type and message of what it raised."""
    try:
        call()
    except Exception as exc:  # reported to the test, which asserts on the type and the message
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _child_attempts(backend: str, group: uc.Group, task: uc.Task, graph: torch.Tensor) -> dict[str, str]:
    """Everything a forked child might try with the parent's unicoll, and what each got."""
    x = np.arange(4.0).reshape(2, 2)
    return {
        "all_gather": _outcome(lambda: uc.all_gather(None, x)),
        "alltoall_single": _outcome(lambda: uc.alltoall_single(None, x, group=group)),
        "global_scatter": _outcome(lambda: uc.global_scatter(x, [1, 1], [1, 1])),
        "global_gather": _outcome(lambda: uc.global_gather(x, [1, 1], [1, 1])),
        "exchange_counts": _outcome(lambda: uc.exchange_counts([1, 1])),
        "barrier": _outcome(lambda: uc.barrier(group)),
        "new_group": _outcome(lambda: uc.new_group([0, 1])),
        "get_rank": _outcome(lambda: uc.get_rank(group)),
        "get_world_size": _outcome(uc.get_world_size),
        "get_backend": _outcome(uc.get_backend),
        "init": _outcome(lambda: uc.init(backend)),
        "Task.wait": _outcome(task.wait),
        "Task.is_completed": _outcome(task.is_completed),
        "backward": _outcome(lambda: graph.sum().backward(retain_graph=True)),
        "is_initialized": str(uc.is_initialized()),
        "finalize": _outcome(uc.finalize),
    }


def _child(how: str, backend: str, group: uc.Group, task: uc.Task, graph: torch.Tensor) -> None:
    """A forked child: try unicoll, report, then end as ``how`` says (``"return"`` falls off
    the end of the script)."""
    start = time.monotonic()
    attempts = _child_attempts(backend, group, task, graph)
    print(json.dumps({"child": how, "attempts": attempts, "seconds": time.monotonic() - start}), flush=True)
    if how == "sys.exit":
        sys.exit(EXITS[how])
    if how == "raise":
        raise RuntimeError("the forked child fails")


def _wait_for_child(pid: int) -> int | str:
    """The exit status of child ``pid``, or ``"hung"`` (it is killed) after :data:`CHILD_WATCH_S`."""
    deadline = time.monotonic() + CHILD_WATCH_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"


def fork_world(backend: str, mpi_beside: bool) -> None:
    """One rank of the fork test (this file run as a script): rank 0 forks a child per way of
    ending while a task and an autograd graph of the world are in flight; then every rank checks
    that the world, the group, the task and the graph still give the right results, and that the
    world can finalize() and init() again while a forked child still lives.
    ``mpi_beside``: probe the mpi backend first, as ``unicoll info`` does, which initializes MPI."""
    if mpi_beside:
        registry.registered()["mpi"].probe()
    uc.init(backend)
    rank = uc.get_rank()
    group = uc.new_group([0, 1])
    task = uc.all_gather(None, np.array([rank], np.int64), sync_op=False)
    x = torch.full((2, 1), float(rank + 1), requires_grad=True)
    graph = uc.alltoall_single(None, x, group=group)
    exits = {}
    for how in EXITS:
        if rank == 0:
            pid = os.fork()
            if pid == 0:
                _child(how, backend, group, task, graph)
                return  # falls off the end of the script: the interpreter's normal exit
            exits[how] = _wait_for_child(pid)
        uc.barrier()
    graph.sum().backward()
    after = {
        "task": task.wait().tolist(),
        "world": uc.all_gather(None, np.array([rank + 10], np.int64)).tolist(),
        "group": uc.alltoall_single(None, np.array([[rank], [rank + 20]]), group=group).tolist(),
        "grad": x.grad.tolist(),
    }
    sleeper = os.fork() if rank == 0 else None
    if sleeper == 0:
        time.sleep(3 * CHILD_WATCH_S)  # killed long before
        os._exit(0)
    uc.barrier()  # the ranks finalize together: a rank's init() must not find rank 0's old store
    uc.finalize()
    uc.init(backend)
    after["again"] = uc.all_gather(None, np.array([rank + 30], np.int64)).tolist()
    if sleeper:
        os.kill(sleeper, signal.SIGKILL)
        os.waitpid(sleeper, 0)
    print(json.dumps({"rank": rank, "exits": exits, "after": after}), flush=True)
    uc.finalize()


def _run_fork_world(backend: str, mpi_beside: bool) -> tuple[list[dict], dict[int, dict], str]:
    """Run :func:`fork_world` on 2 ranks; the children's reports, the ranks' reports, the output."""
    launch = ["run", "--mpi", "-n", "2"] if backend == "mpi" else ["run", "-n", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "unicoll", *launch, __file__, backend, *(["mpi-beside"] if mpi_beside else [])],
        capture_output=True,
        text=True,
        env={**os.environ, "UNICOLL_TIMEOUT": str(WORLD_TIMEOUT_S)},
        timeout=150,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    records = _json_records(done.stdout)
    children = [record for record in records if "child" in record]
    return children, {record["rank"]: record for record in records if "rank" in record}, output


def _json_records(text: str) -> list[dict]:
    """Every report in ``text``, in order: the launcher may prefix lines with the rank, and
    mpiexec may put two ranks' lines on one."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(text, found.start())[0] for found in re.finditer(r'\{"(child|rank)"', text)]


@pytest.mark.parametrize(("backend", "mpi_beside"), [("gloo", False), ("gloo", True), ("mpi", False)])
def test_a_forked_child_gets_clear_errors_and_its_exit_spares_the_parent(backend: str, mpi_beside: bool) -> None:
    """``mpi_beside``: gloo in a process where MPI is initialized too (a child's MPI_Finalize
    made the parent crash at its own exit)."""
    _skip_unless_usable("mpi" if mpi_beside else backend)
    children, ranks, output = _run_fork_world(backend, mpi_beside)
    assert [child["child"] for child in children] == list(EXITS), output
    for child in children:
        attempts = child["attempts"]
        assert child["seconds"] < WORLD_TIMEOUT_S / 2, child  # at once, not after the timeout
        for name in OPERATORS_AND_QUERIES:
            assert attempts[name].startswith(f"NotInitializedError: {name}: this process was forked from process"), name
        assert "in which unicoll is initialized" in attempts["all_gather"]
        assert "start worker processes with the 'spawn' start method" in attempts["all_gather"]
        assert attempts["init"].startswith("RuntimeError: unicoll.init: this process was forked from process"), attempts
        gone = "its session belongs to the process that this one was forked from"
        assert attempts["Task.wait"] == f"ValueError: all_gather: this task can no longer complete: {gone}"
        assert attempts["Task.is_completed"] == attempts["Task.wait"]
        assert attempts["backward"] == f"ValueError: Group(ranks=[0, 1]) cannot be used any more: {gone}"
        assert attempts["is_initialized"] == "False" and attempts["finalize"] == "ok"
    assert ranks[0]["exits"] == EXITS, output
    for rank in (0, 1):
        assert ranks[rank]["after"] == {
            "task": [0, 1],
            "world": [10, 11],
            "group": [[0], [1]] if rank == 0 else [[20], [21]],
            "grad": [[1.0], [1.0]],
            "again": [30, 31],  # init() after finalize() while a forked child lives
        }, output


# -- init() again, with the old session's objects still held -----------------------------------


def _stale(call) -> str:
    """The message of the ValueError that ``call()`` must raise."""
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


def _stale_uses(group: uc.Group) -> dict[str, str]:
    """What each operator and query says of ``group``, made in an earlier session."""
    x = np.arange(4.0).reshape(2, 2)
    return {
        "all_gather": _stale(lambda: uc.all_gather(None, x, group=group)),
        "alltoall_single": _stale(lambda: uc.alltoall_single(None, x, group=group)),
        "global_scatter": _stale(lambda: uc.global_scatter(x, [1, 1], [1, 1], group=group)),
        "global_gather": _stale(lambda: uc.global_gather(x, [1, 1], [1, 1], group=group)),
        "exchange_counts": _stale(lambda: uc.exchange_counts([1, 1], group=group)),
        "barrier": _stale(lambda: uc.barrier(group)),
        "get_rank": _stale(lambda: uc.get_rank(group)),
        "get_world_size": _stale(lambda: uc.get_world_size(group)),
    }


def _session_objects(rank: int, x: torch.Tensor, group: uc.Group) -> dict:
    """A task never waited for, one waited for, and an autograd graph, all on ``group``."""
    waited = uc.alltoall_single(None, np.array([rank, rank]), group=group, sync_op=False)
    waited.wait()
    return {
        "group": group,
        "task": uc.all_gather(None, np.array([rank]), group=group, sync_op=False),
        "waited": waited,
        "graph": uc.alltoall_single(None, x, group=group),
    }


def init_again_and_again(rank: int, backend: str) -> list[dict]:
    """Three finalize()/init() cycles while a group, tasks and an autograd graph of each
    earlier session are held; each cycle reports the new world's results and what the old
    objects said."""
    x = torch.full((2, 1), float(rank + 1), requires_grad=True)
    held = _session_objects(rank, x, uc.new_group([0, 1]))
    cycles = []
    for cycle in range(3):
        uc.finalize()
        assert not uc.is_initialized()
        uc.init(backend)
        fresh = uc.new_group([1, 0])
        cycles.append(
            {
                "world": uc.all_gather(None, np.array([rank + 10 * cycle])).tolist(),
                "fresh group": uc.alltoall_single(None, np.array([[rank], [rank + 5]]), group=fresh).tolist(),
                "stale group": _stale_uses(held["group"]),
                "task": _stale(held["task"].wait),
                "task polled": _stale(held["task"].is_completed),
                "waited": held["waited"].wait().tolist(),
                "backward": _stale(partial(held["graph"].sum().backward, retain_graph=True)),
            }
        )
        held = _session_objects(rank, x, fresh)
    return cycles


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_init_again_while_the_old_sessions_objects_are_held(backend: str) -> None:
    _skip_unless_usable(backend)
    ended = "its session ended at finalize(); make groups again with new_group() after init()"
    for rank, cycles in enumerate(_shared_results(INIT_AGAIN[backend], "lifecycle: init again and again")):
        for cycle, seen in enumerate(cycles):
            assert seen["world"] == [10 * cycle, 10 * cycle + 1]
            assert seen["fresh group"] == ([[0], [1]] if rank == 0 else [[5], [6]])
            for op, message in seen["stale group"].items():
                assert message == (
                    f"{op}: group: expected a group made since the last init(), got Group(ranks=[0, 1]) from an earlier one"
                )
            assert seen["task"].startswith(f"all_gather: this task can no longer complete: {ended}")
            assert seen["task polled"] == seen["task"]
            assert seen["waited"] == [0, 1]  # a task waited for before finalize() keeps its result
            assert seen["backward"].startswith(f"Group(ranks=[0, 1]) cannot be used any more: {ended}")


def init_again_while_rank_0_lags(rank: int, lag: float) -> list[int]:
    """finalize() and init() again, rank 0 ``lag`` seconds after the others: they reach rank 0's
    store of the ending session (with that session's keys) before rank 0 leaves it, while a task
    of that session is still held."""
    held = uc.all_gather(None, np.array([rank]), sync_op=False)
    held.wait()
    uc.barrier()
    if rank == 0:
        time.sleep(lag)
    uc.finalize()
    uc.init("gloo", timeout=30)
    return uc.all_gather(None, np.array([rank + 30])).tolist()


@pytest.mark.parametrize("world_size", [2, 3])
def test_init_again_when_rank_0_finalizes_last(world_size: int) -> None:
    """The other ranks pass over rank 0's old store until rank 0 listens with its new one (before,
    they joined the old session's process group: a peer-lost error or a hang until the timeout)."""
    expected = [30 + r for r in range(world_size)]
    assert _shared_results(LAGS[world_size], "lifecycle: rank 0 finalizes last") == [expected] * world_size


def init_again_after_compiling(rank: int) -> list[int]:
    """torch.compile for the first time while a session runs (which imports torch._dynamo: it
    keeps torch's default group, and so rank 0's store, alive for good), then finalize() and
    init() again on the same port."""
    doubled = torch.compile(lambda x: uc.all_reduce(x * 2), fullgraph=True, backend="eager")
    doubled(torch.ones(2))
    uc.finalize()
    uc.init("gloo", timeout=30)
    return uc.all_gather(None, np.array([rank + 40])).tolist()


def test_init_again_after_compiling() -> None:
    """Rank 0's store socket is shut down at finalize, whatever keeps the store alive: the new
    session listens on the same port (before, rank 0 got "Address already in use" and the
    others timed out). Fresh interpreters: the suite's forkserver has Dynamo loaded already
    (tests/conftest.py)."""
    ranks = uc.testing.spawn(init_again_after_compiling, 2, backend="gloo", timeout=120, start_method="spawn")
    assert ranks == [[40, 41]] * 2


def _shared_results(key: tuple, name: str) -> list:
    from helpers.several import SESSION

    return SESSION.results(key, name)


if __name__ != "__main__":  # the fork test runs this file as a script, without tests/ on its path
    from helpers.several import Case, share

    # In the session's shared worlds, last: each case starts new sessions.
    INIT_AGAIN = {
        backend: share(
            backend,
            2,
            [Case("lifecycle: init again and again", init_again_and_again, (backend,))],
            timeout=90,
            last=True,
        )
        for backend in ("gloo", "mpi")
    }
    LAGS = {
        size: share(
            "gloo",
            size,
            [Case("lifecycle: rank 0 finalizes last", init_again_while_rank_0_lags, (0.5,))],
            timeout=90,
            last=True,
        )
        for size in (2, 3)
    }


# -- in this process ---------------------------------------------------------------------------


def test_an_ended_group_lets_go_of_its_handle() -> None:
    from unicoll.session import end_session

    handle = object()
    group, kept = uc.Group((0, 1), handle, world_rank=1, session=-1), uc.Group((0,), handle, world_rank=0, session=-2)
    assert group.handle is handle and group.ended is None
    end_session(-1, "it was a test")
    end_session(-2, "it was kept", keep_handles=True)
    with pytest.raises(ValueError, match=r"^Group\(ranks=\[0, 1\]\) cannot be used any more: it was a test$"):
        group.handle  # noqa: B018
    assert group._handle is None and kept._handle is handle  # dropped, or kept for a forked child
    assert (group.ended, group.rank, group.world_size) == ("it was a test", 1, 2)


if __name__ == "__main__":
    fork_world(sys.argv[1], mpi_beside=sys.argv[2:] == ["mpi-beside"])
