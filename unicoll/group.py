"""Process groups: a sorted subset of the world's ranks that an operator runs over."""

from __future__ import annotations

from typing import Any


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
        self.handle = handle
        self.session = session
        self._position = ranks.index(world_rank) if world_rank in ranks else None

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
