"""Transport errors by type: the front end reports a backend's TransportError kinds, and nothing
else, as CommunicationErrors; the torch backend converts torch's exceptions at its boundary,
on every way in (checked on gloo with a world of one, torch's calls replaced by failing ones)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import unicoll as uc
from unicoll.backends.torch import compat
from unicoll.errors import (
    TransportError,
    TransportPeerLostError,
    TransportTimeoutError,
    converting,
    reported,
    translated,
)

GROUP = "Group(ranks=[0, 1])"


@pytest.mark.parametrize(
    ("kind", "error", "message"),
    [
        (
            TransportPeerLostError,
            uc.PeerLostError,
            "barrier on Group(ranks=[0, 1]): a peer is gone (its process exited or closed the connection): x",
        ),
        (
            TransportTimeoutError,
            uc.CollectiveTimeoutError,
            "barrier on Group(ranks=[0, 1]): did not complete within the timeout of 5 s (init(timeout=...) or "
            "$UNICOLL_TIMEOUT); a peer may not have called it: x",
        ),
        (TransportError, uc.CommunicationError, "barrier on Group(ranks=[0, 1]): the transport failed: x"),
    ],
)
def test_the_kind_is_the_type(kind, error, message) -> None:
    made = reported(kind("x\nmore lines"), "barrier", GROUP, 5.0)
    assert type(made) is error and str(made) == message


def test_words_make_no_kind() -> None:
    made = reported(TransportError("connection closed by peer; timed out"), "barrier", GROUP, 5.0)
    assert type(made) is uc.CommunicationError


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("[third_party/gloo/gloo/pair.cc:1] Connection closed by peer; timed out"),
        ValueError("bad input"),
        uc.CollectiveTimeoutError("barrier on ...: not complete yet"),
    ],
)
def test_translated_passes_everything_but_transport_errors(exc) -> None:
    with pytest.raises(type(exc)) as info, translated("barrier", GROUP, 5.0):
        raise exc
    assert info.value is exc


def test_translated_chains_the_transport_error() -> None:
    cause = TransportTimeoutError("mpi: barrier timed out")
    with pytest.raises(uc.CollectiveTimeoutError) as info, translated("barrier", GROUP, 5.0):
        raise cause
    assert info.value.__cause__ is cause


class _LibraryError(Exception):
    pass


@converting(lambda exc: TransportPeerLostError(str(exc)) if isinstance(exc, _LibraryError) else None)
def _boundary(exc: Exception) -> None:
    raise exc


@pytest.mark.parametrize("exc", [ValueError("a bug"), TransportTimeoutError("already converted")])
def test_a_boundary_passes_what_it_does_not_convert(exc) -> None:
    with pytest.raises(type(exc)) as info:
        _boundary(exc)
    assert info.value is exc


def test_a_boundary_converts_and_chains() -> None:
    cause = _LibraryError("peer closed")
    with pytest.raises(TransportPeerLostError, match="^peer closed$") as info:
        _boundary(cause)
    assert info.value.__cause__ is cause


# -- the torch backend's boundary ---------------------------------------------------------------


PEER_GONE = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"


class _FailedWork:
    """A torch work that failed with ``error``."""

    def __init__(self, error: Exception) -> None:
        self._error = error

    def wait(self, *args) -> None:
        raise self._error

    def is_completed(self) -> bool:
        return True


@pytest.fixture
def world_of_one(clean_env) -> None:
    """unicoll on gloo, as the only rank of its world (finalized by ``clean_env``)."""
    uc.init("gloo", timeout=5)


def _fail(monkeypatch, function: str, error: Exception, at: str) -> None:
    """Make ``torch.distributed.<function>`` raise ``error`` when called (``at="launch"``) or
    return a work that raises it when waited for (``at="wait"``)."""

    def failing(*args, **kwargs):
        if at == "launch":
            raise error
        return _FailedWork(error)

    monkeypatch.setattr(compat if hasattr(compat, function) else dist, function, failing)  # compat: renamed in 2.13


CALLS = {
    "alltoall_single": ("all_to_all_single", lambda: uc.alltoall_single(None, np.ones(2))),
    "alltoall_single(sync_op=False)": (
        "all_to_all_single",
        lambda: uc.alltoall_single(None, np.ones(2), sync_op=False).wait(),
    ),
    "alltoall_single(out)": ("all_to_all_single", lambda: uc.alltoall_single(np.zeros(2), np.ones(2))),
    "all_gather": ("all_gather_single", lambda: uc.all_gather(None, np.ones(2))),
    "global_scatter": ("all_to_all_single", lambda: uc.global_scatter(np.ones(2), [2], [2])),
    "exchange_counts": ("all_to_all_single", lambda: uc.exchange_counts([2])),
    "barrier": ("barrier", uc.barrier),
    "new_group": ("new_group", lambda: uc.new_group([0])),
    "all_reduce": ("all_reduce", lambda: uc.all_reduce(np.ones(2))),
    "all_reduce(sync_op=False)": ("all_reduce", lambda: uc.all_reduce(np.ones(2), "avg", sync_op=False).wait()),
    "reduce_scatter": ("reduce_scatter_single", lambda: uc.reduce_scatter(None, np.ones(2))),
    "broadcast": ("broadcast", lambda: uc.broadcast(np.ones(2), 0)),
    "reduce": ("all_reduce", lambda: uc.reduce(np.ones(2), 0)),
}


@pytest.mark.parametrize(
    ("call", "at"),
    [(call, at) for call in CALLS for at in ("launch", "wait") if (call, at) != ("new_group", "wait")],
)
def test_torch_failures_are_reported_by_kind(world_of_one, monkeypatch, call, at) -> None:
    """Raised where torch launches the call or where the call is waited for (new_group has no work)."""
    function, run = CALLS[call]
    _fail(monkeypatch, function, RuntimeError(PEER_GONE), at)
    op = call.split("(")[0]
    with pytest.raises(uc.PeerLostError) as info:
        run()
    assert str(info.value) == (
        f"{op} on Group(ranks=[0]): a peer is gone (its process exited or closed the connection): {PEER_GONE}"
    )
    assert isinstance(info.value.__cause__, TransportPeerLostError)
    assert str(info.value.__cause__.__cause__) == PEER_GONE  # torch's own exception, unchanged


@pytest.mark.parametrize("call", list(CALLS))
def test_other_exceptions_from_torch_pass_unchanged(world_of_one, monkeypatch, call) -> None:
    function, run = CALLS[call]
    bug = RuntimeError("a bug, whose text says it timed out and the connection closed by peer")
    _fail(monkeypatch, function, bug, "launch")
    with pytest.raises(RuntimeError) as info:
        run()
    assert info.value is bug


def test_a_store_timeout_in_new_group(world_of_one, monkeypatch) -> None:
    _fail(monkeypatch, "new_group", dist.DistStoreError("wait timeout after 5000ms, keys: /0//1"), "launch")
    with pytest.raises(uc.CollectiveTimeoutError, match=r"^new_group on Group\(ranks=\[0\]\): did not complete"):
        uc.new_group([0])


def test_a_backward_pass_reports_like_the_forward_one(world_of_one, monkeypatch) -> None:
    x = torch.ones(2, 1, requires_grad=True)
    y = uc.alltoall_single(None, x)
    _fail(monkeypatch, "all_to_all_single", RuntimeError(PEER_GONE), "wait")
    with pytest.raises(
        uc.PeerLostError, match=r"^alltoall_single \(backward\) on Group\(ranks=\[0\]\): a peer is gone"
    ):
        y.sum().backward()


def test_an_in_place_backward_pass_reports_like_the_forward_one(world_of_one, monkeypatch) -> None:
    x = torch.ones(2, 1, requires_grad=True)
    y = uc.all_reduce(x * 1)
    _fail(monkeypatch, "all_reduce", RuntimeError(PEER_GONE), "wait")
    with pytest.raises(uc.PeerLostError, match=r"^all_reduce \(backward\) on Group\(ranks=\[0\]\): a peer is gone"):
        y.sum().backward()
