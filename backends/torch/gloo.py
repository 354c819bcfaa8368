"""The ``gloo`` backend: torch.distributed over gloo, CPU arrays of numpy and torch. Where its
ranks listen and how they connect is :mod:`~unicoll.backends.torch.gloo_world`'s."""

from __future__ import annotations

from unicoll.arrays import DTYPES
from unicoll.backends.base import Backend, Capabilities, reductions
from unicoll.libraries import carried_by

CAPABILITIES = Capabilities(
    ops=None,  # every operator the base class composes
    dtypes=frozenset(DTYPES),
    devices=frozenset({"cpu"}),
    libraries=carried_by(frozenset({"numpy", "torch"})),
    reductions=reductions(frozenset(DTYPES)),
)


class GlooFactory:
    """Registered as ``gloo``: usable wherever torch.distributed with gloo is installed."""

    capabilities = CAPABILITIES

    def probe(self) -> str | None:
        try:
            import torch.distributed as dist
        except ImportError as exc:
            return f"torch is not installed ({exc})"
        if not dist.is_available() or not dist.is_gloo_available():
            return "this torch build has no gloo support"
        return None

    def __call__(self, *, rank: int, world_size: int, timeout: float) -> Backend:
        from unicoll.backends.torch.transport import TorchDistBackend

        return TorchDistBackend("gloo", "gloo", CAPABILITIES, rank=rank, world_size=world_size, timeout=timeout)
