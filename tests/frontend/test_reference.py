"""Tests for unicoll.reference, the whole-world numpy semantics of every operator."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from unicoll import reference


def _lists(arrays):
    return [a.tolist() for a in arrays]


# --------------------------------------------------------------------------- worked example


def test_design_worked_example():
    xs = [np.array([0, 1, 2, 3]), np.array([10, 11, 12, 13, 14])]
    lcs = [[1, 0, 2, 1], [0, 2, 1, 2]]

    gcs = reference.global_counts(lcs)
    assert _lists(gcs) == [[1, 0, 0, 2], [2, 1, 1, 2]]
    assert all(g.dtype == np.int64 for g in gcs)

    ys = reference.global_scatter(xs, lcs)
    assert _lists(ys) == [[0, 10, 11], [1, 2, 12, 3, 13, 14]]
    assert all(y.dtype == xs[0].dtype for y in ys)

    back = reference.global_gather(ys, lcs)
    assert _lists(back) == [[0, 1, 2, 3], [10, 11, 12, 13, 14]]


def test_worked_example_numpy_counts_and_columns():
    xs = [np.arange(4 * 3).reshape(4, 3), np.arange(100, 115).reshape(5, 3)]
    lcs = [np.array([1, 0, 2, 1], dtype=np.int32), np.array([0, 2, 1, 2], dtype=np.int64)]
    ys = reference.global_scatter(xs, lcs)
    assert [y.shape for y in ys] == [(3, 3), (6, 3)]
    np.testing.assert_array_equal(ys[0], np.stack([xs[0][0], xs[1][0], xs[1][1]]))
    np.testing.assert_array_equal(ys[1], np.stack([xs[0][1], xs[0][2], xs[1][2], xs[0][3], xs[1][3], xs[1][4]]))


def test_docstring_examples():
    result = doctest.testmod(reference, extraglobs={"np": np})
    assert result.attempted > 0
    assert result.failed == 0


# --------------------------------------------------------------------------- random round trips


def _naive_scatter(xs, lcs):
    """Loop-by-loop transcription of docs/semantics.md's definitions, independent of the reference."""
    world = len(xs)
    experts = len(lcs[0]) // world
    chunks = []  # chunks[c][i] = rows rank c sends for index i
    for x, lc in zip(xs, lcs):
        offsets = np.concatenate([[0], np.cumsum(lc)])
        chunks.append([x[offsets[i] : offsets[i + 1]] for i in range(world * experts)])
    out = []
    for r in range(world):
        parts = [chunks[c][r * experts + e] for e in range(experts) for c in range(world)]
        out.append(np.concatenate(parts, axis=0))
    return out


def _random_case(rng, world, experts, trailing, dtype):
    lcs = []
    for _ in range(world):
        if rng.random() < 0.25:  # an empty rank
            lc = np.zeros(world * experts, dtype=np.int64)
        else:
            lc = rng.integers(0, 4, size=world * experts)
            lc[rng.random(lc.size) < 0.3] = 0  # extra zero counts
        lcs.append(lc if rng.random() < 0.5 else lc.tolist())
    xs = []
    for lc in lcs:
        n = int(np.sum(lc))
        values = rng.integers(-1000, 1000, size=(n, *trailing))
        xs.append(values.astype(dtype) if dtype != np.bool_ else values > 0)
    return xs, lcs


CASES = [
    (world, experts, trailing, dtype)
    for world in (1, 2, 3, 4)
    for experts in (1, 2, 3)
    for trailing in ((), (3,), (2, 2))
    for dtype in (np.float32, np.int64, np.bool_)
]


@pytest.mark.parametrize("world,experts,trailing,dtype", CASES)
def test_gather_inverts_scatter_random(world, experts, trailing, dtype):
    rng = np.random.default_rng(CASES.index((world, experts, trailing, dtype)))
    for _ in range(3):
        xs, lcs = _random_case(rng, world, experts, trailing, dtype)
        ys = reference.global_scatter(xs, lcs)
        gcs = reference.global_counts(lcs)
        assert len(ys) == world
        for y, gc, want in zip(ys, gcs, _naive_scatter(xs, lcs)):
            assert y.dtype == np.dtype(dtype)
            assert y.shape == (int(gc.sum()), *trailing)
            np.testing.assert_array_equal(y, want)
        back = reference.global_gather(ys, lcs)
        for b, x in zip(back, xs):
            assert b.dtype == x.dtype and b.shape == x.shape
            np.testing.assert_array_equal(b, x)


def test_global_counts_transpose_rule():
    rng = np.random.default_rng(0)
    world, experts = 3, 2
    lcs = [rng.integers(0, 5, size=world * experts) for _ in range(world)]
    gcs = reference.global_counts(lcs)
    for r in range(world):
        want = [lcs[c][r * experts + e] for c in range(world) for e in range(experts)]
        assert gcs[r].tolist() == want
        assert gcs[r].dtype == np.int64


def test_all_zero_counts_keep_trailing_shape():
    xs = [np.zeros((0, 3), dtype=np.float32), np.zeros((0, 3), dtype=np.float32)]
    lcs = [[0, 0], [0, 0]]
    for ys in (reference.global_scatter(xs, lcs), reference.global_gather(xs, lcs)):
        assert [(y.shape, y.dtype) for y in ys] == [((0, 3), np.float32)] * 2


# --------------------------------------------------------------------------- alltoall_single


def test_alltoall_single_uneven():
    xs = [np.array([0, 1, 2]), np.array([10, 11]), np.array([20, 21, 22, 23])]
    splits = [[1, 0, 2], [0, 2, 0], [1, 1, 2]]
    ys = reference.alltoall_single(xs, splits)
    assert _lists(ys) == [[0, 20], [10, 11, 21], [1, 2, 22, 23]]


def test_alltoall_single_even_split():
    xs = [
        np.array([[0, 0], [1, 1], [2, 2], [3, 3]]),
        np.array([[10, 10], [11, 11], [12, 12], [13, 13]]),
    ]
    ys = reference.alltoall_single(xs)
    assert _lists(ys) == [
        [[0, 0], [1, 1], [10, 10], [11, 11]],
        [[2, 2], [3, 3], [12, 12], [13, 13]],
    ]


def test_alltoall_single_zero_rows():
    xs = [np.zeros((0, 2), dtype=np.int64), np.array([[5, 6], [7, 8]])]
    ys = reference.alltoall_single(xs, [[0, 0], np.array([2, 0])])
    assert _lists(ys) == [[[5, 6], [7, 8]], []]
    assert [y.shape for y in ys] == [(2, 2), (0, 2)]

    empty = reference.alltoall_single([np.zeros((0,), dtype=np.float32)] * 2)
    assert [(y.shape, y.dtype) for y in empty] == [((0,), np.float32)] * 2


def test_alltoall_single_uneven_rows_without_splits_is_an_error():
    with pytest.raises(ValueError, match="evenly"):
        reference.alltoall_single([np.arange(3), np.arange(2)])


def test_alltoall_single_bad_splits():
    with pytest.raises(ValueError, match="length"):
        reference.alltoall_single([np.arange(2), np.arange(2)], [[1, 1, 0], [1, 1, 0]])
    with pytest.raises(ValueError, match="rows"):
        reference.alltoall_single([np.arange(2), np.arange(2)], [[1, 0], [1, 1]])


# --------------------------------------------------------------------------- all_gather


def test_all_gather_uneven_and_zero_rows():
    xs = [np.array([[1, 2]]), np.zeros((0, 2), dtype=np.int64), np.array([[3, 4], [5, 6]])]
    ys = reference.all_gather(xs)
    assert len(ys) == 3
    for y in ys:
        assert y.dtype == np.int64 and y.shape == (3, 2)
        assert y.tolist() == [[1, 2], [3, 4], [5, 6]]
    ys[0][0, 0] = 99  # copies: one rank's output does not alias another's or the input
    assert ys[1][0, 0] == 1 and xs[0][0, 0] == 1


def test_all_gather_equal_rows():
    xs = [np.array([1.5, 2.5], dtype=np.float32), np.array([3.5, 4.5], dtype=np.float32)]
    ys = reference.all_gather(xs)
    assert _lists(ys) == [[1.5, 2.5, 3.5, 4.5]] * 2
    assert all(y.dtype == np.float32 for y in ys)


def test_all_gather_backward_hand_example():
    # rows = [1, 2]: rank 0 owns gathered row 0, rank 1 owns rows 1..2.
    grads = [
        np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]),
        np.array([[10.0, 0.0], [20.0, 0.0], [30.0, 0.0]]),
    ]
    gs = reference.all_gather_backward(grads, [1, 2])
    assert _lists(gs) == [[[11.0, 1.0]], [[22.0, 2.0], [33.0, 3.0]]]
    assert all(g.dtype == np.float64 for g in gs)


def test_all_gather_backward_zero_rows_and_dtype():
    grads = [np.array([1, 2], dtype=np.int32), np.array([3, 4], dtype=np.int32)]
    grads.append(np.array([5, 6], dtype=np.int32))
    gs = reference.all_gather_backward(grads, [0, 2, 0])
    assert _lists(gs) == [[], [9, 12], []]
    assert all(g.dtype == np.int32 for g in gs)


# --------------------------------------------------------------------------- validation


def test_count_length_not_divisible_by_world():
    with pytest.raises(ValueError, match="multiple"):
        reference.global_scatter([np.arange(2), np.arange(1)], [[1, 1, 0], [1, 0, 0]])
    with pytest.raises(ValueError, match="multiple"):
        reference.global_counts([[1, 1, 0], [1, 0, 0]])


def test_count_sum_must_match_rows():
    with pytest.raises(ValueError, match="rows"):
        reference.global_scatter([np.arange(3), np.arange(1)], [[1, 1], [1, 0]])


def test_gather_rows_must_match_global_count():
    with pytest.raises(ValueError, match="rows"):
        reference.global_gather([np.arange(1), np.arange(1)], [[1, 1], [1, 0]])


def test_inconsistent_inputs():
    with pytest.raises(ValueError, match="one local_count per rank"):
        reference.global_scatter([np.arange(1), np.arange(1)], [[1, 0]])
    with pytest.raises(ValueError, match="length"):
        reference.global_scatter([np.arange(1), np.arange(1)], [[1, 0], [0, 1, 0, 0]])
    with pytest.raises(ValueError, match="non-negative"):
        reference.global_scatter([np.arange(1), np.arange(1)], [[2, -1], [0, 1]])
    with pytest.raises(ValueError, match="integers"):
        reference.global_scatter([np.arange(1), np.arange(1)], [[1.0, 0.0], [0.0, 1.0]])
    with pytest.raises(ValueError, match="trailing shape"):
        reference.all_gather([np.zeros((1, 2)), np.zeros((1, 3))])
    with pytest.raises(ValueError, match="dtype"):
        reference.all_gather([np.zeros(1, dtype=np.float32), np.zeros(1, dtype=np.float64)])
    with pytest.raises(ValueError, match="empty"):
        reference.all_gather([])
    with pytest.raises(ValueError, match="sum\\(rows\\)"):
        reference.all_gather_backward([np.zeros(2), np.zeros(3)], [1, 1])
