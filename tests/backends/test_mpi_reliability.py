"""The mpi backend when callers let go of transfers or ranks fail, with real MPI jobs
(``tests/faults/mpi_jobs.py``): a task dropped before it completed keeps its memory until MPI
completes it; a rank that raises, exits or is interrupted ends the job within seconds, and
``unicoll run --mpi`` names it; a rank that ends before MPI starts does not hang the job; rows
of zero bytes move. Skipped, with the reason, where mpi4py cannot run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import pytest
from faults import reporting

from unicoll.backends.mpi.mpi import MpiFactory
from unicoll.launch.mpi import failure, find_mpiexec
from unicoll.launch.process import GRACE_S

REASON = MpiFactory().probe()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"backend mpi is not usable here: {REASON}")

SCRIPT = Path(__file__).parents[1] / "faults" / "mpi_jobs.py"
TIMEOUT = 60
"""UNICOLL_TIMEOUT of the jobs: a job that waited for it would outlast :data:`JOB_LIMIT`."""
JOB_LIMIT = 30
"""How long a job may take before the test stops it and fails."""
PROMPT = 5.0
"""How soon after a rank's fault its job must have ended, in seconds (gloo's takes 0.03 s)."""


class Job(NamedTuple):
    """What a job of mpi_jobs.py left: each rank's reports, everything printed, the exit code,
    and the wall-clock time it ended."""

    reports: dict[int, list[dict]]
    output: str
    code: int
    ended: float


def run_job(*cases: str, launcher: bool = True) -> Job:
    """Run mpi_jobs.py CASES on 2 ranks under ``unicoll run --mpi`` (or a bare mpiexec), in a
    session of its own that is stopped past :data:`JOB_LIMIT` (then the test fails)."""
    if launcher:
        command = [sys.executable, "-m", "unicoll", "run", "--mpi", "-n", "2", str(SCRIPT), *cases]
    else:
        command = [find_mpiexec(), "-n", "2", sys.executable, str(SCRIPT), *cases]
    # the handshake off: the jobs make one rank time out or skip calls on purpose, which the
    # handshake would answer with CrossRankMismatchError at the next call instead of going on
    env = {**os.environ, "UNICOLL_BACKEND": "mpi", "UNICOLL_TIMEOUT": str(TIMEOUT), "UNICOLL_CHECK": "0",
           "UNICOLL_HANDSHAKE": "0"}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="unicoll-mpi-jobs-") as folder:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**env, reporting.FOLDER: folder}, start_new_session=True,
        )  # fmt: skip
        try:
            output = proc.communicate(timeout=JOB_LIMIT)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the launcher stops the MPI job it started, in its own session
            try:
                output = proc.communicate(timeout=GRACE_S)[0]
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output = proc.communicate()[0]
            pytest.fail(f"the job {cases} ran past {JOB_LIMIT} s:\n{output}")
        ended = time.time()
        return Job(reporting.read(Path(folder)), output, proc.returncode, ended)


@pytest.fixture(scope="module")
def dropped_job() -> Job:
    """One job for every case of letting go of transfers, and rows of zero bytes."""
    return run_job("dropped", "zero-bytes")


def test_transfers_let_go_of_keep_their_memory_until_they_complete(dropped_job: Job) -> None:
    """Before, 6 of 6 such jobs crashed (``double free or corruption``, SIGSEGV) after MPI wrote
    into memory that new arrays had taken."""
    assert dropped_job.code == 0, dropped_job.output
    for rank in (0, 1):
        reports = {(r.get("case"), r.get("op")): r for r in dropped_job.reports[rank]}
        unclean = [op for (case, op), r in reports.items() if case == "no write after free" and not r["clean"]]
        assert unclean == [] and len([c for c, _ in reports if c == "no write after free"]) == 8, dropped_job.output
        for case in (
            "dropped at once",
            "an exception between issuing and waiting",
            "a wait that timed out",
            "pending across finalize and init",
        ):
            assert reports[case, None]["ok"] is True, (rank, case)
        assert reports["a synchronous call that timed out", None]["result"] == ("timed out" if rank == 0 else True)
        assert reports["a task of the ended session", None]["stale"].startswith(
            "all_reduce: this task can no longer complete: its session ended at finalize()"
        )
        assert reports["still in flight at the end", None]["count"] == 0
        assert {"rank": rank, "action": "done"} in dropped_job.reports[rank]


def test_rows_of_zero_bytes(dropped_job: Job) -> None:
    """torch tensors of shape (rows, 0) have address 0, which MPI's allgather refused ("Invalid
    buffer pointer"); every operator now gives numpy's shapes."""
    expected = {
        "all_gather": [4, 0],
        "all_gather list": [[2, 0], [2, 0]],
        "alltoall_single": [4, 0],
        "all_reduce": [2, 0],
        "reduce_scatter": [2, 0],
        "broadcast": [2, 0],
        "global_scatter": [4, 0],
        "global_gather": [4, 0],
        "all_gather uneven": [3, 0],
    }
    for rank in (0, 1):
        seen = {r["library"]: r["shapes"] for r in dropped_job.reports[rank] if r.get("case") == "zero-bytes"}
        assert seen == {"torch": expected, "numpy": expected}, dropped_job.output


@pytest.mark.parametrize(
    ("case", "code", "why"),
    [
        ("raise", 1, "KeyError: 'the expert table has no entry 7'"),
        ("exit", 3, "SystemExit(3)"),
        ("interrupt", 130, "KeyboardInterrupt"),
    ],
)
def test_a_failing_rank_ends_the_job_at_once(case: str, code: int, why: str) -> None:
    """Rank 1 fails while rank 0 waits for it in all_reduce: before, the job waited for the
    whole timeout (300.2 s with the default 300 s); now rank 1 aborts it, and the launcher names it."""
    job = run_job(case)
    (fault,) = job.reports[1]
    assert job.reports[0] == [{"rank": 0, "action": "waits in all_reduce"}], job.output
    assert job.code == code, job.output
    assert f"unicoll run: rank 1 failed with exit code {code} ({why}); stopped the other ranks" in job.output
    assert job.ended - fault["at"] < PROMPT, job.output


def test_a_failing_rank_ends_a_bare_mpiexec_job_at_once() -> None:
    """Without ``unicoll run``: the backend itself aborts the job when its rank exits after an
    uncaught exception."""
    job = run_job("raise", launcher=False)
    (fault,) = job.reports[1]
    assert job.code == 1, job.output
    assert "KeyError: 'the expert table has no entry 7'" in job.output
    assert job.ended - fault["at"] < PROMPT, job.output


@pytest.mark.parametrize(
    ("case", "code", "why"),
    [
        ("exit-early", 3, "failed with exit code 3 (SystemExit(3)) before MPI started"),
        ("exit-early-0", 1, "ended with exit code 0 before starting MPI, while rank 0 started it"),
        ("killed-early", 1, "ended with no exit status (a signal, or os._exit) before starting MPI, while rank 0"),
    ],
)
def test_a_rank_that_ends_before_mpi_starts_ends_the_job(case: str, code: int, why: str) -> None:
    """Rank 0 waits in MPI's start for rank 1, which ended before starting MPI: MPICH's hydra
    waits for ever; the launcher stops the job."""
    job = run_job(case)
    (fault,) = job.reports[1]
    assert job.reports[0] == [], job.output
    assert job.code == code, job.output
    assert f"unicoll run: rank 1 {why}" in job.output
    assert job.ended - fault["at"] < PROMPT, job.output


STRANDED = "before starting MPI, while rank 1 started it (MPI's start waits for every rank)"


def note(mpi: bool, code: int | None = None, *, pid: int = 0, host: str = "elsewhere") -> dict:
    """A rank's note as unicoll.launch.mpi_rank writes it; ended (``code`` given) or running."""
    end = None if code is None else {"code": code, "reason": f"SystemExit({code})", "at": 1.0}
    return {"host": host, "pid": pid, "mpi": mpi, "exit": end}


def test_what_stops_a_job() -> None:
    """A rank that ended with 0 before MPI started stops the job only once another starts MPI
    (a job whose ranks never start MPI ends on its own); a rank that ended after MPI started
    is left to the MPI launcher; a rank whose process is gone from this host has ended, one
    whose process lives has not."""
    assert failure([note(False, 0), note(False)], job_ended=False) is None
    assert failure([note(False, 0), note(True)], job_ended=False) == (0, 1, "ended with exit code 0 " + STRANDED)
    assert failure([note(True, 0), note(True)], job_ended=False) is None
    assert failure([None, note(True, 2)], job_ended=False) == (1, 2, "failed with exit code 2 (SystemExit(2))")
    here = socket.gethostname()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert failure([note(False, pid=int(gone.stdout), host=here), note(True)], job_ended=False).rank == 0
    assert failure([note(False, pid=os.getpid(), host=here), note(True)], job_ended=False) is None
    unknown = "ended with no exit status (a signal, or os._exit) " + STRANDED
    assert failure([note(False), note(True)], job_ended=True) == (0, 1, unknown)
