"""The conformance matrix on the GPU backends that can run here (world size 1: NCCL refuses
two ranks on one GPU): every operator, dtype and array library of each capability table, in
every stream mode (calculation stream, communication stream, asynchronous). Skipped, with
the reason, where a backend is not usable, and an array library's cases where it is not
installed (the GPU machines have no Paddle)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from helpers.background import Worlds
from helpers.conformance import assert_passed, cases, run_cases
from helpers.gpu_backends import GPU_BACKENDS, marks
from unicoll import registry

STREAMS = ("calc", "comm")


def _missing(library: str) -> bool:
    return importlib.util.find_spec(library) is None


def _matrix_of(name: str) -> list:
    """The cases of backend ``name`` in the array libraries installed here."""
    table = registry.registered()[name].capabilities
    installed = dataclasses.replace(table, libraries=frozenset(lib for lib in table.libraries if not _missing(lib)))
    return cases(installed, 1, STREAMS)


def _matrix():
    """One test per case where the backend can run; one, skipped with the reason, where it cannot;
    one skipped per array library of its table that is not installed."""
    for name in GPU_BACKENDS:
        matrix = _matrix_of(name)
        if registry.registered()[name].probe() is not None:
            matrix = matrix[:1]
        for case in matrix:
            yield pytest.param(name, case, marks=marks(name), id=f"{name}-{case.id}")
        for library in sorted(filter(_missing, registry.registered()[name].capabilities.libraries)):
            skip = pytest.mark.skip(reason=f"{name}: {library} is not installed here")
            yield pytest.param(name, None, marks=[*marks(name), skip], id=f"{name}-{library}")


_worlds = Worlds()


@pytest.mark.parametrize(("backend", "case"), list(_matrix()))
def test_gpu_conformance(backend, case) -> None:
    matrix = _matrix_of(backend)
    assert_passed(_worlds.results(backend, run_cases, 1, matrix, "cuda", backend=backend, timeout=600), case)
