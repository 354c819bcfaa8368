"""all_reduce, reduce_scatter and broadcast at their edges, on gloo and mpi (one world of 3 each):
integer and float16 overflow, bool, empty arrays, an output inside its input, a zero block, a
group of one, broadcast's src as a position in the group, and torch's rules for in-place changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import unicoll as uc
from unicoll import runtime
from unicoll.backends.base import Backend
from unicoll.backends.mpi.bfloat16 import reduce_words, rounded, widened


def edges(rank: int) -> dict:
    got: dict = {}
    got["int8 sum wraps"] = uc.all_reduce(np.full(2, 100, np.int8)).tolist()
    got["uint8 prod wraps"] = uc.all_reduce(torch.full((2,), 7, dtype=torch.uint8), "prod").tolist()
    got["float16 overflows"] = uc.all_reduce(np.full(1, 30000, np.float16)).tolist()
    flags = np.array([rank == 0, True, False])
    got["bool"] = [uc.all_reduce(flags.copy(), op).tolist() for op in ("sum", "prod", "max", "min")]
    got["empty"] = [
        tuple(uc.all_reduce(np.empty((0, 3))).shape),
        tuple(uc.all_reduce(torch.empty(2, 0), "avg").shape),
        tuple(uc.reduce_scatter(None, np.empty((0, 2))).shape),
        tuple(uc.reduce_scatter(None, np.ones((3, 0)), "max").shape),
        tuple(uc.broadcast(np.empty(0), 2).shape),
    ]
    x = np.arange(6.0) + 10 * rank
    mine = x[2 * rank : 2 * rank + 2]  # the output is this rank's block of the input
    got["output inside the input"] = uc.reduce_scatter(mine, x).tolist()
    got["zero block"] = uc.reduce_scatter(None, torch.arange(5) * (rank + 1), split_sizes=[3, 0, 2]).tolist()
    # the base class's padded path for unequal blocks (the NCCL backends'), on this transport
    backend, world = runtime.state("test").backend, runtime.resolve_group(None, "test")
    mine = torch.empty([3, 0, 2][rank], 2)
    x = torch.arange(10.0).reshape(5, 2) * (rank + 1)
    got["padded blocks"] = (
        Backend.reduce_scatter_uneven(backend, mine, x, "max", [3, 0, 2], world, False).finish().tolist()
    )
    solo, pair = uc.new_group([1]), uc.new_group([1, 2])
    if rank == 1:
        got["group of one"] = [
            uc.all_reduce(np.array([5.0]), "avg", group=solo).tolist(),
            uc.broadcast(np.array([7]), 0, group=solo).tolist(),
            uc.reduce_scatter(None, np.array([1, 2]), group=solo).tolist(),
        ]
    if rank in (1, 2):  # src is a position: 1 in [1, 2] is world rank 2
        got["src in a group"] = uc.broadcast(np.array([rank]), 1, group=pair).tolist()
    x = torch.ones(2, requires_grad=True)
    y = x * 1
    z = (y * y).sum()  # saves y for its backward
    uc.all_reduce(y)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()
    p = torch.full((2,), float(rank), requires_grad=True)
    with torch.no_grad():  # a parameter's initial value
        uc.broadcast(p, 0)
    got["parameter"] = [p.tolist(), p.requires_grad, p.grad_fn is None]
    return got


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_edges(backend: str) -> None:
    results = uc.testing.spawn(edges, 3, backend=backend)
    for rank, got in enumerate(results):
        assert got["int8 sum wraps"] == [44, 44]  # 300 - 256, as numpy's int8 sums
        assert got["uint8 prod wraps"] == [87, 87]  # 343 - 256
        assert got["float16 overflows"] == [float("inf")]
        assert got["bool"] == [[True, True, False], [False, True, False], [True, True, False], [False, True, False]]
        assert got["empty"] == [(0, 3), (2, 0), (0, 2), (1, 0), (0,)]
        assert got["output inside the input"] == [6 * rank + 30, 6 * rank + 33]
        assert got["zero block"] == [[0, 6, 12], [], [18, 24]][rank]
        start, end = [(0, 3), (3, 3), (3, 5)][rank]  # the max over the ranks is rank 2's: 3 * arange
        assert got["padded blocks"] == (3 * np.arange(10.0).reshape(5, 2)[start:end]).tolist()
        assert got["parameter"] == [[0.0, 0.0], True, True]
    assert results[1]["group of one"] == [[5.0], [7], [1, 2]]
    assert results[1]["src in a group"] == results[2]["src in a group"] == [2]


def test_bfloat16_words_round_as_torch_does() -> None:
    """The mpi backend's bfloat16 arithmetic (16-bit words through float32) against torch's own:
    ties to even, overflow to inf, NaN, subnormals and signed zeros."""
    rng = np.random.default_rng(0)
    with np.errstate(over="ignore"):  # the largest draws overflow float32 on purpose
        values = np.concatenate([
            rng.standard_normal(4000) * 10.0 ** rng.integers(-40, 39, 4000),
            np.array([1 + 2**-8, 1 + 3 * 2**-8, 3.3895e38, -3.4e38, np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-40]),
        ]).astype(np.float32)  # fmt: skip
    expected = torch.from_numpy(values).to(torch.bfloat16)
    words = rounded(values)
    got = torch.from_numpy(words.view(np.int16)).view(torch.bfloat16)
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    np.testing.assert_array_equal(widened(words), got.float().numpy())
    a, b = words[:2000], words[2000:4000]
    for ufunc, torch_op in ((np.add, torch.add), (np.multiply, torch.mul), (np.maximum, torch.maximum)):
        want = torch_op(got[:2000], got[2000:4000])
        mine = torch.from_numpy(reduce_words(ufunc, a, b).view(np.int16)).view(torch.bfloat16)
        torch.testing.assert_close(mine, want, rtol=0, atol=0, equal_nan=True)
