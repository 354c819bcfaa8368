"""Check mode across ranks, async ordering, loopback-only sockets, no unpickling (memory: test_soak.py).
That check mode raises no false alarm over the whole conformance matrix: gloo's world of 3 in
tests/system/test_conformance.py runs in check mode.

The mismatches and the sockets on gloo share one world of 2 in check mode (helpers/several.py):
a world costs more to start than either case takes. The other multi-rank cases run in the
session's shared worlds."""

from __future__ import annotations

import os
import pickle
import socket
from pathlib import Path

import numpy as np
import pytest

import unicoll as uc
from helpers.several import SESSION, Case, SharedWorlds, World, share
from helpers.worlds import MISMATCHES, X, async_in_any_order, mismatches
from unicoll.backends.mpi.mpi import MpiFactory


def test_check_mode_names_the_disagreement_on_every_rank(checked_world: SharedWorlds) -> None:
    for seen in checked_world.results("gloo", "mismatches"):
        for (label, _, _, message), got in zip(MISMATCHES, seen):
            assert message in got, (label, got)


def test_async_operators_waited_in_any_order() -> None:
    assert SESSION.results(ASYNC, "reliability: async in any order") == ["ok"] * 3


def _listening(pid: str = "self") -> dict[str, str]:
    """The local address of each listening TCP socket that process ``pid`` holds, by inode,
    read from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = str(fd.readlink())
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                raw = bytes.fromhex(fields[1].split(":")[0])
                packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found[fields[9]] = socket.inet_ntop(family, packed)
    return found


def sockets_and_pickles(rank: int) -> dict[str, dict[str, str]]:
    """Run every operator with unpickling refused; return the listening sockets of this rank
    and of its parent process (on mpi, hydra's proxy, which holds what mpiexec handed down)."""

    def refuse(*args, **kwargs):
        raise AssertionError("unicoll unpickled data")

    import torch.distributed.distributed_c10d as c10d

    for module, name in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (c10d, "_unpickler")):
        if hasattr(module, name):
            setattr(module, name, refuse)
    uc.global_scatter(X, [3, 3], [3, 3])
    uc.all_gather([], X)
    uc.alltoall_single(None, X, in_split_sizes=[2, 4])
    uc.exchange_counts([1, 2])
    uc.barrier(uc.new_group([0, 1]))
    return {"own": _listening(), "parent": _listening(str(os.getppid()))}


LOOPBACK = ("127.0.0.1", "::1")


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listening sockets from /proc")
def test_loopback_only_and_no_unpickling(checked_world: SharedWorlds) -> None:
    per_rank = checked_world.results("gloo", "sockets and pickles")
    assert per_rank[0]["own"], "rank 0 hosts the rendezvous store, so it listens somewhere"
    for sockets in per_rank:
        assert all(a in LOOPBACK for a in sockets["own"].values()), sockets


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listening sockets from /proc")
def test_loopback_only_and_no_unpickling_on_mpi() -> None:
    """What MPI itself opens (UCX, MPICH's network layer) listens on loopback only; the one
    socket on every interface is hydra's control port, which mpiexec binds to the wildcard
    address (no option changes that) and its proxy and the ranks inherit (docs/mpi.md)."""
    reason = MpiFactory().probe()  # here, not at import: the gloo ranks import this module, and probing starts MPI
    if reason is not None:
        pytest.skip(f"backend mpi is not usable here: {reason}")
    per_rank = SESSION.results(SOCKETS_ON_MPI, "reliability: sockets and pickles")
    for sockets in per_rank:
        own, inherited = sockets["own"], sockets["parent"]
        assert any(a in LOOPBACK for a in own.values()), f"MPI listens somewhere: {own}"
        elsewhere = {inode: a for inode, a in own.items() if a not in LOOPBACK}
        assert elsewhere.items() <= inherited.items(), f"the rank's own sockets: {own}; its parent's: {inherited}"
        assert set(elsewhere.values()) <= {"0.0.0.0", "::"}, elsewhere


@pytest.fixture(scope="module")
def checked_world() -> SharedWorlds:
    """Gloo, 2 ranks, check mode: the mismatches, then the sockets (which refuses unpickling
    in the ranks from then on)."""
    both = [Case("mismatches", mismatches), Case("sockets and pickles", sockets_and_pickles)]
    return SharedWorlds({"gloo": World(2, both, {"backend": "gloo", "env": {"UNICOLL_CHECK": "1"}})})


def init_again(rank: int) -> list[float]:
    """A world can leave and join again: finalize() then init() on every rank."""
    first = uc.all_gather(None, np.array([rank], np.float32)).tolist()
    uc.finalize()
    assert not uc.is_initialized()
    uc.init("gloo")
    return first + uc.all_gather(None, np.array([rank + 10], np.float32)).tolist()


def test_init_after_finalize_in_a_world() -> None:
    assert SESSION.results(INIT_AGAIN, "reliability: init again") == [[0.0, 1.0, 10.0, 11.0]] * 2


# In the session's shared gloo worlds (helpers/several.py); init_again starts a new session: last.
ASYNC = share("gloo", 3, [Case("reliability: async in any order", async_in_any_order)])
INIT_AGAIN = share("gloo", 2, [Case("reliability: init again", init_again)], last=True)
# In the session's shared MPI world of 2 in check mode, last: it refuses unpickling from then on.
SOCKETS_ON_MPI = share("mpi", 2, [Case("reliability: sockets and pickles", sockets_and_pickles)], check=True, last=True)
