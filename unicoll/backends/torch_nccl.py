"""The ``torch-nccl`` backend: torch.distributed over NCCL, torch CUDA tensors.

This release moves CUDA tensors on the default stream semantics of torch.distributed;
the stream options and cupy arrays on this backend are completed by the GPU-backends work.
"""

from __future__ import annotations

import os

from ..arrays import DTYPES
from ..spec import OPS
from .base import Backend, Capabilities

CAPABILITIES = Capabilities(
    ops=frozenset(OPS),
    dtypes=frozenset(DTYPES),
    devices=frozenset({"cuda"}),
    libraries=frozenset({"torch"}),
)


class TorchNcclFactory:
    """Registered as ``torch-nccl``: needs a CUDA device and a torch build with NCCL."""

    capabilities = CAPABILITIES

    def probe(self) -> str | None:
        try:
            import torch
            import torch.distributed as dist
        except ImportError as exc:
            return f"torch is not installed ({exc})"
        if not torch.cuda.is_available():
            return f"no CUDA device is visible to torch {torch.__version__}"
        if not dist.is_available() or not dist.is_nccl_available():
            return "this torch build has no NCCL support"
        local_ranks, devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
        if local_ranks > devices:
            return (
                f"{local_ranks} ranks on this machine ($LOCAL_WORLD_SIZE) but {devices} CUDA device(s); "
                "NCCL needs one per rank"
            )
        return None

    def __call__(self, *, rank: int, world_size: int, timeout: float) -> Backend:
        import torch

        from .torch_dist import TorchDistBackend

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return TorchDistBackend("torch-nccl", "nccl", CAPABILITIES, rank=rank, world_size=world_size, timeout=timeout)
