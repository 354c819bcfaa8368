"""unicoll.testing.spawn: results in rank order, the failing rank's error, no hangs."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import unicoll as uc
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
