"""gloo's worker threads at the end of a session: let them finish before the process may exit.

A gloo process group runs its transfers on worker threads (named ``pt_gloo_runloop``). A worker
reports a transfer complete, then lets go of it, and with it of the transfer's tensors; a tensor
that Python no longer holds is freed there, and freeing it takes the interpreter's lock. Once
the interpreter has begun to shut down, a thread that asks for that lock is ended on the spot,
which in C++ (a destructor that may not throw) aborts the whole process: ``terminate called
without an active exception`` and SIGABRT, after the program had printed its results.

Destroying the process group joins its workers, but torch keeps a group alive after
``destroy_process_group`` in a process that imported ``torch._dynamo`` (``torch.optim`` does)
while the group existed (docs/compile.md), so its workers run until the process exits.
:func:`settle`, run by ``finalize()``, gives such workers the interpreter's lock until they are
all asleep (waiting for work), so none is left holding a transfer when the program ends.
Linux only: elsewhere it does nothing.
"""

from __future__ import annotations

import os
import time

_WORKER = "pt_gloo_runloop"
_TASKS = "/proc/self/task"

SETTLE_S = 0.5
"""The longest :func:`settle` waits (a worker that has not gone to sleep by then is left)."""

_STEP_S = 0.001


def settle(bound: float = SETTLE_S) -> None:
    """Return once every gloo worker thread of this process is asleep twice in a row, releasing
    the interpreter's lock in between (so that a worker waiting for it can free its tensors),
    or after ``bound`` seconds; at once when there are none."""
    deadline = time.monotonic() + bound
    asleep_before = False
    while _workers() and time.monotonic() < deadline:
        time.sleep(_STEP_S)
        asleep = all(state == "S" for state in _workers().values())
        if asleep and asleep_before:
            return
        asleep_before = asleep


def _workers() -> dict[str, str]:
    """The state letter (``R``, ``S``, ...) of each gloo worker thread, by thread id."""
    try:
        tasks = os.listdir(_TASKS)
    except OSError:
        return {}
    states = {}
    for tid in tasks:
        try:
            with open(f"{_TASKS}/{tid}/comm") as comm:
                if comm.read().strip() != _WORKER:
                    continue
            with open(f"{_TASKS}/{tid}/stat") as stat:
                states[tid] = stat.read().rpartition(")")[2].split()[0]
        except OSError:  # the thread ended meanwhile
            continue
    return states
