"""Spawned worlds that run on a thread while the tests go on.

A test that spawns a world waits for it, and while a world's ranks wait on each other, or while
a module's tests run in this process (Dynamo tracing, say), a core is idle. A module starts its
worlds at once with :meth:`Worlds.start`, and each test reads its world's results when it needs
them; a world that failed fails each of its tests with its error, instead of being started
again.
"""

from __future__ import annotations

from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

import unicoll as uc


class Worlds:
    """Worlds by key, each spawned once (``uc.testing.spawn``) on a thread, ``parallel`` at a
    time. Only for tests that assert nothing about time."""

    def __init__(self, parallel: int = 1) -> None:
        self._pool = ThreadPoolExecutor(parallel, thread_name_prefix="world")
        self._started: dict[Hashable, Future] = {}

    def start(self, key: Hashable, *spawn_args: Any, **spawn_kwargs: Any) -> None:
        """Start world ``key``, ``uc.testing.spawn(*spawn_args, **spawn_kwargs)``, unless it was
        started before."""
        if key not in self._started:
            self._started[key] = self._pool.submit(uc.testing.spawn, *spawn_args, **spawn_kwargs)

    def results(self, key: Hashable, *spawn_args: Any, **spawn_kwargs: Any) -> list[Any]:
        """World ``key``'s results by rank, once it ended; started here (as :meth:`start`) if it
        was not."""
        self.start(key, *spawn_args, **spawn_kwargs)
        try:
            return self._started[key].result()
        except Exception as exc:  # reported by every test of the world
            pytest.fail(f"the world {key!r} that runs this test failed: {type(exc).__name__}: {exc}", pytrace=False)
