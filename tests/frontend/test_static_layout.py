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
