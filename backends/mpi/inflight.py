"""The transfers that nobody waits for any more, kept with what they use until MPI completes them.

A non-blocking MPI collective reads and writes its buffers after the call that issued it has
returned, until MPI completes it. Its request, dropped before that, is freed by mpi4py, and the
arrays go with their last reference, while MPI still writes into them: a task dropped without
``wait()`` corrupted the heap (``double free or corruption``, SIGSEGV) in our runs. So a
transfer whose owner lets go of it before it completed (a ``Task`` dropped, an exception
between issuing and waiting, a session ended by ``finalize()``, an internal wait that timed
out) is adopted here with the objects whose memory it uses (:func:`adopt`), and let go of only
once MPI reports it complete (:func:`reap`, at the backend's next transfer and at
``finalize``). The registry is never freed, not even by the interpreter's teardown, after which
mpi4py finalizes MPI: a transfer that never completes keeps its memory until the process ends.

Only transfers that nobody will wait for come here: testing a request completes it, and the
outcome would be lost to a caller that still holds it.
"""

from __future__ import annotations

import collections
from typing import Any

from mpi4py import MPI

from unicoll.forking import keep_forever

ADOPTED: collections.deque[tuple[MPI.Request, tuple[Any, ...]]] = collections.deque()
"""Each adopted request with the objects whose memory it uses. A deque, since a work's
finalizer may adopt from any thread, at any allocation, even while :func:`reap` runs."""
keep_forever(ADOPTED)


def adopt(request: MPI.Request, keep: tuple[Any, ...] = ()) -> None:
    """Keep ``request``, and ``keep`` (the arrays whose memory it reads or writes), until MPI
    completes it."""
    ADOPTED.append((request, keep))


def reap() -> int:
    """Let go of the adopted transfers that have completed; return how many are still in flight."""
    for _ in range(len(ADOPTED)):
        request, keep = ADOPTED.popleft()
        if not _completed(request):
            ADOPTED.append((request, keep))
    return len(ADOPTED)


def hold(handles: tuple[Any, ...]) -> None:
    """Keep ``handles`` (communicators, datatypes, operations) until every transfer adopted now
    has completed: they may run on them."""
    for _ in range(len(ADOPTED)):
        request, keep = ADOPTED.popleft()
        ADOPTED.append((request, (*keep, handles)))


def _completed(request: MPI.Request) -> bool:
    """Whether ``request`` has completed. One that failed has too: MPI is done with its memory,
    and no caller is left to report the failure to."""
    try:
        return request.Test()
    except MPI.Exception:
        return True
