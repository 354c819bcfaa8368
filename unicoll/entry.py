"""One thread at a time inside unicoll's collectives.

Collectives pair up across ranks by the order in which they are issued, so two threads of one
rank issuing them at once would pair calls at random. The contract: a process issues its
collectives from one thread at a time, in the same order on every rank. :func:`exclusive`
enforces the first half: a thread that enters an operator while another thread is inside one
gets a RuntimeError at once, before anything is sent. Check mode enforces the second half
across ranks (:mod:`unicoll.check` compares the issuing threads' names).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from threading import get_ident
from typing import TypeVar

F = TypeVar("F", bound=Callable)

_lock = threading.Lock()
_holder: tuple[str, int] = ("", 0)
"""The operator and the identity of the thread inside, while :data:`_lock` is held (the
thread's name is looked up only for the error: this runs on every call)."""


def _busy(op: str) -> RuntimeError:
    """The error for a thread that calls ``op`` while another thread is inside a collective."""
    inside, ident = _holder
    thread = next((t.name for t in threading.enumerate() if t.ident == ident), "")
    return RuntimeError(
        f"{op}: thread {threading.current_thread().name!r} called it while thread {thread!r} is inside {inside}; "
        "unicoll's collectives must be issued from one thread at a time, in the same order on every rank"
    )


def enter(op: str) -> None:
    """Take the right to issue a collective for ``op``; RuntimeError when another thread has it."""
    global _holder
    if not _lock.acquire(False):
        raise _busy(op)
    _holder = (op, get_ident())


def leave() -> None:
    """Give back what :func:`enter` took."""
    _lock.release()


def current_operator() -> str:
    """The operator whose collective a thread is inside now (``""`` when none is): what a
    backend's own errors and checks name."""
    return _holder[0] if _lock.locked() else ""


def exclusive_as(op: str) -> Callable[[F], F]:
    """A decorator: the function run between :func:`enter` and :func:`leave` for ``op`` (the
    name its errors give: ``"moe.dispatch"``, or the operator an internal entry point serves)."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def entered(*args, **kwargs):
            global _holder
            if not _lock.acquire(False):  # enter() and leave() inlined: this is every call's path
                raise _busy(op)
            _holder = (op, get_ident())
            try:
                return fn(*args, **kwargs)
            finally:
                _lock.release()

        return entered  # type: ignore[return-value]

    return decorate


def exclusive(fn: F) -> F:
    """``fn`` (a collective of the runtime) run between :func:`enter` and :func:`leave`, for its name."""
    return exclusive_as(fn.__name__)(fn)


def _reset_in_child() -> None:
    """A child forked while a thread of the parent was inside a collective starts with the lock free."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_in_child)
