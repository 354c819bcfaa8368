"""What each rank of ``unicoll run --mpi`` runs: ``python -m unicoll.launch.mpi_rank NOTES ARGV...``.

It runs ``python ARGV...`` in this interpreter (a script, or ``-m module``, through
:mod:`runpy`, as ``python -m mpi4py`` does) and keeps a note for the launcher in
``NOTES/rank<K>.json`` (K from the MPI launcher's variables): its host and pid, whether MPI has
begun to start here (the first import of ``mpi4py.MPI``), and how the program ended (its exit
status, and the exception that ended it). :mod:`unicoll.launch.mpi` reads the notes to stop the
job when a rank fails, or when a rank ended before MPI started while another starts it (MPI's
start then waits for it forever: MPICH's hydra does not stop the job), and to say which rank
failed and why.

A program that fails once MPI runs aborts the job (:mod:`unicoll.backends.mpi.abort`), a
``SystemExit`` with a non-zero status included: this runner sees it leave the program.

What the program prints through ``sys.stdout`` and ``sys.stderr`` reaches the launcher in whole
lines, each prefixed ``[rank K] `` as :mod:`unicoll.launch.local` prefixes them
(:class:`RankLines`): the MPI launcher forwards each rank's output as it reads it, so two ranks'
partial lines would otherwise merge into one.
"""

from __future__ import annotations

import importlib.abc
import io
import json
import os
import runpy
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from ..backends.mpi.abort import abort_on_failure, record_failure
from .process import write_atomically

RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
"""Where MPICH's and Intel MPI's hydra, Open MPI and PMIx launchers give a process its rank."""


def _rank() -> int | None:
    """This process's rank from the MPI launcher's variables, or None."""
    return next((int(os.environ[name]) for name in RANK_VARIABLES if os.environ.get(name, "").isdigit()), None)


class RankLines(io.TextIOBase):
    """A text stream over ``stream`` that writes whole lines only, each prefixed with ``prefix``:
    a line's text waits here until its newline (or :meth:`end`), then goes out with the other
    complete lines of the same write in one flush of ``stream``."""

    def __init__(self, stream: TextIO, prefix: str) -> None:
        super().__init__()
        self._stream, self._prefix, self._partial = stream, prefix, ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            *lines, self._partial = (self._partial + text).split("\n")
            if lines:
                self._stream.write("".join(f"{self._prefix}{line}\n" for line in lines))
                self._stream.flush()
        return len(text)

    def flush(self) -> None:
        """Flush the complete lines (a partial line waits for its newline)."""
        self._stream.flush()

    def end(self) -> None:
        """Write out a partial line (the program ended without its newline)."""
        with self._lock:
            partial, self._partial = self._partial, ""
        if partial:
            self._stream.write(f"{self._prefix}{partial}\n")
            self._stream.flush()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()

    @property
    def buffer(self) -> Any:
        """The stream's bytes underneath (what is written there goes out unprefixed)."""
        return self._stream.buffer

    @property
    def encoding(self) -> str:
        return self._stream.encoding

    @property
    def errors(self) -> str | None:
        return self._stream.errors


def note_path(notes: str | Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its note in the folder ``notes``."""
    return Path(notes) / f"rank{rank}.json"


class _Note:
    """This rank's note: written whole (atomically) on every change, by this process only (a
    child forked from it runs this runner's code too); nowhere when the launcher's variables give
    no rank or the folder is not on this host."""

    def __init__(self, notes: str) -> None:
        rank = _rank()
        self._path = None if rank is None else note_path(notes, rank)
        self._fields: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "mpi": False, "exit": None}
        self.update()

    def update(self, **fields: Any) -> None:
        self._fields.update(fields)
        if self._path is not None and os.getpid() == self._fields["pid"]:
            try:
                write_atomically(self._path, json.dumps(self._fields))
            except OSError:  # the launcher's folder is on another host, or gone
                self._path = None


class _MpiStartWatch(importlib.abc.MetaPathFinder):
    """Notes that MPI begins to start here: the first import of ``mpi4py.MPI`` (which calls
    ``MPI_Init``). Finds nothing itself."""

    def __init__(self, note: _Note) -> None:
        self._note: _Note | None = note

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: object = None) -> None:
        if fullname == "mpi4py.MPI" and self._note is not None:
            self._note.update(mpi=True)
            self._note = None


def _ending(exc: BaseException) -> tuple[int, str]:
    """The exit status that ``exc`` leaving the program gives (as the interpreter exits with it;
    130 for ``KeyboardInterrupt``, as a shell reports SIGINT), and what ended it, in one line."""
    if isinstance(exc, SystemExit):
        code = exc.code
        status = 0 if code is None else code & 0xFF if isinstance(code, int) else 1
        return status, f"SystemExit({code!r})"
    text = str(exc).strip().splitlines()
    reason = f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
    return 130 if isinstance(exc, KeyboardInterrupt) else 1, reason


def _run_program(argv: list[str]) -> None:
    """Run ``python argv...`` here: ``sys.argv`` and ``sys.path[0]`` as python sets them."""
    if argv[0] == "-m":
        sys.argv[:] = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    sys.argv[:] = argv
    sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")


def _program_traceback(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` from the program's first frame on: without this runner's frames and runpy's."""
    while tb is not None and (tb.tb_frame.f_globals is globals() or tb.tb_frame.f_globals.get("__name__") == "runpy"):
        tb = tb.tb_next
    return tb


def main(argv: list[str]) -> None:
    """Run the program ``argv[1:]`` with its note in the folder ``argv[0]``, and exit as
    ``python argv[1:]`` would: an exception that leaves the program is printed (through
    ``sys.excepthook``, from the program's first frame, with ``sys.last_value`` set as the
    interpreter sets it for an uncaught exception), and the process exits with status 1 (130
    for ``KeyboardInterrupt``)."""
    note = _Note(argv[0])
    abort_on_failure()
    sys.meta_path.insert(0, _MpiStartWatch(note))
    prefix = f"[rank {_rank()}] "
    out, err = RankLines(sys.stdout, prefix), RankLines(sys.stderr, prefix)
    sys.stdout, sys.stderr = out, err
    try:
        _run(argv[1:], note)
    finally:
        out.end()
        err.end()


def _run(argv: list[str], note: _Note) -> None:
    """:func:`main`'s program, its ending noted."""
    try:
        _run_program(argv)
    except BaseException as exc:
        status, reason = _ending(exc)
        note.update(exit={"code": status, "reason": reason, "at": time.time()})
        if status:
            record_failure(status)
        if isinstance(exc, SystemExit):
            raise
        exc.with_traceback(_program_traceback(exc.__traceback__))  # the hook prints the exception's own
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__  # as uncaught
        sys.excepthook(type(exc), exc, exc.__traceback__)
        sys.exit(status)
    note.update(exit={"code": 0, "reason": None, "at": time.time()})


if __name__ == "__main__":
    main(sys.argv[1:])
