"""The backend registry: who is registered, who can run here, and which one to start.

Built-in backends register with :func:`register_backend` when ``unicoll.backends`` is
imported; other packages do the same, or declare a factory in the ``unicoll.backends``
entry-point group, which is read once, the first time the registry is consulted.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .backends.base import BackendFactory
from .errors import BackendUnavailableError

if TYPE_CHECKING:
    from .backends.cupy.packages import Cuda

ENV_VAR = "UNICOLL_BACKEND"
ENTRY_POINT_GROUP = "unicoll.backends"

_factories: dict[str, BackendFactory] = {}
_entry_points_loaded = False


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make backend ``name`` selectable by :func:`unicoll.init` and ``UNICOLL_BACKEND``.

    ``factory`` has a ``capabilities`` table, a ``probe()`` that returns None when the
    backend can run here (else the reason it cannot) and is called as
    ``factory(rank=..., world_size=..., timeout=...)`` to start it. Registering a name
    again replaces the earlier factory.
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"register_backend: name: expected a non-empty string other than 'auto', got {name!r}")
    for attribute in ("capabilities", "probe"):
        if not hasattr(factory, attribute):
            raise TypeError(f"register_backend: factory: expected an object with .{attribute}, got {factory!r}")
    _factories[name] = factory


def registered() -> dict[str, BackendFactory]:
    """Every registered backend by name, built-ins first, then entry points."""
    global _entry_points_loaded
    if not _entry_points_loaded:
        from importlib.metadata import entry_points  # loads socket, through email: only when asked

        _entry_points_loaded = True
        for point in entry_points(group=ENTRY_POINT_GROUP):
            if point.name not in _factories:
                register_backend(point.name, point.load())
    return dict(_factories)


def resolve(requested: str | None) -> str:
    """The backend to start: ``requested`` > ``$UNICOLL_BACKEND`` > ``"auto"``.

    ``auto`` is ``torch-nccl`` where CUDA and NCCL are usable, else ``gloo``. A name that is
    unknown or cannot run here raises, listing the names that can.
    """
    factories = registered()
    source = "init(backend=...)"
    name = requested
    if name is None:
        name, source = os.environ.get(ENV_VAR, "auto"), f"${ENV_VAR}"
    if name == "auto":
        return "torch-nccl" if "torch-nccl" in factories and factories["torch-nccl"].probe() is None else "gloo"
    if name not in factories:
        raise BackendUnavailableError(
            f"{source}: unknown backend {name!r}; registered: {', '.join(sorted(factories))}; "
            f"usable here: {', '.join(usable_names()) or 'none'}"
        )
    reason = factories[name].probe()
    if reason is not None:
        raise BackendUnavailableError(
            f"{source}: backend {name!r} is not usable here: {reason}; "
            f"usable here: {', '.join(usable_names()) or 'none'}"
        )
    return name


def usable_names() -> list[str]:
    """Names of the registered backends that can run on this machine."""
    return [name for name, factory in registered().items() if factory.probe() is None]


def format_info() -> str:
    """The text of ``unicoll info``: versions, the array libraries found (numpy, torch, cupy, and
    those that join through torch: Paddle, JAX), each backend and whether it can run here."""
    from importlib.metadata import PackageNotFoundError, version
    from importlib.util import find_spec

    from .libraries import joined

    def version_of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    from .backends.cupy import packages as cupy_packages

    cuda = cupy_packages.detect()
    lines = [f"unicoll {version_of('unicoll')}"]
    lines += [
        f"  {package}: {version_of(package)}"
        for package in ("numpy", "array-api-compat", "torch", *_cupy_packages(cuda), "mpi4py", "mpich")
    ]
    lines.append(f"  cuda: {cuda.version} (from {cuda.source})" if cuda.version else f"  cuda: none ({cuda.source})")
    lines.append("array libraries:")
    lines += [f"  {name:<12} {'found' if find_spec(name) else 'not installed'}" for name in ("numpy", "torch", "cupy")]
    lines += [
        f"  {name:<12} {version_of(library.package) if find_spec(library.module) else 'not installed'}"
        f" (joins through torch tensors, DLPack; pip install {library.package})"
        for name, library in joined().items()
    ]
    lines.append("backends:")
    for name, factory in registered().items():
        reason = factory.probe()
        lines.append(f"  {name:<12} {'usable' if reason is None else 'not usable: ' + reason}")
    lines.append(f"auto picks: {resolve('auto')}")
    selected = os.environ.get(ENV_VAR)
    if selected:
        lines.append(f"${ENV_VAR}={selected}")
    return "\n".join(lines)


def _cupy_packages(cuda: Cuda) -> list[str]:
    """The cupy and NCCL packages ``unicoll info`` lists: those of ``cuda``'s major and any other
    major's that are installed; both majors' where neither applies."""
    from .backends.cupy import packages

    majors = [
        major
        for major in packages.CUDA_MAJORS
        if major == cuda.major
        or packages.installed(packages.cupy_package(major))
        or packages.installed(packages.nccl_package(major))
    ] or list(packages.CUDA_MAJORS)
    return [package_of(major) for major in majors for package_of in (packages.cupy_package, packages.nccl_package)]
