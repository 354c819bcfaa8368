"""The conformance matrix on the GPU backends that can run here (world size 1: NCCL refuses
two ranks on one GPU): every operator, dtype and array library of each capability table, in
every stream mode (calculation stream, communication stream, asynchronous). Skipped, with
the reason, where a backend is not usable."""

from __future__ import annotations

import pytest

from helpers.conformance import Worlds, assert_passed, cases, run_cases
from helpers.gpu_backends import GPU_BACKENDS, marks
from unicoll import registry

STREAMS = ("calc", "comm")


def _matrix():
    """One test per case where the backend can run; one, skipped with the reason, where it cannot."""
    for name in GPU_BACKENDS:
        matrix = cases(registry.registered()[name].capabilities, 1, STREAMS)
        if registry.registered()[name].probe() is not None:
            matrix = matrix[:1]
        for case in matrix:
            yield pytest.param(name, case, marks=marks(name), id=f"{name}-{case.id}")


_worlds = Worlds()


@pytest.mark.parametrize(("backend", "case"), list(_matrix()))
def test_gpu_conformance(backend, case) -> None:
    matrix = cases(registry.registered()[backend].capabilities, 1, STREAMS)
    assert_passed(_worlds.outcomes(backend, run_cases, 1, matrix, "cuda", backend=backend, timeout=600), case)
