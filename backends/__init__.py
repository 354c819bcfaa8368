"""The built-in backends, registered through the same :func:`unicoll.register_backend` as any other."""

from __future__ import annotations

from unicoll.backends.cupy.nccl import CupyNcclFactory
from unicoll.backends.mpi.mpi import MpiFactory
from unicoll.backends.torch.gloo import GlooFactory
from unicoll.backends.torch.nccl import TorchNcclFactory
from unicoll.registry import register_backend

register_backend("gloo", GlooFactory())
register_backend("torch-nccl", TorchNcclFactory())
register_backend("cupy-nccl", CupyNcclFactory())
register_backend("mpi", MpiFactory())
