"""What a rank of :func:`unicoll.testing.spawn` sends back, and the errors spawn raises."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple


class SpawnError(RuntimeError):
    """A rank of :func:`spawn` raised or died; ``rank`` says which one.

    ``remote_traceback`` is the rank's formatted traceback, or None when the process died
    without reporting one (then ``exitcode`` is its exit code).
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        remote_traceback: str | None = None,
        exitcode: int | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode


class SpawnTimeout(SpawnError):
    """:func:`spawn` ran past its timeout; ``ranks`` lists the ranks that had not finished."""

    def __init__(self, message: str, *, ranks: Sequence[int]) -> None:
        super().__init__(message, rank=ranks[0])
        self.ranks = list(ranks)


class Report(NamedTuple):
    """What a rank sends back: its return value, or the traceback and time of its failure."""

    ok: bool
    value: Any
    failed_at: float
