"""Jobs across machines: two hosts made of network namespaces (helpers/netns.py), two ranks on
each, started as they would be on two machines: ``unicoll run --nnodes 2 --node-rank K`` on each
host (gloo), or one ``mpiexec`` whose hydra starts the ranks over the hosts (mpi). Skipped, with
the reason, where namespaces cannot be made (not root, no iproute2).

The hosts share this machine's host name, which resolves to a loopback address on many machines
(in containers, clouds, this one): gloo must listen where a host reaches ``MASTER_ADDR`` from,
not where its name points. Each job runs a subset of the
conformance matrix (helpers/multihost_rank.py); the gloo job also runs over a slowed link, then
loses that link in the middle of its transfers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import NamedTuple

import pytest

from helpers import netns
from helpers.forked import start_script
from helpers.multihost_rank import subset
from unicoll.backends.mpi.mpi import MpiFactory
from unicoll.backends.torch.gloo import CAPABILITIES

REASON = netns.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"needs network namespaces: {REASON}")

TESTS = Path(__file__).resolve().parents[1]
RANK = TESTS / "helpers" / "multihost_rank.py"
PORT = 29500  # free: nothing else runs in the namespaces
TIMEOUT = 3.0
RATE_MBIT = 40


@pytest.fixture
def network():
    """Two hosts, removed with whatever still runs on them when the test ends."""
    with netns.Network(2) as made:
        yield made


def _env(**extra: str) -> dict[str, str]:
    """The ranks' environment: helpers importable, the timeout, one thread each."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "UNICOLL_TIMEOUT": str(TIMEOUT),
        "UNICOLL_BACKEND": "gloo",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


class Job(NamedTuple):
    """A process started on a host, its output going to ``log`` (no pipe to fill up)."""

    proc: subprocess.Popen | BaseProcess
    log: Path


def _start(network: netns.Network, host: int, argv: list[str], env: dict[str, str], log: Path) -> Job:
    """Run ``argv`` on ``host`` with ``env``, its output to ``log``."""
    with open(log, "w") as out:
        proc = subprocess.Popen(network.command(host, argv), env=env, stdout=out, stderr=subprocess.STDOUT)
    return Job(proc, log)


def _fork(network: netns.Network, host: int, script: Path, args: list[str], env: dict[str, str], log: Path) -> Job:
    """Run ``python script *args`` on ``host`` with ``env``, its output to ``log``, forked from
    the suite's server (helpers/forked.py: torch imported there once, not by each rank)."""
    return Job(start_script(script, args, env, log, netns=network.namespaces[host]), log)


def _exit_code(proc: subprocess.Popen | BaseProcess, seconds: float) -> int | None:
    """``proc``'s exit code once it exits within ``seconds``, else None."""
    if isinstance(proc, subprocess.Popen):
        try:
            return proc.wait(seconds)
        except subprocess.TimeoutExpired:
            return None
    proc.join(seconds)
    return proc.exitcode


def _nodes(network: netns.Network, argv: list[str], envs: list[dict[str, str]], logs: Path) -> list[Job]:
    """``unicoll run -n 2 ARGV`` on each host, as node K of 2, meeting on the first host."""
    node = [sys.executable, "-m", "unicoll", "run", "-n", "2", "--nnodes", "2"]
    rendezvous = ["--master-addr", network.addresses[0], "--master-port", str(PORT)]
    return [
        _start(network, host, [*node, "--node-rank", str(host), *rendezvous, *argv], env, logs / f"node{host}.log")
        for host, env in enumerate(envs)
    ]


def _finish(jobs: list[Job], within: float) -> None:
    """Return once every job has exited 0, which must be within ``within`` seconds; else fail
    with its output. The jobs are killed either way."""
    deadline = time.monotonic() + within
    try:
        for job in jobs:
            code = _exit_code(job.proc, max(deadline - time.monotonic(), 0.1))
            if code is None:
                pytest.fail(f"the job of {job.log.name} still ran after {within} s: {job.log.read_text()[-3000:]}")
            assert code == 0, job.log.read_text()[-3000:]
    finally:
        for job in jobs:
            job.proc.kill()


def _reports(out: Path, world_size: int) -> list[dict]:
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(world_size)]


def _no_process_left(network: netns.Network) -> None:
    """Nothing runs on the hosts any more (within a second of the jobs' end: no orphan)."""
    deadline = time.monotonic() + 1
    while network.pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert network.pids() == []


def test_gloo_across_hosts_then_a_partition(network, tmp_path) -> None:
    """2 hosts x 2 ranks on gloo, the second host's link slowed to 40 Mbit/s and, once every
    rank runs all-to-alls, cut: the conformance subset passes, each rank listens only on its
    host's address (the first host chose it from MASTER_ADDR; the second names it with
    GLOO_SOCKET_IFNAME), a timed all-to-all takes as long as the link says, and after the cut
    every rank gets CollectiveTimeoutError or PeerLostError within the timeout, and exits."""
    network.limit(1, f"{RATE_MBIT}mbit")
    envs = [_env(), _env(GLOO_SOCKET_IFNAME=netns.DEVICE)]
    jobs = _nodes(network, [str(RANK), str(tmp_path), "bulk", "partition"], envs, tmp_path)
    deadline = time.monotonic() + 90
    while len(list(tmp_path.glob("ready-*"))) < 4:
        if time.monotonic() > deadline or any(job.proc.poll() is not None for job in jobs):
            _finish(jobs, 0)
            pytest.fail("the ranks did not get ready")
        time.sleep(0.05)
    time.sleep(0.3)  # into the next all-to-all
    network.cut(1)
    cut_at = time.time()
    _finish(jobs, TIMEOUT + 10)
    reports = _reports(tmp_path, 4)
    assert reports[1]["cases"] == len(subset(CAPABILITIES, 4)), "rank 1, in the world and the sub-group, ran them all"
    for report in reports:
        rank = report["rank"]
        assert report["failures"] == [], report["failures"][:1]
        assert report["listening"], f"rank {rank} listens nowhere"
        assert set(report["listening"]) == {network.addresses[rank // 2]}, report
        partition = report["partition"]
        assert partition["error"] in ("CollectiveTimeoutError", "PeerLostError"), partition
        assert partition["message"].startswith("alltoall_single on Group(ranks=[0, 1, 2, 3]): "), partition
        assert partition["at"] - cut_at < TIMEOUT + 2, partition
    crossing = 2 * 2 * 2**20 * 8  # bits from the second host's 2 ranks to the first host's 2 (and as many back)
    assert crossing / (RATE_MBIT * 1e6) * 0.8 < reports[0]["bulk_s"] < 30, reports[0]["bulk_s"]
    _no_process_left(network)


INIT_ONLY = """
import json, sys, time
import torch.distributed  # before the clock: it times init, not imports
import unicoll as uc
start = time.monotonic()
try:
    uc.init()
    error, message = None, None
except Exception as exc:
    error, message = type(exc).__name__, str(exc)
rank = int(__import__("os").environ["RANK"])
with open(f"{sys.argv[1]}/rank-{rank}.json", "w") as f:
    json.dump({"rank": rank, "error": error, "message": message, "seconds": time.monotonic() - start}, f)
"""


def test_init_ends_within_its_timeout_when_a_peer_cannot_be_reached(network, tmp_path) -> None:
    """Every host's gloo on loopback (GLOO_SOCKET_IFNAME=lo, honoured): no rank can reach the
    other host's ranks. Every rank's init fails within its timeout, naming what gloo could not
    reach and where each rank listens (before, the ranks that waited for a connection waited five
    times the timeout, and others blamed a finalized session). The ranks start with the variables
    any launcher sets, forked from the suite's server into their hosts."""
    script = tmp_path / "init_only.py"
    script.write_text(INIT_ONLY)
    jobs = []
    for rank in range(4):
        world = {"RANK": str(rank), "WORLD_SIZE": "4", "MASTER_ADDR": network.addresses[0], "MASTER_PORT": str(PORT)}
        env = _env(GLOO_SOCKET_IFNAME="lo", **world)
        jobs.append(_fork(network, rank // 2, script, [str(tmp_path)], env, tmp_path / f"{rank}.log"))
    _finish(jobs, 5 * TIMEOUT + 15)
    for report in _reports(tmp_path, 4):
        assert report["error"] in ("CollectiveTimeoutError", "CommunicationError"), report
        assert report["seconds"] < TIMEOUT + 1.5, report
        assert f"init on backend 'gloo' (rank {report['rank']} of 4): " in report["message"]
        assert "could not connect with every peer (Gloo connectFullMesh failed" in report["message"]
        assert "ranks 0-3 on interface lo (GLOO_SOCKET_IFNAME): each rank must reach every other's" in report["message"]
    _no_process_left(network)


GATHER = """
import json, sys
import numpy as np
import unicoll as uc
from helpers.multihost_rank import listening
uc.init()
rank = uc.get_rank()
gathered = uc.all_gather(None, np.array([rank])).tolist()
with open(f"{sys.argv[1]}/rank-{rank}.json", "w") as f:
    json.dump({"rank": rank, "gathered": gathered, "listening": listening()}, f)
"""


def test_torchrun_across_hosts(network, tmp_path) -> None:
    """torchrun's own multi-node flags on each host (a rank on each): init takes torchrun's
    store, and gloo listens on the host's address there too (on a04b29f, init failed:
    ``Gloo connectFullMesh failed ... remote=[127.0.0.1]``)."""
    script = tmp_path / "gather.py"
    script.write_text(GATHER)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    torchrun += ["--master-addr", network.addresses[0], "--master-port", str(PORT)]
    argv = [[*torchrun, "--node-rank", str(host), str(script), str(tmp_path)] for host in range(2)]
    _finish([_start(network, host, argv[host], _env(), tmp_path / f"node{host}.log") for host in range(2)], 60)
    for report in _reports(tmp_path, 2):
        assert report["gathered"] == [0, 1]
        assert set(report["listening"]) == {network.addresses[report["rank"]]}, report
    _no_process_left(network)


MPI_REASON = MpiFactory().probe() if REASON is None else REASON


@pytest.mark.skipif(MPI_REASON is not None, reason=f"mpi: {MPI_REASON}")
def test_mpi_across_hosts(network, tmp_path) -> None:
    """2 hosts x 2 ranks on mpi: hydra starts the second host's ranks through the namespace
    (``-launcher-exec``), UCX stays on TCP over the hosts' link: the conformance subset passes
    and each rank's own sockets (UCX's) are on its host's address alone."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    hosts = ",".join(f"{address}:2" for address in network.addresses)
    launcher = network.hydra_launcher(tmp_path)
    job = [str(mpiexec), "-launcher", "ssh", "-launcher-exec", str(launcher), "-hosts", hosts]
    job += ["-localhost", network.addresses[0], "-n", "4"]
    for name, value in {"UCX_TLS": "tcp", "UCX_NET_DEVICES": netns.DEVICE, "UNICOLL_BACKEND": "mpi"}.items():
        job += ["-genv", name, value]
    # nothing here times out on purpose; MPI's waits spin, and 4 ranks share 2 cores
    env = _env(UNICOLL_TIMEOUT="60")
    _finish([_start(network, 0, [*job, sys.executable, str(RANK), str(tmp_path)], env, tmp_path / "mpiexec.log")], 120)
    reports = _reports(tmp_path, 4)
    assert reports[1]["cases"] == len(subset(MpiFactory.capabilities, 4))
    for report in reports:
        assert report["backend"] == "mpi"
        assert report["failures"] == [], report["failures"][:1]
        assert set(report["listening"]) == {network.addresses[report["rank"] // 2]}, report
    _no_process_left(network)
