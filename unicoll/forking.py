"""What a process forked from an initialized unicoll process keeps of its parent's transport.

A forked child holds copies of the parent's connections (sockets, shared memory, the MPI
launcher's pipe) but none of the threads that serve them. Using them would mix the child's
traffic into the parent's; releasing them would join threads that do not exist in the child
(torch's process groups then crash or hang) or reach into the parent's job. So the child keeps
every object of the parent's transport alive and untouched (:func:`keep_forever`) and, where
MPI runs (:func:`mpi_running`), ends without the interpreter's teardown
(:func:`exit_before_teardown`): mpi4py calls ``MPI_Finalize`` there, which in a copy of an MPI
process talks to the job's launcher and shares the parent's memory and connections (the parent's
job then timed out, or the parent crashed at its own exit, in our runs).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading

_exit_codes: list[object] = []
"""The code given to the last ``sys.exit()`` of the main thread, once :func:`exit_before_teardown` records it."""


def keep_forever(obj: object) -> None:
    """Hold a reference to ``obj`` that is never given back, so that neither it nor anything it
    references is freed in this process, not even when the interpreter exits."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def mpi_running() -> bool:
    """Whether MPI is initialized, and not finalized, in this process (through mpi4py)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()


def exit_before_teardown() -> None:
    """End this process with ``os._exit`` when the interpreter exits, once the atexit handlers
    registered after this call have run: the handlers registered before it, the freeing of
    modules and the exit functions of C extensions (mpi4py's ``MPI_Finalize``) never run.

    The exit status is kept where it is known: 1 after an uncaught exception, the code given to
    ``sys.exit()``, else 0 (a ``SystemExit`` raised without ``sys.exit()`` exits with 0).
    """
    real_exit = sys.exit

    def recording_exit(status: object = None) -> None:
        if threading.current_thread() is threading.main_thread():  # elsewhere it ends only a thread
            _exit_codes[:] = [status]
        real_exit(status)

    sys.exit = recording_exit
    atexit.register(_exit_now)


def _exit_status() -> int:
    """The status this process exits with: see :func:`exit_before_teardown`."""
    if getattr(sys, "last_value", None) is not None:  # set by the interpreter for an uncaught exception
        return 1
    code = _exit_codes[0] if _exit_codes else None
    if code is None:
        return 0
    return code & 0xFF if isinstance(code, int) else 1  # the interpreter has printed any other code already


def _exit_now() -> None:
    """Leave at once with :func:`_exit_status` (:func:`exit_at_once`)."""
    exit_at_once(_exit_status())


def exit_at_once(status: int) -> None:
    """Flush the standard streams and end this process with ``status`` through ``os._exit``
    (no further exit handlers, no teardown, no waiting for threads), even when a flush fails."""
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None and not stream.closed:
                stream.flush()
    finally:
        os._exit(status)
