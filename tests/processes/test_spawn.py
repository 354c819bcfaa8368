"""unicoll.testing.spawn: results in rank order, the failing rank's error, no hangs."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import unicoll as uc
from helpers.cpu_backends import MPI_REASON
from unicoll.testing import SpawnError, SpawnTimeout


def report(rank: int, name: str) -> tuple:
    return rank, uc.get_backend(), uc.get_world_size(), os.environ.get(name)


def test_results_in_rank_order_with_env() -> None:
    out = uc.testing.spawn(report, 3, "UNICOLL_TEST_MARK", backend="gloo", env={"UNICOLL_TEST_MARK": "here"})
    assert out == [(r, "gloo", 3, "here") for r in range(3)]


SCRIPT = """
import os
import sys

import unicoll as uc


def where(rank, offset):
    return rank + offset, uc.get_backend(), os.path.basename(os.getcwd()), sys.argv[1:]


if __name__ == "__main__":
    print(uc.testing.spawn(where, 2, 10, backend=sys.argv[1]))
"""


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_function_of_the_running_script(backend: str, tmp_path) -> None:
    """``fn`` defined in the script that calls spawn (``__main__``), run from its folder: each
    rank imports the script as multiprocessing's children do, with the parent's argv and working
    directory (before, on mpi: "the MPI job exited with code 1")."""
    (tmp_path / "job.py").write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "job.py", backend], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    folder = tmp_path.name
    assert done.stdout.strip() == str([(10, backend, folder, [backend]), (11, backend, folder, [backend])])


def environment(rank: int, names: tuple[str, ...]) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_ranks_get_the_environment_of_the_call(start_method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank forked from the server (started by an earlier world, with the environment of then)
    sees this process's environment as of the call: a variable set since, one removed since."""
    monkeypatch.setenv("UNICOLL_TEST_GONE", "here")
    names = ("UNICOLL_TEST_GONE", "UNICOLL_TEST_NEW", "UNICOLL_TEST_GIVEN")
    uc.testing.spawn(environment, 1, names, backend="gloo", start_method=start_method)  # the server is running
    monkeypatch.delenv("UNICOLL_TEST_GONE")
    monkeypatch.setenv("UNICOLL_TEST_NEW", "set later")
    seen = uc.testing.spawn(environment, 2, names, backend="gloo", env={"UNICOLL_TEST_GIVEN": "given"},
                            start_method=start_method)  # fmt: skip
    assert seen == [{"UNICOLL_TEST_GONE": None, "UNICOLL_TEST_NEW": "set later", "UNICOLL_TEST_GIVEN": "given"}] * 2


def test_an_unknown_start_method_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"spawn: start_method: expected 'forkserver' or 'spawn' \(or None\), got 'fork'"
    ):
        uc.testing.spawn(environment, 2, (), backend="gloo", start_method="fork")


def threads(rank: int) -> tuple[str | None, int]:
    return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_ranks_get_their_share_of_the_cores(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """As ``unicoll run`` gives them (before, every rank of a spawned world ran one torch thread
    per core: on 2 cores a 2-rank top-2 MoE step of 256 tokens took 95 ms instead of 2.3 ms).
    torch is loaded before a gloo rank's environment is set (this module imports it), so the
    rank sets torch's thread count itself."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = os.cpu_count() or 1
    share = max(1, cores // 2)
    assert uc.testing.spawn(threads, 2, backend=backend) == [(str(share), share)] * 2
    given = uc.testing.spawn(threads, 2, backend=backend, env={"OMP_NUM_THREADS": "2"})
    assert given == [("2", min(2, cores))] * 2


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
    with pytest.raises(SpawnTimeout, match=r"ranks \[0, 1\] had not finished after 1 s"):
        uc.testing.spawn(sleep_forever, 2, backend="gloo", timeout=1)
    assert time.monotonic() - start < 20


def pid_and_parent(rank: int) -> tuple[int, int, str | None]:
    return os.getpid(), os.getppid(), os.environ.get("UNICOLL_TEST_MARK")


def _command_line(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


@pytest.mark.skipif(MPI_REASON is not None, reason=f"mpi: {MPI_REASON}")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_mpi_ranks_are_forked_from_one_server_unless_spawn_is_asked() -> None:
    """Each MPI rank is forked from one server that imported torch once, kept for the next job
    and given each job's environment; ``start_method="spawn"`` starts fresh interpreters."""
    first = uc.testing.spawn(pid_and_parent, 2, backend="mpi", env={"UNICOLL_TEST_MARK": "first"})
    again = uc.testing.spawn(pid_and_parent, 2, backend="mpi", env={"UNICOLL_TEST_MARK": "again"})
    fresh = uc.testing.spawn(pid_and_parent, 2, backend="mpi", start_method="spawn")
    (server,) = {parent for _, parent, _ in first + again}
    assert "unicoll.testing.mpi_server" in _command_line(server)
    assert [mark for _, _, mark in first + again] == ["first"] * 2 + ["again"] * 2
    assert all(parent != server for _, parent, _ in fresh)  # hydra's proxy's, ended with the job


def sleep_with_pid(rank: int, folder: str) -> None:
    with open(os.path.join(folder, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


@pytest.mark.skipif(MPI_REASON is not None, reason=f"mpi: {MPI_REASON}")
def test_a_timed_out_mpi_job_leaves_no_rank_of_the_server_running(tmp_path) -> None:
    """The job is stopped at the timeout: mpiexec ends the processes it started, and the server
    kills the ranks it forked for them."""
    with pytest.raises(SpawnTimeout, match=r"ranks \[0, 1\] had not finished after 3 s"):
        uc.testing.spawn(sleep_with_pid, 2, str(tmp_path), backend="mpi", timeout=3)
    pids = [int(path.read_text()) for path in tmp_path.glob("*.pid")]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(MPI_REASON is not None, reason=f"mpi: {MPI_REASON}")
def test_an_mpi_rank_that_exits_ends_the_job_with_an_error() -> None:
    with pytest.raises(SpawnError, match=r"the MPI job exited with code \d+ before rank\(s\) \[0"):
        uc.testing.spawn(die_on_rank_zero, 2, backend="mpi", timeout=60)
