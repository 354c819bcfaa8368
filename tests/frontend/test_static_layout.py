"""The static-shape MoE layout (unicoll.static_layout) on one process: every rank's layout made
with numpy and with torch, the even all-to-all simulated by slicing, against the whole-world
reference (unicoll.reference.moe_dispatch_static / moe_combine_static)."""

from __future__ import annotations

import doctest

import array_api_compat.numpy as xnp
import array_api_compat.torch as xtorch
import numpy as np
import pytest
import torch

from helpers.static_world import world_combine, world_dispatch
from unicoll import reference, static_layout
from unicoll.backends.blocks import (
    expert_major,
    send_rows,
    slot_index,
    slots_of,
    source_major,
    weighted_sum,
    with_zero_row,
)
from unicoll.routing import static_route
from unicoll.static_layout import static_layout as layout_of


def test_doctests() -> None:
    assert doctest.testmod(static_layout).failed == 0


CASES = [  # world, experts per rank, k, capacity, tokens per rank
    (1, 1, 1, 4, [3]),
    (2, 1, 2, 2, [5, 0]),
    (2, 3, 2, 1, [6, 4]),
    (3, 3, 4, 3, [7, 2, 5]),
    (4, 1, 1, 0, [3, 3, 1, 2]),
    (4, 3, 2, 8, [9, 1, 0, 4]),
]


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_layout_matches_the_whole_world_reference(library: str) -> None:
    rng = np.random.default_rng(7)
    xp = xnp if library == "numpy" else xtorch
    convert = (lambda a: a) if library == "numpy" else torch.from_numpy
    for world, experts, k, capacity, tokens in CASES:
        ids = [rng.integers(-2, world * experts + 1, size=(t, k)) for t in tokens]  # -2 and W*E: dropped
        xs = [rng.standard_normal((t, 3)) for t in tokens]
        xs[0][:1] = np.inf  # a token's inf stays out of the padding
        weights = [rng.random((t, k)) for t in tokens]
        case = f"W={world} E={experts} k={k} C={capacity} tokens={tokens}"
        layouts, rows, counts, demand = world_dispatch(
            xp, [convert(x) for x in xs], [convert(i) for i in ids], experts, capacity
        )
        want_rows, want_counts, want_demand = reference.moe_dispatch_static(xs, ids, experts, capacity)
        for r in range(world):
            np.testing.assert_array_equal(np.asarray(rows[r]), want_rows[r], err_msg=f"rows of rank {r}, {case}")
            np.testing.assert_array_equal(np.asarray(counts[r]), want_counts[r], err_msg=f"counts, {case}")
            np.testing.assert_array_equal(np.asarray(demand[r]), want_demand[r], err_msg=f"demand, {case}")
        ys = [2 * np.asarray(r) + 1 for r in rows]  # padding rows become 1: never read
        for r in range(world):
            ys[r][np.asarray(rows[r]) == 0] = np.nan  # nor are nans where the padding is
        outs = world_combine(xp, [convert(y) for y in ys], layouts, [convert(w) for w in weights], experts, capacity)
        want = reference.moe_combine_static(ys, ids, experts, capacity, weights)
        for c in range(world):
            np.testing.assert_allclose(np.asarray(outs[c]), want[c], rtol=1e-12, err_msg=f"combine of rank {c}, {case}")


def test_gradients_flow_to_x_the_outputs_and_the_weights_and_are_zero_for_dropped_slots() -> None:
    """One rank, E=2, k=2, C=1: token 1's slot to expert 0 is dropped by the capacity."""
    ids = torch.tensor([[0, 1], [0, -1]])
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    w = torch.tensor([[0.5, 2.0], [3.0, 7.0]], requires_grad=True)
    lay = layout_of(xtorch, ids, 2, 1)
    rows = expert_major(xtorch, send_rows(xtorch, x, lay), 1, 2)  # (2, 1, 2): expert 0 gets token 0, expert 1 too
    assert rows.tolist() == [[[1.0, 2.0]], [[1.0, 2.0]]]
    y = rows * torch.tensor([[[10.0]], [[100.0]]])
    back = source_major(xtorch, y, 1, 2)
    slots = slots_of(xtorch, with_zero_row(xtorch, back), slot_index(xtorch, lay, back.shape[0]))
    out = weighted_sum(xtorch, slots, lay.kept, w)
    assert out.tolist() == [[5.0 + 200.0, 10.0 + 400.0], [0.0, 0.0]]
    out.sum().backward()
    assert w.grad.tolist() == [[30.0, 300.0], [0.0, 0.0]]  # dropped slots: exactly zero
    assert x.grad.tolist() == [[0.5 * 10 + 2.0 * 100] * 2, [0.0, 0.0]]


def test_the_host_route_makes_the_same_layout() -> None:
    """:func:`unicoll.routing.static_route` (the host backends' layout, from the host routing's
    send order) equals the array-API layout field by field, dtype and shape included, on
    random ids with -1, ids out of range, no tokens, repeated experts and capacities from 0."""
    rng = np.random.default_rng(7)
    for _ in range(2000):
        tokens, k, experts, capacity = (int(v) for v in rng.integers((0, 1, 1, 0), (9, 4, 6, 5)))
        ids = rng.integers(-2, experts + 2, (tokens, k))
        want, got = layout_of(xnp, ids, experts, capacity), static_route(ids, experts, capacity)
        for name, a, b in zip(want._fields, want, got):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), (name, ids, experts, capacity)


ONCE_CASES = [  # world, experts per rank, k, capacity, tokens per rank, bound
    (1, 2, 2, 3, [4], 4),
    (2, 1, 2, 2, [5, 0], 5),
    (2, 3, 2, 1, [6, 4], 8),
    (2, 2, 3, 4, [6, 6], 6),  # repeated experts within a token below
    (3, 3, 4, 3, [7, 2, 5], 7),
    (4, 2, 8, 9, [9, 1, 0, 4], 12),
]


def test_once_per_rank_blocks_equal_the_reference_and_the_plain_gradients() -> None:
    """Each token sent once per rank in fixed shapes (unicoll.once_blocks), a whole world on one
    process: the blocks, counts and combine of the reference, and the gradients of x and the
    weights equal to the plain step's (integer values: every sum exact), NaN and inf in x and in
    the padding kept out."""
    from helpers.static_world import world_once
    from unicoll import once_blocks

    rng = np.random.default_rng(11)
    for world, experts, k, capacity, tokens, bound in ONCE_CASES:
        case = f"W={world} E={experts} k={k} C={capacity} tokens={tokens} bound={bound}"
        ids = [rng.integers(-1, world * experts, size=(t, k)) for t in tokens]
        if k == 3:
            ids[0][:, 2] = ids[0][:, 0]  # one expert twice in a token
        xs = [rng.integers(0, 4, (t, 3)).astype(np.float64) for t in tokens]
        weights = [rng.integers(1, 3, (t, k)).astype(np.float64) for t in tokens]
        tx = [torch.from_numpy(x).requires_grad_() for x in xs]
        tw = [torch.from_numpy(w).requires_grad_() if c else None for c, w in enumerate(weights)]  # rank 0 unweighted
        blocks, counts, outs, sent = world_once(tx, [torch.from_numpy(i) for i in ids], tw, experts, capacity, bound)
        want_rows, want_counts, _ = reference.moe_dispatch_static(xs, ids, experts, capacity)
        ys = [2 * r + 1 for r in want_rows]
        plain_weights = [np.ones_like(weights[0])] + weights[1:]
        want = reference.moe_combine_static(ys, ids, experts, capacity, plain_weights)
        for r in range(world):
            np.testing.assert_array_equal(blocks[r].detach().numpy(), want_rows[r], err_msg=f"rows {r}, {case}")
            np.testing.assert_array_equal(counts[r].numpy(), want_counts[r], err_msg=f"counts {r}, {case}")
            np.testing.assert_array_equal(outs[r].detach().numpy(), want[r], err_msg=f"combine {r}, {case}")
            assert sent[r].token.shape[0] == world * once_blocks.rows_per_rank(bound, experts, capacity)
        # the gradients against the plain step's, simulated the same way
        sum(((o * o).sum() for o in outs), torch.tensor(0.0, dtype=torch.float64)).backward()
        px = [torch.from_numpy(x).requires_grad_() for x in xs]
        pw = [torch.from_numpy(w).requires_grad_() if c else None for c, w in enumerate(weights)]
        layouts, rows, _, _ = world_dispatch(xtorch, px, [torch.from_numpy(i) for i in ids], experts, capacity)
        plain = world_combine(xtorch, [2 * r + 1 for r in rows], layouts, pw, experts, capacity)
        sum(((o * o).sum() for o in plain), torch.tensor(0.0, dtype=torch.float64)).backward()
        for r in range(world):
            assert torch.equal(tx[r].grad, px[r].grad), f"x.grad {r}, {case}"
            if r:
                assert torch.equal(tw[r].grad, pw[r].grad), f"w.grad {r}, {case}"


def test_once_per_rank_blocks_doctests() -> None:
    from unicoll import once_blocks

    assert doctest.testmod(once_blocks).failed == 0
