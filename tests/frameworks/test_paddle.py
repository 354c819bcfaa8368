"""Paddle tensors in and out of every operator, with gradients through Paddle's own autograd
(paddle.autograd.PyLayer), on real processes; the conformance matrix runs them too
(tests/system/test_conformance.py)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

import unicoll as uc  # noqa: E402
from helpers.frameworks import GLOBAL, SCATTERED, X, paddle_gradients, paddle_worked_examples  # noqa: E402
from helpers.gradients import OPS  # noqa: E402
from helpers.several import SESSION, Case, share  # noqa: E402

GRADIENTS = share("gloo", 3, [Case("paddle: gradients", paddle_gradients)])
EXAMPLES = share("gloo", 2, [Case("paddle: worked examples", paddle_worked_examples)])


def test_every_operator_has_paddle_gradients() -> None:
    for report in SESSION.results(GRADIENTS, "paddle: gradients"):
        assert report == {f"{op}-{mode}": "ok" for op in OPS for mode in ("sync", "async")}


def test_the_worked_examples_with_paddle_tensors() -> None:
    """docs/semantics.md's global_scatter example (W=2, n_expert=2) and alltoall_single, on
    paddle.Tensor, with Paddle's backward()."""
    got = SESSION.results(EXAMPLES, "paddle: worked examples")
    for rank, result in enumerate(got):
        assert result["types"] == ["Tensor"] * 5
        assert result["global_count"] == GLOBAL[rank]
        assert result["scattered"] == SCATTERED[rank]
        assert result["gathered"] == [2 * v for v in X[rank]]
        assert result["grad"] == [2.0] * len(X[rank])  # the doubled round trip
        assert result["uneven_grad"] == [3.0] * len(X[rank])
        assert result["filled_in_place"]
    assert [r["uneven"] for r in got] == [[0.0, 10.0, 11.0], [1.0, 2.0, 3.0, 12.0, 13.0, 14.0]]
    assert [r["even"] for r in got] == [[0.0, 1.0, 10.0, 11.0], [2.0, 3.0, 12.0, 13.0]]


def test_errors_name_paddle_types() -> None:
    uc.init("gloo")
    try:
        x = paddle.ones([4, 2])
        with pytest.raises(TypeError, match=r"global_scatter: local_count: expected a paddle\.Tensor of dtype int32 "
                           r"or int64, got paddle\.Tensor float32 \(4,\) on cpu"):  # fmt: skip
            uc.global_scatter(x, paddle.ones([1]).expand([4]), [4])
        with pytest.raises(ValueError, match=r"global_scatter: x: .*got paddle\.Tensor float32 \(\) on cpu"):
            uc.global_scatter(paddle.to_tensor(1.0), [1], [1])
        leaf = paddle.ones([3], dtype="float32")
        leaf.stop_gradient = False
        with pytest.raises(ValueError, match=r"all_reduce: tensor: .*under paddle\.no_grad\(\).*a leaf paddle\.Tensor"):
            uc.all_reduce(leaf)
        jnp = pytest.importorskip("jax.numpy")
        with pytest.raises(TypeError, match=r"global_scatter: arguments: expected arrays of one library .*got "
                           r"paddle\.Tensor and jax\.Array"):  # fmt: skip
            uc.global_scatter(x, jnp.array([4]), [4])
        with pytest.raises(TypeError, match=r"moe\.dispatch: missing a required argument: 'experts_per_rank'"):
            uc.moe.dispatch(x, paddle.zeros([4, 1], dtype="int64"))
        with pytest.raises(TypeError, match=r"all_reduce: multiple values for argument 'tensor'"):
            uc.all_reduce(x, tensor=x)
        with pytest.raises(TypeError, match=r"alltoall_single: got an unexpected keyword argument 'splits'"):
            uc.alltoall_single(None, x, splits=[2, 2])
        with paddle.no_grad():
            assert uc.all_reduce(leaf) is leaf
        np.testing.assert_array_equal(leaf.numpy(), [1.0, 1.0, 1.0])
    finally:
        uc.finalize()


def test_in_place_results_and_tasks() -> None:
    """all_reduce fills the caller's tensor and records the change in Paddle's autograd; a
    Task's wait() hands back Paddle tensors."""
    uc.init("gloo")
    try:
        leaf = paddle.to_tensor([1.0, 2.0], stop_gradient=False)
        y = leaf * 3
        assert uc.all_reduce(y) is y and y.numpy().tolist() == [3.0, 6.0]
        (y * y).sum().backward()
        assert leaf.grad.numpy().tolist() == [18.0, 36.0]
        task = uc.all_gather(None, paddle.to_tensor([[5, 6]], dtype="int32"), sync_op=False)
        gathered = task.wait()
        assert isinstance(gathered, paddle.Tensor) and gathered.numpy().tolist() == [[5, 6]]
    finally:
        uc.finalize()


def test_import_unicoll_imports_neither_paddle_nor_jax() -> None:
    code = "import sys, unicoll, unicoll.moe; print(sorted(m for m in ('paddle', 'jax', 'jaxlib') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
