"""Tests of ``unicoll bench``: a tiny sweep through the command line, and its pieces.

Timings are never asserted: only the shape of the output and the correctness column.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers.several import SESSION, Case, share
from unicoll import cli
from unicoll.cli import bench, bench_cases, bench_config, bench_report

SIZES = [1024, 2048, 4096]


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """Run the tiny sweep of the docs once: its stdout and the JSON it writes."""
    out = tmp_path_factory.mktemp("bench") / "out.json"
    argv = ["bench", "-n", "2", "--min-bytes", "1K", "--max-bytes", "4K", "--iters", "1", "--warmup", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "unicoll", *argv, "--backend", "gloo", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(out.read_text())


def test_json_holds_every_figure(tiny_sweep: tuple[str, dict]) -> None:
    _, result = tiny_sweep
    assert result["backend"] == "gloo" and result["world_size"] == 2
    assert result["config"]["ops"] == list(bench_config.OPS)
    assert [(row["op"], row["size_bytes"]) for row in result["rows"]] == [
        (op, s) for op in bench_config.OPS for s in SIZES
    ]
    for row in result["rows"]:
        assert row["correct"] is True
        assert row["dtype"] == "float32" and row["count"] * 4 == row["size_bytes"]
        for key in ("time_us", "algbw_gbps", "busbw_gbps", "raw_time_us", "raw_algbw_gbps", "raw_busbw_gbps"):
            assert row[key] > 0
        share = {"all_reduce": 1.0, "broadcast": 1.0}.get(row["op"], 0.5)  # nccl-tests' factors for 2 ranks
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * share)
        assert row["ratio"] == pytest.approx(row["time_us"] / row["raw_time_us"])
    frontend = result["frontend"]["ops"]
    assert set(frontend) == set(bench_config.OPS)
    for op, figures in frontend.items():
        assert figures["frontend_us"] > 0
        if op in ("global_scatter", "global_gather"):
            assert figures["frontend_fresh_counts_us"] > 0
        assert figures["difference_us"] == pytest.approx(figures["unicoll_us"] - figures["raw_us"])
    overhead = result["overhead"]
    assert overhead["ranks"] == 2 and set(overhead["ops"]) == set(bench_config.OPS)
    for figures in overhead["ops"].values():
        assert figures["unicoll_us"] > 0 and figures["raw_us"] > 0
        assert figures["difference_us"] == pytest.approx(figures["unicoll_us"] - figures["raw_us"])
        assert figures["ratio"] == pytest.approx(figures["unicoll_us"] / figures["raw_us"])
        assert figures["raw_again_ratio"] > 0


def test_table_is_printed_like_nccl_tests(tiny_sweep: tuple[str, dict]) -> None:
    stdout, result = tiny_sweep
    lines = stdout.splitlines()
    header = next(line for line in lines if "count" in line and line.startswith("#"))
    for column in ("size", "count", "type", "op", "time", "algbw", "busbw", "correct", "raw time", "ratio"):
        assert column in header
    data = [line.split() for line in lines if line and not line.startswith("#") and line.split()[0].isdigit()]
    assert len(data) == len(result["rows"])
    assert all(fields[7] == "yes" for fields in data)
    assert "front end" in stdout
    rows = [line.split() for line in lines if line.split() and line.split()[0] in bench_config.OPS]
    assert [fields[0] for fields in rows[-len(bench_config.OPS) :]] == list(
        bench_config.OPS
    )  # the N-rank overhead, last
    assert "2 ranks" in next(line for line in lines if line.startswith("# 2 ranks"))
    assert "raw/raw" in stdout


def test_plot_is_drawn(tiny_sweep: tuple[str, dict], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    bench_report.plot(tiny_sweep[1], tmp_path / "busbw.png")
    assert (tmp_path / "busbw.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(("text", "size"), [("4096", 4096), ("1K", 1024), ("64M", 64 << 20), ("2GiB", 2 << 30)])
def test_sizes_parse_in_binary_units(text: str, size: int) -> None:
    assert bench.parse_bytes(text) == size


@pytest.mark.parametrize("text", ["", "K", "1.5M", "-1K", "0", "1X"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected a size"):
        bench.parse_bytes(text)


def test_min_above_max_fails_before_starting_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "-n", "2", "--min-bytes", "8K", "--max-bytes", "4K"]) == 2
    assert "--min-bytes 8192 is above --max-bytes 4096" in capsys.readouterr().err


def test_unwritable_json_fails_before_starting_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, the whole sweep ran and only then the write failed. A file that exists is left as
    it was, and the check leaves no file behind."""
    missing = tmp_path / "no-such-dir" / "out.json"
    assert cli.main(["bench", "-n", "2", "--json", str(missing)]) == 2
    assert (
        f"--json: expected a file it can write, got {str(missing)!r} (No such file or directory)"
        in capsys.readouterr().err
    )
    assert cli.main(["bench", "-n", "2", "--json", str(tmp_path)]) == 2
    assert "(Is a directory)" in capsys.readouterr().err
    kept, fresh = tmp_path / "kept.json", tmp_path / "fresh.json"
    kept.write_text("before")
    assert bench._unwritable(kept) is None and kept.read_text() == "before"
    assert bench._unwritable(fresh) is None and not fresh.exists()


@pytest.mark.usefixtures("clean_env")
def test_transport_stubbed_moves_nothing_and_restores_the_backend() -> None:
    """Inside the hook a call runs unicoll's work but leaves its output as it was; after it,
    calls move bytes again; on more than one rank the hook refuses."""
    import unicoll as uc
    from unicoll import runtime

    uc.init("gloo")
    try:
        x, out = np.arange(4.0), np.full(4, -1.0)
        with runtime.transport_stubbed():
            assert uc.alltoall_single(out, x) is out
            assert out.tolist() == [-1.0] * 4
            with pytest.raises(ValueError, match="alltoall_single: out"):
                uc.alltoall_single(np.empty(3), x)  # validation still runs
        assert uc.alltoall_single(out, x).tolist() == [0.0, 1.0, 2.0, 3.0]
        assert uc.get_backend() == "gloo" and type(runtime.state("test").backend).__name__ == "TorchDistBackend"
    finally:
        uc.finalize()
    assert SESSION.results(STUB_REFUSED, "bench: stub refused on two ranks") == [True, True]


def _stub_refused_on_two_ranks(rank: int) -> bool:
    from unicoll import runtime

    with pytest.raises(RuntimeError, match="transport_stubbed: expected a world of one rank, got 2 ranks"):
        with runtime.transport_stubbed():
            pass
    return True


# In the session's shared gloo world of 2 (helpers/several.py).
STUB_REFUSED = share("gloo", 2, [Case("bench: stub refused on two ranks", _stub_refused_on_two_ranks)])


def test_every_benched_operator_is_a_specified_one() -> None:
    """The bench's operators are the specs' (the top-k step as moe_topk), each with a case; the
    specs' operators it leaves out are the ones composed of another's transfer."""
    from unicoll.spec import OPS as SPEC_OPS

    assert set(bench_config.OPS) == set(bench_cases.CASES)
    assert set(bench_config.OPS) - {"moe_topk"} <= set(SPEC_OPS)
    assert set(SPEC_OPS) - set(bench_config.OPS) == {"alltoall", "reduce"}  # alltoall_single's transfer, all_reduce's
