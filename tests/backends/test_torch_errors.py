"""What torch 2.13 raises for each fault of its store and of gloo's process group, measured with
raw torch.distributed (no unicoll in the way), and the kind that
:func:`unicoll.backends.torch.errors.torch_failure` gives each: the facts its docstring states."""

from __future__ import annotations

import multiprocessing
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from unicoll.backends.torch.errors import torch_failure
from unicoll.errors import TransportError, TransportPeerLostError, TransportTimeoutError
from unicoll.launch.local import free_port
from unicoll.testing.spawn import PRELOAD


def _kind(exc: Exception) -> str | None:
    """The name of the TransportError class that ``exc`` becomes, or None."""
    error = torch_failure(exc)
    return None if error is None else type(error).__name__


def _recorded(label: str, call, records: list) -> None:
    """Run ``call`` and record what it raised: its type and the kind it becomes."""
    try:
        call()
    except Exception as exc:
        records.append((label, type(exc).__name__, _kind(exc), str(exc).splitlines()[0]))
    else:
        records.append((label, None, None, ""))


def _gloo_faults(rank: int, port: int, results: multiprocessing.Queue) -> None:
    """Rank ``rank`` of a raw gloo world of 2 whose collectives time out after 1 s: rank 1 is
    late, then absent, then gone; rank 0 records what each fault raises."""
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=1))
    spare = dist.new_group([0, 1], timeout=timedelta(seconds=30))  # for after the world's pairs time out
    x, out, records = torch.arange(4.0), torch.empty(4), []
    _recorded("sizes that differ", lambda: dist.all_to_all_single(torch.empty(3), x), records)
    _recorded("dtypes that differ", lambda: dist.all_to_all_single(out.long(), x), records)
    if rank == 1:
        time.sleep(0.3)
        dist.all_to_all_single(out, x)  # late for rank 0's first wait
        time.sleep(1.5)  # absent from rank 0's next two calls
        dist.barrier(group=spare)
        os._exit(0)  # gone
    work = dist.all_to_all_single(out, x, async_op=True)
    _recorded("Work.wait(timeout) runs out", lambda: work.wait(timedelta(seconds=0.05)), records)
    work.wait()
    _recorded("gloo's timeout", lambda: dist.all_to_all_single(out, x), records)
    _recorded("after gloo's timeout", lambda: dist.all_to_all_single(out, x), records)
    dist.barrier(group=spare)
    time.sleep(0.5)
    _recorded("a peer is gone", lambda: dist.all_to_all_single(out, x, group=spare), records)
    results.put(records)
    results.close()
    results.join_thread()  # sent before the exit
    os._exit(0)  # torch's teardown of a broken process group can hang


def test_gloo_faults() -> None:
    ctx = multiprocessing.get_context("forkserver")  # the server uc.testing.spawn keeps: torch imported once
    ctx.set_forkserver_preload(list(PRELOAD))
    results, port = ctx.Queue(), free_port()
    ranks = [ctx.Process(target=_gloo_faults, args=(rank, port, results)) for rank in (0, 1)]
    for proc in ranks:
        proc.start()
    try:
        records = results.get(timeout=60)
    finally:
        for proc in ranks:
            proc.join(10)
            proc.kill()
    found = {label: (error, kind) for label, error, kind, _ in records}
    assert found == {
        "sizes that differ": ("RuntimeError", "TransportError"),  # gloo's enforce: unicoll validates first
        "dtypes that differ": ("ValueError", None),
        "Work.wait(timeout) runs out": ("RuntimeError", "TransportTimeoutError"),
        "gloo's timeout": ("RuntimeError", "TransportTimeoutError"),
        "after gloo's timeout": ("RuntimeError", "TransportTimeoutError"),
        "a peer is gone": ("RuntimeError", "TransportPeerLostError"),
    }, records
    texts = {label: text for label, _, _, text in records}
    assert (
        "gloo/transport/tcp/pair.cc" in texts["a peer is gone"]
        and "Connection closed by peer" in texts["a peer is gone"]
    )
    assert texts["after gloo's timeout"] == "Application timeout caused pair closure"


def test_store_faults() -> None:
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=0.3), wait_for_workers=False)
    with pytest.raises(dist.DistStoreError) as info:
        master.get("never set")
    assert type(torch_failure(info.value)) is TransportTimeoutError

    client = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=5))
    del master  # the host of the store is gone while the client waits
    with pytest.raises(dist.DistNetworkError, match="Connection was likely closed") as info:
        client.get("never set")
    assert type(torch_failure(info.value)) is TransportPeerLostError

    start = time.monotonic()
    with pytest.raises(dist.DistNetworkError, match="timed out") as info:
        dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=0.2))
    assert type(torch_failure(info.value)) is TransportTimeoutError
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(
    "exc",
    [RuntimeError("a bug: connection closed by peer, timed out"), ValueError("gloo/ bad input"), KeyError("gloo/")],
)
def test_other_exceptions_are_no_transport_failures(exc) -> None:
    """Only gloo's own exceptions are read; words alone make no transport failure."""
    assert torch_failure(exc) is None


def test_a_transport_error_of_no_particular_kind() -> None:
    error = torch_failure(dist.DistBackendError("NCCL error: unhandled system error"))
    assert type(error) is TransportError and str(error) == "NCCL error: unhandled system error"
