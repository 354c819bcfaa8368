"""Which cupy and NCCL packages ``cupy-nccl``'s probe and ``unicoll info`` name, for the CUDA that
torch or the driver reports, checked with that CUDA faked: torch's ``torch.version.cuda``, the
driver's ``cuDriverGetVersion`` through a stand-in for ``ctypes.CDLL``, and the installed
distributions."""

from __future__ import annotations

import ctypes
import importlib.metadata
import re
import sys
import types
from importlib.metadata import PackageNotFoundError
from pathlib import Path

import pytest
import torch

from unicoll import registry
from unicoll.backends.cupy import nccl as cupy_nccl
from unicoll.backends.cupy import packages

TORCH = torch.__version__


class _Driver:
    """A stand-in for the CUDA driver's library that reports ``version`` (12080 is CUDA 12.8)."""

    def __init__(self, version: int) -> None:
        self.version = version

    def cuDriverGetVersion(self, pointer) -> int:  # the driver's own name
        ctypes.cast(pointer, ctypes.POINTER(ctypes.c_int)).contents.value = self.version
        return 0


def _fake_cuda(monkeypatch, built_for: str | None, driver: int | None) -> None:
    """torch built for CUDA ``built_for`` (None: no CUDA build), and a driver that supports
    ``driver`` (None: no driver library)."""
    monkeypatch.setattr(torch.version, "cuda", built_for)

    def load(name: str) -> _Driver:
        if driver is None:
            raise OSError(f"{name}: cannot open shared object file")
        return _Driver(driver)

    monkeypatch.setattr(ctypes, "CDLL", load)


def _fake_installed(monkeypatch, *names: str) -> None:
    """Only the distributions ``names`` (and every one that is not cupy's or NCCL's) are installed."""
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name.startswith(("cupy-cuda", "nvidia-nccl-cu")):
            if name not in names:
                raise PackageNotFoundError(name)
            return "14.2.0"
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


@pytest.mark.parametrize(
    ("built_for", "driver", "expected"),
    [
        ("13.0", 12080, packages.Cuda("13.0", f"torch {TORCH}")),  # torch's CUDA first
        ("12.6", None, packages.Cuda("12.6", f"torch {TORCH}")),
        (None, 13000, packages.Cuda("13.0", "the CUDA driver")),  # a CPU build of torch: the driver's
        (None, 12080, packages.Cuda("12.8", "the CUDA driver")),
        (None, None, packages.Cuda(None, f"torch {TORCH} has no CUDA build and no CUDA driver is loaded")),
    ],
)
def test_detect_reads_torch_then_the_driver(monkeypatch, built_for, driver, expected) -> None:
    _fake_cuda(monkeypatch, built_for, driver)
    assert packages.detect() == expected


def test_a_driver_that_fails_or_reports_nothing_is_no_driver(monkeypatch) -> None:
    _fake_cuda(monkeypatch, None, 0)
    assert packages.driver_cuda() is None
    monkeypatch.setattr(_Driver, "cuDriverGetVersion", lambda self, pointer: 3)  # CUDA_ERROR_NOT_INITIALIZED
    assert packages.driver_cuda() is None


@pytest.mark.parametrize(
    ("cuda", "hint"),
    [
        (
            packages.Cuda("13.0", "torch 2.11.0+cu130"),
            "pip install 'unicoll[cupy-cuda13]' (CUDA 13.0, from torch 2.11.0+cu130)",
        ),
        (
            packages.Cuda("12.8", "the CUDA driver"),
            "pip install 'unicoll[cupy-cuda12]' (CUDA 12.8, from the CUDA driver)",
        ),
        (
            packages.Cuda("11.8", "torch 2.4.0+cu118"),
            "pip install 'unicoll[cupy-cuda12]' for CUDA 12 or 'unicoll[cupy-cuda13]' for CUDA 13 (CUDA 11.8, from torch 2.4.0+cu118)",
        ),
        (
            packages.Cuda(None, "torch 2.13.0+cpu has no CUDA build and no CUDA driver is loaded"),
            "pip install 'unicoll[cupy-cuda12]' for CUDA 12 or 'unicoll[cupy-cuda13]' for CUDA 13 "
            "(no CUDA found: torch 2.13.0+cpu has no CUDA build and no CUDA driver is loaded)",
        ),
    ],
)
def test_install_hint_names_the_extra_of_the_cuda_major(cuda, hint) -> None:
    assert packages.install_hint(cuda) == hint


def test_each_major_has_an_extra_with_the_packages_it_names() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for major in packages.CUDA_MAJORS:
        names = {re.match(r"[\w-]+", requirement).group() for requirement in extras[f"cupy-cuda{major}"]}
        assert names == {packages.cupy_package(major), packages.nccl_package(major)}
    assert extras["cupy"] == ["unicoll[cupy-cuda12]"]  # the name from before the extras per major


def _without_cupy(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError


def _cupy_without_nccl(monkeypatch) -> None:
    """A stand-in cupy 14 that sees one device and cannot load NCCL."""
    fake = types.ModuleType("cupy")
    fake.__version__ = "14.2.0"
    fake.cuda = types.ModuleType("cupy.cuda")
    fake.cuda.runtime = types.SimpleNamespace(getDeviceCount=lambda: 1)
    fake.cuda.nccl = types.ModuleType("cupy.cuda.nccl")
    fake.cuda.nccl.available = False
    for module in (fake, fake.cuda, fake.cuda.nccl):
        monkeypatch.setitem(sys.modules, module.__name__, module)


def test_probe_without_cupy_names_the_package_of_torchs_cuda(monkeypatch) -> None:
    _without_cupy(monkeypatch)
    _fake_cuda(monkeypatch, "13.0", 13000)
    assert cupy_nccl.CupyNcclFactory().probe() == (
        "the package cupy-cuda13x is not installed (import of cupy halted; None in sys.modules); "
        f"pip install 'unicoll[cupy-cuda13]' (CUDA 13.0, from torch {TORCH})"
    )


def test_probe_without_cupy_or_cuda_names_both_majors(monkeypatch) -> None:
    _without_cupy(monkeypatch)
    _fake_cuda(monkeypatch, None, None)
    assert cupy_nccl.CupyNcclFactory().probe() == (
        "the package cupy-cuda12x or cupy-cuda13x is not installed (import of cupy halted; None in sys.modules); "
        "pip install 'unicoll[cupy-cuda12]' for CUDA 12 or 'unicoll[cupy-cuda13]' for CUDA 13 "
        f"(no CUDA found: torch {TORCH} has no CUDA build and no CUDA driver is loaded)"
    )


@pytest.mark.parametrize("major", packages.CUDA_MAJORS)
def test_probe_without_nccl_names_the_nccl_of_the_installed_cupy(monkeypatch, major) -> None:
    """cupy-cuda{major}x is installed: its CUDA decides, whatever torch is built for."""
    _cupy_without_nccl(monkeypatch)
    _fake_cuda(monkeypatch, "12.6" if major == 13 else "13.0", None)
    _fake_installed(monkeypatch, f"cupy-cuda{major}x")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert cupy_nccl.CupyNcclFactory().probe() == (
        f"cupy cannot load the NCCL library: the package nvidia-nccl-cu{major} is missing; "
        f"pip install 'unicoll[cupy-cuda{major}]' (CUDA {major}, from cupy-cuda{major}x)"
    )


def test_probe_without_nccl_and_a_cupy_from_elsewhere_reads_the_driver(monkeypatch) -> None:
    _cupy_without_nccl(monkeypatch)
    _fake_cuda(monkeypatch, None, 12040)
    _fake_installed(monkeypatch)
    assert cupy_nccl.CupyNcclFactory().probe() == (
        "cupy cannot load the NCCL library: the package nvidia-nccl-cu12 is missing; "
        "pip install 'unicoll[cupy-cuda12]' (CUDA 12.4, from the CUDA driver)"
    )


def _info_lines(monkeypatch, built_for: str | None, driver: int | None, *installed: str) -> list[str]:
    _without_cupy(monkeypatch)
    _fake_cuda(monkeypatch, built_for, driver)
    _fake_installed(monkeypatch, *installed)
    return registry.format_info().splitlines()


def _listed(lines: list[str]) -> list[str]:
    """The cupy and NCCL packages that ``unicoll info`` lists."""
    return [line.split(":")[0].strip() for line in lines if line.startswith(("  cupy-cuda", "  nvidia-nccl-cu"))]


def test_info_names_the_packages_of_torchs_cuda(monkeypatch) -> None:
    lines = _info_lines(monkeypatch, "13.0", 13000)
    assert _listed(lines) == ["cupy-cuda13x", "nvidia-nccl-cu13"]
    assert f"  cuda: 13.0 (from torch {TORCH})" in lines
    (cupy_line,) = [line for line in lines if line.startswith("  cupy-nccl ")]
    assert cupy_line.endswith(
        f"not installed (import of cupy halted; None in sys.modules); pip install 'unicoll[cupy-cuda13]' (CUDA 13.0, from torch {TORCH})"
    )


def test_info_lists_what_is_installed_beside_the_cuda_major(monkeypatch) -> None:
    lines = _info_lines(monkeypatch, None, 13000, "nvidia-nccl-cu12")
    assert _listed(lines) == ["cupy-cuda12x", "nvidia-nccl-cu12", "cupy-cuda13x", "nvidia-nccl-cu13"]
    assert "  cuda: 13.0 (from the CUDA driver)" in lines


def test_info_without_cuda_lists_both_majors(monkeypatch) -> None:
    lines = _info_lines(monkeypatch, None, None)
    assert _listed(lines) == ["cupy-cuda12x", "nvidia-nccl-cu12", "cupy-cuda13x", "nvidia-nccl-cu13"]
    assert f"  cuda: none (torch {TORCH} has no CUDA build and no CUDA driver is loaded)" in lines
