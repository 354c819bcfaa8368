""":func:`unicoll.testing.spawn` for the ``mpi`` backend: the world is an MPI job.

MPI processes join a world only when an MPI launcher starts them, so the parent writes the
function and its arguments to a job file (pickled by the parent, read back by its own
children: no rank ever unpickles another rank's data) and starts
``mpiexec -n N python -m unicoll.testing.mpi JOB`` (:mod:`unicoll.launch.mpi`). Each rank runs
the function between ``unicoll.init`` and ``unicoll.finalize`` and writes its report next to
the job file. Each rank is first prepared as :mod:`multiprocessing`'s spawn prepares a child
(the parent's ``sys.path``, ``sys.argv``, working directory, and its main script imported as
``__mp_main__``), so a function defined in the script that calls ``spawn`` travels as it does on
gloo; the parent collects the reports, and stops the job at the first failure or at
the timeout.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing import spawn as mp_spawn
from pathlib import Path
from typing import Any

from ..launch import mpi as mpirun
from ..launch.process import GRACE_S, write_atomically
from ..runtime import finalize, get_rank, init
from .report import Report, SpawnError, SpawnTimeout

_POLL_S = 0.01
"""How often the parent looks for reports."""


def spawn_mpi(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    backend: str | None,
    timeout: float,
    env: Mapping[str, str] | None,
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` MPI ranks; see :func:`unicoll.testing.spawn`."""
    with tempfile.TemporaryDirectory(prefix="unicoll-spawn-") as tmp:
        job = Path(tmp) / "job.pkl"
        payload = pickle.dumps((fn, args))  # fails here, in the parent, for what cannot travel
        preparation = mp_spawn.get_preparation_data("unicoll-rank")
        del preparation["name"]  # the rank is known only once MPI has started
        del preparation["authkey"]  # no multiprocessing connection to authenticate (and it refuses pickling)
        job.write_bytes(pickle.dumps({"preparation": preparation, "backend": backend, "payload": payload}))
        proc = mpirun.start(world_size, ["-m", __name__, str(job)], env=env)
        try:
            results = _collect(proc, Path(tmp), world_size, timeout)
            proc.wait(GRACE_S)
            return results
        finally:
            mpirun.stop(proc)


def _report_path(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.pkl"


def _collect(proc: Any, directory: Path, world_size: int, timeout: float) -> list[Any]:
    """Every rank's result by rank; raise for the first rank to fail, or after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    reports: dict[int, Report] = {}
    while True:
        for rank in range(world_size):
            path = _report_path(directory, rank)
            if rank not in reports and path.exists():
                reports[rank] = pickle.loads(path.read_bytes())
        failures = [(report.failed_at, rank) for rank, report in reports.items() if not report.ok]
        if failures:
            _, rank = min(failures)
            trace = reports[rank].value
            raise SpawnError(f"spawn: rank {rank} raised:\n{trace}", rank=rank, remote_traceback=trace)
        missing = [rank for rank in range(world_size) if rank not in reports]
        if not missing:
            return [reports[rank].value for rank in range(world_size)]
        code = proc.poll()
        if code is not None and not any(_report_path(directory, rank).exists() for rank in missing):
            raise SpawnError(
                f"spawn: the MPI job exited with code {code} before rank(s) {missing} reported a result "
                "(see its output above)",
                rank=missing[0],
                exitcode=code,
            )
        if time.monotonic() > deadline:
            raise SpawnTimeout(
                f"spawn: ranks {missing} had not finished after {timeout} s; killed every rank", ranks=missing
            )
        time.sleep(_POLL_S)


def _rank_main(job_path: str) -> None:
    """Entry point of a rank: load the job, run it in the world, write this rank's report."""
    job = pickle.loads(Path(job_path).read_bytes())
    mp_spawn.prepare(job["preparation"])  # so that fn's module, __main__ too, imports as it did in the parent
    fn, args = pickle.loads(job["payload"])

    init(job["backend"])
    rank = get_rank()
    try:
        report = Report(True, fn(rank, *args), 0.0)
    except BaseException:
        report = Report(False, traceback.format_exc(), time.time())
    # Report before finalize: finalize may wait for peers that wait for this rank.
    write_atomically(_report_path(Path(job_path).parent, rank), pickle.dumps(report))
    if not report.ok:
        os._exit(1)  # the MPI launcher stops the other ranks
    finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    from mpi4py import MPI

    MPI.Finalize()
    os._exit(0)  # skip the interpreter's teardown, which takes about a second with torch loaded


if __name__ == "__main__":
    _rank_main(sys.argv[1])
