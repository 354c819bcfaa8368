"""The ``cupy-nccl`` backend entry: CuPy's NCCL bindings for cupy arrays.

Registered so that ``unicoll info`` and backend selection report it; the transport itself
is not part of this release, and the entry says so instead of starting.
"""

from __future__ import annotations

from ..arrays import DTYPES
from ..errors import BackendUnavailableError
from ..spec import OPS
from .base import Backend, Capabilities

CAPABILITIES = Capabilities(
    ops=frozenset(OPS),
    dtypes=frozenset(DTYPES) - {"bfloat16"},
    devices=frozenset({"cuda"}),
    libraries=frozenset({"cupy"}),
)


class CupyNcclFactory:
    """Registered as ``cupy-nccl``: reports what is missing on this machine."""

    capabilities = CAPABILITIES

    def probe(self) -> str | None:
        try:
            import cupy
            from cupy.cuda import nccl  # noqa: F401
        except Exception as exc:  # ImportError, or a CUDA library that fails to load
            return f"cupy with NCCL is not importable ({type(exc).__name__}: {exc})"
        try:
            devices = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # cupy raises CUDARuntimeError without a driver
            return f"no CUDA device is usable ({type(exc).__name__}: {exc})"
        if devices == 0:
            return "no CUDA device is visible"
        return "the cupy-nccl transport is not included in this release of unicoll"

    def __call__(self, *, rank: int, world_size: int, timeout: float) -> Backend:
        raise BackendUnavailableError(f"backend 'cupy-nccl' is not usable here: {self.probe()}")
