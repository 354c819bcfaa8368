"""Fault injection with real processes: every fault ends in a clear error on every surviving
rank within the timeout, or in what docs/reliability.md says happens instead, on gloo and on
mpi; `unicoll run` stops the world when a rank fails.

A gloo world whose test needs no launcher runs its ranks forked from a server that imported
torch once (helpers/forked.py), nothing between them and the test; the others, and every mpi
world, run under `unicoll run`."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from faults import reporting

import unicoll as uc
from helpers.cpu_backends import BACKENDS, MPI_REASON
from helpers.forked import FATAL, start_script
from unicoll.launch.local import free_port, world_env

SCRIPT = Path(__file__).parents[1] / "faults" / "inject.py"
TIMEOUT = 4  # UNICOLL_TIMEOUT for these worlds, seconds


class World(NamedTuple):
    """What a world of inject.py left: each rank's reports, everything printed, the exit codes
    (the launcher's, or each started rank's when no launcher ran: negative for a signal)."""

    reports: dict[int, list[dict]]
    output: str
    codes: list[int]


def _env(backend: str, check: bool, timeout: float) -> dict[str, str]:
    return {**os.environ, "UNICOLL_BACKEND": backend, "UNICOLL_TIMEOUT": str(timeout), "UNICOLL_CHECK": str(int(check))}


class Started(NamedTuple):
    """Processes of a world of inject.py (the launcher, or the ranks), and the folder of its
    reports (faults/reporting.py) and of the ranks' output."""

    procs: list[subprocess.Popen] | list[BaseProcess]
    reports: Path


def _folder() -> Path:
    return Path(tempfile.mkdtemp(prefix="unicoll-inject-"))


def run_world(
    fault: str, backend: str = "gloo", *, check: bool = False, timeout: float = TIMEOUT, env: dict | None = None
) -> World:
    """Run inject.py FAULT as 2 ranks under `unicoll run` (`--mpi` for mpi), ``env`` added."""
    return finish_world(start_world(fault, backend, check=check, timeout=timeout, env=env))


def start_world(
    fault: str, backend: str = "gloo", *, check: bool = False, timeout: float = TIMEOUT, env: dict | None = None
) -> Started:
    """Start :func:`run_world`'s world (with ``env`` added to its environment), without waiting for it."""
    launch = ["run", "--mpi", "-n", "2"] if backend == "mpi" else ["run", "-n", "2"]
    folder = _folder()
    proc = subprocess.Popen(
        [sys.executable, "-m", "unicoll", *launch, str(SCRIPT), fault],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**_env(backend, check, timeout), **(env or {}), reporting.FOLDER: str(folder)},
    )
    return Started([proc], folder)


def finish_world(started: Started) -> World:
    """Wait for a world from :func:`start_world` (killing it after 90 s, as a failure)."""
    (proc,) = started.procs
    try:
        stdout, stderr = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return World(_read(started.reports), stdout + stderr, [proc.returncode])


def start_ranks(
    fault: str, ranks: tuple[int, ...], *, check: bool = False, timeout: float = TIMEOUT, env: dict | None = None
) -> Started:
    """Start ``ranks`` of a gloo world of 2 running inject.py FAULT (with ``env`` added),
    forked without a launcher (helpers/forked.py): nothing stops the others when one dies, so
    the survivors report what they see."""
    port, folder = free_port(), _folder()
    procs = [
        start_script(
            SCRIPT,
            [fault],
            {
                **_env("gloo", check, timeout),
                **(env or {}),
                **world_env(rank, 2, "127.0.0.1", port),
                reporting.FOLDER: str(folder),
            },
            folder / f"output{rank}.txt",
        )
        for rank in ranks
    ]
    return Started(procs, folder)


def finish(started: Started) -> World:
    """Wait for processes from :func:`start_ranks` (killing them after a minute)."""
    deadline = time.monotonic() + 60
    for proc in started.procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
    output = "".join(path.read_text() for path in sorted(started.reports.glob("output*.txt")))
    return World(_read(started.reports), output, [proc.exitcode for proc in started.procs])


def run_fault(fault: str, backend: str = "gloo", *, check: bool = False, env: dict | None = None) -> World:
    """inject.py FAULT on 2 ranks where the test needs no launcher: on gloo forked
    (:func:`start_ranks`), on mpi under `unicoll run --mpi` (:func:`run_world`)."""
    if backend == "mpi":
        return run_world(fault, backend, check=check, env=env)
    return finish(start_ranks(fault, (0, 1), check=check, env=env))


def _read(folder: Path) -> dict[int, list[dict]]:
    """The ranks' reports in ``folder``, which goes with them."""
    try:
        return reporting.read(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


CAUGHT = """
for line in open("/proc/self/status"):
    if line.startswith("SigCgt:"):
        print(int(line.split()[1], 16))
"""
"""A script that prints the signals this process catches (a bit mask)."""


def test_a_forked_script_ends_on_a_fatal_signal_as_a_fresh_interpreter(tmp_path) -> None:
    """The suite's server imported Paddle, whose handlers catch the fatal signals (and end the
    process only after a report, which a thread's exit can beat, with status 0): a script forked
    from it catches none of them, as a fresh interpreter does."""
    script = tmp_path / "caught.py"
    script.write_text(CAUGHT)
    forked = start_script(script, [], dict(os.environ), tmp_path / "output.txt")
    forked.join(60)
    fresh = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
    fatal = sum(1 << (number - 1) for number in FATAL)
    masks = [int((tmp_path / "output.txt").read_text()), int(fresh.stdout)]
    assert forked.exitcode == 0 and [mask & fatal for mask in masks] == [0, 0], masks


def test_mismatched_counts_in_check_mode_fail_on_every_rank() -> None:
    world = run_fault("mismatch-checked", check=True)
    expected = "global_scatter: ranks disagree: rank 1 expects 2 row(s) from rank 0 for expert 1, but rank 0 sends 1"
    for rank in (0, 1):
        (record,) = world.reports[rank]
        assert record["error"] == "CrossRankMismatchError", world.output
        assert record["message"] == expected
        assert record["seconds"] < TIMEOUT
    assert set(world.codes) == {0}


@pytest.mark.parametrize("backend", BACKENDS)
def test_mismatched_counts_without_check_mode(backend) -> None:
    """The handshake: both mismatches raise CrossRankMismatchError on both ranks, within the
    timeout, and the process lives on."""
    world = run_fault("mismatch-unchecked", backend)
    expected = [
        "alltoall_single: ranks disagree: rank 1 expects 3 row(s) from rank 0, but rank 0 sends 2",
        "alltoall_single: ranks disagree: rank 1 expects 1 row(s) from rank 0, but rank 0 sends 2",
    ]
    for rank in (0, 1):
        assert [(r["error"], r["message"]) for r in world.reports[rank]] == [
            ("CrossRankMismatchError", message) for message in expected
        ], world.output
        assert all(r["seconds"] < TIMEOUT for r in world.reports[rank])
    assert set(world.codes) == {0}


@pytest.mark.parametrize("backend", BACKENDS)
def test_mismatched_counts_with_the_handshake_off(backend) -> None:
    """What docs/reliability.md says turning the handshake off risks: a receiver that expects
    more rows than its peer sends gets the rows sent and leaves the rest unwritten, on both
    backends; one that expects fewer is aborted by gloo (SIGABRT in gloo's network thread), and
    gets the first rows on mpi."""
    world = run_fault("mismatch-unchecked", backend, env={"UNICOLL_HANDSHAKE": "0"})
    own_rows = [[104.0, 105.0], [106.0, 107.0]]  # what rank 1 keeps of its own rows
    more, *fewer = world.reports[1]
    assert (more["error"], more["expected"]) == (None, 3), world.output
    assert len(more["rows"]) == 5
    assert more["rows"][:2] == [[4.0, 5.0], [6.0, 7.0]] and more["rows"][3:] == own_rows
    if backend == "gloo":
        # gloo aborts rank 1 inside the call; where rank 0 had already finished both calls and
        # left, rank 1's peer watch may see that first and raise, just before the abort lands
        assert [r["error"] for r in fewer] in ([], ["PeerLostError"]), world.output
        assert world.codes[1] == -signal.SIGABRT, world.output
        assert "terminate called after throwing an instance of 'gloo::EnforceNotMet'" in world.output
    else:
        assert [(r["error"], r["expected"], r["rows"]) for r in fewer] == [(None, 1, [[4.0, 5.0], *own_rows])]
        assert world.codes == [0]
    for record in world.reports[0]:  # rank 0 passes consistent counts: it returns or loses rank 1
        assert record["error"] in (None, "PeerLostError"), world.output
        assert record["seconds"] < TIMEOUT


@pytest.mark.parametrize("backend", BACKENDS)
def test_mismatched_counts_with_the_handshake_off_are_caught_by_verification(backend) -> None:
    """The same calls with verification on (``UNICOLL_VERIFY=1``): a receiver that expects
    more rows than its peer sends no longer returns rows left unwritten: both ranks raise the
    same IntegrityError. One that expects fewer is still aborted inside gloo before any check
    can run; on mpi it raises IntegrityError on both ranks too."""
    world = run_fault("mismatch-unchecked", backend, env={"UNICOLL_HANDSHAKE": "0", "UNICOLL_VERIFY": "1"})
    first = [reports[0] for reports in world.reports.values()]
    assert [r["error"] for r in first] == ["IntegrityError"] * 2, (world.reports, world.output)
    assert first[0]["message"] == first[1]["message"]
    assert "call 1 (verified): the block rank 0 sent to rank 1 arrived different" in first[0]["message"]
    if backend == "gloo":
        assert world.codes[1] == -signal.SIGABRT, world.output
    else:
        assert [r["error"] for reports in world.reports.values() for r in reports] == ["IntegrityError"] * 4
        assert world.codes == [0]


def test_peer_that_exits_fails_the_current_and_next_operator() -> None:
    world = run_fault("peer-exits")
    assert world.reports[1] == [{"rank": 1, "action": "exits"}]
    assert len(world.reports[0]) == 2, world.output
    for record in world.reports[0]:
        assert record["error"] == "PeerLostError"
        assert record["message"].startswith("alltoall_single on Group(ranks=[0, 1]): a peer is gone")
        assert record["seconds"] < TIMEOUT + 1


def _skip_unless_installed(library: str) -> None:
    """Skip where ``library`` is not installed (found, not imported: only the ranks import it)."""
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed (pip install 'unicoll[{library}]')")


def test_a_rank_that_raises_mid_step_ends_the_world() -> None:
    """Rank 1 raises between dispatch and combine of a step on Paddle tensors (under Paddle's
    autograd): the launcher stops the world at once, or rank 0 loses its peer within the
    timeout; rank 0 never reports a result. (What rank 0 sees of a lost peer inside each
    library's autograd: the next test.)"""
    _skip_unless_installed("paddle")
    start = time.monotonic()
    world = run_world("raises-mid-step:paddle")
    assert "RuntimeError: rank 1 raises mid-step" in world.output, world.output
    assert world.reports[1] == [{"rank": 1, "action": "raises"}]
    assert all(record["error"] == "PeerLostError" for record in world.reports.get(0, [])), world.output
    assert any(code != 0 for code in world.codes) and time.monotonic() - start < TIMEOUT + 30


@pytest.mark.parametrize("library", ["paddle", "jax", "torch", "torch-static"])
def test_a_rank_that_exits_mid_step_is_lost_in_its_peers_step(library: str) -> None:
    """Rank 1 exits between dispatch and combine: rank 0's combine, inside the library's
    autograd, raises PeerLostError (not the library's own error type) within the timeout
    (torch: a step that sends each token once per rank; torch-static: in the static mode)."""
    _skip_unless_installed(library.split("-")[0])
    world = run_fault(f"exits-mid-step:{library}")
    assert world.reports[1] == [{"rank": 1, "action": "exits"}]
    (record,) = world.reports[0]
    assert record["error"] == "PeerLostError", world.output
    op = "moe.combine_static" if library == "torch-static" else "moe.combine"
    assert record["message"].startswith(f"{op} on Group(ranks=[0, 1]): a peer is gone"), record
    assert record["seconds"] < TIMEOUT + 1


def test_peer_killed_mid_transfer_is_lost_at_once_on_gloo() -> None:
    """Rank 1 is SIGKILLed while rank 0 writes 64 MiB to it (it stopped reading): gloo alone
    leaves that write waiting until the timeout; the peer watch notices within a fraction of
    a second. No launcher runs, so nothing stops rank 0 before it reports."""
    world = finish(start_ranks("peer-killed", (0, 1)))
    (killed,) = world.reports[1]
    (record,) = world.reports[0]
    assert record["error"] == "PeerLostError", world.output
    assert record["message"].startswith("alltoall_single on Group(ranks=[0, 1]): a peer is gone")
    assert record["at"] - killed["at"] < 1.0, "noticed a second or more after the kill"
    assert world.codes == [0, -9]


@pytest.mark.skipif(MPI_REASON is not None, reason=f"mpi: {MPI_REASON}")
def test_peer_killed_under_mpiexec_stops_the_job() -> None:
    """On mpi the launcher (MPICH's hydra) stops the job when a rank is killed: the survivor
    is killed too, before any timeout, and never reports; mpiexec exits with the signal."""
    start = time.time()
    world = run_world("peer-killed", "mpi")
    (killed,) = world.reports[1]
    assert world.reports[0] == [], world.output
    assert "BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES" in world.output
    assert world.codes == [9]
    assert time.time() - killed["at"] < TIMEOUT - 1, "the job outlived the kill by most of the timeout"
    assert killed["at"] > start


ABSENT_PEERS = [
    ("peer-absent", "all_gather", TIMEOUT, {}),
    # the handshake: an asynchronous call returns its Task once the peers' records are in
    ("peer-absent-async", "alltoall_single", TIMEOUT, {}),
    ("peer-absent-async", "alltoall_single", 2, {"UNICOLL_HANDSHAKE": "0"}),  # Task.wait(timeout=2) times it
]


def test_peer_that_never_calls_times_out(tmp_path) -> None:
    """Each fault of :data:`ABSENT_PEERS` in a world of its own, the worlds at once: each spends
    most of its time waiting out its timeout."""
    started = [
        # INJECT_DONE: the absent peer leaves once rank 0 has its error
        (fault, op, bound, start_ranks(fault, (0, 1), env={"INJECT_DONE": str(tmp_path / f"{i}.done"), **env}))
        for i, (fault, op, bound, env) in enumerate(ABSENT_PEERS)
    ]
    worlds = [(fault, op, bound, finish(procs)) for fault, op, bound, procs in started]
    for fault, op, bound, world in worlds:
        assert len(world.reports[0]) == 1, f"{fault}: {world.output}"
        (record,) = world.reports[0]
        assert record["error"] == "CollectiveTimeoutError", f"{fault}: {world.output}"
        assert record["message"].startswith(
            f"{op} on Group(ranks=[0, 1]): did not complete within the timeout of {bound} s"
        ), f"{fault}: {record['message']}"
        assert bound - 0.5 < record["seconds"] < bound + 2, f"{fault}: {record['seconds']} s"


@pytest.mark.parametrize("backend", BACKENDS)
def test_wait_with_timeout_0_polls(backend) -> None:
    """``Task.wait(timeout=0)`` on a call the peer makes 1 s later raises at once, and a later
    ``wait()`` still returns the result."""
    world = run_fault("poll", backend, env={"UNICOLL_HANDSHAKE": "0"})  # with it, the call waits for the peer's record
    polled, waited, result = world.reports[0]
    assert polled["error"] == "CollectiveTimeoutError", world.output
    assert polled["message"] == (
        "alltoall_single on Group(ranks=[0, 1]): not complete yet (Task.wait(timeout=0) polls; wait again for the result)"
    )
    assert polled["seconds"] < 0.5  # the peer calls 1 s later: a wait would have taken that
    assert waited["error"] is None and 0.5 < waited["seconds"] < TIMEOUT
    assert result["rows"] == [[0.0, 1.0], [2.0, 3.0], [100.0, 101.0], [102.0, 103.0]]
    assert result["completed"] is True


@pytest.mark.parametrize("backend", BACKENDS)
def test_wait_checks_its_timeout(backend, monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "UNICOLL_CHECK"):
        monkeypatch.delenv(name, raising=False)
    uc.init(backend, timeout=10)
    try:
        x = np.arange(4.0).reshape(2, 2)
        task = uc.alltoall_single(None, x, sync_op=False)
        for bad, error, expected in [
            (-1, ValueError, "a number of seconds from 0 to 1e+07, or None, got -1"),
            (math.nan, ValueError, "a number of seconds from 0 to 1e+07, or None, got nan"),
            (math.inf, ValueError, "a number of seconds from 0 to 1e+07, or None, got inf"),
            ("1", TypeError, "a number of seconds or None, got '1'"),
            (True, TypeError, "a number of seconds or None, got True"),
        ]:
            with pytest.raises(error, match=rf"^Task\.wait: timeout: expected {re.escape(expected)}$"):
                task.wait(bad)
        deadline = time.monotonic() + 5
        while not task.is_completed():  # a world of one still runs the transfer on gloo's thread
            assert time.monotonic() < deadline, "a world of one did not complete a 64-byte all-to-all"
            time.sleep(0.001)
        np.testing.assert_array_equal(task.wait(timeout=0), x)  # a poll of a completed call returns it
        assert task.wait(np.float32(0.5)) is task.wait()
    finally:
        uc.finalize()


@pytest.fixture(scope="module")
def inits_alone() -> Iterator[dict[str, list[Started]]]:
    """The worlds in which a rank's peer never starts init, started together (each spends its
    time waiting out its timeout of 2 s), by backend: on gloo one in which only rank 1 starts
    and one in which only rank 0 does, forked; on mpi one whose rank 1 never calls init."""
    started = {"gloo": [start_ranks("init", (1,), timeout=2), start_ranks("init", (0,), timeout=2)]}
    if MPI_REASON is None:
        started["mpi"] = [start_world("init-absent", "mpi", timeout=2)]
    yield started
    for world in started.values():
        for procs in world:
            for proc in procs.procs:
                proc.kill()


def test_init_fails_within_the_timeout_on_gloo(inits_alone) -> None:
    """Each gets a CollectiveTimeoutError naming init and what to check, within the timeout (the
    rendezvous store, the process group and the peer watch share one deadline)."""
    (alone,), (absent,) = (finish(procs).reports[rank] for procs, rank in zip(inits_alone["gloo"], (1, 0)))
    for rank, record in ((1, alone), (0, absent)):
        assert record["error"] == "CollectiveTimeoutError", record
        assert record["message"].startswith(
            f"init on backend 'gloo' (rank {rank} of 2): did not complete within the timeout of 2 s"
        )
        assert (
            "; check that all 2 ranks start and call init() with the same MASTER_ADDR:MASTER_PORT" in record["message"]
        )
        assert record["seconds"] < 3
    assert "rank 0's store at 127.0.0.1:" in alone["message"]


@pytest.mark.skipif(MPI_REASON is not None, reason=f"mpi: {MPI_REASON}")
def test_init_fails_within_the_timeout_on_mpi(inits_alone) -> None:
    (started,) = inits_alone["mpi"]
    world = finish_world(started)
    (record,) = world.reports[0]
    assert record["error"] == "CollectiveTimeoutError", world.output
    assert record["message"].startswith(
        "init on backend 'mpi' (rank 0 of 2): did not complete within the timeout of 2 s"
    )
    assert record["message"].endswith("; check that every rank of the MPI job calls init()")
    assert record["seconds"] < 3


def test_launcher_stops_the_world_and_names_the_failing_rank(tmp_path) -> None:
    script = tmp_path / "crash.py"
    script.write_text(
        "import os, time, numpy as np, unicoll as uc\n"
        "uc.init('gloo')\n"
        "uc.barrier()\n"
        "if uc.get_rank() == 1:\n"
        "    os._exit(3)\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "unicoll", "run", "-n", "3", str(script)], capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 3
    assert "rank 1 failed with exit code 3; stopped the other ranks" in done.stderr
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_that_raises_beside_a_running_thread_ends_the_world_at_once(backend) -> None:
    """Rank 1 raises while a ThreadPoolExecutor's thread (not a daemon) has a minute of work, and
    rank 0 waits for it in all_reduce: the world ends within seconds, and `unicoll run` names
    rank 1. Before, rank 1's interpreter waited for that thread before its exit (MPI_Abort on
    mpi), and the world waited the whole timeout: on gloo, rank 0's timeout then ended it, and
    `unicoll run` named rank 0."""
    world = run_world("raises-beside-thread", backend, timeout=30)
    ended = time.time()
    (fault,) = world.reports[1]
    assert world.reports[0] == [{"rank": 0, "action": "waits in all_reduce"}], world.output
    assert world.codes == [1], world.output
    assert "unicoll run: rank 1 failed with exit code 1" in world.output
    assert "KeyError: 'the expert table has no entry 7'" in world.output
    assert ended - fault["at"] < 10, world.output  # the timeout is 30 s, the thread's work 60 s
