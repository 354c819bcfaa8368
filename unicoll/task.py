"""``Task``: the handle that ``sync_op=False`` returns."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

from .backends.base import Work
from .errors import CollectiveTimeoutError, bad_input, translated
from .group import Group
from .runtime import MAX_TIMEOUT
from .session import join_session

_PENDING = object()


def _wait_seconds(timeout: object) -> float | None:
    """``Task.wait``'s ``timeout`` checked: None, or seconds from 0 (a poll) to :data:`MAX_TIMEOUT`."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise bad_input("Task.wait", "timeout", "a number of seconds or None", repr(timeout), TypeError)
    if not 0 <= timeout <= MAX_TIMEOUT:  # NaN fails too
        raise bad_input("Task.wait", "timeout", f"a number of seconds from 0 to {MAX_TIMEOUT:g}, or None", timeout)
    return float(timeout)


class Task:
    """An operator in flight. ``wait()`` returns its result once; ``is_completed()`` polls.

    >>> task = uc.alltoall_single(None, x, sync_op=False)   # doctest: +SKIP
    >>> y = task.wait()                                      # doctest: +SKIP
    """

    def __init__(
        self, works: tuple[Work, ...], finish: Callable[[], Any], timeout: float, op: str, group: Group
    ) -> None:
        self._works = works
        self._finish = finish
        self._timeout = timeout
        self._op = op
        self._group = group
        self._result: Any = _PENDING
        join_session(group.session, self)

    def is_completed(self) -> bool:
        """Whether the transfers are done (``wait()`` will not block on communication).
        Raises the :class:`~unicoll.CommunicationError` of a transfer that failed."""
        if self._result is not _PENDING:
            return True
        self._check_session()
        with translated(self._op, self._group, self._timeout):
            return all(work.is_completed() for work in self._works)

    def _end_session(self, reason: str, keep_handles: bool) -> None:
        """The session ended (see :func:`unicoll.session.end_session`): let go of the transfers,
        whose works keep their process group alive, unless ``keep_handles``."""
        if not keep_handles:
            self._works, self._finish = (), None

    def _check_session(self) -> None:
        """ValueError when the session that issued the task has ended (``finalize()``, or this
        process is a fork of the one that issued it): its transfers are never touched again."""
        if self._group.ended is not None:
            raise ValueError(f"{self._op}: this task can no longer complete: {self._group.ended}")

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the operator completes (at most ``timeout`` seconds, default the one
        given to ``init``) and return its result: the output array or the filled list.
        ``timeout=0`` polls: the result if the transfers are done, else
        :class:`~unicoll.CollectiveTimeoutError` at once.

        Raises :class:`~unicoll.CollectiveTimeoutError` past the timeout and
        :class:`~unicoll.PeerLostError` when a rank of the group is gone. Past a timeout given
        here, shorter than ``init``'s, the task can be waited for again.
        """
        seconds = _wait_seconds(timeout)
        if self._result is _PENDING:
            self._check_session()
            seconds = self._timeout if seconds is None else seconds
            with translated(self._op, self._group, seconds):
                if seconds == 0 and not self.is_completed():
                    raise CollectiveTimeoutError(
                        f"{self._op} on {self._group}: not complete yet "
                        "(Task.wait(timeout=0) polls; wait again for the result)"
                    )
                for work in self._works:
                    work.wait(seconds)
            self._result = self._finish()
            self._works, self._finish = (), None  # a torch work keeps its process group alive
        return self._result

    def _then(self, convert: Callable[[Any], Any]) -> Task:
        """This task, whose ``wait()`` returns ``convert(result)`` (once): for unicoll's own
        floors, where a result is handed back as another library's array or in another shape."""
        if self._result is not _PENDING:
            self._result = convert(self._result)
        elif self._finish is not None:
            finish = self._finish
            self._finish = lambda: convert(finish())
        return self

    def __repr__(self) -> str:
        state = "done" if self._result is not _PENDING else "in flight"
        return f"<unicoll.Task {self._op} {state}>"
