"""What a session (one ``init()`` to its ``finalize()``) has handed out, so that its end reaches it.

Groups and tasks outlive their session in the caller's hands. When the session ends, each is
told (:func:`end_session`): from then on it refuses to be used, and it lets go of what it holds
of the transport, since a torch process group stays alive, its store's port bound, while
anything references it or one of its works.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol


class SessionObject(Protocol):
    """What :func:`join_session` takes: an object with a use for the session's end."""

    def _end_session(self, reason: str, keep_handles: bool) -> None: ...


_members: dict[int, weakref.WeakSet[Any]] = {}
"""What every session that has not ended has handed out and still lives, by session number."""


def _never() -> bool:
    """Nothing traces until :mod:`unicoll.compiled.traced` loads."""
    return False


_tracing: Callable[[], bool] = _never
"""Whether torch.compile is tracing the caller (:func:`tracing_told_by`)."""


def tracing_told_by(test: Callable[[], bool]) -> None:
    """From now on, ``test()`` says whether torch.compile is tracing: called by
    :mod:`unicoll.compiled.traced` as it loads, with ``torch.compiler.is_compiling``."""
    global _tracing
    _tracing = test


def join_session(session: int, obj: SessionObject) -> None:
    """Have ``obj`` told when ``session`` ends, if it still lives then. Not while torch.compile
    traces: what a trace makes lives in the trace only (joining would make every compiled call
    rebuild the object to add it, and guard the compiled code on how many objects the session
    holds, so that any Task or group made between calls compiled it again)."""
    if _tracing():
        return
    _members.setdefault(session, weakref.WeakSet()).add(obj)


def end_session(session: int, reason: str, *, keep_handles: bool = False) -> None:
    """Tell everything ``session`` handed out that it has ended, for ``reason`` (said wherever
    one is used afterwards). They drop their transport handles, unless ``keep_handles``: a
    forked child must never free what its parent still uses."""
    for obj in list(_members.pop(session, ())):
        obj._end_session(reason, keep_handles)
