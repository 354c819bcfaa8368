"""A least-recently-used map bounded in bytes, for what the front end derives from arguments.

Training loops bring new counts every step, so every cache here sees an endless stream of
keys; each is bounded by the bytes it holds (keys and values, as the caller measures them),
not by its number of entries, and holds no caller array (callers store copies or derived
values only). Built on :class:`cachetools.LRUCache`, which does the byte accounting.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import cachetools


class _Entry(NamedTuple):
    value: Any
    nbytes: int


def _entry_bytes(entry: _Entry) -> int:
    return entry.nbytes


class BoundedCache:
    """At most ``max_bytes`` of entries; the least recently used go first.

    >>> cache = BoundedCache(100)
    >>> cache.put("a", 1, nbytes=60); cache.put("b", 2, nbytes=60)
    >>> cache.get("a"), cache.get("b"), cache.nbytes
    (None, 2, 60)
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lru: cachetools.LRUCache = cachetools.LRUCache(max_bytes, getsizeof=_entry_bytes)

    def get(self, key: Hashable) -> Any:
        """The value stored under ``key`` (now the most recently used), else None."""
        entry = self._lru.get(key)
        return None if entry is None else entry.value

    def put(self, key: Hashable, value: Any, nbytes: int) -> None:
        """Store ``value`` under ``key``, counting ``nbytes`` for both; an entry larger than
        the whole bound is not stored."""
        if nbytes <= self.max_bytes:
            self._lru[key] = _Entry(value, nbytes)

    def clear(self) -> None:
        """Forget every entry."""
        self._lru.clear()

    @property
    def nbytes(self) -> int:
        """The bytes the entries hold, as their callers measured them."""
        return self._lru.currsize

    def __len__(self) -> int:
        return len(self._lru)
