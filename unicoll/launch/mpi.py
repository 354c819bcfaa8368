"""Start an MPI job on this machine: what ``unicoll run --mpi`` (and ``unicoll bench`` and
``unicoll.testing.spawn`` on the ``mpi`` backend) run.

The command is ``MPIEXEC -n N python ARGV...``. MPIEXEC is the one given, else the
``mpiexec`` installed beside this Python (the MPICH wheel of the ``mpi`` extra puts it there,
next to the libmpi that mpi4py loads), else the first ``mpiexec`` on ``PATH`` (a system MPI).
The ranks get ``UNICOLL_BACKEND=mpi`` and, as with :func:`unicoll.launch.local.run`, their
share of the cores in ``OMP_NUM_THREADS``; variables already set win. The MPI launcher
forwards output and stops every rank when one fails. The module imports nothing heavy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from .process import sigterm_raises_system_exit, stop_sessions, thread_share


def find_mpiexec(mpiexec: str | None = None) -> str:
    """The MPI launcher to use: ``mpiexec`` when given, else the one beside ``sys.executable``,
    else ``mpiexec`` on ``PATH``. FileNotFoundError, saying how to get one, when none exists."""
    if mpiexec is not None:
        found = shutil.which(mpiexec)
        if found is None:
            raise FileNotFoundError(f"unicoll run: --mpiexec: expected an executable, got {mpiexec!r}")
        return found
    beside = Path(sys.executable).parent / "mpiexec"
    if os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError(
            "unicoll run --mpi: no mpiexec beside this Python or on PATH; pip install 'unicoll[mpi]' installs one"
        )
    return found


def command(nprocs: int, argv: Sequence[str], mpiexec: str | None = None) -> list[str]:
    """The command line that runs ``python *argv`` as ``nprocs`` MPI ranks."""
    if nprocs < 1:
        raise ValueError(f"unicoll run: nprocs: expected a positive integer, got {nprocs}")
    if not argv:
        raise ValueError("unicoll run: argv: expected a script or -m module, got nothing")
    return [find_mpiexec(mpiexec), "-n", str(nprocs), sys.executable, *argv]


def job_env(nprocs: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of the ranks: ``UNICOLL_BACKEND=mpi`` and the thread share unless set,
    then this process's environment, then ``env``."""
    return {"UNICOLL_BACKEND": "mpi", **thread_share(nprocs), **os.environ, **(env or {})}


def start(
    nprocs: int, argv: Sequence[str], *, mpiexec: str | None = None, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start the MPI job in its own session (so :func:`stop` reaches every process of it)."""
    return subprocess.Popen(
        command(nprocs, argv, mpiexec),
        env=job_env(nprocs, env),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the MPI job: SIGTERM to its session, SIGKILL after the grace time."""
    stop_sessions([proc])


def run(nprocs: int, argv: Sequence[str], *, mpiexec: str | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run ``python *argv`` as ``nprocs`` MPI ranks and return the MPI launcher's exit code.

    Ctrl-C, or SIGTERM to this process (from the main thread), stops the job and propagates.
    """
    proc = start(nprocs, argv, mpiexec=mpiexec, env=env)
    try:
        with sigterm_raises_system_exit():
            return proc.wait()
    finally:
        stop(proc)
