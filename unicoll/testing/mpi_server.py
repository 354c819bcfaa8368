"""The server that forks the ranks of :func:`unicoll.testing.spawn`'s MPI jobs.

A fresh interpreter that imports torch takes about 1.5 s of CPU time before it runs anything:
most of an MPI rank's start. This server imports :data:`PRELOAD` once, then forks each rank.
mpiexec starts a small process per rank instead of the rank itself
(:mod:`unicoll.testing.mpi_stub`), which hands the server what hydra gave it: its standard
streams and the socket of MPI's process manager (``PMI_FD``), with its environment and working
directory. The forked rank takes them over, initializes MPI (the server never imports mpi4py's
``MPI``) and runs the job (:func:`unicoll.testing.mpi_rank.rank_main`); the stub waits for its exit
status and ends as it did. A stub that ends first (mpiexec stopping the job) takes its rank
with it: the server kills the rank once the stub's connection closes. The server ends when the
process that started it does (its stdin, a pipe from that process, closes), killing the ranks
still running.

Like multiprocessing's forkserver, it forks ranks of a process that started with its parent's
environment: a rank runs with its job's environment (``os.environ`` replaced as it starts),
but a variable read as a process starts (glibc's ``MALLOC_*``, ``LD_PRELOAD``) reaches only the
ranks of ``start_method="spawn"``, a fresh interpreter each.
"""

from __future__ import annotations

import atexit
import importlib
import os
import pickle
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

from .mpi_rank import rank_main

PRELOAD = ("numpy", "torch", "unicoll", "unicoll.testing.mpi_rank")
"""What the server imports once, before it forks any rank."""

STUB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_stub.py")
"""The script mpiexec runs for each rank (with ``python -S``)."""

_START_S = 120.0
"""How long a starting server may take to listen (it imports torch first)."""

_POLL_S = 0.01
"""How often the server reaps ranks that ended."""

_lock = threading.Lock()
_running: tuple[int, subprocess.Popen[bytes], str] | None = None  # (the pid that started it, the server, its socket)


def address() -> str:
    """The socket of this process's server, started on the first call (and again if it died)."""
    global _running
    with _lock:
        if _running is not None and (_running[0] != os.getpid() or _running[1].poll() is not None):
            _running = None  # a child of the process that started it, or a server that died
        if _running is None:
            _running = (os.getpid(), *_start())
        return _running[2]


def _start() -> tuple[subprocess.Popen[bytes], str]:
    """Start a server and return it with its socket once it listens."""
    folder = tempfile.mkdtemp(prefix="unicoll-mpi-server-")
    path = os.path.join(folder, "socket")
    server = subprocess.Popen([sys.executable, "-m", __name__, path], stdin=subprocess.PIPE)
    atexit.register(_stop, os.getpid(), server, folder)
    deadline = time.monotonic() + _START_S
    while not os.path.exists(path):
        if server.poll() is not None:
            code = server.returncode
            raise RuntimeError(f"unicoll.testing: the MPI rank server exited with code {code} as it started")
        if time.monotonic() > deadline:
            server.kill()
            raise RuntimeError(f"unicoll.testing: the MPI rank server did not listen within {_START_S:g} s")
        time.sleep(_POLL_S)
    return server, path


def _stop(starter: int, server: subprocess.Popen[bytes], folder: str) -> None:
    """End the server (it kills the ranks still running) and remove its socket's folder, in the
    process that started it (``starter``): a forked child that exits leaves it be."""
    if os.getpid() != starter:
        return
    if server.stdin is not None:
        server.stdin.close()
    try:
        server.wait(5)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    shutil.rmtree(folder, ignore_errors=True)


def serve(path: str) -> None:
    """Listen at ``path`` (made visible once listening) and fork a rank for each stub that
    connects, until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the ranks and the parent, which ends this
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".binding")
    listener.listen(64)
    os.rename(path + ".binding", path)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    ranks: dict[int, socket.socket] = {}  # a running rank's pid: its stub's connection
    while True:
        for key, _ in selector.select(_POLL_S):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                pid = _fork(conn, [listener, *ranks.values()])
                if pid is None:
                    conn.close()
                    continue
                ranks[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
            elif key.fileobj is sys.stdin:  # the process that started this server ended
                for pid in ranks:
                    _kill(pid)
                return
            else:  # a stub ended before its rank: the job is being stopped
                selector.unregister(key.fileobj)
                _kill(key.data)
        _reap(ranks, selector)


def _fork(conn: socket.socket, others: list[socket.socket]) -> int | None:
    """Fork the rank a stub asks for on ``conn``; return its pid, or None for a request that
    did not come whole (a stub that ended as it connected). The rank closes its copies of
    ``others`` (the listener, the other stubs' connections)."""
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 4)
    try:
        request = pickle.loads(message)
    except Exception:
        request = None
    if request is None or len(fds) != 4:
        for fd in fds:
            os.close(fd)
        return None
    pid = os.fork()
    if pid == 0:
        for sock in [conn, *others]:
            sock.close()
        _rank(request, fds)
    for fd in fds:
        os.close(fd)
    return pid


def _rank(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked rank: take the stub's streams, environment and process manager's socket,
    run the job, and exit (never returns)."""
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["environ"])
        os.environ["PMI_FD"] = str(fds[3])
        os.chdir(request["cwd"])
        rank_main(request["job"])  # exits
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(ranks: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    """Send each rank that ended its wait status, to its stub."""
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = ranks.pop(pid, None)
        if conn is None:
            continue
        try:
            selector.unregister(conn)
        except KeyError:  # unregistered when its stub ended
            pass
        try:
            conn.sendall(status.to_bytes(4, "little"))
        except OSError:  # the stub is gone already
            pass
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
