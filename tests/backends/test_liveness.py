"""The peer watch on its own: three "ranks" in one process, meeting through threads instead of a
process group. A rank that closes its connection is reported to the others, strangers are
turned away, and a forked child does not keep a dead rank's connection open."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from unicoll.backends.torch.liveness import PeerWatch, start_watch

WORLD = 3


def watches(world: int = WORLD, timeout: float = 5.0) -> list[PeerWatch]:
    """Every rank's watch, started from one thread per rank; ``share`` hands rank 0's values on."""
    shared: list[list[int]] = []
    ready = threading.Barrier(world)
    made: dict[int, PeerWatch | BaseException] = {}

    def share(values: list[int]) -> list[int]:
        if values[0]:  # rank 0's port and token; the others pass zeros
            shared.append(values)
        ready.wait()
        return shared[0]

    def start(rank: int) -> None:
        try:
            made[rank] = start_watch(rank, world, "127.0.0.1", time.monotonic() + timeout, share)
        except BaseException as exc:  # re-raised below, in the test's thread
            made[rank] = exc

    threads = [threading.Thread(target=start, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in made.values():
        if isinstance(result, BaseException):
            raise result
    return [made[rank] for rank in range(world)]


def until(condition, seconds: float = 2.0) -> bool:
    """Whether ``condition()`` holds within ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_closed_rank_is_lost_for_its_groups_only() -> None:
    zero, one, two = watches()
    try:
        assert [w.lost(range(WORLD)) for w in (zero, one, two)] == [None] * 3
        two.close()
        assert until(lambda: zero.lost(range(WORLD)) == 2)  # rank 0's thread saw it
        assert until(lambda: one.lost([1, 2]) == 2)  # and told rank 1
        assert one.lost([0, 1]) is None and zero.lost([0, 1]) is None  # a group without rank 2 goes on
        zero.close()
        assert until(lambda: one.lost([0, 1]) == 0)  # rank 0's end closed
    finally:
        for watch in (zero, one, two):
            watch.close()


def test_strangers_are_turned_away() -> None:
    """A connection that does not greet with the shared token takes no rank's place."""
    shared: list[list[int]] = []
    got = threading.Event()

    def share(values: list[int]) -> list[int]:
        shared.append(values)
        got.set()
        return values

    result: list[PeerWatch | None] = []
    rank0 = threading.Thread(target=lambda: result.append(start_watch(0, 2, "127.0.0.1", time.monotonic() + 5, share)))
    rank0.start()
    got.wait(5)
    port, token = shared[0]
    with socket.create_connection(("127.0.0.1", port)) as stranger:
        stranger.sendall((token + 1).to_bytes(8, "big") + (1).to_bytes(4, "big"))
        time.sleep(0.1)
        assert rank0.is_alive(), "rank 0 took the stranger for rank 1"
        with socket.create_connection(("127.0.0.1", port)) as rank1:
            rank1.sendall(token.to_bytes(8, "big") + (1).to_bytes(4, "big"))
            rank0.join(5)
            (watch,) = result
            assert watch.lost([0, 1]) is None
    assert until(lambda: watch.lost([0, 1]) == 1)
    watch.close()


def test_rank_0_times_out_waiting_for_a_rank() -> None:
    with pytest.raises(RuntimeError, match=r"peer watch: rank\(s\) \[1\] did not connect to rank 0 .*timed out"):
        start_watch(0, 2, "127.0.0.1", time.monotonic() + 0.2, lambda values: values)


def test_no_watch_where_rank_0_cannot_listen() -> None:
    assert start_watch(0, 2, "192.0.2.254", time.monotonic() + 1, lambda values: values) is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_keep_a_connection_open() -> None:
    """Rank 1's process forks, then rank 1 closes: rank 0 must still see it go."""
    zero, one = watches(2)
    try:
        child = os.fork()
        if child == 0:
            time.sleep(3)
            os._exit(0)
        one.close()
        assert until(lambda: zero.lost([0, 1]) == 1), "the child's copy kept rank 1's connection open"
        os.kill(child, 9)
        os.waitpid(child, 0)
    finally:
        zero.close()
        one.close()
