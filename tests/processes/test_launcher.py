"""Tests of ``unicoll run``: the launcher (rank environment, prefixed output, stopping the
world when a rank fails) and the command line around it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from unicoll import cli
from unicoll.launch import local as launcher

REPO_ROOT = Path(launcher.__file__).resolve().parents[2]

ENV_NAMES = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PYTHONUNBUFFERED",
]

PRINT_ENV = f"""
import os, sys
print(" ".join(f"{{name}}={{os.environ.get(name)}}" for name in {ENV_NAMES!r}))
print("argv", sys.argv[1:])
print("to stderr", file=sys.stderr)
"""

FAIL_ON_RANK_1 = """
import os, sys, time
if os.environ["RANK"] == "1":
    deadline = time.monotonic() + 30
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:  # rank 0 is running
        time.sleep(0.01)
    print("rank 1 gives up")
    sys.exit(3)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(60)
"""


def write_script(directory: Path, name: str, source: str) -> str:
    """Write ``source`` to ``directory/name`` and return its path as a string."""
    path = directory / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def rank_lines(text: str, rank: int) -> list[str]:
    """The lines of ``text`` that ``rank`` printed, without their ``[rank K] `` prefix."""
    prefix = f"[rank {rank}] "
    return [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]


def parse_env_line(line: str) -> dict[str, str]:
    """Turn ``NAME=value NAME=value ...`` into a dict."""
    return dict(item.split("=", 1) for item in line.split())


def test_run_prefixes_output_and_sets_rank_env(tmp_path, capfd):
    script = write_script(tmp_path, "print_env.py", PRINT_ENV)

    assert launcher.run(2, [script, "--flag", "x"]) == 0

    out, err = capfd.readouterr()
    assert all(line.startswith(("[rank 0] ", "[rank 1] ")) for line in out.splitlines())
    ports = set()
    for rank in (0, 1):
        env_line, argv_line = rank_lines(out, rank)
        env = parse_env_line(env_line)
        assert env == {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": env["MASTER_PORT"],
            "PYTHONUNBUFFERED": "1",
        }
        ports.add(env["MASTER_PORT"])
        assert argv_line == "argv ['--flag', 'x']"
        assert rank_lines(err, rank) == ["to stderr"]
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536


def test_run_passes_module_form_and_extra_env(tmp_path, capfd):
    source = 'import os\nprint(os.environ["EXTRA"], os.environ["MASTER_PORT"])\n'
    write_script(tmp_path, "rank_module.py", source)
    extra_env = {"PYTHONPATH": str(tmp_path), "EXTRA": "module"}

    assert launcher.run(2, ["-m", "rank_module"], master_port=29555, env=extra_env) == 0

    out = capfd.readouterr().out
    assert sorted(out.splitlines()) == ["[rank 0] module 29555", "[rank 1] module 29555"]


def test_failing_rank_stops_the_others_quickly(tmp_path, capfd):
    script = write_script(tmp_path, "fail.py", FAIL_ON_RANK_1)
    pid_file = tmp_path / "rank0.pid"

    start = time.monotonic()
    code = launcher.run(2, [script, str(pid_file)])
    elapsed = time.monotonic() - start

    assert code == 3
    assert elapsed < 15
    out, err = capfd.readouterr()
    assert "[rank 1] rank 1 gives up" in out.splitlines()
    assert "unicoll run: rank 1 failed with exit code 3; stopped the other ranks" in err.splitlines()
    with pytest.raises(ProcessLookupError):  # rank 1 failed once rank 0 was running: rank 0 is gone now
        os.kill(int(pid_file.read_text()), 0)


def test_rank_killed_by_a_signal_returns_1(tmp_path, capfd):
    script = write_script(
        tmp_path,
        "kill_self.py",
        """
        import os, signal, time
        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        """,
    )

    assert launcher.run(2, [script]) == 1
    assert "rank 0 failed with exit code -9" in capfd.readouterr().err


def test_run_rejects_an_empty_world(tmp_path):
    with pytest.raises(ValueError, match="nprocs"):
        launcher.run(0, ["script.py"])


def cli_subprocess(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m unicoll ARGS...`` with this checkout importable."""
    python_path = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": python_path}
    return subprocess.run(
        [sys.executable, "-m", "unicoll", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_run_starts_every_rank(tmp_path):
    script = write_script(tmp_path, "print_env.py", PRINT_ENV)

    result = cli_subprocess("run", "-n", "2", script, "-n", "5", "--other")

    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        env_line, argv_line = rank_lines(result.stdout, rank)
        assert parse_env_line(env_line)["RANK"] == str(rank)
        assert argv_line == "argv ['-n', '5', '--other']"
        assert rank_lines(result.stderr, rank) == ["to stderr"]


def test_cli_run_returns_the_failing_rank_code(tmp_path):
    script = write_script(tmp_path, "fail.py", FAIL_ON_RANK_1)

    result = cli_subprocess("run", "-n", "2", script, str(tmp_path / "rank0.pid"))

    assert result.returncode == 3
    assert "unicoll run: rank 1 failed with exit code 3" in result.stderr


def test_cli_info_prints_the_registry_report(monkeypatch, capsys):
    fake_registry = types.ModuleType("unicoll.registry")
    fake_registry.format_info = lambda: "backends: fake"
    monkeypatch.setitem(sys.modules, "unicoll.registry", fake_registry)

    assert cli.main(["info"]) == 0
    assert capsys.readouterr().out == "backends: fake\n"


def test_cli_rejects_a_bad_process_count(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "-n", "0", "script.py"])
    assert exit_info.value.code == 2
    assert "expected a positive integer" in capsys.readouterr().err


def test_each_rank_gets_its_share_of_the_cores(tmp_path, capfd, monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    script = tmp_path / "threads.py"
    script.write_text("import os\nprint('threads', os.environ['OMP_NUM_THREADS'])\n")
    assert launcher.run(2, [str(script)]) == 0
    share = str(max(1, (os.cpu_count() or 1) // 2))
    assert capfd.readouterr().out.count(f"threads {share}") == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert launcher.run(1, [str(script)]) == 0
    assert "threads 7" in capfd.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--master-port", "0"],
            "unicoll run: --master-port: expected a port number from 1 to 65535 (or none, on one node, for a free one), got 0",
        ),
        (
            ["--master-port", "99999"],
            "unicoll run: --master-port: expected a port number from 1 to 65535 (or none, on one node, for a free one), got 99999",
        ),
        (  # an address of TEST-NET-3 (RFC 5737): no machine's; binding it fails and sends nothing
            ["--master-addr", "203.0.113.1"],
            "unicoll run: --master-addr: expected an address of this machine, which hosts rank 0 (--node-rank 0), "
            "got '203.0.113.1' ([Errno 99] Cannot assign requested address)",
        ),
        (["--nnodes", "2"], "unicoll run: --node-rank: expected this node's number from 0 to 1, got none"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--master-port", "29500"],
            "unicoll run: --node-rank: expected this node's number from 0 to 1 (with --nnodes 2), got 2",
        ),
        (
            ["--nnodes", "2", "--node-rank", "1"],
            "unicoll run: --master-port: expected the port rank 0 listens on, the same on all 2 nodes, got none",
        ),
        (
            ["--nnodes", "2", "--node-rank", "1", "--master-port", "29500"],
            "unicoll run: --master-addr: expected an address that the other nodes reach (with --nnodes 2), got "
            "'127.0.0.1', a loopback address",
        ),
        (
            ["--mpi", "--nnodes", "2"],
            "unicoll run: --master-addr/--master-port/--nnodes/--node-rank do not apply to --mpi (MPI connects the "
            "ranks; its launcher places them on nodes)",
        ),
    ],
)
def test_cli_run_refuses_a_rendezvous_it_cannot_start(tmp_path, flags, message):
    """A usage error at once, naming the flag, what it expects and what it got, and no rank
    started; before, port 0 waited out the timeout and 99999 and an address of no machine's
    printed tracebacks."""
    script = write_script(tmp_path, "print_env.py", PRINT_ENV)

    start = time.monotonic()
    result = cli_subprocess("run", "-n", "2", *flags, script)

    assert (result.returncode, result.stderr.strip(), result.stdout) == (2, message, "")
    assert time.monotonic() - start < 10


PARTIAL_LINES = """
import sys, time
for i in range(60):
    print(f"part {i} ", end="", flush=True)
    time.sleep(0.002)  # the other rank writes meanwhile
    print("end", flush=True)
print("to stderr", file=sys.stderr)
print("no newline at the end", end="")
"""


@pytest.mark.parametrize("mpi", [False, True], ids=["gloo", "mpi"])
def test_run_keeps_lines_whole_and_prefixed_on_both_launchers(tmp_path, mpi: bool) -> None:
    """Two ranks writing lines in parts at once: every line arrives whole with its rank's
    prefix, a last line without its newline too, under ``unicoll run`` and ``unicoll run --mpi``
    (whose MPI launcher forwarded the parts as it read them: the ranks' lines merged)."""
    script = write_script(tmp_path, "partial.py", PARTIAL_LINES)
    result = cli_subprocess("run", *(["--mpi"] if mpi else []), "-n", "2", script)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert rank_lines(result.stdout, rank) == [f"part {i} end" for i in range(60)] + ["no newline at the end"]
        assert rank_lines(result.stderr, rank) == ["to stderr"]
    assert all(line.startswith(("[rank 0] ", "[rank 1] ")) for line in result.stdout.splitlines())
