"""The ``cupy-nccl`` backend entry: CuPy's NCCL bindings, for cupy arrays (and CUDA torch tensors).

What it can move and whether it can run here; the transport itself is
:class:`unicoll.backends.cupy.transport.CupyNcclBackend`, imported only when it starts, so
this module imports neither cupy nor torch.

bfloat16 is not in the table: cupy has no bfloat16 dtype, so a torch bfloat16 tensor has no
cupy view to move. Every other dtype, bool included, moves as raw bytes.
"""

from __future__ import annotations

import os
import warnings

from unicoll.arrays import DTYPES
from unicoll.backends.base import Backend, Capabilities, devices_short, reductions
from unicoll.backends.cupy import packages
from unicoll.libraries import carried_by

CAPABILITIES = Capabilities(
    ops=None,  # every operator the base class composes
    dtypes=frozenset(DTYPES) - {"bfloat16"},
    devices=frozenset({"cuda"}),
    libraries=carried_by(frozenset({"cupy", "torch"})),
    reductions=reductions(frozenset(DTYPES) - {"bfloat16"}),
)

#: The first cupy release whose NCCL unique id is a bytes object (earlier ones used a tuple).
MIN_CUPY = 14


class CupyNcclFactory:
    """Registered as ``cupy-nccl``: needs cupy 14+, a CUDA device per local rank and NCCL."""

    capabilities = CAPABILITIES

    def probe(self) -> str | None:
        try:
            import cupy
        except ModuleNotFoundError as exc:
            cuda = packages.detect()
            missing = packages.named(cuda, packages.cupy_package)
            return f"the package {missing} is not installed ({exc}); {packages.install_hint(cuda)}"
        except Exception as exc:  # a CUDA library that fails to load
            return f"cupy is not importable ({type(exc).__name__}: {exc})"
        major = int(cupy.__version__.split(".")[0])
        if major < MIN_CUPY:
            return f"cupy {cupy.__version__} is too old: cupy-nccl needs cupy {MIN_CUPY} or later"
        try:
            devices = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # cupy raises CUDARuntimeError without a driver
            return f"no CUDA device is usable ({type(exc).__name__}: {exc})"
        if devices == 0:
            return "no CUDA device is visible"
        with warnings.catch_warnings():  # cupy warns at import when libnccl cannot be loaded
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl
        if not nccl.available:
            cuda = packages.of_installed_cupy()
            missing = packages.named(cuda, packages.nccl_package)
            return f"cupy cannot load the NCCL library: the package {missing} is missing; {packages.install_hint(cuda)}"
        return devices_short(devices)

    def __call__(self, *, rank: int, world_size: int, timeout: float) -> Backend:
        import cupy

        from unicoll.backends.cupy.transport import CupyNcclBackend

        cupy.cuda.Device(int(os.environ.get("LOCAL_RANK", "0"))).use()
        return CupyNcclBackend(CAPABILITIES, rank=rank, world_size=world_size, timeout=timeout)
