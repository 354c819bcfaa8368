"""The conformance matrix on the CPU backends (gloo, mpi): 1 to 4 ranks, one spawned world per
backend and size. A backend that cannot run here is skipped with the reason."""

from __future__ import annotations

import pytest

import unicoll as uc
from helpers.conformance import cases, run_cases
from unicoll import registry

CPU_BACKENDS = ("gloo", "mpi")
WORLD_SIZES = (1, 2, 3, 4)
FACTORIES = {name: registry.registered()[name] for name in CPU_BACKENDS}
MATRIX = {(b, w): cases(FACTORIES[b].capabilities, w) for b in CPU_BACKENDS for w in WORLD_SIZES}


def _params():
    for backend in CPU_BACKENDS:
        reason = FACTORIES[backend].probe()
        marks = [pytest.mark.skipif(reason is not None, reason=f"backend {backend} is not usable here: {reason}")]
        for w in WORLD_SIZES:
            for case in MATRIX[backend, w]:
                yield pytest.param(backend, case, marks=marks, id=f"{backend}-{case.id}")


@pytest.fixture(scope="module")
def outcomes() -> dict[tuple[str, int], list[dict[str, str | None]]]:
    """Each (backend, world size)'s per-rank outcomes, computed lazily, one spawned world each."""
    cache: dict[tuple[str, int], list[dict[str, str | None]]] = {}

    def get(backend: str, world_size: int) -> list[dict[str, str | None]]:
        key = (backend, world_size)
        if key not in cache:
            cache[key] = uc.testing.spawn(run_cases, world_size, MATRIX[key], backend=backend, timeout=240)
        return cache[key]

    return get


@pytest.mark.parametrize(("backend", "case"), list(_params()))
def test_conformance(backend, case, outcomes) -> None:
    per_rank = outcomes(backend, case.world_size)
    failures = [o[case.id] for o in per_rank if o.get(case.id)]
    assert not failures, "\n".join(failures)
    ran = [o for o in per_rank if case.id in o]
    assert ran, "no rank ran this case"
