"""Paddle tensors in and out of every operator, with gradients through Paddle's own autograd
(paddle.autograd.PyLayer), on real processes; the conformance matrix runs them too
(tests/system/test_conformance.py)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from helpers.frameworks import (
    GLOBAL,
    SCATTERED,
    X,
    paddle_backward_twice,
    paddle_errors_and_in_place,
    paddle_gradients,
    paddle_worked_examples,
)
from helpers.gradients import OPS
from helpers.several import SESSION, Case, share

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("paddle") is None or importlib.util.find_spec("jax") is None,
    reason="paddle or jax is not installed (pip install 'unicoll[paddle,jax]')",
)
"""(Paddle is imported by the ranks only: this process stays free of it.)"""

GRADIENTS = share("gloo", 3, [Case("paddle: gradients", paddle_gradients)])
EXAMPLES = share(
    "gloo",
    2,
    [
        Case("paddle: worked examples", paddle_worked_examples),
        Case("paddle: errors and in place", paddle_errors_and_in_place),
        Case("paddle: backward twice", paddle_backward_twice),
    ],
)


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
    for seen in SESSION.results(EXAMPLES, "paddle: errors and in place"):
        assert seen["float counts"] == (
            "TypeError: global_scatter: local_count: expected a paddle.Tensor of dtype int32 or int64, "
            "got paddle.Tensor float32 (4,) on cpu"
        )
        assert re.fullmatch(
            r"ValueError: global_scatter: x: .*got paddle\.Tensor float32 \(\) on cpu", seen["scalar x"]
        )
        assert re.fullmatch(r"ValueError: all_reduce: tensor: .*under paddle\.no_grad\(\).*a leaf paddle\.Tensor.*",
                            seen["leaf in place"])  # fmt: skip
        assert seen["two libraries"] == (
            "TypeError: global_scatter: arguments: expected arrays of one joined library, got paddle.Tensor and jax.Array"
        )
        assert seen["torch ids"] == (
            "TypeError: moe.dispatch_static: topk_idx: expected a paddle.Tensor (the library of the call's other "
            "arrays), got torch int64 (4, 1) on cpu"
        )
        assert seen["missing"] == "TypeError: moe.dispatch: missing a required argument: 'experts_per_rank'"
        assert seen["twice"] == "TypeError: all_reduce: multiple values for argument 'tensor'"
        assert seen["unknown"] == "TypeError: alltoall_single: got an unexpected keyword argument 'splits'"
        assert seen["no_grad is leaf"] and seen["no_grad values"] == [2.0, 2.0, 2.0]


def test_in_place_results_and_tasks() -> None:
    """all_reduce fills the caller's tensor and records the change in Paddle's autograd (2
    ranks: y = 3 leaf summed, and the sum of both ranks' 2 y for y's gradient); a tensor a
    backward saved and an operator then wrote makes that backward raise, as Paddle's in-place
    operators do; a Task's wait() hands back Paddle tensors."""
    for seen in SESSION.results(EXAMPLES, "paddle: errors and in place"):
        assert seen["in place is y"] and seen["in place values"] == [6.0, 12.0]
        assert seen["in place grad"] == [72.0, 144.0]
        assert seen["task"] == ("Tensor", "paddle.int32", [[0, 6], [1, 6]])
        for name, error in seen["saved, then written"].items():  # before: no error, a.grad 6.0 where it is 3.0
            assert error.startswith("RuntimeError: (PermissionDenied) Tensor '' used in gradient computation "
                                    "has been modified by an inplace operation"), (name, error)  # fmt: skip


def test_a_second_backward_through_an_operator_is_refused() -> None:
    """backward(retain_graph=True) twice through all_gather: Paddle 3.3.1's PyLayer would crash
    the rank (SIGSEGV, the world failing); the second is refused instead, as the PyLayer's
    error, and the next graph's backward is right (2 ranks: x in both gathers)."""
    refused = (
        "all_gather: backward through it ran already: a second backward() through the same graph "
        "(retain_graph=True) is not supported by Paddle's PyLayer"
    )
    for seen in SESSION.results(EXAMPLES, "paddle: backward twice"):
        assert seen["first"] == [4.0, 4.0] and seen["after"] == [6.0, 6.0]
        assert seen["second"].startswith(f"OSError: (External) RuntimeError: {refused}"), seen["second"]


def test_import_unicoll_imports_neither_paddle_nor_jax() -> None:
    code = "import sys, unicoll, unicoll.moe; print(sorted(m for m in ('paddle', 'jax', 'jaxlib') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
