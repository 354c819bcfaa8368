"""A rank of :func:`unicoll.testing.spawn`'s MPI jobs (:mod:`unicoll.testing.mpi`): a fresh
interpreter (``python -m unicoll.testing.mpi_rank JOB``) or forked from the server
(:mod:`unicoll.testing.mpi_server`). It loads the job, runs the function between
``unicoll.init`` and ``unicoll.finalize`` and writes its report next to the job file."""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
from multiprocessing import spawn as mp_spawn
from pathlib import Path

from ..launch.process import take_thread_share, write_atomically
from ..runtime import finalize, get_rank, init
from .report import Report


def report_path(directory: Path, rank: int) -> Path:
    """Where rank ``rank`` of the job whose file is in ``directory`` writes its report."""
    return directory / f"rank{rank}.pkl"


def rank_main(job_path: str) -> None:
    """Entry point of a rank, fresh or forked from the server: load the job, run it in the
    world, write this rank's report, and exit."""
    job = pickle.loads(Path(job_path).read_bytes())
    mp_spawn.prepare(job["preparation"])  # so that fn's module, __main__ too, imports as it did in the parent
    fn, args = pickle.loads(job["payload"])
    take_thread_share()

    init(job["backend"])
    rank = get_rank()
    try:
        report = Report(True, fn(rank, *args), 0.0)
    except BaseException:
        report = Report(False, traceback.format_exc(), time.time())
    # Report before finalize: finalize may wait for peers that wait for this rank.
    write_atomically(report_path(Path(job_path).parent, rank), pickle.dumps(report))
    if not report.ok:
        os._exit(1)  # the MPI launcher stops the other ranks
    finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    from mpi4py import MPI

    MPI.Finalize()
    os._exit(0)  # skip the interpreter's teardown, which takes about a second with torch loaded


if __name__ == "__main__":
    rank_main(sys.argv[1])
