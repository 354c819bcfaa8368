"""The rendezvous on CPU: torch's TCPStore bound by rank 0 to ``MASTER_ADDR:MASTER_PORT``, its
failures as TransportError kinds, and cupy-nccl's NCCL id exchange through it, run by the real
``CupyNcclBackend`` on spawned processes with a stand-in for cupy whose ids are random bytes
(and whose NCCL errors, at init, are reported by their status)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import secrets
import socket
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import pytest

from unicoll.backends.rendezvous import arrive, listen, open_store, route_source, share_bytes
from unicoll.errors import TransportError, TransportPeerLostError, TransportTimeoutError
from unicoll.launch.local import free_port

ADDR = "127.0.0.1"


@pytest.fixture
def port(monkeypatch) -> int:
    """A free port, as ``MASTER_PORT`` on ``MASTER_ADDR=127.0.0.1``."""
    chosen = free_port()
    monkeypatch.setenv("MASTER_ADDR", ADDR)
    monkeypatch.setenv("MASTER_PORT", str(chosen))
    return chosen


def _soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


# -- the store -----------------------------------------------------------------------------------


def test_bytes_travel_unchanged(port) -> None:
    host, guest = open_store(0, 2, 5, _soon()), open_store(1, 2, 5, _soon())
    value = b"\x00\xff" * 64  # an NCCL id is 128 bytes, zeros included
    assert share_bytes(host.store, "id", value) == value
    assert share_bytes(guest.store, "id", None) == value


def test_rank_0_binds_the_address_it_is_given(port) -> None:
    host = open_store(0, 2, 5, _soon())
    with socket.socket(fileno=os.dup(host.listen_fd)) as bound:
        assert bound.getsockname() == (ADDR, port)


def test_a_key_nobody_sets_times_out(port) -> None:
    host = open_store(0, 2, 0.3, _soon())
    start = time.monotonic()
    with pytest.raises(TransportTimeoutError, match="wait timeout after 300ms"):
        share_bytes(host.store, "never", None)
    assert time.monotonic() - start < 3


def test_a_host_that_goes_away_is_a_lost_peer(port) -> None:
    host, guest = open_store(0, 2, 5, _soon()), open_store(1, 2, 5, _soon())
    del host
    gc.collect()
    with pytest.raises(TransportPeerLostError, match="Connection was likely closed"):
        share_bytes(guest.store, "never", None)


def test_nobody_listening_times_out_at_the_deadline(port) -> None:
    start = time.monotonic()
    with pytest.raises(TransportTimeoutError, match=rf"rank 0's store at {ADDR}:{port} was not listening; timed out"):
        open_store(1, 2, 5, _soon(0.3))
    assert time.monotonic() - start < 2


def test_a_port_in_use_is_a_failure_of_no_particular_kind(port) -> None:
    with listen(ADDR, port), pytest.raises(TransportError, match=rf"rank 0 cannot listen on {ADDR}:{port}") as info:
        open_store(0, 2, 5, _soon())
    assert type(info.value) is TransportError


def test_dropping_the_store_frees_the_port(port) -> None:
    """What cupy-nccl's finalize() relies on for a later init() on the same port."""
    host = open_store(0, 2, 5, _soon())
    del host
    gc.collect()
    listen(ADDR, port).close()


def test_a_store_that_resets_the_connection_is_tried_again(port, monkeypatch) -> None:
    """Rank 0 closing the store of the session being left while a rank's client registers with
    it resets that connection in the client's constructor (torch's DistNetworkError): the rank
    connects again until rank 0's new store takes it."""
    import torch.distributed as dist

    host = open_store(0, 2, 5, _soon())
    made = []

    def resetting_twice(*args: Any, **kwargs: Any) -> Any:
        made.append(args)
        if len(made) <= 2:
            raise dist.DistNetworkError("Connection reset by peer")
        return real(*args, **kwargs)

    real = dist.TCPStore
    monkeypatch.setattr(dist, "TCPStore", resetting_twice)
    guest = open_store(1, 2, 5, _soon())
    assert len(made) == 3
    assert share_bytes(host.store, "id", b"new") == share_bytes(guest.store, "id", None) == b"new"


@pytest.mark.parametrize("raw", ["0", "99999", "-1", "http"])
def test_a_port_out_of_range_is_refused_at_once(port, monkeypatch, raw) -> None:
    """Before, port 0 let rank 0 listen on a port nobody knew and the others wait out the timeout."""
    monkeypatch.setenv("MASTER_PORT", raw)
    with pytest.raises(
        RuntimeError, match=rf"^unicoll\.init: \$MASTER_PORT: expected a port number from 1 to 65535, got '{raw}'$"
    ):
        open_store(0, 2, 5, _soon())


def test_the_route_to_a_loopback_address_leaves_from_loopback() -> None:
    assert route_source(ADDR) == ADDR


def test_arrive_hands_every_rank_the_notes_of_all(port) -> None:
    host, guest = open_store(0, 2, 5, _soon()), open_store(1, 2, 5, _soon())
    seen: dict[int, list[str]] = {}
    guest_thread = threading.Thread(target=lambda: seen.update({1: arrive(guest.store, 1, 2, "B", _soon())}))
    guest_thread.start()
    seen[0] = arrive(host.store, 0, 2, "A", _soon())
    guest_thread.join(5)
    assert seen == {0: ["A", "B"], 1: ["A", "B"]}


def test_arrive_names_the_ranks_that_did_not(port) -> None:
    """Ranks 0 and 2 of 4 arrive; 1 and 3 never do: both are told which, at the deadline."""
    host, guest = open_store(0, 4, 5, _soon()), open_store(2, 4, 5, _soon())
    errors: dict[int, Exception] = {}

    def arrive_as(rank: int, store: Any) -> None:
        try:
            arrive(store, rank, 4, "A", _soon(0.3))
        except TransportTimeoutError as exc:
            errors[rank] = exc

    start = time.monotonic()
    guest_thread = threading.Thread(target=arrive_as, args=(2, guest.store))
    guest_thread.start()
    arrive_as(0, host.store)
    guest_thread.join(5)
    assert time.monotonic() - start < 2
    expected = "rendezvous: rank(s) [1, 3] did not reach rank 0's store; timed out"
    assert {rank: str(exc) for rank, exc in errors.items()} == {0: expected, 2: expected}


# -- cupy-nccl's id exchange, with cupy stood in for ----------------------------------------------


def _fake_cupy(failing: int | None) -> dict[str, types.ModuleType]:
    """Modules standing in for cupy with what CupyNcclBackend needs to make and finalize
    communicators; ``cupy.cuda.nccl.made`` records each communicator as (size, id, rank). With
    ``failing``, making one raises NcclError of that status instead."""
    cupy, cuda = types.ModuleType("cupy"), types.ModuleType("cupy.cuda")
    nccl, runtime = types.ModuleType("cupy.cuda.nccl"), types.ModuleType("cupy.cuda.runtime")

    class NcclError(RuntimeError):
        def __init__(self, status: int) -> None:
            super().__init__(f"NCCL error {status}")
            self.status = status

    class NcclCommunicator:
        def __init__(self, size: int, unique_id: bytes, rank: int) -> None:
            if failing is not None:
                raise NcclError(failing)
            nccl.made.append((size, unique_id, rank))

        def check_async_error(self) -> None: ...

        def destroy(self) -> None: ...

        def abort(self) -> None: ...

    class Stream:
        def __init__(self, non_blocking: bool = False) -> None: ...

        def record(self) -> Any:
            return types.SimpleNamespace(done=True)

    class Event:
        def __init__(self, block: bool = False, disable_timing: bool = False) -> None: ...

    nccl.NcclError, nccl.NcclCommunicator, nccl.made = NcclError, NcclCommunicator, []
    constants = ("FLOAT16", "FLOAT32", "FLOAT64", "INT8", "UINT8", "INT32", "INT64", "SUM", "MAX", "MIN", "PROD")
    for number, name in enumerate(constants):  # the element types and reductions the transport names
        setattr(nccl, f"NCCL_{name}", number)
    nccl.get_unique_id = lambda: b"\x00" + secrets.token_bytes(127)
    runtime.CUDARuntimeError = type("CUDARuntimeError", (RuntimeError,), {})
    cuda.nccl, cuda.runtime, cuda.Stream, cuda.Event, cupy.cuda = nccl, runtime, Stream, Event, cuda
    return {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.nccl": nccl, "cupy.cuda.runtime": runtime}


def _cupy_rank(
    rank: int, together: Any, world_size: int, timeout: float, groups: list[tuple[int, ...]], failing: int | None = None
) -> dict:
    """Start CupyNcclBackend as ``rank`` on the stand-in, make ``groups``, finalize once every
    rank has made them (``together``, a barrier: NCCL's own communicators would wait for their
    members); report the communicators made, whether torch was imported, or the error and how
    long it took. ``failing``: see :func:`_fake_cupy`. The ranks of a world of more than one
    import torch (whose store the backend uses) and meet before the clock starts: on a loaded
    machine, an import that takes seconds would otherwise count against the timeout, as the
    ranks' differences in start would."""
    fake = _fake_cupy(failing)
    sys.modules.update(fake)
    from unicoll.backends.cupy.nccl import CAPABILITIES
    from unicoll.backends.cupy.transport import CupyNcclBackend

    if world_size > 1:
        import torch.distributed  # noqa: F401

        together.wait(60)
    start = time.monotonic()
    try:
        backend = CupyNcclBackend(CAPABILITIES, rank=rank, world_size=world_size, timeout=timeout)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    for members in groups:
        backend.new_group(members)
    together.wait(30)
    backend.finalize()
    return {"made": fake["cupy.cuda.nccl"].made, "torch": "torch" in sys.modules}


def _child(
    results: Any, rank: int, together: Any, env: dict[str, str], target: Callable[..., Any], args: tuple
) -> None:
    os.environ.update(env)
    results.put((rank, target(rank, together, *args)))


def _on_processes(ranks: list[int], env: dict[str, str], target: Callable[..., Any], *args: Any) -> dict[int, Any]:
    """``target(rank, together, *args)`` on one spawned process per rank of ``ranks`` (with
    ``env``), by rank; ``together`` is a barrier of those processes."""
    ctx = multiprocessing.get_context("spawn")
    results, together = ctx.Queue(), ctx.Barrier(len(ranks))
    procs = [ctx.Process(target=_child, args=(results, rank, together, env, target, args)) for rank in ranks]
    for proc in procs:
        proc.start()
    try:
        return dict(results.get(timeout=60) for _ in ranks)
    finally:
        for proc in procs:
            proc.join(10)
            proc.kill()


def _env(world_size: int) -> dict[str, str]:
    return {"MASTER_ADDR": ADDR, "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size)}


def test_each_group_gets_its_first_members_id() -> None:
    """Every world rank makes every group in the same order; each group's members get the id
    its first member made, and a group of one needs nobody's."""
    per_rank = _on_processes([0, 1, 2], _env(3), _cupy_rank, 3, 5.0, [(1, 2), (0,), (0, 1, 2)])
    made = [per_rank[rank]["made"] for rank in (0, 1, 2)]
    world, pair, everyone = [made[0][0], made[1][0], made[2][0]], [made[1][1], made[2][1]], [m[-1] for m in made]
    alone = made[0][1]
    assert [(size, position) for size, _, position in world] == [(3, 0), (3, 1), (3, 2)]
    assert [(size, position) for size, _, position in pair] == [(2, 0), (2, 1)]
    assert [(size, position) for size, _, position in everyone] == [(3, 0), (3, 1), (3, 2)]
    assert (alone[0], alone[2]) == (1, 0) and len(made[0]) == 3, "rank 0 made the world, its own group, the last"
    ids = [{unique_id for _, unique_id, _ in group} for group in (world, pair, everyone, [alone])]
    assert [len(shared) for shared in ids] == [1, 1, 1, 1], "members of a group got different ids"
    assert len(set().union(*ids)) == 4, "two groups got the same id"
    assert all(len(unique_id) == 128 for unique_id in set().union(*ids))
    assert all(report["torch"] for report in per_rank.values()), "the store is torch's"


def test_a_world_of_one_needs_no_store_nor_torch() -> None:
    (report,) = _on_processes([0], {"WORLD_SIZE": "1"}, _cupy_rank, 1, 5.0, [(0,)]).values()
    assert [(size, rank) for size, _, rank in report["made"]] == [(1, 0), (1, 0)]
    assert report["torch"] is False


def test_init_fails_within_the_timeout_when_rank_0_never_starts() -> None:
    env = _env(2)
    (report,) = _on_processes([1], env, _cupy_rank, 2, 1.0, []).values()
    assert report["error"] == "CollectiveTimeoutError", report
    assert report["message"].startswith(
        "init on backend 'cupy-nccl' (rank 1 of 2): did not complete within the timeout of 1 s"
    )
    assert f"rank 0's store at {ADDR}:{env['MASTER_PORT']} was not listening" in report["message"]
    assert report["message"].endswith(
        f"; check that all 2 ranks start and call init() with the same MASTER_ADDR:MASTER_PORT "
        f"({ADDR}:{env['MASTER_PORT']}), and that rank 0 can be reached there"
    )
    assert report["seconds"] < 3, "the timeout is 1 s (2 s of slack for a loaded machine)"


@pytest.mark.parametrize(
    ("status", "error", "kind"),
    [(6, "PeerLostError", "a peer is gone"), (3, "CommunicationError", "the transport failed")],
)
def test_nccl_errors_are_reported_by_their_status(status, error, kind) -> None:
    """cupy-nccl's boundary: ncclRemoteError (6) is a lost peer, ncclInternalError (3) a
    failure of no particular kind."""
    (report,) = _on_processes([0], {"WORLD_SIZE": "1"}, _cupy_rank, 1, 5.0, [], status).values()
    assert report["error"] == error, report
    assert report["message"].startswith(f"init on backend 'cupy-nccl' (rank 0 of 1): {kind}")
    assert f"NCCL error {status}" in report["message"]
