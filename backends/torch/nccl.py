"""The ``torch-nccl`` backend: torch.distributed over NCCL, for CUDA torch tensors and cupy arrays.

The transport is :class:`unicoll.backends.torch.transport.TorchNcclBackend`. Streams (docs/semantics.md,
"use_calc_stream"):

- ``use_calc_stream=True`` issues the collective with ``async_op=False``, which torch (2.7 and
  later) launches on the caller's current CUDA stream: no event, no extra stream.
- otherwise it is issued with ``async_op=True``, on the process group's NCCL stream, which
  torch orders after the current stream. With ``sync_op=True`` the current stream then waits
  for it at once; with ``sync_op=False`` it waits in ``Task.wait()``. Neither blocks the host.

cupy arrays travel zero-copy through DLPack, whose stream handshake orders them against
torch's current stream, and come back as cupy arrays. CPU arrays are rejected by the
capability table (``devices={"cuda"}``) with an error naming the backend: nothing is copied
to the device behind the caller's back. The timeout given to ``init`` is enforced by torch's
NCCL watchdog, which aborts a collective that runs past it.
"""

from __future__ import annotations

import os

from unicoll.arrays import DTYPES
from unicoll.backends.base import Backend, Capabilities, devices_short, reductions
from unicoll.libraries import carried_by

CAPABILITIES = Capabilities(
    ops=None,  # every operator the base class composes
    dtypes=frozenset(DTYPES),
    devices=frozenset({"cuda"}),
    libraries=carried_by(frozenset({"torch", "cupy"})),
    reductions=reductions(frozenset(DTYPES)),
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
        return devices_short(torch.cuda.device_count())

    def __call__(self, *, rank: int, world_size: int, timeout: float) -> Backend:
        import torch

        from unicoll.backends.torch.transport import TorchNcclBackend

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return TorchNcclBackend("torch-nccl", "nccl", CAPABILITIES, rank=rank, world_size=world_size, timeout=timeout)
