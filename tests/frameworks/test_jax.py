"""JAX arrays in and out of every operator, with gradients through jax.custom_vjp, and the
static-shape MoE operators inside jax.jit (ordered host callbacks), on real processes; the
conformance matrix runs them too (tests/system/test_conformance.py)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from helpers.forked import start_script
from helpers.frameworks import (
    jax_gradients,
    jax_jit_ended_session,
    jax_jit_errors,
    jax_moe_training,
    jax_refusals,
    jax_static_in_jit,
)
from helpers.gradients import OPS
from helpers.several import SESSION, Case, share
from unicoll.launch.local import free_port, world_env

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
        Case("jax: errors in jit", jax_jit_errors),
    ],
)
ENDED = share("gloo", 2, [Case("jax: jit of an ended session", jax_jit_ended_session, ("gloo",))], last=True)

OVERFLOW = (
    "moe.dispatch_static: capacity: expected room for every slot (overflow='error'): at least 4, got 2: rank 0 "
    "routes 4 slots to expert 0 (2 of its slots would be dropped)"
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


def test_errors_inside_jit_are_unicolls_own_inside_jit_errors() -> None:
    """overflow="error" inside jax.jit: JAX's JaxRuntimeError by itself; inside
    uc.moe.jit_errors() the eager call's ValueError, with JAX's error as its cause."""
    for seen in SESSION.results(WORLD, "jax: errors in jit"):
        assert seen["eager"] == f"ValueError: {OVERFLOW}"
        assert seen["jit"] == "JaxRuntimeError"
        assert seen["caught"] == f"ValueError: {OVERFLOW} (from JaxRuntimeError)"
        assert seen["roomy"] == "returned"


def test_a_jitted_step_of_an_ended_session_raises_its_error() -> None:
    """A jitted step traced before finalize(), inside uc.moe.jit_errors(): NotInitializedError
    before init(), the ended session's ValueError after it; traced again, it runs."""
    ended = (
        "moe.dispatch_static: group: expected a group of the running session (jax.clear_caches() traces a jax.jit "
        "step again), got the one the step was traced with: its session ended at finalize()"
    )
    for rank, seen in enumerate(SESSION.results(ENDED, "jax: jit of an ended session")):
        assert seen["finalized"] == (
            "NotInitializedError: moe.dispatch_static: unicoll is not initialized: call unicoll.init() first "
            "(from JaxRuntimeError)"
        )
        assert seen["ended"].startswith(f"ValueError: {ended}") and seen["ended"].endswith("(from JaxRuntimeError)")
        assert seen["traced again"] == ["[[4, 4]]", "[[0, 0]]"][rank]


@functools.cache
def _two_devices_world() -> dict[int, dict]:
    """helpers.frameworks.jax_devices_and_a_lost_peer on 2 gloo ranks with two JAX CPU devices
    each, started without a launcher (rank 1 exits mid-step), each forked from the suite's server
    (helpers/forked.py; JAX reads ``XLA_FLAGS`` when its first array is made, which the server
    never makes): each rank's report."""
    port = free_port()
    env = {**os.environ, "UNICOLL_BACKEND": "gloo", "UNICOLL_TIMEOUT": "30",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "two_devices.py"
        script.write_text("from helpers.frameworks import jax_devices_and_a_lost_peer as run\nrun()\n")
        outputs = [Path(folder) / f"rank{rank}.txt" for rank in range(2)]
        ranks = [
            start_script(script, [], {**env, **world_env(rank, 2, "127.0.0.1", port)}, outputs[rank])
            for rank in range(2)
        ]
        try:
            for rank in ranks:
                rank.join(120)
        finally:
            for rank in ranks:
                rank.kill()  # none left behind by a failure (a no-op for a rank that exited)
        texts = [output.read_text() if output.exists() else "" for output in outputs]
    reports = [json.loads(line) for text in texts for line in text.splitlines() if line.startswith("{")]
    assert len(reports) == 2, "\n".join(texts)
    return {report["rank"]: report for report in reports}


def test_results_come_back_on_the_jax_device_of_the_inputs() -> None:
    """Arrays on cpu:1 (of two JAX CPU devices): all_reduce's result and jax.grad's gradient
    come back there, not on JAX's default device; a sharded array is refused; a traced array
    is taken to live on JAX's default device (cpu:1 within jax.default_device)."""
    for seen in _two_devices_world().values():
        assert seen["traced"] == "[{CpuDevice(id=1)}]"
        assert seen["all_reduce"] == "{CpuDevice(id=1)}"
        assert seen["grad"] == ["{CpuDevice(id=1)}", [4.0] * 4]  # x in both ranks' gather, times 2
        assert seen["sharded"] == (
            "ValueError: all_reduce: tensor: expected a jax.Array on one device, got jax.Array float32 (4,) on cpu "
            "sharded over 2 devices"
        )


def test_a_peer_lost_inside_jit_is_caught_as_peer_lost_error() -> None:
    """Rank 1 exits after the dispatch of a jitted step: rank 0's step, inside
    uc.moe.jit_errors(), raises PeerLostError naming combine_static (JAX's error its cause)."""
    step = _two_devices_world()[0]["step"]
    assert step.startswith("PeerLostError: moe.combine_static on Group(ranks=[0, 1]): a peer is gone"), step
    assert step.endswith("(from JaxRuntimeError)")
