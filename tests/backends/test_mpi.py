"""The ``mpi`` backend beyond the conformance matrix: worlds of forked ranks and of mpiexec, timeouts
instead of hangs, gradients, check mode, groups, init again, ``unicoll run --mpi`` and
``unicoll bench --backend mpi``. Skipped, with the reason, where mpi4py cannot run.

The cases that need no environment of their own (but check mode) run in the session's shared
MPI worlds (helpers/several.py): one start (a rendezvous, MPI's start and end) for the cases of
every module."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import helpers.cli
import unicoll as uc
from helpers.gradients import OPS as GRADIENT_OPS
from helpers.gradients import gradients
from helpers.several import SESSION, Case, share
from helpers.worlds import MISMATCHES, async_in_any_order, mismatches
from unicoll.backends.mpi.mpi import MpiFactory
from unicoll.testing import SpawnError

REASON = MpiFactory().probe()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"backend mpi is not usable here: {REASON}")


def facts(rank: int) -> tuple:
    group = uc.new_group([2, 1])
    position = uc.get_rank(group) if group.is_member else None
    if group.is_member:
        uc.barrier(group)
    return rank, uc.get_backend(), uc.get_world_size(), position


def test_rank_and_size_come_from_mpi() -> None:
    assert _shared(3, "facts") == [(0, "mpi", 3, None), (1, "mpi", 3, 0), (2, "mpi", 3, 1)]


def raise_on_rank_one(rank: int) -> None:
    if rank == 1:
        raise KeyError("the expert table has no entry 7")
    uc.barrier()


def test_failing_rank_is_named_with_its_traceback() -> None:
    with pytest.raises(SpawnError, match="rank 1 raised") as info:
        uc.testing.spawn(raise_on_rank_one, 2, backend="mpi", timeout=60)
    assert "KeyError: 'the expert table has no entry 7'" in info.value.remote_traceback


def absent_peer(rank: int) -> list:
    """Rank 1 skips the collectives; rank 0 must get timeouts, not hang."""
    x = np.arange(8.0).reshape(4, 2)
    if rank == 1:
        time.sleep(3.5)  # past rank 0's six timeouts: 4 x 0.5 s, 2 x 0.25 s
        return []
    seen = []
    calls = (lambda: uc.all_gather(None, x), lambda: uc.barrier(), lambda: uc.new_group([0]), lambda: uc.all_reduce(x))
    for call in calls:
        start = time.monotonic()
        with pytest.raises(uc.CollectiveTimeoutError) as info:
            call()
        seen.append((str(info.value), time.monotonic() - start))
    task = uc.alltoall_single(None, x, sync_op=False)
    assert not task.is_completed()
    start = time.monotonic()
    with pytest.raises(uc.CollectiveTimeoutError) as info:
        task.wait(timeout=0.25)
    seen.append((str(info.value), time.monotonic() - start))
    task = uc.broadcast(x, 1, sync_op=False)
    start = time.monotonic()
    with pytest.raises(uc.CollectiveTimeoutError) as info:
        task.wait(timeout=0.25)
    seen.append((str(info.value), time.monotonic() - start))
    return seen


def test_a_peer_that_never_calls_times_out() -> None:
    # the handshake off: the asynchronous calls' Tasks are what is timed (with it, the call itself
    # waits for the peer's record: tests/processes/test_faults.py)
    env = {"UNICOLL_TIMEOUT": "0.5", "UNICOLL_HANDSHAKE": "0"}
    seen, _ = uc.testing.spawn(absent_peer, 2, backend="mpi", env=env, timeout=60)
    ops = ["all_gather", "barrier", "new_group", "all_reduce", "alltoall_single", "broadcast"]
    for (message, seconds), op, bound in zip(seen, ops, (0.5, 0.5, 0.5, 0.5, 0.25, 0.25), strict=True):
        assert message.startswith(f"{op} on Group(ranks=[0, 1]): did not complete within the timeout of {bound:g} s")
        assert "mpi:" in message and "timed out" in message
        assert bound - 0.1 < seconds < bound + 1


def test_gradients_match_the_reference() -> None:
    reports = _shared(3, "gradients")
    assert all(len(r) == 2 * len(GRADIENT_OPS) and set(r.values()) == {"ok"} for r in reports)


def _moe_counts(case: str, world: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Each rank's local_count (3 experts per rank) for a case of :func:`moe_both_paths`."""
    local = [rng.multinomial(64, np.full(world * 3, 1 / (world * 3))) for _ in range(world)]
    for rank in range(world):
        if case == "skewed" and rank == 0:  # every row to the last expert: empty chunks
            local[0] = np.eye(world * 3, dtype=np.int64)[-1] * 64
        if case == "mixed" and rank > 0:  # 4 rows each, to rank 0's first expert
            local[rank] = np.eye(world * 3, dtype=np.int64)[0] * 4
        if case == "one receives":  # every row to rank 0's experts: the others receive none
            local[rank] = np.zeros(world * 3, dtype=np.int64)
            local[rank][:3] = rng.multinomial(64, np.full(3, 1 / 3))
    return local


def moe_both_paths(rank: int) -> list[str]:
    """global_scatter and global_gather below and above the size from which mpi fuses the
    reorder into the transfer (``_FUSED_FROM_BYTES``),
    numpy and torch, against the reference; also where ranks take different ways in one call
    (each decides by its own bytes). The way each rank took, by its input's size."""
    from unicoll import reference, runtime
    from unicoll.backends.mpi.transport import _FUSED_FROM_BYTES

    backend, called = runtime.state("test").backend, []
    comm_of = backend._comm
    backend._comm = lambda group: _Recording(comm_of(group), called)  # which collective each call issues
    world, seen = uc.get_world_size(), []
    large = 8 * _FUSED_FROM_BYTES // 8 // 64  # float64: 64 rows are 8x the size, 4 rows half of it
    for case, hidden in (("small", 2), ("even", large), ("skewed", large), ("mixed", large), ("one receives", large)):
        rng = np.random.default_rng(len(case))
        local = _moe_counts(case, world, rng)
        glob = reference.global_counts(local)
        xs = [rng.standard_normal((int(local[r].sum()), hidden)) for r in range(world)]
        for as_array, sync_op in ((np.asarray, True), (torch.from_numpy, False)):  # torch: as Tasks
            scattered = uc.global_scatter(
                as_array(xs[rank]), local[rank], glob[rank], sync_op=sync_op, use_calc_stream=sync_op
            )
            scattered = scattered if sync_op else scattered.wait()
            np.testing.assert_array_equal(np.asarray(scattered), reference.global_scatter(xs, local)[rank])
            back = uc.global_gather(scattered, local[rank], glob[rank], sync_op=sync_op, use_calc_stream=sync_op)
            np.testing.assert_array_equal(np.asarray(back if sync_op else back.wait()), xs[rank])
            paths = ["fused" if x.nbytes >= _FUSED_FROM_BYTES else "reordered" for x in (xs[rank], scattered)]
            seen.append(f"{case}, {as_array.__name__}: scatter {paths[0]}, gather {paths[1]}")
    # whichever way: the same collective on every rank, after the handshake's gather of the ranks' records
    assert called == ["Iallgather", "Ialltoallw"] * (len(called) // 2), called
    return seen


class _Recording:
    """A communicator that records the name of each collective it is asked for."""

    def __init__(self, comm: object, called: list[str]) -> None:
        self._comm, self._called = comm, called

    def __getattr__(self, name: str) -> object:
        if name.startswith("I"):
            self._called.append(name)
        return getattr(self._comm, name)


def test_moe_operators_fused_or_not_match_the_reference() -> None:
    """Every rank's result is right whichever way each rank took; "mixed" and "one receives"
    have ranks on both sides of a threshold in one call."""
    both, first = "scatter fused, gather fused", "scatter reordered, gather reordered"
    on_rank_0 = {"small": first, "even": both, "skewed": both, "mixed": both, "one receives": both}
    on_others = {
        **on_rank_0,
        "mixed": "scatter reordered, gather fused",
        "one receives": "scatter fused, gather reordered",
    }
    expected = [
        [f"{case}, {name}: {paths[case]}" for case in on_rank_0 for name in ("asarray", "from_numpy")]
        for paths in (on_rank_0, on_others, on_others)
    ]
    assert _shared(3, "fused or not") == expected


def test_check_mode_names_the_disagreement() -> None:
    for seen in SESSION.results(CHECKED, "mpi: mismatches"):
        for (label, _, _, message), got in zip(MISMATCHES, seen, strict=True):
            assert message in got, (label, got)


def test_async_operators_waited_in_any_order() -> None:
    assert _shared(3, "async in any order") == ["ok"] * 3


def init_again(rank: int) -> list[float]:
    first = uc.all_gather(None, torch.tensor([float(rank)], dtype=torch.bfloat16)).tolist()
    uc.finalize()
    uc.init("mpi")
    return first + uc.all_gather(None, np.array([rank + 10], np.float32)).tolist()


def test_init_after_finalize() -> None:
    assert _shared(2, "init again") == [[0.0, 1.0, 10.0, 11.0]] * 2


def test_processes_started_without_mpi_are_refused(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match=r"MPI's COMM_WORLD has 1 rank\(s\) but \$WORLD_SIZE is 2; start the ranks"):
        uc.init("mpi")
    assert not uc.is_initialized()


def test_a_world_of_one_without_a_launcher() -> None:
    uc.init("mpi", timeout=10)
    try:
        x = torch.arange(6.0).reshape(3, 2)
        assert torch.equal(uc.global_scatter(x, [1, 2], [1, 2]), x)
        assert uc.exchange_counts([1, 2]).tolist() == [1, 2]
    finally:
        uc.finalize()


def test_waits_yield_only_on_an_oversubscribed_node(monkeypatch) -> None:
    from unicoll.backends.mpi.transport import _LOCAL_SIZE_VARIABLES, _YIELD_AFTER_S, yield_after

    for name in _LOCAL_SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert yield_after(2) == float("inf")  # no launcher variable: every rank is local
    assert yield_after(4) == _YIELD_AFTER_S
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")  # 4 ranks on two nodes of 2
    assert yield_after(4) == float("inf")
    monkeypatch.setenv("MPI_LOCALNRANKS", "3")
    assert yield_after(4) == _YIELD_AFTER_S


def test_probe_names_the_missing_package(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    assert MpiFactory().probe().startswith("mpi4py with an MPI library is not importable (ModuleNotFoundError")


def test_info_lists_mpi_as_usable() -> None:
    out = helpers.cli.info()  # run once for the session
    assert "  mpi          usable" in out.splitlines()


def test_unicoll_run_mpi(tmp_path) -> None:
    script = tmp_path / "hello.py"
    script.write_text(
        "import sys, unicoll as uc\n"
        "uc.init()\n"
        "total = uc.all_gather(None, uc.exchange_counts([uc.get_rank()] * uc.get_world_size()))\n"
        "print(f'rank {uc.get_rank()} of {uc.get_world_size()} on {uc.get_backend()}: {total.tolist()} {sys.argv[1:]}')\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "unicoll", "run", "--mpi", "-n", "3", str(script), "--x", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    for rank in range(3):
        assert f"rank {rank} of 3 on mpi: {[0, 1, 2] * 3} ['--x', '1']" in done.stdout


def test_unicoll_run_mpi_refuses_options_it_does_not_use(capsys) -> None:
    from unicoll import cli

    assert cli.main(["run", "--mpi", "-n", "2", "--master-port", "1234", "x.py"]) == 2
    assert "do not apply to --mpi" in capsys.readouterr().err
    assert cli.main(["run", "-n", "2", "--mpiexec", "mpiexec", "x.py"]) == 2
    assert "--mpiexec needs --mpi" in capsys.readouterr().err
    assert cli.main(["run", "--mpi", "--mpiexec", "/no/such/mpiexec", "-n", "2", "x.py"]) == 2
    assert capsys.readouterr().err == "unicoll run: --mpiexec: expected an executable, got '/no/such/mpiexec'\n"


def test_bench_compares_with_bare_mpi4py_and_a_memory_copy(tmp_path) -> None:
    out = tmp_path / "out.json"
    argv = ["bench", "-n", "2", "--backend", "mpi", "--min-bytes", "1K", "--max-bytes", "2K", "--iters", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "unicoll", *argv, "--warmup", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert (result["backend"], result["baseline"], result["world_size"]) == ("mpi", "mpi4py", 2)
    assert all(row["correct"] and row["raw_time_us"] > 0 for row in result["rows"])
    assert [c["size_bytes"] for c in result["copy"]] == [1024, 2048] and all(c["gbps"] > 0 for c in result["copy"])
    assert "# raw = bare mpi4py Alltoallv/Allgather" in done.stdout
    assert "# memory copy: one process" in done.stdout


def dropped_inputs(rank: int) -> bool:
    """Asynchronous transfers whose input the caller drops at once (and a staged copy of a
    non-contiguous input, which nothing else holds): MPI reads them after the call returns,
    while the peer is late and other allocations reuse freed memory, so the transfer must
    keep them alive."""
    import gc

    rows = 2**20  # 8 MiB of float64 each way: sent once the late peer arrives, not at the call
    out, gathered = torch.empty(2 * rows), torch.empty(2 * rows)
    if rank == 1:
        time.sleep(0.3)
    source = torch.arange(4 * rows, dtype=torch.float64).float() + 10 * rank
    moved = uc.alltoall_single(out, source[::2], sync_op=False)  # strided: staged through a contiguous copy
    shared = uc.all_gather(gathered, torch.full((rows,), float(rank)), sync_op=False)
    del source
    gc.collect()
    noise = [torch.full((rows,), -1.0) for _ in range(8)]  # reuses the freed memory
    moved.wait(), shared.wait()
    del noise
    sent_to_me = torch.arange(4 * rows, dtype=torch.float64).float()[::2]
    expected = torch.cat([sent_to_me[rank * rows : (rank + 1) * rows] + 10 * c for c in range(2)])
    return bool(torch.equal(out, expected)) and gathered.tolist() == [0.0] * rows + [1.0] * rows


def test_an_asynchronous_transfer_keeps_the_arrays_the_caller_dropped() -> None:
    assert _shared(2, "dropped inputs") == [True, True]


# The session's shared MPI worlds (helpers/several.py): moe_both_paths last (it records the
# backend's collectives from then on), init_again last (it starts a new session); the mismatches
# in the world of 2 in check mode.
JOBS = {
    3: share(
        "mpi",
        3,
        [
            Case("mpi: facts", facts),
            Case("mpi: gradients", gradients),
            Case("mpi: async in any order", async_in_any_order),
        ],
    ),
    2: share("mpi", 2, [Case("mpi: dropped inputs", dropped_inputs)]),
}
share("mpi", 3, [Case("mpi: fused or not", moe_both_paths)], last=True)
share("mpi", 2, [Case("mpi: init again", init_again)], last=True)
CHECKED = share("mpi", 2, [Case("mpi: mismatches", mismatches)], check=True)


def _shared(size: int, name: str) -> list:
    return SESSION.results(JOBS[size], f"mpi: {name}")
