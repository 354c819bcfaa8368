"""unicoll.testing.spawn: results in rank order, the failing rank's error, no hangs."""

from __future__ import annotations

import os
import time

import pytest

import unicoll as uc
from unicoll.testing import SpawnError, SpawnTimeout


def report(rank: int, name: str) -> tuple:
    return rank, uc.get_backend(), uc.get_world_size(), os.environ.get(name)


def test_results_in_rank_order_with_env() -> None:
    out = uc.testing.spawn(report, 3, "UNICOLL_TEST_MARK", backend="gloo", env={"UNICOLL_TEST_MARK": "here"})
    assert out == [(r, "gloo", 3, "here") for r in range(3)]


def raise_on_rank_one(rank: int) -> None:
    if rank == 1:
        raise KeyError("the expert table has no entry 7")
    uc.barrier()  # rank 0 waits for a peer that will never come


def test_failing_rank_is_named_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(SpawnError, match="rank 1 raised") as info:
        uc.testing.spawn(raise_on_rank_one, 2, backend="gloo", timeout=60)
    assert info.value.rank == 1
    assert "KeyError: 'the expert table has no entry 7'" in info.value.remote_traceback
    assert time.monotonic() - start < 30


def die_on_rank_zero(rank: int) -> None:
    if rank == 0:
        os._exit(7)
    time.sleep(60)


def test_dead_rank_reports_its_exit_code() -> None:
    with pytest.raises(SpawnError, match="rank 0 exited with code 7") as info:
        uc.testing.spawn(die_on_rank_zero, 2, backend="gloo", timeout=60)
    assert info.value.exitcode == 7


def sleep_forever(rank: int) -> None:
    time.sleep(600)


def test_timeout_stops_every_rank() -> None:
    start = time.monotonic()
    with pytest.raises(SpawnTimeout, match=r"ranks \[0, 1\] had not finished after 3 s"):
        uc.testing.spawn(sleep_forever, 2, backend="gloo", timeout=3)
    assert time.monotonic() - start < 20
