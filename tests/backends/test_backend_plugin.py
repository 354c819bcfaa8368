"""The example backend package (``examples/backend_plugin``): installed with pip into a
temporary folder, found by unicoll through its ``unicoll.backends`` entry point, and run
through the conformance matrix like the built-in backends (1 to 3 ranks, one spawned world
each)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.background import Worlds
from helpers.conformance import assert_all_passed, by_operator, cases, run_cases

SOURCE = Path(__file__).resolve().parents[2] / "examples" / "backend_plugin"
WORLD_SIZES = (1, 2, 3)


def _capabilities():
    """The example's capability table, read from its source (the matrix is generated when
    tests are collected, before the package is installed)."""
    spec = importlib.util.spec_from_file_location("unicoll_pairwise_source", SOURCE / "unicoll_pairwise.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CAPABILITIES


CAPABILITIES = _capabilities()
MATRIX = {w: cases(CAPABILITIES, w) for w in WORLD_SIZES}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example installed by pip into a folder of its own, put on ``sys.path`` (which the
    spawned ranks inherit) for the duration of this module."""
    root = tmp_path_factory.mktemp("plugin")
    source, target = root / "source", root / "site"
    shutil.copytree(SOURCE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "--target", str(target), str(source)], check=True, capture_output=True, timeout=120)
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    yield target
    sys.path.remove(str(target))


@pytest.fixture(scope="module")
def worlds(installed: Path) -> Worlds:
    """Every world of the matrix, started at once, two at a time, the largest first."""
    started = Worlds(parallel=2)
    for w in sorted(WORLD_SIZES, reverse=True):
        started.start(w, run_cases, w, MATRIX[w], backend="pairwise", timeout=240)
    return started


def test_info_lists_the_installed_backend(installed: Path) -> None:
    env = {"PYTHONPATH": str(installed), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "unicoll", "info"], capture_output=True, text=True, env=env, check=True)
    assert any(line.split() == ["pairwise", "usable"] for line in out.stdout.splitlines()), out.stdout


@pytest.mark.parametrize(
    ("w", "group"), [(w, group) for w in WORLD_SIZES for group in by_operator(MATRIX[w]).values()],
    ids=[f"W{w}-{op}" for w in WORLD_SIZES for op in by_operator(MATRIX[w])],
)  # fmt: skip
def test_conformance(w, group, worlds) -> None:
    """Every case of one operator on one world of the plugin backend; a failure names each case that failed."""
    assert_all_passed(worlds.results(w, run_cases, w, MATRIX[w], backend="pairwise", timeout=240), group)


def test_the_moe_column_names_the_entry_points_the_backend_overrides(installed: Path) -> None:
    """The example moves MoE rows itself: its table says so, and its class overrides exactly
    those entry points (the conformance matrix above holds them to the reference)."""
    import unicoll_pairwise

    from unicoll.backends.base import MOE_ENTRY_POINTS, Backend

    overridden = {name for name in MOE_ENTRY_POINTS if getattr(unicoll_pairwise.PairwiseBackend, name)
                  is not getattr(Backend, name)}  # fmt: skip
    assert overridden == set(unicoll_pairwise.CAPABILITIES.moe) == set(MOE_ENTRY_POINTS)


def _static_step_counted(rank: int) -> dict:
    """A static dispatch, combine and backward pass on the plugin, counting the calls of its
    static entry points (the front end goes through them, the backward passes too)."""
    import torch
    import unicoll_pairwise

    import unicoll as uc

    calls: list[str] = []
    for name in ("moe_dispatch_static", "moe_combine_static"):
        original = getattr(unicoll_pairwise.PairwiseBackend, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        setattr(unicoll_pairwise.PairwiseBackend, name, counted)
    x = (torch.arange(8.0).reshape(4, 2) + 10 * rank).requires_grad_()
    ids = torch.tensor([[0, 1], [1, -1], [0, 0], [1, 0]])
    rows, counts, handle = uc.moe.dispatch_static(x, ids, experts_per_rank=1, capacity=4)
    out = uc.moe.combine_static(rows * 2, handle)
    out.sum().backward()
    return {"calls": calls, "out": out.tolist(), "x": x.tolist(), "grad": x.grad.tolist()}


def test_the_static_mode_goes_through_the_entry_points(installed: Path) -> None:
    """dispatch_static, combine_static and both backward passes reach the plugin's own static
    entry points, and give the hand-computed result: each token's row times 2 per slot sent."""
    import unicoll as uc

    slots = [2, 1, 2, 2]  # slots of each token that are not -1 (capacity 4 keeps every one)
    for report in uc.testing.spawn(_static_step_counted, 2, backend="pairwise", timeout=120):
        assert report["calls"] == ["moe_dispatch_static", "moe_combine_static"] * 2
        assert report["out"] == [[2 * n * v for v in row] for n, row in zip(slots, report["x"])]
        assert report["grad"] == [[2.0 * n] * 2 for n in slots]
