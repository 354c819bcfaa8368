"""JAX arrays in and out of every operator, with gradients through jax.custom_vjp, and the
static-shape MoE operators inside jax.jit (ordered host callbacks), on real processes; the
conformance matrix runs them too (tests/system/test_conformance.py)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from helpers.frameworks import jax_gradients, jax_moe_training, jax_refusals, jax_static_in_jit
from helpers.gradients import OPS
from helpers.several import SESSION, Case, share

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("jax") is None, reason="jax is not installed (pip install 'unicoll[jax]')"
)
"""(JAX is imported by the ranks only: this process stays free of it.)"""

GRADIENTS = share("gloo", 3, [Case("jax: gradients", jax_gradients)])
WORLD = share(
    "gloo",
    2,
    [
        Case("jax: static in jit", jax_static_in_jit),
        Case("jax: moe training", jax_moe_training),
        Case("jax: refusals", jax_refusals),
    ],
)


def test_every_operator_has_jax_gradients() -> None:
    for report in SESSION.results(GRADIENTS, "jax: gradients"):
        assert report == {op: "ok" for op in OPS}


def test_static_moe_inside_jit_equals_eager() -> None:
    assert SESSION.results(WORLD, "jax: static in jit") == ["ok", "ok"]


def test_moe_layer_trained_with_jax_matches_the_dense_model() -> None:
    """Three SGD steps of a top-2 MoE layer over 2 ranks (jax.jit, dispatch_static and
    combine_static) against the same layer dense in one process."""
    for result in SESSION.results(WORLD, "jax: moe training"):
        np.testing.assert_allclose(result["losses"], result["dense_losses"], rtol=1e-5)
        assert result["losses"][-1] < result["losses"][0]
        np.testing.assert_allclose(result["router"], result["dense_router"], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(result["experts"], result["dense_experts"], rtol=1e-4, atol=1e-5)


def test_jax_arrays_are_never_filled_in_place() -> None:
    for seen in SESSION.results(WORLD, "jax: refusals"):
        assert seen["filled"] == (
            "TypeError: alltoall_single: out_tensor: expected None (jax.Array cannot be filled in place: the "
            "operator returns a new array), got jax.Array float32 (4,) on cpu"
        )
        assert seen["all_reduce"] == (True, [0.0, 2.0, 4.0, 6.0], [0.0, 1.0, 2.0, 3.0])
        assert seen["float ids"].startswith(
            "TypeError: moe.dispatch_static: topk_idx: expected a jax.Array of dtype int32"
        )
        assert seen["jit"].startswith("TypeError: global_scatter: inside jax.jit only")
