"""The Python side of ``tools/gpu_check.sh``: whether a backend can run, the versions and the GPU,
one step's record, and the summary of them all.

    python tools/gpu_check.py probe BACKEND          # exit 0 where it can run, else print why not, exit 3
    python tools/gpu_check.py versions FILE.json     # python, torch, CUDA, cupy, NCCL, numpy, mpi4py; the GPU
    python tools/gpu_check.py record WORK NAME LIMIT_S OUTCOME SECONDS LOG COMMAND [REASON]
    python tools/gpu_check.py summary WORK OUT       # OUT/summary.json, OUT/summary.txt; exit 1 if a step failed

``record`` appends one JSON line per step to ``WORK/steps.jsonl``: OUTCOME is the step's exit code,
or ``skip`` (its backend cannot run here) or ``not-run`` (no time was left), with the REASON.
``summary`` reads those lines, each step's log and pytest's JUnit XML (``WORK/NAME.xml``), and the
versions (``WORK/versions.json``), and adds what each step measured: the tests' counts, skip
reasons and failures, the reorder benchmark's table, ``unicoll bench``'s figures
(``WORK/NAME.json``), the examples' result lines.
``probe`` and ``versions`` import unicoll and the array libraries; the rest imports nothing heavy,
so a summary can be written after every step.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

#: ``probe``'s exit code for a backend that cannot run here (1 is Python's for an uncaught exception).
NOT_USABLE = 3
#: Exit codes of ``timeout``: its limit passed (124), or it had to kill (137).
TIMED_OUT = (124, 137)
#: pytest's exit code when no test was selected.
NO_TESTS = 5
#: The line of a script that skips by itself, as ``benchmarks/gpu_reorder.py`` does without a GPU.
SKIPPED_LINE = re.compile(r"^\S+: skipped: (.*)$", re.MULTILINE)
#: One row of benchmarks/gpu_reorder.py's table: bytes, copy GB/s, reorder GB/s, ratio, unicoll GB/s, ratio.
REORDER_ROW = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", re.MULTILINE)
REORDER_WORST = re.compile(r"^goal: reorder / copy, worst size: ([\d.]+)", re.MULTILINE)
#: One row of benchmarks/call_overhead.py's table: op, bytes, unicoll us, raw us, overhead us, ratio.
OVERHEAD_ROW = re.compile(
    r"^(?:\[rank 0\])?\s*(\S+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+(-?[\d.]+)\s+([\d.]+)\s*$", re.MULTILINE
)
#: A goal a benchmark checks: ``goal: WHAT: FIGURE (goal TARGET): pass|fail``.
GOAL = re.compile(r"^(?:\[rank 0\] )?goal: (.+): (\S+) \(goal ([^)]*)\): (pass|fail)$", re.MULTILINE)
#: The largest cost of cupy-nccl's front end over torch-nccl's, in microseconds (alltoall_single at
#: 64 KiB, each backend's time over its raw all-to-all).
FRONT_END_GOAL_US = 20.0
#: The lines the examples end with: moe_dispatch.py's timing, train_moe.py's verdict.
EXAMPLE_RESULT = re.compile(
    r"^(?:\[rank 0\] )?(moe\.dispatch \+ moe\.combine: .*|backend \S+: .* Adam steps: .*)$", re.MULTILINE
)
#: How many lines of a step's log its record keeps.
TAIL_LINES = 6


def probe(backend: str) -> int:
    """Print why ``backend`` cannot run here and return :data:`NOT_USABLE`, or return 0 where it can."""
    from unicoll import registry

    factory = registry.registered().get(backend)
    reason = f"no backend named {backend!r}" if factory is None else factory.probe()
    if reason is None:
        return 0
    print(f"{backend}: {reason}")
    return NOT_USABLE


def versions(path: Path) -> int:
    """Write the versions of everything the GPU paths use, and the GPU's model, to ``path``."""
    found: dict[str, Any] = {"python": sys.version.split()[0]}
    for name, read in _READERS.items():
        try:
            found[name] = read()
        except Exception as exc:  # a library that is missing or cannot reach a device
            found[name] = f"unavailable: {type(exc).__name__}: {exc}"
    path.write_text(json.dumps(found, indent=1) + "\n")
    print(json.dumps(found, indent=1))
    print(headline(found))
    return 0


def headline(found: dict[str, Any]) -> str:
    """The versions in one line: ``python 3.12.3, torch 2.11.0+cu130 (CUDA 13.0, NCCL 2.27.7), ...``."""
    torch, cupy, packages = found.get("torch"), found.get("cupy"), found.get("packages", {})
    parts = [f"python {found['python']}"]
    if isinstance(torch, dict):
        parts.append(f"torch {torch['version']} (CUDA {torch['cuda']}, NCCL {torch.get('nccl', '-')})")
    if isinstance(cupy, dict):
        parts.append(f"cupy {cupy['version']} (CUDA runtime {cupy['cuda_runtime']}, NCCL {cupy['nccl']})")
    parts += [f"{name} {packages.get(name, '-')}" for name in ("numpy", "mpi4py")]
    missing = [name for name, version in packages.items() if version == "not installed"]
    if missing:
        parts.append(f"not installed: {' '.join(missing)}")
    gpu = found.get("gpu (nvidia-smi)")
    parts.append(f"GPU: {'; '.join(gpu) if isinstance(gpu, list) else gpu}")
    return ", ".join(parts)


def _nvidia_smi() -> list[str]:
    query = "--query-gpu=name,memory.total,driver_version,compute_cap"
    out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip() or f"exit code {out.returncode}")
    return out.stdout.strip().splitlines()


def _torch() -> dict[str, Any]:
    import torch

    found: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda}
    if torch.distributed.is_nccl_available():  # (2, 28, 9), the NCCL torch is built with; an int before torch 2.1
        nccl = torch.cuda.nccl.version()
        found["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    found["cuda_available"] = torch.cuda.is_available()
    if found["cuda_available"]:
        found["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        found["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return found


def _cupy() -> dict[str, Any]:
    import cupy

    runtime = cupy.cuda.runtime
    found: dict[str, Any] = {"version": cupy.__version__, "cuda_runtime": runtime.runtimeGetVersion()}
    found["cuda_driver"] = runtime.driverGetVersion()
    from cupy.cuda import nccl

    found["nccl"] = nccl.get_version() if nccl.available else "not loadable"
    found["devices"] = runtime.getDeviceCount()
    return found


def _packages() -> dict[str, str]:
    """The versions of unicoll, of every package it requires (installed without its dependencies,
    so a missing one shows here as ``not installed``), of the test tools, and of cupy and NCCL."""
    from importlib.metadata import PackageNotFoundError, distributions, requires, version

    required = [
        re.match(r"[A-Za-z0-9._-]+", line).group() for line in requires("unicoll") or [] if "extra ==" not in line
    ]
    wanted = ("unicoll", *required, "mpi4py", "mpich", "pytest", "hypothesis")
    found = {}
    for name in wanted:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    for dist in distributions():  # each CUDA major's cupy and NCCL: cupy-cuda13x, nvidia-nccl-cu13, ...
        name = dist.metadata["Name"] or ""
        if re.fullmatch(r"cupy-cuda\d+x|nvidia-nccl-cu\d+", name):
            found[name] = dist.version
    return found


def _mpi4py() -> dict[str, str]:
    from mpi4py import MPI

    return {"library": MPI.Get_library_version().strip().splitlines()[0]}


_READERS = {
    "packages": _packages,
    "gpu (nvidia-smi)": _nvidia_smi,
    "torch": _torch,
    "cupy": _cupy,
    "mpi4py": _mpi4py,
}


def record(work: Path, name: str, limit_s: str, outcome: str, seconds: str, log: str, command: str, reason: str) -> int:
    """Append one step's record to ``work/steps.jsonl``."""
    ran = outcome not in ("skip", "not-run")
    line = {"name": name, "command": command, "limit_s": int(limit_s), "exit_code": int(outcome) if ran else None}
    line.update(seconds=round(float(seconds), 1), log=log, not_run=None if ran else outcome.replace("-", " "))
    line["reason"] = reason or None
    with (work / "steps.jsonl").open("a") as steps:
        steps.write(json.dumps(line) + "\n")
    return 0


def step_summary(work: Path, step: dict[str, Any]) -> dict[str, Any]:
    """``step``'s record with its status (pass, fail, skip, timeout, not run), its counts and figures."""
    text = (work / step["log"]).read_text(errors="replace") if step["log"] else ""
    summary = dict(step)
    summary["tail"] = text.strip().splitlines()[-TAIL_LINES:]
    junit = work / f"{step['name']}.xml"
    tests = junit_counts(junit) if junit.exists() else None
    if tests is not None:
        summary["tests"] = tests
    summary["figures"] = figures(work, step["name"], text)
    summary["status"] = status(step, tests, text)
    return summary


def status(step: dict[str, Any], tests: dict[str, Any] | None, text: str) -> str:
    """What came of a step: ``not run``, ``skip``, ``timeout``, ``pass`` or ``fail``."""
    rc = step["exit_code"]
    if rc is None:
        return step["not_run"]
    if rc in TIMED_OUT:
        return "timeout"
    if tests is not None:
        if tests["failed"] or tests["errors"] or rc not in (0, NO_TESTS):
            return "fail"
        return "pass" if tests["passed"] else "skip"
    if rc != 0:
        return "fail"
    return "skip" if SKIPPED_LINE.search(text) else "pass"


def junit_counts(path: Path) -> dict[str, Any]:
    """Passed, failed, errors and skipped from pytest's JUnit XML, with the skip reasons (and how
    many tests each) and the names of the tests that failed."""
    root = ET.parse(path).getroot()
    cases = root.iter("testcase")
    failed, skips, counts = [], Counter(), Counter()
    for case in cases:
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        kind = "passed" if outcome is None else {"failure": "failed", "error": "errors"}.get(outcome.tag, "skipped")
        counts[kind] += 1
        if kind == "skipped":
            skips[outcome.get("message", "")] += 1
        elif kind != "passed":
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    found: dict[str, Any] = {kind: counts[kind] for kind in ("passed", "failed", "errors", "skipped")}
    found["skip_reasons"] = dict(skips.most_common())
    found["failures"] = failed
    return found


def figures(work: Path, name: str, text: str) -> dict[str, Any]:
    """What a step measured: the reorder table, ``unicoll bench``'s JSON, an example's result line,
    a skipping script's reason. Empty for the rest."""
    found: dict[str, Any] = {}
    skipped = SKIPPED_LINE.search(text)
    if skipped:
        found["skipped"] = skipped.group(1)
    rows = REORDER_ROW.findall(text)
    if rows:
        keys = ("bytes", "copy_gbps", "reorder_gbps", "reorder_ratio", "unicoll_gbps", "unicoll_ratio")
        found["reorder"] = [dict(zip(keys, (int(row[0]), *map(float, row[1:])))) for row in rows]
        worst = REORDER_WORST.search(text)
        found["worst_reorder_ratio"] = float(worst.group(1)) if worst else None
        found["device"] = text.strip().splitlines()[0]
    overhead = OVERHEAD_ROW.findall(text)
    if overhead:
        keys = ("op", "bytes", "unicoll_us", "raw_us", "overhead_us", "ratio")
        found["call_overhead"] = [dict(zip(keys, (row[0], int(row[1]), *map(float, row[2:])))) for row in overhead]
    goals = GOAL.findall(text)
    if goals:
        found["goals"] = [dict(zip(("goal", "figure", "target", "verdict"), goal)) for goal in goals]
    bench = work / f"{name}.json"
    if bench.exists():
        found.update(bench_figures(json.loads(bench.read_text())))
    results = EXAMPLE_RESULT.findall(text)
    if results:
        found["result"] = results[-1]
    return found


def bench_figures(result: dict[str, Any]) -> dict[str, Any]:
    """``unicoll bench --json``'s figures: the device, each row (operator and size, unicoll and the
    raw call), the whole call beside the raw one per operator, and the front end's cost."""
    keys = ("op", "size_bytes", "time_us", "raw_time_us", "ratio", "busbw_gbps", "correct")
    return {
        "device": result.get("device"),
        "baseline": result.get("baseline"),
        "rows": [{key: row.get(key) for key in keys} for row in result.get("rows", [])],
        "overhead": result.get("overhead", {}).get("ops", {}),
        "frontend": result.get("frontend", {}).get("ops", {}),
    }


def summary(work: Path, out: Path) -> int:
    """Write ``out/summary.json`` and ``out/summary.txt`` from the steps recorded so far and print the
    table; return 1 if a step failed or ran out of time, else 0."""
    lines = (work / "steps.jsonl").read_text().splitlines() if (work / "steps.jsonl").exists() else []
    steps = [step_summary(work, json.loads(line)) for line in lines]
    versions_file = work / "versions.json"
    found = json.loads(versions_file.read_text()) if versions_file.exists() else {}
    totals = Counter(step["status"] for step in steps)
    goals = [goal for step in steps for goal in step["figures"].get("goals", [])] + front_end_goal(steps)
    tests = Counter()
    for step in steps:
        tests.update({key: value for key, value in step.get("tests", {}).items() if isinstance(value, int)})
    result = {
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": round(sum(step["seconds"] for step in steps), 1),
        "gpu": found.get("gpu (nvidia-smi)"),
        "versions": found,
        "totals": {status: totals[status] for status in ("pass", "fail", "timeout", "skip", "not run")},
        "tests": {key: tests[key] for key in ("passed", "failed", "errors", "skipped")},
        "goals": goals,
        "still_to_run": [step["name"] for step in steps if step["status"] in ("not run", "timeout")],
        "steps": steps,
    }
    (out / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
    table = format_table(result)
    (out / "summary.txt").write_text(table + "\n")
    print(table)
    return 1 if totals["fail"] or totals["timeout"] else 0


def front_end_goal(steps: list[dict[str, Any]]) -> list[dict[str, str]]:
    """cupy-nccl's front end against torch-nccl's, from both overhead steps' alltoall_single at their
    smallest size, as one goal; none until both steps have run."""
    costs = {}
    for step in steps:
        rows = [row for row in step["figures"].get("call_overhead", []) if row["op"] == "alltoall_single"]
        if rows:
            costs[step["name"]] = min(rows, key=lambda row: row["bytes"])["overhead_us"]
    if not {"overhead-torch-nccl", "overhead-cupy-nccl"} <= set(costs):
        return []
    excess = costs["overhead-cupy-nccl"] - costs["overhead-torch-nccl"]
    verdict = "pass" if excess <= FRONT_END_GOAL_US else "fail"
    what = "cupy-nccl's front end over torch-nccl's (alltoall_single, smallest size)"
    return [{"goal": what, "figure": f"{excess:.1f}us", "target": f"<= {FRONT_END_GOAL_US:g}us", "verdict": verdict}]


def format_table(result: dict[str, Any]) -> str:
    """The summary as text: one line per step, then the totals."""
    lines = [f"{'step':<26} {'status':<8} {'rc':>4} {'s':>6} {'limit':>6}  detail"]
    for step in result["steps"]:
        rc = "" if step["exit_code"] is None else str(step["exit_code"])
        timing = f"{step['seconds']:>6.1f} {step['limit_s']:>6}"
        lines.append(f"{step['name']:<26} {step['status']:<8} {rc:>4} {timing}  {_detail(step)}")
    totals = ", ".join(f"{count} {status}" for status, count in result["totals"].items())
    tests = ", ".join(f"{count} {kind}" for kind, count in result["tests"].items())
    lines.append(f"steps: {totals}; tests: {tests}; {result['seconds']} s")
    lines.extend(
        f"goal {goal['verdict']}: {goal['goal']}: {goal['figure']} (goal {goal['target']})" for goal in result["goals"]
    )
    lines.append(f"gpu: {result['gpu']}")
    if result["still_to_run"]:
        lines.append(f"still to run: bash tools/gpu_check.sh --only {','.join(result['still_to_run'])}")
    return "\n".join(lines)


def _detail(step: dict[str, Any]) -> str:
    """The one thing to read about a step: why it skipped, its counts, its headline figure."""
    if step["reason"]:
        return step["reason"]
    tests, figures = step.get("tests"), step["figures"]
    if tests is not None:
        detail = ", ".join(f"{tests[kind]} {kind}" for kind in ("passed", "failed", "errors", "skipped"))
        reasons = list(tests["skip_reasons"])
        return detail + (f" ({reasons[0]})" if reasons else "")
    if "skipped" in figures:
        return figures["skipped"]
    if "goals" in figures:
        met = sum(goal["verdict"] == "pass" for goal in figures["goals"])
        return f"goals met: {met} of {len(figures['goals'])}"
    if "result" in figures:
        return figures["result"]
    return step["tail"][-1] if step["tail"] else ""


def main(argv: list[str]) -> int:
    """Dispatch the subcommand in ``argv`` (see the module's docstring)."""
    commands = {
        "probe": lambda args: probe(*args),
        "versions": lambda args: versions(Path(args[0])),
        "record": lambda args: record(Path(args[0]), *args[1:7], args[7] if len(args) > 7 else ""),
        "summary": lambda args: summary(Path(args[0]), Path(args[1])),
    }
    if not argv or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
