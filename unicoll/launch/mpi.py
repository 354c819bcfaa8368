"""Start an MPI job on this machine: what ``unicoll run --mpi`` (and ``unicoll bench`` and
``unicoll.testing.spawn`` on the ``mpi`` backend) run.

The command is ``MPIEXEC -n N python ARGV...``. MPIEXEC is the one given, else the
``mpiexec`` installed beside this Python (the MPICH wheel of the ``mpi`` extra puts it there,
next to the libmpi that mpi4py loads), else the first ``mpiexec`` on ``PATH`` (a system MPI).
The ranks get ``UNICOLL_BACKEND=mpi`` and, as with :func:`unicoll.launch.local.run`, their
share of the cores in ``OMP_NUM_THREADS``; variables already set win. The MPI launcher
forwards output (:func:`run`'s ranks write it in whole lines, prefixed ``[rank K] ``). The
module imports nothing heavy.

:func:`run` (``unicoll run --mpi``) runs each rank's program through
:mod:`unicoll.launch.mpi_rank`, which keeps a note of how the rank is doing, and watches the
notes: a rank that failed ends the job at once, and so does one that ended before MPI started
while another rank starts it (MPICH's hydra would wait for it forever); either way the launcher
says which rank and why, as the launcher of :mod:`unicoll.launch.local` does.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from .mpi_rank import note_path
from .process import sigterm_raises_system_exit, stop_sessions, thread_share

_POLL_S = 0.05
"""How often :func:`run` reads the ranks' notes."""


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


class Failure(NamedTuple):
    """A rank that ended the job: its rank, the exit code :func:`run` returns, and why, in words."""

    rank: int
    code: int
    why: str


def run(nprocs: int, argv: Sequence[str], *, mpiexec: str | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run ``python *argv`` as ``nprocs`` MPI ranks; return the exit code of the rank that
    failed, else the MPI launcher's.

    As soon as a rank has ended with a non-zero status, or ended before MPI started while
    another rank starts MPI (:func:`failure`), the job is stopped and ``unicoll run: rank K
    failed with exit code C (why); stopped the other ranks`` goes to stderr. Ctrl-C, or SIGTERM
    to this process (from the main thread), stops the job and propagates.
    """
    with tempfile.TemporaryDirectory(prefix="unicoll-mpi-") as notes:
        proc = start(nprocs, ["-m", "unicoll.launch.mpi_rank", notes, *argv], mpiexec=mpiexec, env=env)
        try:
            with sigterm_raises_system_exit():
                found = _watch(proc, Path(notes), nprocs)
        finally:
            stop(proc)
    if found is None:
        return proc.returncode
    print(f"unicoll run: rank {found.rank} {found.why}; stopped the other ranks", file=sys.stderr, flush=True)
    return found.code


def _watch(proc: subprocess.Popen[bytes], notes: Path, nprocs: int) -> Failure | None:
    """Read the ranks' notes until one tells a :func:`failure` or the job has ended."""
    while True:
        ended = proc.poll() is not None  # before reading: the notes then hold how every rank ended
        found = failure([_read(note_path(notes, rank)) for rank in range(nprocs)], ended)
        if found is not None or ended:
            return found
        time.sleep(_POLL_S)


def _read(path: Path) -> dict[str, Any] | None:
    """A rank's note (:mod:`unicoll.launch.mpi_rank`), or None before it wrote one."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def failure(notes: Sequence[dict[str, Any] | None], job_ended: bool) -> Failure | None:
    """What ends the job, from the ranks' notes (None for a rank without one yet) and whether
    the job has ended (then so has every rank): the
    first rank (in time) that ended with a non-zero status; else a rank that ended before
    starting MPI (with status 0, or without one: a signal, ``os._exit``) while another rank
    started it, whose start waits for every rank of the job (exit code 1); else None."""
    ranks = {rank: note for rank, note in enumerate(notes) if note is not None}
    ended = {rank: note for rank, note in ranks.items() if job_ended or _ended(note)}
    failed = [(note["exit"]["at"], rank) for rank, note in ended.items() if note["exit"] and note["exit"]["code"]]
    if failed:
        rank = min(failed)[1]
        end, when = ended[rank]["exit"], "" if ended[rank]["mpi"] else " before MPI started"
        return Failure(rank, end["code"], f"failed with exit code {end['code']} ({end['reason']}){when}")
    starting = [rank for rank, note in ranks.items() if note["mpi"]]
    stranded = [rank for rank, note in ended.items() if not note["mpi"]]
    if not starting or not stranded:
        return None
    rank, end = stranded[0], ended[stranded[0]]["exit"]
    how = f"exit code {end['code']}" if end else "no exit status (a signal, or os._exit)"
    why = f"ended with {how} before starting MPI, while rank {starting[0]} started it"
    return Failure(rank, 1, f"{why} (MPI's start waits for every rank)")


def _ended(note: dict[str, Any]) -> bool:
    """Whether the rank of ``note`` has ended: its process is gone (on this host; elsewhere,
    its note tells how it ended)."""
    if note["host"] != socket.gethostname():
        return note["exit"] is not None
    try:
        os.kill(note["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process took the pid
        return True
    return False
