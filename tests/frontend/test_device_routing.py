"""The dynamic dispatch's routing on the array API (unicoll.device_routing), with numpy and
torch, against the host routing (unicoll.routing.route) and the host reorders
(unicoll.backends.layout): the same rows, in the same order, for every case."""

from __future__ import annotations

import doctest

import array_api_compat.numpy as xnp
import array_api_compat.torch as xtorch
import numpy as np
import pytest
import torch

from unicoll import device_routing
from unicoll.backends.layout import expert_major_to_rank_major, rank_major_to_expert_major
from unicoll.device_routing import device_routing as route_on_device
from unicoll.device_routing import expert_major_orders
from unicoll.routing import route


def test_doctests() -> None:
    assert doctest.testmod(device_routing).failed == 0


def _cases():
    rng = np.random.default_rng(11)
    yield np.zeros((0, 2), dtype=np.int64), 4, None
    yield np.full((3, 2), -1), 4, None
    yield np.array([[0]]), 1, 0
    for _ in range(60):
        experts = int(rng.integers(1, 12))
        tokens, k = int(rng.integers(0, 40)), int(rng.integers(1, 5))
        ids = rng.integers(-1, experts, size=(tokens, k))
        capacity = None if rng.random() < 0.4 else int(rng.integers(0, 6))
        yield ids, experts, capacity


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_the_same_layout_as_the_host_routing(library: str) -> None:
    xp = xnp if library == "numpy" else xtorch
    convert = (lambda a: a) if library == "numpy" else torch.from_numpy
    for ids, experts, capacity in _cases():
        want = route(ids, experts, capacity)
        got = route_on_device(xp, convert(ids), experts, capacity)
        sent = int(want.local_count.sum())
        case = f"ids={ids.tolist()} experts={experts} capacity={capacity}"
        np.testing.assert_array_equal(np.asarray(got.local_count), want.local_count, err_msg=case)
        np.testing.assert_array_equal(np.asarray(got.send_tokens)[:sent], want.send_tokens, err_msg=case)
        np.testing.assert_array_equal(np.asarray(got.slot_rows), want.slot_rows, err_msg=case)


def test_ids_out_of_range_are_dropped_and_reported() -> None:
    ids = np.array([[0, 7], [-3, 1]])
    got = route_on_device(xnp, ids, 4, None)
    assert got.local_count.tolist() == [1, 1, 0, 0]
    assert got.slot_rows.tolist() == [0, 2, 2, 1]
    assert got.faults.tolist() == [-3, 7, 2, 1]  # lowest, highest, and the slot of each


def test_the_reorders_of_what_arrives_match_the_host_ones() -> None:
    rng = np.random.default_rng(5)
    for _ in range(40):
        received = rng.integers(0, 4, size=(int(rng.integers(1, 5)), int(rng.integers(1, 5))))
        rows = int(received.sum())
        for xp, convert in ((xnp, lambda a: a), (xtorch, torch.from_numpy)):
            to_em, to_rm = expert_major_orders(xp, convert(received), rows)
            np.testing.assert_array_equal(np.asarray(to_em), rank_major_to_expert_major(received))
            np.testing.assert_array_equal(np.asarray(to_rm), expert_major_to_rank_major(received))
