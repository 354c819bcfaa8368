"""The GPU backends, found from their capability tables, as pytest parameters that carry the
``gpu`` marker and skip, with the probe's reason, where the backend cannot run."""

from __future__ import annotations

from typing import Any

import pytest

import unicoll as uc
from unicoll import registry
from unicoll.backends.base import Capabilities

#: Every registered backend that moves CUDA arrays.
GPU_BACKENDS = [name for name, f in registry.registered().items() if "cuda" in f.capabilities.devices]


def marks(name: str) -> list:
    """The ``gpu`` marker and a skip with the backend's reason when it is not usable here."""
    reason = registry.registered()[name].probe()
    return [pytest.mark.gpu, pytest.mark.skipif(reason is not None, reason=f"{name}: {reason}")]


def params(*extra: tuple) -> list:
    """One parameter per GPU backend (times each of ``extra``'s values), marked as above."""
    combos = extra or ((),)
    return [
        pytest.param(name, *values, marks=marks(name), id="-".join([name, *map(str, values)]))
        for name in GPU_BACKENDS
        for values in combos
    ]


class OnGloo:
    """The factory of ``backend`` (a TorchDistBackend class, named ``name``, with ``table``)
    driving gloo: a GPU backend's own code path run on the host."""

    def __init__(self, backend: type, name: str, table: Capabilities) -> None:
        self.backend, self.name, self.capabilities = backend, name, table

    def probe(self) -> None:
        return None

    def __call__(self, *, rank: int, world_size: int, timeout: float) -> Any:
        return self.backend(self.name, "gloo", self.capabilities, rank=rank, world_size=world_size, timeout=timeout)


def start_on_gloo(registered: str, backend: type, name: str, table: Capabilities) -> None:
    """Register and start :class:`OnGloo` of ``backend`` as ``registered``."""
    registry.register_backend(registered, OnGloo(backend, name, table))
    uc.init(registered)


def device_path() -> Capabilities:
    """The table of torch-nccl's transport driving gloo on the host (:func:`restart_on_the_device_path`)."""
    from unicoll.backends.base import reductions
    from unicoll.backends.torch import nccl as torch_nccl

    return Capabilities(
        ops=torch_nccl.CAPABILITIES.ops,
        dtypes=frozenset({"float32", "float64", "int64", "bool"}),
        devices=frozenset({"cpu"}),
        libraries=frozenset({"numpy", "torch"}),
        reductions=reductions(frozenset({"float32", "float64", "int64"})),
    )


def restart_on_the_device_path(name: str) -> None:
    """Restart this rank on torch-nccl's transport driving gloo, registered as ``name``: a
    device backend's code path (``host_memory`` False) on CPU arrays, which a host backend
    does not take."""
    from unicoll.backends.torch.transport import TorchNcclBackend

    uc.finalize()
    start_on_gloo(name, TorchNcclBackend, name, device_path())
