"""JAX arrays on a CUDA device through each GPU backend (a world of one): the eager operators,
their gradients through jax.custom_vjp, and the static MoE operators inside jax.jit, whose host
callbacks hand their blocks to the GPU transport. Marked ``gpu``; skipped with the backend's
reason, or JAX's, where either has no GPU."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import unicoll as uc
from helpers.frameworks import jax_on_the_gpu
from helpers.gpu_backends import params
from helpers.gradients import OPS

pytestmark = pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed")


@pytest.mark.parametrize("backend", params())
def test_jax_arrays_on_the_gpu(backend: str) -> None:
    # JAX takes three quarters of the GPU's memory at its first array unless told not to
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    (seen,) = uc.testing.spawn(jax_on_the_gpu, 1, backend=backend, env=env, timeout=300)
    if "skip" in seen:
        pytest.skip(seen["skip"])
    values, platforms = seen["all_reduce"]
    np.testing.assert_array_equal(values, np.arange(6.0).reshape(3, 2))
    assert platforms == ["gpu"]
    assert seen["gradients"] == {op: "ok" for op in OPS}
    assert seen["static in jit"] == "ok"
