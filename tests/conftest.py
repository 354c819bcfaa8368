"""Fixtures shared by the test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import unicoll as uc


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process that is no rank of any world: the variables ``unicoll.init`` reads unset, and
    unicoll finalized afterwards."""
    for name in ("UNICOLL_BACKEND", "UNICOLL_TIMEOUT", "UNICOLL_CHECK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    yield
    uc.finalize()
