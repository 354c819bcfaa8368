"""Which cupy and NCCL packages fit this machine's CUDA: the install hint of ``cupy-nccl``'s probe
and of ``unicoll info``.

cupy and NCCL come as one package per CUDA major version (``cupy-cuda12x`` with
``nvidia-nccl-cu12``, ``cupy-cuda13x`` with ``nvidia-nccl-cu13``), and unicoll has one extra for
each (``unicoll[cupy-cuda12]``, ``unicoll[cupy-cuda13]``). The CUDA to match is the one torch is
built for (its wheels bring that CUDA's NCCL), else the newest the driver supports. Nothing here
imports cupy; torch, ctypes and importlib.metadata (which loads socket) are imported only when
asked, since ``import unicoll`` imports this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: The CUDA major versions that unicoll has an extra for.
CUDA_MAJORS = (12, 13)

#: Where the CUDA driver's library is found (Linux, then Windows).
DRIVER_LIBRARIES = ("libcuda.so.1", "nvcuda.dll")


@dataclass(frozen=True)
class Cuda:
    """The CUDA version the packages should match, and where it was read."""

    version: str | None
    """``"13.0"``, or None where neither torch nor the driver reports one."""
    source: str
    """What reported the version (``"torch 2.11.0+cu130"``), or why there is none."""

    @property
    def major(self) -> int | None:
        """The major version, or None."""
        return None if self.version is None else int(self.version.split(".")[0])

    @property
    def described(self) -> str:
        """``"CUDA 13.0, from torch 2.11.0+cu130"``, or ``"no CUDA found: ..."``."""
        return f"no CUDA found: {self.source}" if self.version is None else f"CUDA {self.version}, from {self.source}"


def detect() -> Cuda:
    """The CUDA that torch is built for, else the newest one the driver supports."""
    import torch

    built_for = torch.version.cuda
    if built_for:
        return Cuda(built_for, f"torch {torch.__version__}")
    driver = driver_cuda()
    if driver is not None:
        return Cuda(driver, "the CUDA driver")
    return Cuda(None, f"torch {torch.__version__} has no CUDA build and no CUDA driver is loaded")


def driver_cuda() -> str | None:
    """The newest CUDA version the installed driver supports (``"13.0"``), or None without one."""
    import ctypes

    for name in DRIVER_LIBRARIES:
        try:
            driver = ctypes.CDLL(name)
        except OSError:
            continue
        found = ctypes.c_int(0)
        if driver.cuDriverGetVersion(ctypes.byref(found)) == 0 and found.value > 0:
            return f"{found.value // 1000}.{found.value % 1000 // 10}"
    return None


def cupy_package(major: int) -> str:
    """The cupy package built for CUDA ``major``."""
    return f"cupy-cuda{major}x"


def nccl_package(major: int) -> str:
    """The NCCL package built for CUDA ``major``."""
    return f"nvidia-nccl-cu{major}"


def installed(package: str) -> bool:
    """Whether the distribution ``package`` is installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(package)
    except PackageNotFoundError:
        return False
    return True


def of_installed_cupy() -> Cuda:
    """The CUDA of the cupy package installed from PyPI (``cupy-cuda13x``), else :func:`detect`'s."""
    for major in CUDA_MAJORS:
        if installed(cupy_package(major)):
            return Cuda(str(major), cupy_package(major))
    return detect()


def named(cuda: Cuda, package_of: Callable[[int], str]) -> str:
    """The package ``package_of`` names for ``cuda``; where unicoll has no extra for it, each major's."""
    majors = (cuda.major,) if cuda.major in CUDA_MAJORS else CUDA_MAJORS
    return " or ".join(package_of(major) for major in majors)


def install_hint(cuda: Cuda) -> str:
    """The pip command that installs cupy and NCCL for ``cuda``; for each major with an extra when
    ``cuda`` has none."""
    if cuda.major in CUDA_MAJORS:
        return f"pip install 'unicoll[cupy-cuda{cuda.major}]' ({cuda.described})"
    choices = " or ".join(f"'unicoll[cupy-cuda{major}]' for CUDA {major}" for major in CUDA_MAJORS)
    return f"pip install {choices} ({cuda.described})"
