"""Start one process per rank on this machine, the way ``unicoll run`` does.

Each rank runs ``python <argv...>`` with the variables :func:`unicoll.init` reads (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).
Every line a rank prints reaches this process's stdout or stderr prefixed with ``[rank K] ``.
The first rank to fail stops the whole world, so a crash never leaves its peers hanging in a
collective. The module imports nothing heavy, so ``unicoll run`` starts at once.

A job of several machines runs this once on each (``nnodes`` nodes of ``nprocs`` ranks; node
``node_rank`` runs ranks ``node_rank * nprocs`` to ``node_rank * nprocs + nprocs - 1``), all
meeting at ``master_addr:master_port`` on node 0, as torchrun's static rendezvous does. Each
node stops its own ranks when one fails; the other nodes' ranks then lose a peer and fail too.
The rendezvous is checked before any rank starts (:func:`check_rendezvous`).

Each rank runs in its own session (process group); stopping a rank signals its group, which
also reaches the worker processes it started (:mod:`unicoll.launch.process`).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from ..backends.rendezvous import route_source
from .process import sigterm_raises_system_exit, stop_sessions, thread_share

_POLL_S = 0.05
"""How often the launcher checks whether a rank has exited."""

_READER_JOIN_S = 1.0
"""How long to wait for a stopped rank's last output lines."""

_output_locks = {"stdout": threading.Lock(), "stderr": threading.Lock()}
"""One lock per stream, so lines from different ranks never interleave mid-line."""


def free_port(addr: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``addr`` now, found by binding port 0.

    The port is released before returning, so another process could take it in between; the
    window is short enough for a rendezvous started right after.
    """
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        return sock.getsockname()[1]


def world_env(
    rank: int, world_size: int, master_addr: str, master_port: int, local_world_size: int | None = None
) -> dict[str, str]:
    """Return the variables that place a process in a world: its rank and the rendezvous.
    ``local_world_size`` is the number of ranks on each machine (None: the whole world)."""
    local = world_size if local_world_size is None else local_world_size
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % local),
        "LOCAL_WORLD_SIZE": str(local),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def check_rendezvous(master_addr: str, master_port: int | None, nnodes: int = 1, node_rank: int = 0) -> None:
    """Check, before any rank starts, where the ranks of node ``node_rank`` of ``nnodes`` will
    meet: a ValueError naming the flag of ``unicoll run``, what it expects and what it got. The
    port must be one (1 to 65535; required with several nodes, and the same on each); node 0
    hosts rank 0, so ``master_addr`` must be an address of this machine there, and one that
    this machine has a route to elsewhere (a loopback address only for a single node)."""
    if nnodes < 1:
        raise ValueError(f"unicoll run: --nnodes: expected a positive integer, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(
            f"unicoll run: --node-rank: expected this node's number from 0 to {nnodes - 1} (with --nnodes "
            f"{nnodes}), got {node_rank}"
        )
    if master_port is None and nnodes > 1:
        raise ValueError(
            f"unicoll run: --master-port: expected the port rank 0 listens on, the same on all {nnodes} nodes, got none"
        )
    if master_port is not None and not 0 < master_port < 65536:
        raise ValueError(
            f"unicoll run: --master-port: expected a port number from 1 to 65535 (or none, on one node, for a "
            f"free one), got {master_port}"
        )
    expected = (
        "an address of this machine, which hosts rank 0 (--node-rank 0)"
        if node_rank == 0
        else "the address of the node that hosts rank 0 (--node-rank 0), with a route from this machine"
    )
    try:
        if node_rank == 0:
            free_port(master_addr)  # binds there
        source = route_source(master_addr)  # on node 0, the address itself
    except OSError as exc:
        raise ValueError(f"unicoll run: --master-addr: expected {expected}, got {master_addr!r} ({exc})") from None
    if nnodes > 1 and ipaddress.ip_address(source.split("%")[0]).is_loopback:
        raise ValueError(
            f"unicoll run: --master-addr: expected an address that the other nodes reach (with --nnodes {nnodes}), "
            f"got {master_addr!r}, a loopback address"
        )


def run(
    nprocs: int,
    argv: Sequence[str],
    *,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    env: Mapping[str, str] | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
) -> int:
    """Run ``python *argv`` as ``nprocs`` ranks on this machine and return the world's exit code.

    ``argv`` is what follows ``python`` on a command line: ``["train.py", "--lr", "1e-3"]`` or
    ``["-m", "package.module", ...]``. ``env`` adds variables to every rank's environment; the
    rank variables always win. ``master_port=None`` picks a free port on ``master_addr``.
    Each rank gets ``OMP_NUM_THREADS`` from :func:`thread_share` unless it is already set.
    With ``nnodes`` > 1 this machine is node ``node_rank`` of a job that runs this on every node
    (see the module); :func:`check_rendezvous` raises ValueError before any rank starts.

    Returns 0 when every rank exits 0. As soon as one rank exits otherwise, the others are
    stopped (SIGTERM, then SIGKILL after a few seconds), a line naming the rank goes to stderr,
    and its exit code is returned (1 when it was killed by a signal). Ctrl-C (or SIGTERM to
    this process, when ``run`` is called from the main thread) stops every rank and propagates.
    """
    if nprocs < 1:
        raise ValueError(f"unicoll run: nprocs: expected a positive integer, got {nprocs}")
    if not argv:
        raise ValueError("unicoll run: argv: expected a script or -m module, got nothing")
    check_rendezvous(master_addr, master_port, nnodes, node_rank)
    port = free_port(master_addr) if master_port is None else master_port
    first = node_rank * nprocs
    procs: list[subprocess.Popen[str]] = []
    readers: list[threading.Thread] = []
    try:
        with sigterm_raises_system_exit():
            for rank in range(first, first + nprocs):
                world = world_env(rank, nnodes * nprocs, master_addr, port, nprocs)
                procs.append(_start_rank(argv, {**thread_share(nprocs), **os.environ, **(env or {}), **world}))
                readers += _forward_output(procs[-1], rank)
            failure = _wait_first_failure(procs)
    finally:
        stop_sessions(procs)
        for reader in readers:
            reader.join(_READER_JOIN_S)
    if failure is None:
        return 0
    local, code = failure
    print(
        f"unicoll run: rank {first + local} failed with exit code {code}; stopped the other ranks",
        file=sys.stderr,
        flush=True,
    )
    return code if code > 0 else 1


def _start_rank(argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """Start one rank, unbuffered, in its own session, its output piped back as text lines."""
    return subprocess.Popen(
        [sys.executable, *argv],
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        encoding="utf-8",
        errors="replace",
        start_new_session=True,
    )


def _forward_output(proc: subprocess.Popen[str], rank: int) -> list[threading.Thread]:
    """Start the threads that copy ``proc``'s stdout and stderr here, line by line, prefixed."""
    threads = [
        threading.Thread(
            target=_copy_lines,
            args=(pipe, name, f"[rank {rank}] "),
            name=f"unicoll-rank{rank}-{name}",
            daemon=True,
        )
        for pipe, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))
    ]
    for thread in threads:
        thread.start()
    return threads


def _copy_lines(pipe: TextIO, stream_name: str, prefix: str) -> None:
    """Write every line of ``pipe`` to ``sys.<stream_name>`` with ``prefix``, whole lines only.

    When that stream is closed (``unicoll run ... | head``), the lines are read and dropped,
    so the rank never blocks on a full pipe.
    """
    with pipe:
        for line in pipe:
            text = prefix + (line if line.endswith("\n") else line + "\n")
            with _output_locks[stream_name]:
                stream = getattr(sys, stream_name)
                try:
                    stream.write(text)
                    stream.flush()
                except (OSError, ValueError):
                    pass


def _wait_first_failure(procs: Sequence[subprocess.Popen[str]]) -> tuple[int, int] | None:
    """Wait until every rank exits 0 (return None) or one fails (return its index in ``procs``
    and its code)."""
    running = set(range(len(procs)))
    while running:
        for rank in sorted(running):
            code = procs[rank].poll()
            if code is None:
                continue
            if code != 0:
                return rank, code
            running.discard(rank)
        time.sleep(_POLL_S)
    return None
