"""Several cases in one spawned world.

Starting a world costs about 0.3 s and 0.5 CPU-s on two cores (forked ranks, the rendezvous,
finalize; a fresh interpreter that imports torch costs 2 CPU-s more), often more than the case
it runs. Cases that share a backend, a world
size and an environment are therefore added to one world, by key; the world is spawned once,
when a test first asks for one of its cases, and runs them all in order on every rank. Each test
then asserts on its own case's results, as it did on a world of its own.

A module keeps its own worlds in a module-scoped :class:`SharedWorlds` fixture, or adds its cases
with :func:`share` to :data:`SESSION`, the worlds shared by every module of the session: each
module adds them when pytest imports it (all modules are imported before the first test runs),
so a world holds the cases of the modules collected. Only cases that leave the world as they
found it (or run last) belong there; a case that depends on a fresh session (the validator's
memory of accepted calls, say) keeps a world of its own. The cases of a world run in the order
they were added, except that those added with ``last=True`` (a case that ends the session and
starts another, or leaves the backend changed) run after the others.

A case that raises on a rank stops the world (its peers may be waiting for it in a collective),
with an error that names the case; every test of that world then fails with that error.

Under pytest-xdist every worker imports every module, so each holds the same session worlds:
the first worker to ask for a world runs it and leaves its outcome in a folder the workers
share (:meth:`SharedWorlds.share_through`), where the others read it instead of running the
world again.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import pickle
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import unicoll as uc

DEFAULT_TIMEOUT = 120
"""``spawn``'s own default: the seconds a world gets for each group of cases that names none."""


@dataclass(frozen=True)
class Case:
    """``fn(rank, *args)`` on every rank, by ``name``; ``fn`` must be defined at module level."""

    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class World:
    """Cases for a world of ``size`` ranks, in order, and the arguments of its ``spawn``
    (``timeout``: the seconds these cases may take; a shared world gets the sum)."""

    size: int
    cases: Sequence[Case]
    spawn_kwargs: dict[str, Any] = field(default_factory=dict)


def run_cases(rank: int, cases: Sequence[Case]) -> dict[str, Any]:
    """On one rank: every case in order; each case's result by name. A case that raises is
    re-raised naming the case (the original error chained, so the traceback shows both)."""
    results: dict[str, Any] = {}
    for case in cases:
        try:
            results[case.name] = case.fn(rank, *case.args)
        except Exception as exc:
            raise AssertionError(f"case {case.name!r} failed on rank {rank}: {type(exc).__name__}: {exc}") from exc
    return results


@dataclass
class _Entry:
    size: int
    spawn_kwargs: dict[str, Any]
    timeout: float = 0.0
    cases: list[Case] = field(default_factory=list)
    last: list[Case] = field(default_factory=list)
    per_rank: list[dict[str, Any]] | None = None
    error: str | None = None

    @property
    def ordered(self) -> list[Case]:
        """The cases in the order they run: those added with ``last=True`` after the others."""
        return [*self.cases, *self.last]

    @property
    def started(self) -> bool:
        return self.per_rank is not None or self.error is not None


class SharedWorlds:
    """Worlds by key, each spawned once, the first time a test asks for a case of it."""

    def __init__(self, worlds: dict[Hashable, World] | None = None) -> None:
        self._entries: dict[Hashable, _Entry] = {}
        self._shared: Path | None = None
        for key, world in (worlds or {}).items():
            self.add(key, world)

    def share_through(self, folder: Path) -> None:
        """Share each world's outcome with the other processes of a test run (pytest-xdist's
        workers) through ``folder``: the first to ask for a world runs it, holding the world's
        lock there, and writes its outcome; the others wait on the lock and read it."""
        folder.mkdir(parents=True, exist_ok=True)
        self._shared = folder

    def add(self, key: Hashable, world: World, *, last: bool = False) -> None:
        """Add ``world``'s cases to world ``key`` (after the cases added before; with ``last``,
        after every case added without it). Its size and spawn arguments but the timeout must
        be the world's."""
        kwargs = {name: value for name, value in world.spawn_kwargs.items() if name != "timeout"}
        entry = self._entries.setdefault(key, _Entry(world.size, kwargs))
        assert (entry.size, entry.spawn_kwargs) == (world.size, kwargs), (
            f"world {key!r}: cases for {world.size} ranks with {kwargs} added to a world of {entry.size} with "
            f"{entry.spawn_kwargs}"
        )
        assert not entry.started, f"world {key!r}: cases added after it started"
        names = [case.name for case in [*entry.ordered, *world.cases]]
        assert len(set(names)) == len(names), f"world {key!r}: two cases share a name: {names}"
        entry.timeout += world.spawn_kwargs.get("timeout", DEFAULT_TIMEOUT)
        (entry.last if last else entry.cases).extend(world.cases)

    def results(self, key: Hashable, name: str) -> list[Any]:
        """Case ``name``'s result on each rank of world ``key``, in rank order."""
        entry = self._entries[key]
        assert name in [case.name for case in entry.ordered], f"world {key!r} runs no case {name!r}"
        if not entry.started:
            entry.per_rank, entry.error = self._outcome(key, entry)
        if entry.error is not None:
            pytest.fail(f"the world {key!r} that runs case {name!r} failed: {entry.error}", pytrace=False)
        return [results[name] for results in entry.per_rank]

    def _outcome(self, key: Hashable, entry: _Entry) -> tuple[list[dict[str, Any]] | None, str | None]:
        """World ``key``'s results by rank, or its error: run here, or read from the shared
        folder where another process ran it."""
        if self._shared is None:
            return _run(entry)
        name = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
        with (self._shared / f"{name}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process ends
            done = self._shared / f"{name}.pickle"
            if done.exists():
                return pickle.loads(done.read_bytes())
            outcome = _run(entry)
            written = done.with_suffix(".partial")
            written.write_bytes(pickle.dumps(outcome))
            os.replace(written, done)
            return outcome


def _run(entry: _Entry) -> tuple[list[dict[str, Any]] | None, str | None]:
    """Spawn ``entry``'s world: its results by rank, or the error that stopped it."""
    try:
        per_rank = uc.testing.spawn(run_cases, entry.size, entry.ordered, **entry.spawn_kwargs, timeout=entry.timeout)
    except Exception as exc:  # reported by every test of this world
        return None, f"{type(exc).__name__}: {exc}"
    return per_rank, None


#: The worlds shared by every module of the session, by key (backend, world size, check mode).
SESSION = SharedWorlds()


def share(
    backend: str,
    size: int,
    cases: Sequence[Case],
    *,
    check: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    last: bool = False,
) -> tuple[str, int, str]:
    """Add ``cases`` to the session's world of ``size`` ``backend`` ranks, in check mode
    (``UNICOLL_CHECK=1``) or with the environment as it is; returns the world's key in
    :data:`SESSION`. ``timeout``: the seconds these cases may take."""
    key = (backend, size, "check" if check else "plain")
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    if check:
        kwargs["env"] = {"UNICOLL_CHECK": "1"}
    SESSION.add(key, World(size, cases, kwargs), last=last)
    return key
