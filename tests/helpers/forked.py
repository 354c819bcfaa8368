"""Run a script as ``python SCRIPT ARGS...`` would, in a process forked from the server that
``uc.testing.spawn`` keeps (torch and unicoll imported once, :data:`unicoll.testing.spawn.PRELOAD`).

A fresh interpreter spends about two seconds of CPU time importing torch before a fault script
does anything; the fault tests start a dozen worlds of such ranks, with no launcher between
them and the test. Here each one starts in a fraction of that: it gets the environment given
(nothing of the server's), ``sys.argv`` and the script's folder first on ``sys.path``, runs the
script as ``__main__``, then the exit handlers (``atexit``), and exits with the script's
status; its standard output and error go to a file. The handlers of the fatal signals that
the server's imports installed (Paddle's print a report, then end the process, slowly enough
that a thread's ``exit`` may end it first with status 0) are put back to the defaults a fresh
interpreter has. What differs from a fresh interpreter: the C libraries the server loaded read
their environment when it started (as for ``uc.testing.spawn``'s ranks). Given a network
namespace (``ip netns add``'s name), the process enters it first, as ``ip netns exec`` would put
a fresh interpreter there: a host of helpers/netns.py.
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing
import os
import runpy
import signal
import sys
from collections.abc import Mapping, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path

from unicoll.testing.spawn import PRELOAD

CLONE_NEWNET = 0x40000000
"""setns(2)'s kind of namespace: a network namespace (<sched.h>)."""
FATAL = (signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGSEGV, signal.SIGTERM)
"""The signals that end a fresh interpreter, which Paddle (imported by the suite's server) catches."""


def start_script(
    script: Path, args: Sequence[str], env: Mapping[str, str], output: Path, *, netns: str | None = None
) -> BaseProcess:
    """Start ``python script *args`` with environment ``env``, its output written to ``output``,
    in network namespace ``netns`` (None: this machine's)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    process = context.Process(target=_run, args=(str(script), list(args), dict(env), str(output), netns))
    process.start()
    return process


def _enter(netns: str) -> None:
    """Move this process into network namespace ``netns``: its sockets from now on are there."""
    libc = ctypes.CDLL(None, use_errno=True)
    descriptor = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(descriptor, CLONE_NEWNET) != 0:
            number = ctypes.get_errno()
            raise OSError(number, f"setns into network namespace {netns}: {os.strerror(number)}")
    finally:
        os.close(descriptor)


def _run(script: str, args: list[str], env: dict[str, str], output: str, netns: str | None) -> None:
    """In the forked process: the namespace, the output, the signals, the environment, the thread
    count, then the script."""
    if netns is not None:
        _enter(netns)
    sys.stdout.flush()
    sys.stderr.flush()
    descriptor = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    for number in FATAL:
        signal.signal(number, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch  # preloaded: read OMP_NUM_THREADS before this process had it

        torch.set_num_threads(int(threads))
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # as the interpreter's exit would; multiprocessing's skips them
