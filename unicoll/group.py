"""Process groups: a sorted subset of the world's ranks that an operator runs over."""

from __future__ import annotations

import itertools
import weakref
from typing import Any

from .session import join_session

_numbers = itertools.count()
_live: weakref.WeakValueDictionary[int, Group] = weakref.WeakValueDictionary()
"""Every group that still lives, by :attr:`Group.number`: as many entries as the caller keeps
groups, since an entry goes with its group."""


def group_numbered(number: int) -> Group | None:
    """The live group whose :attr:`Group.number` is ``number``, else None."""
    return _live.get(number)


class Group:
    """A set of ranks, made by :func:`unicoll.new_group` (or the whole world).

    Rank numbers in counts and split sizes are positions inside the group: the group's
    ``ranks`` are sorted, and position ``p`` is world rank ``ranks[p]``.

    >>> g = Group((1, 3), handle=None, world_rank=3, session=0)
    >>> g.rank, g.world_size
    (1, 2)
    """

    def __init__(self, ranks: tuple[int, ...], handle: Any, world_rank: int, session: int) -> None:
        self.ranks = ranks
        self.session = session
        self._handle = handle
        self._ended: str | None = None
        self._position = ranks.index(world_rank) if world_rank in ranks else None
        self.number = next(_numbers)
        """Unique among the process's groups: how a traced operator's schema names the group
        (:mod:`unicoll.compiled.custom_ops`), found again with :func:`group_numbered`."""
        _live[self.number] = self
        join_session(session, self)

    @property
    def handle(self) -> Any:
        """The transport's handle of the group (None for the world); ValueError once the
        session that made the group has ended, so a stale group never reaches a transport."""
        if self._ended is not None:
            raise ValueError(f"{self!r} cannot be used any more: {self._ended}")
        return self._handle

    def _end_session(self, reason: str, keep_handles: bool) -> None:
        """The session ended (see :func:`unicoll.session.end_session`): refuse use from now on."""
        self._ended = reason
        if not keep_handles:
            self._handle = None

    @property
    def ended(self) -> str | None:
        """Why the group cannot be used any more (its session ended), or None while it can."""
        return self._ended

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return len(self.ranks)

    @property
    def is_member(self) -> bool:
        """Whether this process belongs to the group."""
        return self._position is not None

    @property
    def rank(self) -> int:
        """This process's position in the group; ValueError if it is not a member."""
        if self._position is None:
            raise ValueError(f"group: expected a group this rank belongs to, got Group(ranks={list(self.ranks)})")
        return self._position

    def __repr__(self) -> str:
        return f"Group(ranks={list(self.ranks)})"
