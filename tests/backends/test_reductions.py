"""all_reduce, reduce_scatter and broadcast at their edges, on gloo and mpi (one world of 3 each):
integer and float16 overflow, bool, empty arrays, a 0-d loss, an output inside its input, a zero
block, a group of one, broadcast's src as a position in the group, torch's rules for in-place
changes, and float max and min with NaN and signed zeros.

The cases run in the session's shared world of 3 ranks of each backend (helpers/several.py)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import unicoll as uc
from helpers.several import SESSION, Case, share
from unicoll import reference, runtime
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
    w = torch.tensor(float(rank + 1), requires_grad=True)
    loss = w * 2  # a 0-d loss, summed over the ranks in place as torch.distributed does it
    summed = uc.all_reduce(loss)
    summed.backward()
    task = uc.all_reduce(np.array(float(rank)), "max", sync_op=False)
    got["0-d"] = [summed is loss, tuple(summed.shape), summed.item(), w.grad.item(), task.wait().tolist()]
    return got


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_edges(backend: str) -> None:
    results = SESSION.results(WORLDS[backend], "reductions: edges")
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
        assert got["0-d"] == [True, (), 12.0, 6.0, 2.0]  # the gradient of w: 2, summed over 3 ranks
    assert results[1]["group of one"] == [[5.0], [7], [1, 2]]
    assert results[1]["src in a group"] == results[2]["src in a group"] == [2]


FLOATS = ("float16", "bfloat16", "float32", "float64")


def _specials(rank: int, world: int) -> np.ndarray:
    """Rank ``rank``'s row of values where a float max or min used to depend on the order of
    the ranks: NaN on one rank (first, last, a middle one), signed zeros, infinities, and a
    maximum held by the last rank."""
    nan, inf = np.nan, np.inf
    return np.array([
        nan if rank == 0 else 1.0,
        nan if rank == world - 1 else -1.0,
        nan if rank == 1 else rank + 0.5,
        -0.0 if rank % 2 == 0 else 0.0,
        0.0 if rank == 0 else -0.0,
        -inf if rank == 1 else (inf if rank == 2 else 2.0),
        rank + 0.5,
    ])  # fmt: skip


def _bits(a: torch.Tensor | np.ndarray) -> list[int]:
    """The bits of each element of a float array (NaN's payload and the sign of zero included)."""
    t = torch.as_tensor(a)
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).tolist()


def _rows(rank: int, world: int, rows: int) -> np.ndarray:
    return np.stack([_specials(rank, world)[np.roll(np.arange(7), r)] for r in range(rows)])


def _as(a: np.ndarray, dtype: str, library: str) -> torch.Tensor | np.ndarray:
    t = torch.from_numpy(a).to(getattr(torch, dtype))
    return t if library == "torch" else t.numpy()


def _uneven(world: int) -> list[int]:
    """The uneven reduce_scatter's split sizes: 3, 0, 1, 2 on 4 ranks, 6 rows on any."""
    splits = [3, 0, 1, 2][:world]
    splits[-1] += 6 - sum(splits)
    return splits


def float_extremes(rank: int) -> dict:
    """Float max and min with NaN and signed zeros: all_reduce (also as a Task) and
    reduce_scatter (even and uneven), numpy and torch, on the world and a sub-group; the
    bits of every result."""
    world = uc.get_world_size()
    pair = uc.new_group([1, world - 1])
    got: dict = {}
    for dtype in FLOATS:
        for op in ("max", "min"):
            libraries = ("torch",) if dtype == "bfloat16" else ("torch", "numpy")
            for library in libraries:
                array = functools.partial(_as, dtype=dtype, library=library)
                key = (dtype, op, library)
                got[("all_reduce", *key)] = _bits(uc.all_reduce(array(_rows(rank, world, 1)), op))
                got[("task", *key)] = _bits(uc.all_reduce(array(_rows(rank, world, 2)), op, sync_op=False).wait())
                x = array(_rows(rank, world, 2 * world))
                got[("reduce_scatter", *key)] = _bits(uc.reduce_scatter(None, x, op))
                splits = _uneven(world)
                x = array(_rows(rank, world, 6))
                got[("uneven", *key)] = _bits(uc.reduce_scatter(None, x, op, split_sizes=splits))
                if rank in (1, world - 1):
                    got[("pair", *key)] = _bits(uc.all_reduce(array(_rows(rank, world, 1)), op, group=pair))
    return got


W = 3
"""The session's shared worlds (helpers/several.py) of W ranks run this module's cases."""
WORLDS = {
    backend: share(backend, W, [Case("reductions: edges", edges), Case("reductions: float extremes", float_extremes)])
    for backend in ("gloo", "mpi")
}


def _expected(kind: str, dtype: str, op: str, world: int) -> list[list[int]]:
    """Each rank's expected bits, from the numpy reference (bfloat16 rounded from float32)."""
    wide = "float32" if dtype == "bfloat16" else dtype
    ranks = [1, world - 1] if kind == "pair" else range(world)
    rows = {"all_reduce": 1, "task": 2, "pair": 1, "reduce_scatter": 2 * world, "uneven": 6}[kind]
    xs = [_rows(r, world, rows).astype(wide) for r in ranks]
    if kind == "reduce_scatter":
        results = reference.reduce_scatter(xs, op)
    elif kind == "uneven":
        results = reference.reduce_scatter(xs, op, _uneven(world))
    else:
        results = reference.all_reduce(xs, op)
    converted = [torch.from_numpy(y).to(getattr(torch, dtype)) for y in results]
    return [_bits(torch.where(t.isnan(), float("nan"), t)) for t in converted]  # 0x7FC0: torch's cast gave 0xFFFF


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_float_max_min_propagate_nan_alike_on_every_rank(backend: str) -> None:
    """NaN on any rank gives NaN on every rank, -0 < +0, and every rank gets the same bits,
    which are the reference's (before: mpi gave ranks different answers, gloo dropped NaN)."""
    world = W
    results = SESSION.results(WORLDS[backend], "reductions: float extremes")
    assert len(results[1]) == 7 * 2 * 5  # (dtype, library) pairs x (max, min) x kinds of call
    for key in results[1]:
        kind, dtype, op, _ = key
        ranks = [1, world - 1] if kind == "pair" else range(world)
        assert [results[r][key] for r in ranks] == _expected(kind, dtype, op, world), key
    assert np.isnan(reference.all_reduce([np.array([np.nan, 1.0]), np.array([1.0, np.nan])], "max")[0]).all()


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
    for ufunc, torch_op in ((np.add, torch.add), (np.multiply, torch.mul)):
        want = torch_op(got[:2000], got[2000:4000])
        mine = torch.from_numpy(reduce_words(ufunc, a, b).view(np.int16)).view(torch.bfloat16)
        torch.testing.assert_close(mine, want, rtol=0, atol=0, equal_nan=True)
