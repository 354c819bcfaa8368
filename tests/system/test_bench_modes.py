"""``unicoll bench --moe-modes`` through the command line, on a tiny grid: every case present,
its three steps equal (the ``ok`` column), the bytes and padding consistent with the capacity.
Timings are never asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from unicoll.cli import bench_modes


def test_the_grid_runs_and_its_three_steps_agree(tmp_path: Path) -> None:
    out = tmp_path / "modes.json"
    argv = ["bench", "-n", "2", "--backend", "gloo", "--moe-modes", "--tokens", "48", "--hidden", "8"]
    proc = subprocess.run(
        [sys.executable, "-m", "unicoll", *argv, "--iters", "1", "--warmup", "0", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["k"], r["factor"]) for r in rows] == [(k, f) for k in bench_modes.TOPK for f in bench_modes.FACTORS]
    for r in rows:
        assert r["correct"] is True, r
        assert r["capacity"] == math.ceil(r["factor"] * 48 * r["k"] / (2 * 4))
        # gloo sends only the valid rows of the static mode's blocks, and twice the counts (sent and demand)
        assert (r["static_mib"] - r["dynamic_mib"]) * 2**20 == 2 * 4 * 8
        assert 0 <= r["padding"] < 1 and r["static_ms"] > 0 and r["dynamic_ms"] > 0 and r["hand_ms"] > 0
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("# unicoll bench --moe-modes: backend gloo, 2 ranks, 48 tokens x 8 float32")
    assert len([line for line in lines if line.endswith(" yes")]) == len(rows)
