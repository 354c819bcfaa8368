"""The conformance matrix on gloo: 1 to 4 ranks, one spawned world per size."""

from __future__ import annotations

import pytest

import unicoll as uc
from conformance import cases, run_cases
from unicoll.backends.gloo import CAPABILITIES

WORLD_SIZES = (1, 2, 3, 4)
MATRIX = {w: cases(CAPABILITIES, w) for w in WORLD_SIZES}


@pytest.fixture(scope="module")
def outcomes() -> dict[int, list[dict[str, str | None]]]:
    """Each world size's per-rank outcomes, computed lazily, one spawned world per size."""
    cache: dict[int, list[dict[str, str | None]]] = {}

    def get(world_size: int) -> list[dict[str, str | None]]:
        if world_size not in cache:
            cache[world_size] = uc.testing.spawn(run_cases, world_size, MATRIX[world_size], backend="gloo", timeout=240)
        return cache[world_size]

    return get


@pytest.mark.parametrize("case", [c for w in WORLD_SIZES for c in MATRIX[w]], ids=lambda c: c.id)
def test_conformance(case, outcomes) -> None:
    per_rank = outcomes(case.world_size)
    failures = [o[case.id] for o in per_rank if o.get(case.id)]
    assert not failures, "\n".join(failures)
    ran = [o for o in per_rank if case.id in o]
    assert ran, "no rank ran this case"
