"""``Task``: the handle that ``sync_op=False`` returns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .backends.base import Work
from .errors import translated
from .group import Group

_PENDING = object()


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

    def is_completed(self) -> bool:
        """Whether the transfers are done (``wait()`` will not block on communication)."""
        return self._result is not _PENDING or all(work.is_completed() for work in self._works)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the operator completes (at most ``timeout`` seconds, default the one
        given to ``init``) and return its result: the output array or the filled list.

        Raises :class:`~unicoll.CollectiveTimeoutError` past the timeout and
        :class:`~unicoll.PeerLostError` when a rank of the group is gone.
        """
        if self._result is _PENDING:
            seconds = self._timeout if timeout is None else timeout
            with translated(self._op, self._group, seconds):
                for work in self._works:
                    work.wait(seconds)
            self._result = self._finish()
        return self._result

    def __repr__(self) -> str:
        state = "done" if self._result is not _PENDING else "in flight"
        return f"<unicoll.Task {self._op} {state}>"
