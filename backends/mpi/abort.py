"""A rank of an MPI job that fails ends the job at once, instead of stalling it for the timeout.

When the interpreter exits, mpi4py calls ``MPI_Finalize``, which waits for the other ranks,
while they wait for this one in their next collective: a rank that raised held its job for the
whole timeout (300.2 s with the default 300 s, measured). So once MPI runs, a process that exits after an
uncaught exception (``KeyboardInterrupt`` included), or after :func:`record_failure`, calls
``MPI_Abort`` on ``COMM_WORLD`` with its exit status instead: the MPI launcher stops every rank
and exits with that status (MPICH's hydra, in a fraction of a second).

The interpreter tells exit handlers of an uncaught exception (``sys.last_value``) but not of the
status given to ``sys.exit``, which the program may also have caught; a runner that sees the
program's ``SystemExit`` leave records it (:mod:`unicoll.launch.mpi_rank` does, under ``unicoll
run --mpi``).
"""

from __future__ import annotations

import atexit
import fcntl
import os
import stat
import struct
import sys
import termios
import time

from unicoll.forking import mpi_running

_recorded: list[int] = []
"""The failing exit status given to :func:`record_failure`, if any."""

_owner: list[int] = []
"""The pid of the process that called :func:`abort_on_failure`: a child forked from it holds a
copy of its MPI state and its exit handlers, and must not abort the parent's job."""


def abort_on_failure() -> None:
    """Have this process abort its MPI job when it exits failing (see the module); once per
    process, however often it is called."""
    _owner[:] = [os.getpid()]
    atexit.unregister(_abort_if_failed)
    atexit.register(_abort_if_failed)


def record_failure(status: int) -> None:
    """This process exits with the non-zero ``status`` (a ``SystemExit`` that left the program)."""
    _recorded[:] = [status]


def failure_status() -> int:
    """The status this process fails with: the one recorded, else 130 after an uncaught
    ``KeyboardInterrupt`` (as a shell reports SIGINT) and 1 after another uncaught exception;
    0 when it does not fail."""
    if _recorded:
        return _recorded[0]
    uncaught = getattr(sys, "last_value", None)  # set by the interpreter for an uncaught exception
    if uncaught is None:
        return 0
    return 130 if isinstance(uncaught, KeyboardInterrupt) else 1


def _abort_if_failed() -> None:
    """At exit: ``MPI_Abort`` with :func:`failure_status` when it is not 0 and MPI runs here, in
    the process that asked for it."""
    status = failure_status()
    if not status or _owner != [os.getpid()] or not mpi_running():
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # None, closed, or a broken pipe
            pass
    _drained((1, 2), DRAIN_SECONDS)
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(status)


DRAIN_SECONDS = 0.5
"""How long an aborting rank waits at most for the launcher to read what it wrote."""


def _drained(fds: tuple[int, ...], seconds: float) -> None:
    """Wait until the launcher has read every byte written to the pipes ``fds`` (the traceback
    just printed), at most ``seconds``: the launcher forwards a rank's output as it reads it,
    and ``MPI_Abort`` stops it, dropping what it had not read yet. Files and terminals, which
    hold no unread bytes, return at once."""
    deadline = time.monotonic() + seconds
    for fd in fds:
        while time.monotonic() < deadline:
            try:
                if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                    break
                unread = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
            except OSError:  # closed, or no such query on this kind of file
                break
            if unread == 0:
                break
            time.sleep(0.005)
