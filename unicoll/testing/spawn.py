"""Run a function on every rank of a small world of new processes, for tests.

:func:`spawn` starts one process per rank (multiprocessing's "forkserver" start method, from a
server that imported torch and unicoll once; or "spawn", a fresh interpreter each), places it
in the world through the environment, calls ``unicoll.init``, runs the function and sends its
return value back. On the ``mpi`` backend with MPICH, forked ranks learn their place from a PMI
server in this process (:mod:`unicoll.testing.pmi`); with ``"spawn"`` or another MPI, the
world is an MPI job started by mpiexec (:mod:`unicoll.testing.mpi`). The first rank to fail
stops the world and its traceback is raised here as :class:`SpawnError`, so a failing test
shows the remote error instead of a hang.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from ..forking import mpi_running
from ..launch.local import free_port, world_env
from ..launch.process import GRACE_S, thread_share
from ..runtime import finalize, init
from .pmi import PmiServer, serves_this_mpi
from .report import Report, SpawnError, SpawnTimeout

PRELOAD = ("numpy", "torch", "torch.distributed", "unicoll", "unicoll.backends.torch")
"""What the server that forks the ranks imports once (see :func:`spawn`'s ``start_method``):
most of a rank's start, where each fresh interpreter took about a second of CPU time."""


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout: float = 120,
    env: Mapping[str, str] | None = None,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` new processes; return the results by rank.

    Each process gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` (a free port), its share of the cores in
    ``OMP_NUM_THREADS`` (as ``unicoll run`` gives it, unless this process or ``env`` sets it;
    torch's thread count follows it) and ``env``, then calls
    ``unicoll.init(backend)``, runs ``fn`` and finally ``unicoll.finalize()``. The variables are
    set when the process starts running, after it has imported unicoll (and the running
    script) and before it unpickles ``fn`` and ``args`` (importing ``fn``'s module). ``fn``,
    ``args`` and the results must be picklable; ``fn`` must be defined at module level (in
    the running script too: each rank imports it as ``__mp_main__``, as multiprocessing's
    children do).

    ``start_method`` is multiprocessing's: ``"forkserver"`` (the default where the platform has
    it) forks each rank from a server process that imported :data:`PRELOAD` once, the first
    time this process spawned a world: a world of 2 starts in about 0.3 s where fresh
    interpreters take about 1 s, and 2 s of CPU time. Such a rank runs with this process's
    environment as of the call (``os.environ`` replaced as it starts), but C libraries the
    server loaded read theirs when it started: a variable read as a process starts (glibc's
    ``MALLOC_*``, ``LD_PRELOAD``) reaches only ranks of ``"spawn"``, a fresh interpreter each.

    When the backend is ``mpi`` (``backend``, else ``UNICOLL_BACKEND`` from ``env`` or this
    process), the ranks are an MPI world. With ``"forkserver"`` and MPICH (whose launcher is
    hydra) they are forked from the server as above, and this process serves them the PMI
    through which an MPI launcher tells ranks their rank, size and peers
    (:mod:`unicoll.testing.pmi`): a world of 2 that imports torch starts in about 0.3 s
    instead of 2 s. Otherwise (``"spawn"``, or another MPI) they are an MPI job started by
    mpiexec, each rank a fresh interpreter. Either way ``env`` is added to their environment.

    Raises :class:`SpawnError` for the first rank (in time) that raised or died, after
    stopping the others, and :class:`SpawnTimeout` when ranks are still running after
    ``timeout`` seconds (every process is killed).
    """
    if world_size < 1:
        raise ValueError(f"spawn: world_size: expected a positive integer, got {world_size}")
    methods = multiprocessing.get_all_start_methods()
    if start_method is None:
        start_method = "forkserver" if "forkserver" in methods else "spawn"
    if start_method not in ("forkserver", "spawn") or start_method not in methods:
        expected = " or ".join(repr(m) for m in ("forkserver", "spawn") if m in methods)
        raise ValueError(f"spawn: start_method: expected {expected} (or None), got {start_method!r}")
    mpi = (backend or {**os.environ, **(env or {})}.get("UNICOLL_BACKEND")) == "mpi"
    if mpi and (start_method != "forkserver" or not serves_this_mpi()):
        from .mpi import spawn_mpi

        return spawn_mpi(fn, world_size, args, backend, timeout, env)
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # read once, when the server starts
    share = {} if "OMP_NUM_THREADS" in os.environ else thread_share(world_size)
    work = pickle.dumps((fn, args))  # unpickled by each rank once its variables are set
    port = free_port()
    procs: list[BaseProcess] = []
    conns: list[Connection] = []
    pmi = PmiServer(world_size) if mpi else None
    try:
        for rank in range(world_size):
            receiver, sender = ctx.Pipe(duplex=False)
            conns.append(receiver)
            placed = world_env(rank, world_size, "127.0.0.1", port) if pmi is None else pmi.rank_env(rank)
            child_env = {**os.environ, **share, **(env or {}), **placed}
            proc = ctx.Process(
                target=_child_main,
                args=(sender, rank, child_env, backend, work, None if pmi is None else pmi.rank_sockets[rank]),
                name=f"unicoll-rank{rank}",
            )
            with sender:
                proc.start()
            procs.append(proc)
            if pmi is not None:  # the rank has its copy: its end closes the server's line to it
                pmi.rank_sockets[rank].close()
        results = _collect(procs, conns, timeout)
        _join(procs, time.monotonic() + GRACE_S)
        return results
    finally:
        _stop(procs)
        for conn in conns:
            conn.close()
        if pmi is not None:
            pmi.close()


def _child_main(
    conn: Connection,
    rank: int,
    env: dict[str, str],
    backend: str | None,
    work: bytes,
    pmi_socket: socket.socket | None,
) -> None:
    """Entry point of a rank: set its variables, unpickle ``fn`` and its arguments from
    ``work``, join the world, run ``fn``, send back its result or its error (an MPI rank finds
    the parent's PMI server on ``pmi_socket``)."""
    try:
        os.environ.clear()  # a rank forked from the server has the server's: this call's instead
        os.environ.update(env)
        if pmi_socket is not None:
            _place_mpi_rank(rank, pmi_socket)
        fn, args = pickle.loads(work)  # may import mpi4py.MPI, which starts MPI: not before now
        _take_thread_share()
        result = _run_in_world(conn, fn, rank, args, backend)
        # Plain pickle, not the Connection's ForkingPickler: torch registers reducers there
        # that share tensors through this process, which exits right after sending.
        payload = pickle.dumps(Report(True, result, 0.0))
    except BaseException:
        if not conn.closed:
            _send_failure(conn)
        sys.exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send_bytes(payload)
    _finalize_mpi()
    # Skip the interpreter's teardown, which takes about a second with torch loaded; the
    # world is finalized and everything the rank printed is flushed.
    os._exit(0)


def _finalize_mpi() -> None:
    """End MPI where the rank started it, as an MPI rank must before it exits (after its
    result is sent: MPI's end waits for every rank)."""
    if mpi_running():
        sys.modules["mpi4py.MPI"].Finalize()


def _place_mpi_rank(rank: int, pmi_socket: socket.socket) -> None:
    """Tell MPI, which reads it when it starts, where this rank's PMI server is; refuse a rank
    in which MPI started already (a running script that imports ``mpi4py.MPI`` as it loads,
    itself or through a module it imports): it would be a world of its own."""
    if mpi_running():
        raise RuntimeError(
            f"unicoll.testing.spawn: rank {rank}: MPI started before the rank joined its world (the running "
            "script imports mpi4py.MPI as it loads, itself or through a module it imports); import it inside "
            "functions, or pass start_method='spawn'"
        )
    os.environ["PMI_FD"] = str(pmi_socket.fileno())


def _take_thread_share() -> None:
    """Give torch, which the server (or the running script) loaded before ``OMP_NUM_THREADS``
    was set here, that many threads (a library loaded later reads the variable itself)."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _run_in_world(
    conn: Connection, fn: Callable[..., Any], rank: int, args: tuple[Any, ...], backend: str | None
) -> Any:
    """Call ``fn(rank, *args)`` between ``unicoll.init(backend)`` and ``unicoll.finalize()``.

    A failure of ``fn`` is sent before ``finalize`` runs: finalize may wait for peers that are
    themselves waiting for this rank, and the parent stops them all once it knows.
    """
    init(backend)
    try:
        return fn(rank, *args)
    except BaseException:
        _send_failure(conn)
        raise
    finally:
        finalize()


def _send_failure(conn: Connection) -> None:
    """Send the exception being handled, with the time it is reported, and close ``conn``."""
    report = Report(False, traceback.format_exc(), time.time())
    conn.send_bytes(pickle.dumps(report))
    conn.close()


def _collect(procs: Sequence[BaseProcess], conns: Sequence[Connection], timeout: float) -> list[Any]:
    """Receive every rank's result; raise for the first rank to fail, or after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    while len(results) < len(procs):
        pending = [rank for rank in range(len(procs)) if rank not in results]
        remaining = deadline - time.monotonic()
        waitables = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        ready = set(wait(waitables, timeout=max(0.0, remaining)))
        if not ready:
            raise SpawnTimeout(
                f"spawn: ranks {pending} had not finished after {timeout} s; killed every rank",
                ranks=pending,
            )
        failures: list[tuple[float, SpawnError]] = []
        for rank in pending:
            if conns[rank] in ready or procs[rank].sentinel in ready:
                report = _receive(conns[rank], procs[rank])
                if report.ok:
                    results[rank] = report.value
                else:
                    failures.append((report.failed_at, _rank_error(rank, report, procs[rank])))
        if failures:
            raise min(failures, key=lambda failure: failure[0])[1]
    return [results[rank] for rank in range(len(procs))]


def _receive(conn: Connection, proc: BaseProcess) -> Report:
    """Read the report of ``proc``; when it exited without one, wait for its exit code."""
    try:
        if conn.poll():
            return pickle.loads(conn.recv_bytes())
    except EOFError:
        pass
    proc.join(GRACE_S)
    return Report(False, None, time.time())


def _rank_error(rank: int, report: Report, proc: BaseProcess) -> SpawnError:
    """Build the exception for a failed rank from its traceback or its exit code."""
    if report.value is not None:
        return SpawnError(f"spawn: rank {rank} raised:\n{report.value}", rank=rank, remote_traceback=report.value)
    return SpawnError(
        f"spawn: rank {rank} exited with code {proc.exitcode} without reporting a result (see its output above)",
        rank=rank,
        exitcode=proc.exitcode,
    )


def _join(procs: Sequence[BaseProcess], deadline: float) -> None:
    """Wait until every process has exited or ``deadline`` (a ``time.monotonic`` value)."""
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))


def _stop(procs: Sequence[BaseProcess]) -> None:
    """Stop every process still running (SIGTERM, then SIGKILL after the grace time), reap all."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    _join(procs, time.monotonic() + GRACE_S)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
        proc.close()
