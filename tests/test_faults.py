"""Fault injection with real processes: every fault ends in a clear error on every surviving
rank within the timeout, and `unicoll run` stops the world when a rank fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "faults" / "inject.py"
TIMEOUT = 4  # UNICOLL_TIMEOUT for these worlds, seconds


def run_world(fault: str, *, check: bool = False) -> tuple[dict[int, list[dict]], subprocess.CompletedProcess]:
    env = {**os.environ, "UNICOLL_TIMEOUT": str(TIMEOUT), "UNICOLL_CHECK": "1" if check else "0"}
    done = subprocess.run(
        [sys.executable, "-m", "unicoll", "run", "-n", "2", str(SCRIPT), fault],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    reports: dict[int, list[dict]] = {0: [], 1: []}
    for line in done.stdout.splitlines():
        _, _, payload = line.partition("] ")
        if payload.startswith("{"):
            record = json.loads(payload)
            reports[record["rank"]].append(record)
    return reports, done


def test_mismatched_counts_in_check_mode_fail_on_every_rank() -> None:
    reports, done = run_world("mismatch-checked", check=True)
    expected = "global_scatter: ranks disagree (check mode): rank 1 expects 2 row(s) from rank 0 for expert 1, but rank 0 sends 1"
    for rank in (0, 1):
        (record,) = reports[rank]
        assert record["error"] == "CrossRankMismatchError", done.stdout + done.stderr
        assert record["message"] == expected
        assert record["seconds"] < TIMEOUT
    assert done.returncode == 0


def test_mismatched_counts_without_check_mode_do_not_hang() -> None:
    """Without check mode gloo does not compare sizes across ranks: the call returns (with
    wrong rows, as docs/reliability.md warns) or fails, but never waits past the timeout."""
    reports, done = run_world("mismatch-unchecked")
    for rank in (0, 1):
        (record,) = reports[rank]
        assert record["error"] in (None, "CommunicationError", "PeerLostError"), done.stdout + done.stderr
        assert record["seconds"] < TIMEOUT + 1


def test_peer_that_exits_fails_the_current_and_next_operator() -> None:
    reports, done = run_world("peer-exits")
    assert reports[1] == [{"rank": 1, "action": "exits"}]
    assert len(reports[0]) == 2, done.stdout + done.stderr
    for record in reports[0]:
        assert record["error"] == "PeerLostError"
        assert record["message"].startswith("alltoall_single on Group(ranks=[0, 1]): a peer is gone")
        assert record["seconds"] < TIMEOUT + 1


@pytest.mark.parametrize(
    ("fault", "op", "bound"), [("peer-absent", "all_gather", TIMEOUT), ("peer-absent-async", "alltoall_single", 2)]
)
def test_peer_that_never_calls_times_out(fault, op, bound) -> None:
    reports, done = run_world(fault)
    (record,) = reports[0]
    assert record["error"] == "CollectiveTimeoutError", done.stdout + done.stderr
    assert record["message"].startswith(
        f"{op} on Group(ranks=[0, 1]): did not complete within the timeout of {bound} s"
    )
    assert bound - 0.5 < record["seconds"] < bound + 2


def test_launcher_stops_the_world_and_names_the_failing_rank(tmp_path) -> None:
    script = tmp_path / "crash.py"
    script.write_text(
        "import os, time, numpy as np, unicoll as uc\n"
        "uc.init('gloo')\n"
        "uc.barrier()\n"
        "if uc.get_rank() == 1:\n"
        "    os._exit(3)\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "unicoll", "run", "-n", "3", str(script)], capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 3
    assert "rank 1 failed with exit code 3; stopped the other ranks" in done.stderr
    assert time.monotonic() - start < 30
