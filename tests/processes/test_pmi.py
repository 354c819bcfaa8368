"""unicoll.testing.pmi: the PMI-1 server through which MPI ranks forked by ``spawn`` find each
other (the protocol against a client written here, and real MPICH ranks of 1 to 4), and the
MPI jobs that ``start_method="spawn"`` still starts with mpiexec."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import psutil
import pytest

import unicoll as uc
from unicoll.backends.mpi.mpi import MpiFactory
from unicoll.testing import SpawnError
from unicoll.testing.pmi import PmiServer, serves_this_mpi

REASON = MpiFactory().probe()
needs_mpich = pytest.mark.skipif(
    REASON is not None or not serves_this_mpi(), reason=f"MPICH is not usable here: {REASON or 'not MPICH'}"
)


class Client:
    """One rank's end of the protocol, as MPICH's simple PMI speaks it."""

    def __init__(self, server: PmiServer, rank: int) -> None:
        self._lines = server.rank_sockets[rank].makefile("rwb", buffering=0)

    def ask(self, line: str) -> dict[str, str]:
        self._lines.write(f"{line}\n".encode())
        answer = self._lines.readline().decode()
        return dict(field.split("=", 1) for field in answer.split())


def test_the_server_answers_what_mpich_asks() -> None:
    server = PmiServer(2)
    try:
        first, second = Client(server, 0), Client(server, 1)
        assert first.ask("cmd=init pmi_version=1 pmi_subversion=1") == {
            "cmd": "response_to_init", "pmi_version": "1", "pmi_subversion": "1", "rc": "0"}  # fmt: skip
        assert first.ask("cmd=get_maxes")["rc"] == "0"
        kvsname = first.ask("cmd=get_my_kvsname")["kvsname"]
        assert second.ask("cmd=get_my_kvsname")["kvsname"] == kvsname  # one job, one space
        assert first.ask(f"cmd=get kvsname={kvsname} key=PMI_process_mapping")["value"] == "(vector,(0,1,2))"
        assert first.ask(f"cmd=put kvsname={kvsname} key=card-0 value=tcp://a=b")["rc"] == "0"
        assert second.ask(f"cmd=get kvsname={kvsname} key=card-0")["value"] == "tcp://a=b"  # '=' kept
        assert second.ask(f"cmd=get kvsname={kvsname} key=absent")["rc"] == "-1"
        assert first.ask("cmd=job-getid")["rc"] == "-1"  # answered, not left waiting
        waited: list[dict[str, str]] = []
        behind = threading.Thread(target=lambda: waited.append(second.ask("cmd=barrier_in")))
        behind.start()
        behind.join(0.2)
        assert waited == []  # rank 1 waits for rank 0
        assert first.ask("cmd=barrier_in") == {"cmd": "barrier_out", "rc": "0"}
        behind.join(10)
        assert waited == [{"cmd": "barrier_out", "rc": "0"}]
        assert first.ask("cmd=finalize") == {"cmd": "finalize_ack", "rc": "0"}
    finally:
        server.close()


def test_close_wakes_a_rank_left_in_a_barrier() -> None:
    """A peer that died before the barrier: the rank waiting there sees its socket close, and
    ``close`` returns, its threads ended."""
    server = PmiServer(2)
    waiting = Client(server, 0)
    answers: list[dict[str, str]] = []
    behind = threading.Thread(target=lambda: answers.append(waiting.ask("cmd=barrier_in")))
    behind.start()
    behind.join(0.2)
    server.close()
    behind.join(10)
    assert answers == [{}]  # end of file: no barrier_out
    assert not [t for t in threading.enumerate() if t.name.startswith("unicoll-pmi")]


def world_facts(rank: int) -> tuple[int, int, float, str]:
    """The rank and size MPI sees, a sum across the world, and what started this process."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    total = uc.all_reduce(np.array([rank + 1.0]))[0]
    parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return world.Get_rank(), world.Get_size(), float(total), parent


@needs_mpich
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_forked_ranks_form_an_mpi_world(size: int) -> None:
    facts = uc.testing.spawn(world_facts, size, backend="mpi")
    assert [fact[:3] for fact in facts] == [(rank, size, size * (size + 1) / 2) for rank in range(size)]
    assert all("forkserver" in fact[3] for fact in facts), facts  # no launcher between


@needs_mpich
def test_start_method_spawn_starts_an_mpi_job() -> None:
    facts = uc.testing.spawn(world_facts, 2, backend="mpi", start_method="spawn")
    assert [fact[:3] for fact in facts] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert all("hydra_pmi_proxy" in fact[3] for fact in facts), facts


STARTS_MPI = """
from mpi4py import MPI  # starts MPI in every process that imports this script

import unicoll as uc


def rank_of(rank):
    return rank


if __name__ == "__main__":
    uc.testing.spawn(rank_of, 2, backend="mpi")
"""


@needs_mpich
def test_a_running_script_that_started_mpi_is_refused(tmp_path) -> None:
    """A rank that imports such a script starts MPI as a world of one before it can be told its
    place: it is refused with what to do, instead of a world that MPI does not see."""
    (tmp_path / "job.py").write_text(STARTS_MPI)
    done = subprocess.run([sys.executable, "job.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert SpawnError.__name__ in done.stderr
    assert "MPI started before the rank joined its world (the running script imports mpi4py.MPI as it" in done.stderr


def die_in_a_collective(rank: int, folder: str) -> None:
    """Each rank notes its pid; rank 1 then dies while rank 0 waits for it in an all-reduce."""
    (Path(folder) / str(rank)).write_text(str(os.getpid()))
    if rank == 1:
        os._exit(3)
    uc.all_reduce(np.ones(4))


@needs_mpich
def test_a_rank_that_dies_ends_the_forked_world_and_leaves_no_process(tmp_path) -> None:
    """Without a launcher to stop the job, spawn stops the rank left waiting, and the PMI
    server's threads end with it."""
    with pytest.raises(SpawnError, match="rank 1 exited with code 3") as info:
        uc.testing.spawn(die_in_a_collective, 2, str(tmp_path), backend="mpi", timeout=60)
    assert info.value.exitcode == 3
    pids = [int((tmp_path / str(rank)).read_text()) for rank in range(2)]
    assert [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"] == []
    assert not [t for t in threading.enumerate() if t.name.startswith("unicoll-pmi")]
