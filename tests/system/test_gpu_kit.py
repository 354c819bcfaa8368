"""tools/gpu_check.sh, the one-call run of every GPU check, and its helper tools/gpu_check.py: the
script end to end on this machine (without a GPU its GPU steps skip with their reason), and the
summary read from real pytest and ``unicoll bench`` output."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
KIT = ROOT / "tools" / "gpu_check.sh"


def _load_helper():
    """tools/gpu_check.py as a module (tools/ is no package)."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _load_helper()

without_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU steps' skips without a GPU")


SAMPLE = (
    "import pytest\n"
    "def test_passes(): pass\n"
    "def test_fails(): assert False\n"
    "@pytest.mark.parametrize('n', [1, 2])\n"
    "def test_skips(n): pytest.skip('torch-nccl: no CUDA device')\n"
    "def test_skips_otherwise(): pytest.skip('cupy-nccl: no cupy')\n"
    "@pytest.fixture\n"
    "def broken(): raise RuntimeError('fixture')\n"
    "def test_errors(broken): pass\n"
)
"""A test module whose pytest run the kit's JUnit reader counts."""

EXAMPLE_RUNS = {"moe_dispatch.py": "--iters", "train_moe.py": "--steps"}
"""Each example the kit runs on a GPU backend, with the option that shortens it."""


def _run(folder: Path, name: str) -> tuple[list[str], dict[str, str], Path]:
    """Run ``name``'s command, environment and working directory: the kit's (``OUT`` is
    ``folder``), and the real runs whose output the kit reads: a pytest run, the examples and a
    bench, on gloo."""
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(folder)}
    if name in KIT_RUNS:
        # the module's runs share two cores with the other worker: the steps' GPU limits, times 4
        env["GPU_CHECK_LIMIT_FACTOR"] = "4"
        args, seconds = KIT_RUNS[name]
        if seconds is not None:
            env["GPU_CHECK_SECONDS"] = str(seconds)
        return ["bash", str(KIT), "--no-install", *args], env, ROOT
    if name == "pytest":
        (folder / "test_sample.py").write_text(SAMPLE)
        # without hypothesis's plugin, which imports hypothesis at the end of every run (1 CPU-s)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest"]
        command.append("--junitxml=junit.xml")
        return [*command, "test_sample.py"], env, folder
    if name == "bench":
        command = [sys.executable, "-m", "unicoll", "bench", "-n", "1", "--backend", "gloo", "--op", "alltoall_single"]
        command += ["--min-bytes", "1K", "--max-bytes", "2K", "--iters", "2", "--warmup", "0"]
        return [*command, "--json", str(folder / "bench-gloo.json")], env, ROOT
    example, option = name, EXAMPLE_RUNS[name]
    command = [sys.executable, "-m", "unicoll", "run", "-n", "1", f"examples/{example}", "--backend", "gloo"]
    return [*command, option, "2"], env, ROOT


SKIPPED_STEPS = ["versions", "reorder-cupy", "example-moe-torch-nccl", "example-moe-cupy-nccl"]
KIT_RUNS = {
    **({} if torch.cuda.is_available() else {"skips": (["--only", ",".join(SKIPPED_STEPS)], None)}),
    "spent": (["--only", "versions,bench-torch-nccl"], 0),
    "default": ([], 0),
    "unknown step": (["--only", "versions,conformance-torch"], 0),
}
"""The kit's runs, by name: its arguments and its seconds (``GPU_CHECK_SECONDS``). The run
whose GPU steps skip starts only where they do (no CUDA device): elsewhere they would run."""
RUNS = [*KIT_RUNS, "pytest", "bench", *EXAMPLE_RUNS]


class Runs:
    """The module's runs, started together (each is one process most of its time, and the
    suite's machine has two cores), each with a folder of its own, where its output goes too;
    :meth:`result` waits for one."""

    def __init__(self, folder: Path) -> None:
        self._started = {}
        for name in RUNS:
            out = folder / name.replace(" ", "-")
            out.mkdir()
            command, env, cwd = _run(out, name)
            with (out / "stdout.txt").open("w") as stdout, (out / "stderr.txt").open("w") as stderr:
                proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True, cwd=cwd, env=env)
            self._started[name] = (proc, out)

    def result(self, name: str) -> tuple[subprocess.CompletedProcess, Path]:
        """Run ``name``'s exit and output once it ended, and its folder."""
        proc, out = self._started[name]
        code = proc.wait(timeout=300)
        output = [(out / f"{stream}.txt").read_text() for stream in ("stdout", "stderr")]
        return subprocess.CompletedProcess(proc.args, code, *output), out

    def stop(self) -> None:
        """Kill what still runs."""
        for proc, _ in self._started.values():
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    started = Runs(tmp_path_factory.mktemp("gpu-kit"))
    yield started
    started.stop()


@without_cuda
def test_the_kit_runs_and_skips_the_gpu_steps_with_their_reason(runs: Runs) -> None:
    run, tmp_path = runs.result("skips")
    assert run.returncode == 0, run.stdout + run.stderr
    written = sorted(p.name for p in tmp_path.iterdir() if p.name not in ("stdout.txt", "stderr.txt"))
    assert written == ["gpu_check.log", "logs.tar.gz", "summary.json", "summary.txt"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [step["name"] for step in summary["steps"]] == SKIPPED_STEPS
    versions, reorder, example, _ = summary["steps"]
    assert versions["status"] == "pass" and versions["exit_code"] == 0
    assert versions["limit_s"] == 20 * 4  # its limit times GPU_CHECK_LIMIT_FACTOR
    assert summary["versions"]["python"] == platform.python_version()
    assert summary["versions"]["torch"]["version"] == torch.__version__
    assert summary["versions"]["packages"]["numpy"] == __import__("numpy").__version__
    assert example["status"] == "skip" and example["exit_code"] is None
    assert example["reason"].startswith("torch-nccl: no CUDA device is visible to torch")
    assert example["command"] == f"{sys.executable} -m unicoll run -n 1 examples/moe_dispatch.py --backend torch-nccl"
    assert reorder["status"] == "skip" and reorder["reason"].startswith("cupy-nccl: ")
    assert summary["totals"] == {"pass": 1, "fail": 0, "timeout": 0, "skip": 3, "not run": 0}
    assert (tmp_path / "summary.txt").read_text() in run.stdout
    with tarfile.open(tmp_path / "logs.tar.gz") as logs:
        assert {"./steps.jsonl", "./versions.json", "./versions.log"} <= set(logs.getnames())
    log = (tmp_path / "gpu_check.log").read_text()
    assert "=== example-moe-torch-nccl: skipped: torch-nccl: no CUDA device" in log
    # each backend probed once, however many steps need it (two need cupy-nccl)
    assert [line.split(":")[0] for line in log.splitlines() if line.startswith("=== probe ")] == [
        "=== probe cupy-nccl",
        "=== probe torch-nccl",
    ], log


def test_no_step_starts_once_the_runs_seconds_are_spent(runs: Runs) -> None:
    run, tmp_path = runs.result("spent")
    assert run.returncode == 0, run.stdout + run.stderr
    steps = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert [(step["name"], step["status"]) for step in steps] == [
        ("versions", "not run"),
        ("bench-torch-nccl", "not run"),
    ]
    assert steps[0]["reason"] == "not run: the run's 0 s were spent"


def test_the_default_run_leaves_the_later_steps_and_names_what_is_still_to_run(runs: Runs) -> None:
    run, tmp_path = runs.result("default")
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    reasons = {step["name"]: step["reason"] for step in summary["steps"]}
    assert reasons["moe-device"] == "not run: the run's 0 s were spent"
    later = [name for name, reason in reasons.items() if reason == "not run: left for a second call (--only)"]
    assert later == [
        *(f"example-{e}-{b}" for b in ("torch-nccl", "cupy-nccl") for e in ("moe", "train")),
        "bench-torch-nccl",
        "bench-cupy-nccl",
    ]
    assert summary["still_to_run"] == list(reasons)
    assert run.stdout.splitlines()[-2] == f"still to run: bash tools/gpu_check.sh --only {','.join(reasons)}"


def test_only_refuses_a_step_that_does_not_exist(runs: Runs) -> None:
    run, _ = runs.result("unknown step")
    assert run.returncode == 2
    assert "tools/gpu_check.sh: --only names no step conformance-torch (see --help)" in run.stderr
    assert "--only names no step versions" not in run.stderr


@pytest.mark.parametrize("factor", ["0", "1.5", "two"])
def test_a_limit_factor_that_is_no_whole_number_is_refused(factor: str) -> None:
    env = {**os.environ, "GPU_CHECK_LIMIT_FACTOR": factor}
    run = subprocess.run(["bash", str(KIT), "--no-install"], capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 2
    expected = f"tools/gpu_check.sh: GPU_CHECK_LIMIT_FACTOR must be a whole number of 1 or more, got '{factor}'"
    assert expected in run.stderr


def test_the_header_carries_an_ignored_wheel_folder() -> None:
    """The device call in the script's header carries .gpu-wheels, which git must ignore (only
    ignored paths are carried), as it ignores the default output folder."""
    header = subprocess.run(["bash", str(KIT), "--help"], capture_output=True, text=True, check=True).stdout
    (carried,) = re.findall(r'run\(command="bash tools/gpu_check.sh", carry=\["([^"]+)"\], timeout_s=600\)', header)
    for path in (f"{carried}/array_api_compat-1.16.0-py3-none-any.whl", "gpu-check-out/summary.json"):
        ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert ignored.returncode == 0, f"{path} is not ignored by git"


def test_junit_counts_from_a_real_pytest_run(runs: Runs) -> None:
    _, out = runs.result("pytest")
    xml = out / "junit.xml"
    assert gpu_check.junit_counts(xml) == {
        "passed": 1,
        "failed": 1,
        "errors": 1,
        "skipped": 3,
        "skip_reasons": {"torch-nccl: no CUDA device": 2, "cupy-nccl: no cupy": 1},
        "failures": ["test_sample::test_fails", "test_sample::test_errors"],
    }


def _step(exit_code: int | None, not_run: str | None = None) -> dict:
    return {"exit_code": exit_code, "not_run": not_run}


def _tests(passed: int = 0, failed: int = 0, errors: int = 0) -> dict:
    return {"passed": passed, "failed": failed, "errors": errors, "skipped": 0}


@pytest.mark.parametrize(
    ("step", "tests", "text", "status"),
    [
        (_step(None, "skip"), None, "", "skip"),
        (_step(None, "not run"), None, "", "not run"),
        (_step(124), _tests(passed=3), "", "timeout"),  # timeout's limit passed
        (_step(137), None, "", "timeout"),  # killed after it
        (_step(0), _tests(passed=3), "", "pass"),
        (_step(1), _tests(passed=3, failed=1), "", "fail"),
        (_step(1), _tests(passed=3, errors=1), "", "fail"),
        (_step(2), _tests(), "", "fail"),  # pytest interrupted, say by a collection error
        (_step(0), _tests(), "", "skip"),  # every test skipped
        (_step(5), _tests(), "", "skip"),  # no test selected
        (_step(0), None, "gpu_reorder: skipped: RuntimeError: no CUDA device\n", "skip"),
        (_step(0), None, "done\n", "pass"),
        (_step(1), None, "Traceback ...\n", "fail"),
    ],
)
def test_status(step, tests, text, status) -> None:
    assert gpu_check.status(step, tests, text) == status


REORDER_OUTPUT = """NVIDIA H100 80GB HBM3, torch float32, rows of 1024, 8 ranks x 4 experts
       bytes  copy GB/s  reorder GB/s  ratio  unicoll GB/s  ratio
     1048576      812.3         640.1   0.79         402.7   0.50
  1073741824     2950.0        2714.0   0.92        2650.5   0.90
goal: reorder / copy, worst size: 0.79 (goal >= 0.80): fail
"""


def test_figures_of_the_reorder_benchmark() -> None:
    found = gpu_check.figures(Path("."), "reorder-torch", REORDER_OUTPUT)
    assert found["device"] == "NVIDIA H100 80GB HBM3, torch float32, rows of 1024, 8 ranks x 4 experts"
    assert found["worst_reorder_ratio"] == 0.79
    assert found["goals"] == [
        {"goal": "reorder / copy, worst size", "figure": "0.79", "target": ">= 0.80", "verdict": "fail"}
    ]
    assert found["reorder"][1] == {
        "bytes": 1073741824,
        "copy_gbps": 2950.0,
        "reorder_gbps": 2714.0,
        "reorder_ratio": 0.92,
        "unicoll_gbps": 2650.5,
        "unicoll_ratio": 0.90,
    }


OVERHEAD_OUTPUT = """# unicoll {backend} against raw torch.distributed, 1 rank(s) on NVIDIA H200
                    op      bytes  unicoll (us)   raw (us)  overhead (us)  ratio
       alltoall_single      65536          {mine}       10.0           {excess}   {ratio}
  moe.dispatch+combine   67108864        3000.0     2200.0          800.0   1.36
goal: moe.dispatch+combine at 67108864 bytes: 1.36x (goal <= 1.5x raw): pass
"""


def _overhead_step(backend: str, mine: float) -> dict:
    text = OVERHEAD_OUTPUT.format(backend=backend, mine=mine, excess=mine - 10.0, ratio=mine / 10.0)
    return {"name": f"overhead-{backend}", "figures": gpu_check.figures(Path("."), f"overhead-{backend}", text)}


def test_figures_and_goals_of_the_overhead_benchmark() -> None:
    step = _overhead_step("torch-nccl", 22.5)
    assert step["figures"]["call_overhead"][0] == {
        "op": "alltoall_single",
        "bytes": 65536,
        "unicoll_us": 22.5,
        "raw_us": 10.0,
        "overhead_us": 12.5,
        "ratio": 2.25,
    }
    assert step["figures"]["goals"] == [
        {
            "goal": "moe.dispatch+combine at 67108864 bytes",
            "figure": "1.36x",
            "target": "<= 1.5x raw",
            "verdict": "pass",
        }
    ]
    assert gpu_check.front_end_goal([step]) == []
    for cupy_us, verdict in ((42.0, "pass"), (43.0, "fail")):
        (goal,) = gpu_check.front_end_goal([step, _overhead_step("cupy-nccl", cupy_us)])
        assert (goal["figure"], goal["verdict"]) == (f"{cupy_us - 22.5:.1f}us", verdict)


@pytest.mark.parametrize(
    ("example", "result"),
    [
        ("moe_dispatch.py", r"moe\.dispatch \+ moe\.combine: median [\d.]+ ms over 2 iterations \(slowest rank\)"),
        ("train_moe.py", r"backend gloo: 1 ranks x 2 experts, 2 Adam steps: every loss and every parameter match .*"),
    ],
)
def test_figures_of_the_examples(runs: Runs, example: str, result: str) -> None:
    """The line each example ends with, from a real run on gloo, as the kit reads it on a GPU backend."""
    run, _ = runs.result(example)
    assert run.returncode == 0, run.stdout + run.stderr
    (found,) = gpu_check.figures(Path("."), "example", run.stdout).values()
    assert re.fullmatch(result, found), found


def test_figures_of_a_real_unicoll_bench_run(runs: Runs) -> None:
    """``unicoll bench --json`` on gloo, read as the kit reads a GPU backend's."""
    run, out = runs.result("bench")
    assert run.returncode == 0, run.stderr
    found = gpu_check.figures(out, "bench-gloo", "")
    assert found["baseline"] == "torch.distributed" and found["device"] == "cpu"
    assert [(row["op"], row["size_bytes"], row["correct"]) for row in found["rows"]] == [
        ("alltoall_single", 1024, True),
        ("alltoall_single", 2048, True),
    ]
    assert all(row["time_us"] > 0 and row["raw_time_us"] > 0 for row in found["rows"])
    assert set(found["overhead"]["alltoall_single"]) >= {"unicoll_us", "raw_us", "difference_us", "raw_again_ratio"}
    assert found["frontend"]["alltoall_single"]["frontend_us"] > 0
    overheads = [_overhead_step("torch-nccl", 22.5), _overhead_step("cupy-nccl", 40.0)]
    (goal,) = gpu_check.front_end_goal([*overheads, {"name": "bench-gloo", "figures": found}])
    assert goal["figure"] == "17.5us"  # the bench's own overhead figures are not the call_overhead rows
