"""The MoE operators' plan (unicoll.backends.layout.MoePlan): its rows per rank and reorders
against hand-computed layouts, and what it keeps of the caller's counts."""

from __future__ import annotations

import numpy as np
import pytest

import unicoll as uc
from unicoll import runtime, validate
from unicoll.backends import layout
from unicoll.backends.layout import MoePlan, expert_major_to_rank_major, moe_plan, rank_major_to_expert_major


def test_a_plan_by_hand() -> None:
    """W=2, E=2 on rank 0: it receives 2 rows from rank 0 for expert 1, and 1 row from rank 1
    for each expert; the buffer (rank-major) is r0e1 r0e1 r1e0 r1e1, expert-major r1e0 r0e1 r0e1 r1e1."""
    plan = MoePlan(np.array([3, 0, 1, 4]), np.array([0, 2, 1, 1]), 2)
    assert (plan.send, plan.recv) == ([3, 5], [2, 2])
    assert plan.received.tolist() == [[0, 2], [1, 1]]
    assert plan.to_expert_major.tolist() == [2, 0, 1, 3]
    assert plan.to_rank_major.tolist() == [1, 2, 0, 3]


def test_reorders_are_made_on_first_use_and_counted_before() -> None:
    """A backend that places rows itself never asks for the reorders; the bytes a plan says it
    holds already count them, as the memory of accepted calls counts a plan when it is remembered."""
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 50, size=12)
    plan = MoePlan(counts, counts, 3)
    counted = plan.nbytes
    assert plan._to_expert_major is None and plan._to_rank_major is None
    forward, inverse = plan.to_rank_major, plan.to_expert_major  # the inverse first: it makes both
    np.testing.assert_array_equal(forward, expert_major_to_rank_major(counts.reshape(3, 4)))
    np.testing.assert_array_equal(inverse, rank_major_to_expert_major(counts.reshape(3, 4)))
    assert plan.to_expert_major is inverse  # made once
    assert counted >= forward.nbytes + inverse.nbytes + plan.received.nbytes
    assert plan.nbytes == counted


def test_expert_major_chunks_place_each_rank_s_rows_where_the_reorder_puts_them() -> None:
    """Copying each source rank's chunk for each expert to where ``expert_major_chunks`` says
    (mpi's indexed datatypes) gives the reorder's expert-major rows: empty chunks, ranks that
    send nothing and single rows included. Made once, counted before."""
    rng = np.random.default_rng(5)
    cases = [np.array([[1, 2], [1, 0]]), np.zeros((3, 2), dtype=np.int64), np.array([[0, 0, 4], [3, 0, 0]])]
    cases += [rng.integers(0, 4, size=(world, experts)) for world, experts in ((2, 2), (3, 4), (4, 3))]
    for received in cases:
        world = received.shape[0]
        plan = MoePlan(received.reshape(-1), received.reshape(-1), world)
        counted = plan.nbytes
        rank_major = np.arange(int(received.sum()))
        placed, at = np.full(rank_major.size, -1), 0
        for counts, starts in plan.expert_major_chunks:
            for rows, start in zip(counts, starts):
                placed[start : start + rows] = rank_major[at : at + rows]
                at += rows
        np.testing.assert_array_equal(placed, rank_major[rank_major_to_expert_major(received)])
        assert plan.expert_major_chunks is plan.expert_major_chunks and plan.nbytes == counted


def test_a_padded_plan_places_each_block_s_rows_first_and_never_moves_padding() -> None:
    """With a capacity, the expert-major side is E * W * C rows, block (e, c) at (e * W + c) * C:
    the reorder, its inverse and the chunks (mpi's placed receive) agree with the blocks built
    by hand; only the rows received travel (recv), and the padding rows are the rest."""
    rng = np.random.default_rng(8)
    cases = [(np.array([[1, 2], [1, 0]]), 2), (np.zeros((3, 2), dtype=np.int64), 1), (np.array([[0, 3]]), 3)]
    cases += [(rng.integers(0, 5, size=(world, experts)), 4) for world, experts in ((2, 2), (3, 4), (4, 1), (1, 3))]
    for received, capacity in cases:
        world, experts = received.shape
        plan = MoePlan(received.reshape(-1), received.reshape(-1), world, capacity=capacity)
        counted, total = plan.nbytes, int(received.sum())
        rank_major = np.arange(1, total + 1)  # 0 marks padding
        by_hand, at = np.zeros((experts, world, capacity), dtype=np.int64), 0
        for c in range(world):
            for e in range(experts):
                by_hand[e, c, : received[c, e]] = rank_major[at : at + received[c, e]]
                at += received[c, e]
        by_hand = by_hand.reshape(-1)
        assert plan.reordered and plan.expert_major_rows == experts * world * capacity
        assert sum(plan.recv) == total
        np.testing.assert_array_equal(np.append(rank_major, 0)[plan.to_expert_major], by_hand)
        np.testing.assert_array_equal(by_hand[plan.to_rank_major], rank_major)
        np.testing.assert_array_equal(plan.padding_rows, np.flatnonzero(by_hand == 0))
        placed, at = np.zeros(plan.expert_major_rows, dtype=np.int64), 0
        for counts, starts in plan.expert_major_chunks:
            for rows, start in zip(counts, starts):
                placed[start : start + rows] = rank_major[at : at + rows]
                at += rows
        np.testing.assert_array_equal(placed, by_hand)
        assert plan.nbytes == counted


def test_the_last_plan_is_kept_per_capacity() -> None:
    counts = np.array([1, 0, 2, 1])
    padded = moe_plan(counts, counts, 2, capacity=2)
    assert moe_plan(counts, counts, 2, capacity=2) is padded
    assert moe_plan(counts, counts, 2).capacity is None and moe_plan(counts, counts, 2, capacity=3).capacity == 3


def test_no_reorder_for_one_rank_or_one_expert() -> None:
    for counts, world in ((np.array([2, 0, 3]), 1), (np.array([2, 5]), 2)):
        plan = MoePlan(counts, counts, world)
        assert plan.to_expert_major is None and plan.to_rank_major is None
        assert plan.nbytes < 1024


def test_a_plan_keeps_a_copy_of_the_counts() -> None:
    """The caller's counts may change after the call: the plan keeps what it read."""
    local, glob = np.array([1, 2, 3, 4]), np.array([4, 3, 2, 1])
    plan = MoePlan(local, glob, 2)
    glob[:] = 0
    assert plan.received.tolist() == [[4, 3], [2, 1]]
    assert plan.to_expert_major.tolist() == [0, 1, 2, 3, 7, 8, 4, 5, 6, 9]


def test_a_remembered_call_carries_its_plan_in_the_memory_bound(clean_env: None) -> None:
    """global_scatter remembers its plan with the call: what the memory counts includes it,
    and the call it serves next uses the same plan."""
    uc.init("gloo")
    x, counts = np.arange(6.0), np.array([1, 2, 3])
    uc.global_scatter(x, counts, counts)
    memory = runtime.state("test").memory.accepted
    ((kept, nbytes, _),) = memory._entries.values()
    assert isinstance(kept.plan, MoePlan)
    assert nbytes == validate._ENTRY_OVERHEAD + 2 * 3 * validate._BYTES_PER_COUNT + kept.plan.nbytes
    np.testing.assert_array_equal(uc.global_scatter(x, counts.copy(), counts), x)
    assert next(iter(memory._entries.values()))[0] is kept


def test_global_gather_after_global_scatter_shares_its_plan(clean_env: None) -> None:
    """A training step's global_gather brings the counts its global_scatter used: one plan
    serves both (and their backward passes), not two."""
    uc.init("gloo")
    x, local, glob = np.arange(6.0), np.array([1, 2, 3]), np.array([1, 2, 3])
    y = uc.global_scatter(x, local, glob)
    np.testing.assert_array_equal(uc.global_gather(y, local.copy(), glob.copy()), x)
    plans = [call.plan for call, *_ in runtime.state("test").memory.accepted._entries.values()]
    assert len(plans) == 2 and plans[0] is plans[1]


def test_moe_plan_keeps_only_the_last_plan_within_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = np.array([3, 1, 2, 2])
    first = moe_plan(counts, counts, 2)
    assert moe_plan(counts.copy(), counts.copy(), 2) is first
    assert moe_plan(counts, counts[::-1].copy(), 2) is not first  # other counts: a new plan, which replaces it
    assert moe_plan(counts, counts, 2) is not first
    monkeypatch.setattr(layout, "LAST_PLAN_BYTES", 0)
    big = moe_plan(counts, counts[::-1].copy(), 2)
    assert moe_plan(counts, counts[::-1].copy(), 2) is not big and layout._last is None


@pytest.mark.parametrize("dtype", ["bool", "int8", "float16", "float32", "complex128"])
@pytest.mark.parametrize("shape", [(5, 3), (5, 4), (5, 2, 3), (5,), (5, 0), (0, 4)])
def test_row_words_gather_the_same_bits(dtype: str, shape: tuple[int, ...]) -> None:
    """A gather of row_words' view, viewed back, is the gather of the rows, bit for bit (NaNs
    with payloads included), and the words are never narrower than the elements."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (*shape, dt.itemsize), dtype=np.uint8).view(dt).reshape(shape)
    words = layout.row_words(x)
    row_bytes = dt.itemsize * int(np.prod(shape[1:]))
    if x.ndim == 2 and row_bytes:
        assert words.itemsize == max(dt.itemsize, min(8, row_bytes & -row_bytes))
    index = np.array([4, 0, 0, 2, 1])[: shape[0]]
    rows = np.take(words, index, axis=0).view(dt).reshape(len(index), *shape[1:])
    assert rows.view(np.uint8).tobytes() == x[index].view(np.uint8).tobytes()
