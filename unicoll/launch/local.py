"""Start one process per rank on this machine, the way ``unicoll run`` does.

Each rank runs ``python <argv...>`` with the variables :func:`unicoll.init` reads (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).
Every line a rank prints reaches this process's stdout or stderr prefixed with ``[rank K] ``.
The first rank to fail stops the whole world, so a crash never leaves its peers hanging in a
collective. The module imports nothing heavy, so ``unicoll run`` starts at once.

Each rank runs in its own session (process group); stopping a rank signals its group, which
also reaches the worker processes it started (:mod:`unicoll.launch.process`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

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


def world_env(rank: int, world_size: int, master_addr: str, master_port: int) -> dict[str, str]:
    """Return the variables that place a process in a world: its rank and the rendezvous."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def run(
    nprocs: int,
    argv: Sequence[str],
    *,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run ``python *argv`` as ``nprocs`` ranks on this machine and return the world's exit code.

    ``argv`` is what follows ``python`` on a command line: ``["train.py", "--lr", "1e-3"]`` or
    ``["-m", "package.module", ...]``. ``env`` adds variables to every rank's environment; the
    rank variables always win. ``master_port=None`` picks a free port on ``master_addr``.
    Each rank gets ``OMP_NUM_THREADS`` from :func:`thread_share` unless it is already set.

    Returns 0 when every rank exits 0. As soon as one rank exits otherwise, the others are
    stopped (SIGTERM, then SIGKILL after a few seconds), a line naming the rank goes to stderr,
    and its exit code is returned (1 when it was killed by a signal). Ctrl-C (or SIGTERM to
    this process, when ``run`` is called from the main thread) stops every rank and propagates.
    """
    if nprocs < 1:
        raise ValueError(f"unicoll run: nprocs: expected a positive integer, got {nprocs}")
    if not argv:
        raise ValueError("unicoll run: argv: expected a script or -m module, got nothing")
    port = free_port(master_addr) if master_port is None else master_port
    procs: list[subprocess.Popen[str]] = []
    readers: list[threading.Thread] = []
    try:
        with sigterm_raises_system_exit():
            for rank in range(nprocs):
                world = world_env(rank, nprocs, master_addr, port)
                procs.append(_start_rank(argv, {**thread_share(nprocs), **os.environ, **(env or {}), **world}))
                readers += _forward_output(procs[-1], rank)
            failure = _wait_first_failure(procs)
    finally:
        stop_sessions(procs)
        for reader in readers:
            reader.join(_READER_JOIN_S)
    if failure is None:
        return 0
    rank, code = failure
    print(
        f"unicoll run: rank {rank} failed with exit code {code}; stopped the other ranks",
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
    """Wait until every rank exits 0 (return None) or one fails (return its rank and code)."""
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
