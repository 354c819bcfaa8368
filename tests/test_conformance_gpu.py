"""The conformance matrix on the GPU backends that can run here (world size 1: NCCL refuses
two ranks on one GPU). Skipped, with the reason, where a backend is not usable."""

from __future__ import annotations

import pytest

import unicoll as uc
from conformance import cases, run_cases
from unicoll import registry

GPU_BACKENDS = [name for name, f in registry.registered().items() if "cuda" in f.capabilities.devices]


def _matrix():
    for name in GPU_BACKENDS:
        factory = registry.registered()[name]
        reason = factory.probe()
        marks = [pytest.mark.gpu, pytest.mark.skipif(reason is not None, reason=f"{name}: {reason}")]
        for case in cases(factory.capabilities, 1):
            yield pytest.param(name, case, marks=marks, id=f"{name}-{case.id}")


_outcomes: dict[str, list[dict[str, str | None]]] = {}


@pytest.mark.parametrize(("backend", "case"), list(_matrix()))
def test_gpu_conformance(backend, case) -> None:
    if backend not in _outcomes:
        matrix = cases(registry.registered()[backend].capabilities, 1)
        _outcomes[backend] = uc.testing.spawn(run_cases, 1, matrix, "cuda", backend=backend, timeout=240)
    failure = _outcomes[backend][0].get(case.id)
    assert case.id in _outcomes[backend][0], "the case did not run"
    assert failure is None, failure
