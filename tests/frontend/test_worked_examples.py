"""Hand-computed examples on real processes: docs/semantics.md's worked examples (global_scatter, and
top-k dispatch and combine) and small cases of alltoall_single and all_gather, with counts given as
lists, numpy and torch int32 arrays."""

from __future__ import annotations

import numpy as np
import torch

import unicoll as uc

# docs/semantics.md, global_scatter's worked example: W=2, E=2, one column, values are row labels
X = [[0, 1, 2, 3], [10, 11, 12, 13, 14]]
LOCAL = [[1, 0, 2, 1], [0, 2, 1, 2]]
GLOBAL = [[1, 0, 0, 2], [2, 1, 1, 2]]
SCATTERED = [[0, 10, 11], [1, 2, 12, 3, 13, 14]]

# docs/semantics.md, top-k dispatch and combine: W=2, E=2, top-2; expert g multiplies by g + 1
TOKENS = [[1, 2, 3], [10, 11]]
TOPK_IDX = [[[2, 0], [1, -1], [0, 3]], [[0, 3], [2, 0]]]
TOPK_WEIGHTS = [[[0.5, 0.5], [1.0, 0.3], [0.25, 0.75]], [[0.5, 0.5], [0.5, 0.5]]]
DISPATCHED = [([1, 3, 10, 11, 2], [4, 1]), ([1, 11, 3, 10], [2, 2])]
COMBINED = [[2.0, 4.0, 9.75], [25.0, 22.0]]
DISPATCHED_CAPACITY_1 = [([1, 10, 2], [2, 1]), ([1, 11, 3, 10], [2, 2])]

# docs/semantics.md, the static-shape mode on the same example: capacity 2, then 1
STATIC = [([[1, 3, 10, 11], [2, 0, 0, 0]], [[2, 2], [1, 0]]), ([[1, 0, 11, 0], [3, 0, 10, 0]], [[1, 1], [1, 1]])]
STATIC_CAPACITY_1 = [([[1, 10], [2, 0]], [[1, 1], [1, 0]]), ([[1, 11], [3, 10]], [[1, 1], [1, 1]])]
BEFORE_DROP = [[[2, 2], [1, 0]], [[1, 1], [1, 1]]]
COMBINED_CAPACITY_1 = [[2.0, 4.0, 9.0], [25.0, 16.5]]


def worked_example(rank: int) -> dict[str, list]:
    x_np = np.array(X[rank], dtype=np.float32).reshape(-1, 1)
    x_t = torch.tensor(X[rank]).reshape(-1, 1)
    lc_t = torch.tensor(LOCAL[rank], dtype=torch.int32)
    gc = uc.exchange_counts(lc_t)
    y_np = uc.global_scatter(x_np, LOCAL[rank], np.array(GLOBAL[rank]))
    y_t = uc.global_scatter(x_t, lc_t, gc)
    back = uc.global_gather(y_t, lc_t, gc)
    tokens = torch.tensor(TOKENS[rank], dtype=torch.float32).reshape(-1, 1)
    rows, per_expert, handle = uc.moe.dispatch(
        tokens, torch.tensor(TOPK_IDX[rank]), torch.tensor(TOPK_WEIGHTS[rank]), experts_per_rank=2
    )
    expert = torch.repeat_interleave(torch.arange(2) + 2 * rank, torch.tensor(per_expert))  # each row's global expert
    combined = uc.moe.combine(rows * (expert[:, None] + 1), handle)
    capped, capped_per_expert, _ = uc.moe.dispatch(
        tokens.numpy(), np.array(TOPK_IDX[rank]), experts_per_rank=2, capacity=1
    )
    static = {}
    for capacity in (2, 1):
        blocks, counts, h = uc.moe.dispatch_static(
            tokens, torch.tensor(TOPK_IDX[rank]), torch.tensor(TOPK_WEIGHTS[rank]), experts_per_rank=2,
            capacity=capacity,
        )  # fmt: skip
        scale = (torch.arange(2) + 2 * rank + 1.0).reshape(2, 1, 1)  # expert g multiplies by g + 1
        out = uc.moe.combine_static(blocks * scale, h)
        static[capacity] = ((blocks.squeeze(-1).tolist(), counts.tolist()), out.ravel().tolist(),
                            h.received_before_drop.tolist())  # fmt: skip
    return dict(
        global_count=gc.tolist(),
        count_dtype=[str(gc.dtype)],
        numpy=y_np.ravel().tolist(),
        torch=y_t.ravel().tolist(),
        back=back.ravel().tolist(),
        dispatched=(rows.ravel().tolist(), per_expert),
        combined=combined.ravel().tolist(),
        capacity_1=(capped.ravel().tolist(), capped_per_expert),
        static=static,
    )


def test_design_worked_example() -> None:
    for rank, got in enumerate(uc.testing.spawn(worked_example, 2, backend="gloo")):
        assert got["global_count"] == GLOBAL[rank]
        assert got["count_dtype"] == ["torch.int32"]
        assert got["numpy"] == SCATTERED[rank]
        assert got["torch"] == SCATTERED[rank]
        assert got["back"] == X[rank]
        assert got["dispatched"] == DISPATCHED[rank]
        assert got["combined"] == COMBINED[rank]
        assert got["capacity_1"] == DISPATCHED_CAPACITY_1[rank]
        assert got["static"][2] == (STATIC[rank], COMBINED[rank], BEFORE_DROP[rank])
        assert got["static"][1] == (STATIC_CAPACITY_1[rank], COMBINED_CAPACITY_1[rank], BEFORE_DROP[rank])


def test_topk_worked_example_is_the_reference() -> None:
    """The hand-computed top-k example agrees with the whole-world reference, too."""
    xs = [np.array(t, dtype=np.float64) for t in TOKENS]
    rows, per_expert = uc.reference.moe_dispatch(xs, TOPK_IDX, 2)
    assert [(r.tolist(), p) for r, p in zip(rows, per_expert)] == DISPATCHED
    ys = [r * np.repeat(np.arange(2) + 2 * rank + 1, p) for rank, (r, p) in enumerate(zip(rows, per_expert))]
    assert [c.tolist() for c in uc.reference.moe_combine(ys, TOPK_IDX, 2, TOPK_WEIGHTS)] == COMBINED
    capped = uc.reference.moe_dispatch(xs, TOPK_IDX, 2, capacity=1)
    assert [(r.tolist(), p) for r, p in zip(*capped)] == DISPATCHED_CAPACITY_1
    for capacity, blocks, combined in ((2, STATIC, COMBINED), (1, STATIC_CAPACITY_1, COMBINED_CAPACITY_1)):
        rows, counts, before = uc.reference.moe_dispatch_static(xs, TOPK_IDX, 2, capacity)
        assert [(r.tolist(), c.tolist()) for r, c in zip(rows, counts)] == blocks
        assert [b.tolist() for b in before] == BEFORE_DROP
        ys = [r * (np.arange(2) + 2 * rank + 1.0).reshape(2, 1) for rank, r in enumerate(rows)]
        assert [
            c.tolist() for c in uc.reference.moe_combine_static(ys, TOPK_IDX, 2, capacity, TOPK_WEIGHTS)
        ] == combined


def small_cases(rank: int) -> dict[str, list]:
    # alltoall_single, W=3: rank r holds rows 10r.., sends in_splits[r][c] rows to rank c
    in_splits = [[1, 0, 2], [0, 0, 1], [2, 1, 0]][rank]
    x = np.arange(sum(in_splits)) + 10 * rank
    exchanged = uc.alltoall_single(None, x, in_split_sizes=in_splits)
    # all_gather with uneven rows: rank r holds r rows of value r
    parts: list = []
    uc.all_gather(parts, torch.full((rank, 2), rank))
    gathered = uc.all_gather(None, np.full(rank, rank, dtype=np.int8))
    return dict(alltoall=exchanged.tolist(), parts=[p.tolist() for p in parts], gathered=gathered.tolist())


def test_hand_computed_small_cases() -> None:
    out = uc.testing.spawn(small_cases, 3, backend="gloo")
    assert [o["alltoall"] for o in out] == [[0, 20, 21], [22], [1, 2, 10]]
    for o in out:
        assert o["parts"] == [[], [[1, 1]], [[2, 2], [2, 2]]]
        assert o["gathered"] == [1, 2, 2]
