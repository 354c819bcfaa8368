"""The built-in backends, registered through the same :func:`unicoll.register_backend` as any other."""

from __future__ import annotations

from ..registry import register_backend
from .cupy_nccl import CupyNcclFactory
from .gloo import GlooFactory
from .mpi import MpiFactory
from .torch_nccl import TorchNcclFactory

register_backend("gloo", GlooFactory())
register_backend("torch-nccl", TorchNcclFactory())
register_backend("cupy-nccl", CupyNcclFactory())
register_backend("mpi", MpiFactory())
