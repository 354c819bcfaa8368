"""The grouped send/recv schedule of cupy-nccl's all-to-all, simulated with numpy on CPU.

Every rank's schedule is built, each send is matched with the peer's receive and its bytes
copied, and the received buffers are compared with ``unicoll.reference.alltoall_single``.
"""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from unicoll import reference
from unicoll.backends.cupy import schedule
from unicoll.backends.cupy.schedule import Transfer, alltoallv_schedule


def _simulate(xs: list[np.ndarray], splits: np.ndarray) -> list[np.ndarray]:
    """Run every rank's schedule on byte buffers; return each rank's received rows."""
    world = len(xs)
    row_bytes = xs[0].dtype.itemsize * int(np.prod(xs[0].shape[1:], dtype=np.int64))
    plans = [alltoallv_schedule(r, world, splits[r].tolist(), splits[:, r].tolist(), row_bytes) for r in range(world)]
    sent = [x.reshape(-1).view(np.uint8) for x in xs]
    received = [np.zeros(int(splits[:, r].sum()) * row_bytes, np.uint8) for r in range(world)]
    for r, plan in enumerate(plans):
        peers = [t.peer for t in plan]
        assert len(set(peers)) == len(peers), f"rank {r} lists a peer twice: {peers}"
        assert not plan or plan[0].peer == r or splits[r, r] == 0, "the ring starts with the rank itself"
        for t in plan:
            assert t.send_bytes or t.recv_bytes, f"rank {r}: a transfer with nothing in it: {t}"
            if not t.send_bytes:
                continue
            match = [u for u in plans[t.peer] if u.peer == r]
            assert len(match) == 1 and match[0].recv_bytes == t.send_bytes, f"rank {r} -> {t.peer}: no matching receive"
            u = match[0]
            received[t.peer][u.recv_offset : u.recv_offset + u.recv_bytes] = sent[r][
                t.send_offset : t.send_offset + t.send_bytes
            ]
        for t in plan:  # every receive has its send
            if t.recv_bytes:
                assert any(u.peer == r and u.send_bytes == t.recv_bytes for u in plans[t.peer])
    return [buf.view(xs[0].dtype).reshape(-1, *xs[0].shape[1:]) for buf in received]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(25))
def test_schedule_moves_what_the_reference_moves(world: int, seed: int) -> None:
    rng = np.random.default_rng([world, seed])
    splits = rng.integers(0, 4, (world, world)) * (rng.random((world, world)) > 0.35)
    if world > 1 and seed % 4 == 0:
        splits[rng.integers(world)] = 0  # a rank that sends nothing
    dtype = [np.float32, np.int8, np.bool_, np.float64, np.int64][seed % 5]
    trailing = [(), (3,), (2, 2)][seed % 3]
    xs = [rng.integers(0, 100, (int(s.sum()), *trailing)).astype(dtype) for s in splits]
    got = _simulate(xs, splits)
    for r, want in enumerate(reference.alltoall_single(xs, list(splits))):
        np.testing.assert_array_equal(got[r], want)


def test_zero_sizes_are_dropped_on_both_sides() -> None:
    plan = alltoallv_schedule(0, 4, [0, 2, 0, 0], [0, 0, 1, 0], 8)
    assert plan == [Transfer(1, 0, 16, 0, 0), Transfer(2, 16, 0, 0, 8)]
    assert alltoallv_schedule(2, 3, [1, 1, 1], [1, 1, 1], 0) == []  # rows of zero bytes


def test_ring_order_starts_at_the_rank() -> None:
    assert [t.peer for t in alltoallv_schedule(2, 4, [1] * 4, [1] * 4, 1)] == [2, 3, 0, 1]


@pytest.mark.parametrize(
    ("args", "message"),
    [((1, 2, [1, 2], [3, 4], 4), "rank 1 sends 2 row\\(s\\) to itself but expects 4"),
     ((2, 2, [0, 0], [0, 0], 4), "rank: expected 0 <= rank < 2, got 2"),
     ((0, 2, [0], [0, 0], 4), "expected 2 send and receive sizes, got 1 and 2"),
     ((0, 2, [0, -1], [0, 0], 4), "non-negative")],
)  # fmt: skip
def test_bad_sizes_are_refused(args, message) -> None:
    with pytest.raises(ValueError, match=message):
        alltoallv_schedule(*args)


def test_docstring_example() -> None:
    assert doctest.testmod(schedule).failed == 0
