"""What every starter of processes here shares: stopping a process session with a grace period,
SIGTERM as SystemExit while ranks run, the ranks' thread share, and files replaced atomically.

Each world (``unicoll run``'s ranks, an MPI job) runs in sessions of its own, so a signal to a
session reaches every worker process the ranks started. This relies on POSIX process groups.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

GRACE_S = 5.0
"""How long a stopped process (or a finished one) has to exit before it is killed."""


def signal_session(proc: subprocess.Popen, sig: signal.Signals) -> None:
    """Send ``sig`` to the session (process group) that ``proc`` leads, if any of it lives."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_sessions(procs: Sequence[subprocess.Popen]) -> None:
    """Stop the sessions of ``procs``: SIGTERM to each, then SIGKILL to those whose leader has
    not exited within :data:`GRACE_S`. Sessions whose leader already exited are signalled too,
    so the workers they left behind stop with them."""
    for proc in procs:
        signal_session(proc, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_session(proc, signal.SIGKILL)
            proc.wait()


def thread_share(nprocs: int) -> dict[str, str]:
    """``OMP_NUM_THREADS`` giving each of ``nprocs`` ranks its share of this machine's cores, as
    torchrun does; a value already in the environment wins. Without it every rank starts one
    OpenMP thread per core, and N ranks oversubscribe the machine and stall one another."""
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nprocs))}


@contextmanager
def sigterm_raises_system_exit() -> Iterator[None]:
    """Turn SIGTERM into ``SystemExit(143)`` for the duration, so the ranks are cleaned up.

    The ranks run in their own sessions and do not see signals sent to this process's group;
    without this, a scheduler's SIGTERM would orphan them. Signal handlers can only be set in
    the main thread; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """Signal handler: leave the way SIGTERM's default action would report."""
    raise SystemExit(128 + signum)


def write_atomically(path: str | Path, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` (text is written as UTF-8) at once, so a reader never
    sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)
