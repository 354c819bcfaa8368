"""JAX arrays in and out of every operator, with gradients through jax.custom_vjp, and the
static-shape MoE operators inside jax.jit (ordered host callbacks), on real processes; the
conformance matrix runs them too (tests/system/test_conformance.py)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import unicoll as uc  # noqa: E402
from helpers.frameworks import jax_gradients, jax_moe_training, jax_static_in_jit  # noqa: E402
from helpers.gradients import OPS  # noqa: E402
from helpers.several import SESSION, Case, share  # noqa: E402

GRADIENTS = share("gloo", 3, [Case("jax: gradients", jax_gradients)])
WORLD = share("gloo", 2, [Case("jax: static in jit", jax_static_in_jit), Case("jax: moe training", jax_moe_training)])


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
    uc.init("gloo")
    try:
        x = jnp.arange(4.0)
        with pytest.raises(TypeError, match=r"alltoall_single: out_tensor: expected None \(jax\.Array cannot be "
                           r"filled in place: the operator returns a new array\), got jax\.Array float32 \(4,\)"):  # fmt: skip
            uc.alltoall_single(jnp.zeros(4), x)
        y = uc.all_reduce(x)
        assert isinstance(y, jax.Array) and y is not x and np.asarray(y).tolist() == [0.0, 1.0, 2.0, 3.0]
        with pytest.raises(TypeError, match=r"moe\.dispatch_static: topk_idx: expected a jax\.Array of dtype int32"):
            uc.moe.dispatch_static(x[:, None], jnp.zeros((4, 1)), experts_per_rank=1, capacity=4)
        with pytest.raises(TypeError, match=r"global_scatter: inside jax\.jit only"):
            jax.jit(lambda x: uc.global_scatter(x, [4], [4]))(x)
    finally:
        uc.finalize()
