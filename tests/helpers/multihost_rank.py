"""One rank of a job across machines (tests/system/test_multihost.py), started by ``unicoll run`` on each
host (gloo) or by ``mpiexec`` over the hosts (mpi):

    PYTHONPATH=tests python tests/helpers/multihost_rank.py OUT [bulk] [partition]

It runs a subset of the conformance matrix (:func:`subset`), reads the sockets it listens on,
and, when asked, times one bulk all-to-all (``bulk``) and then keeps all-to-alls going until a
transfer fails (``partition``: the test cuts a host's link once every rank has written
``OUT/ready-RANK``). It writes what it saw to ``OUT/rank-RANK.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import psutil

import unicoll as uc
from helpers.conformance import Case, cases, run_cases
from unicoll.backends.base import Capabilities

BULK_BYTES = 2**20
"""What each rank sends each other rank in the timed all-to-all."""

PARTITION_S = 60
"""How long the ranks keep transfers going while they wait for the partition."""


def subset(caps: Capabilities, world_size: int) -> list[Case]:
    """Every operator and layout of the matrix in float32 on numpy, and in int64 and bfloat16 on
    torch, each in the matrix's setting for it (sync or async, world or sub-group), and the
    top-k dispatch and combine in float32 on torch."""
    chosen = []
    for case in cases(caps, world_size):
        if case.op == "moe":
            keep = case.dtype == "float32" and case.library == "torch"
        else:
            keep = (case.library, case.dtype) in {("numpy", "float32"), ("torch", "int64"), ("torch", "bfloat16")}
        if keep:
            chosen.append(case)
    return chosen


def listening() -> list[str]:
    """The addresses of the TCP sockets this process listens on (psutil reads them from
    /proc/net/tcp and tcp6), less those it shares with its parent: on mpi, hydra's control
    socket, which mpiexec binds to every address and its proxy and every rank inherit."""
    me = psutil.Process()
    own, inherited = (
        {c.laddr for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN} for p in (me, me.parent())
    )
    return sorted(address.ip for address in own - inherited)


def bulk(rank: int) -> float:
    """Seconds one all-to-all of :data:`BULK_BYTES` to each rank takes (the slowest rank's)."""
    world = uc.get_world_size()
    x = np.full((world * BULK_BYTES // 8,), rank, dtype=np.float64)
    uc.barrier()
    start = time.monotonic()
    y = uc.alltoall_single(None, x)
    seconds = np.array([time.monotonic() - start])
    assert (y.reshape(world, -1) == np.arange(world)[:, None]).all()
    return float(uc.all_reduce(seconds, op="max")[0])


def partition(rank: int, out: Path) -> dict[str, object]:
    """Say this rank is ready, then run all-to-alls until one fails: its error, and the wall-clock
    time it came."""
    world = uc.get_world_size()
    x = np.zeros((world * BULK_BYTES // 8,), dtype=np.float64)
    uc.barrier()
    (out / f"ready-{rank}").touch()
    deadline = time.monotonic() + PARTITION_S
    while time.monotonic() < deadline:
        try:
            uc.alltoall_single(None, x)
        except uc.CommunicationError as exc:
            return {"error": type(exc).__name__, "message": str(exc), "at": time.time()}
    return {"error": None}


def main(out: Path, phases: list[str]) -> None:
    uc.init()
    rank = uc.get_rank()
    backend = uc.get_backend()
    if backend == "gloo":
        from unicoll.backends.torch.gloo import CAPABILITIES
    else:
        from unicoll.backends.mpi.mpi import CAPABILITIES
    chosen = subset(CAPABILITIES, uc.get_world_size())
    outcome = run_cases(rank, chosen)
    report: dict[str, object] = {
        "rank": rank,
        "backend": backend,
        "cases": len(outcome),
        "failures": [failure for failure in outcome.values() if failure],
        "listening": listening(),
    }
    if "bulk" in phases:
        report["bulk_s"] = bulk(rank)
    if "partition" in phases:
        report["partition"] = partition(rank, out)
    (out / f"rank-{rank}.json.tmp").write_text(json.dumps(report))
    os.replace(out / f"rank-{rank}.json.tmp", out / f"rank-{rank}.json")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
