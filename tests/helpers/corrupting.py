"""A transport that corrupts one block on demand, for the tests of verification.

:class:`Corrupting` wraps a running backend (gloo, or mpi) and moves everything through its
primitives; after :func:`arm`, the next transfer on the armed rank changes the block that
arrived from one source rank, in one of the ways of :data:`KINDS`, once. Its operators are the
ones :class:`~unicoll.backends.base.Backend` composes from those primitives, so every operator
and both MoE modes, forward and backward, reach it. It is registered through the plugin
mechanism (:func:`unicoll.register_backend`) as ``corrupting-gloo``, ``corrupting-mpi`` and
``corrupting-device-path`` (torch-nccl's transport driving gloo: a GPU backend's logic on the host).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import unicoll as uc
from unicoll.backends.base import Backend, Work
from unicoll.backends.host import host_view
from unicoll.backends.wrapped import Wrapped

KINDS = ("bit", "other rank", "swapped rows", "zeros", "nan bits")
"""How a block is changed: one bit flipped; the block of another source rank in its place; its
first two rows swapped; zeros; the payload bits of a NaN it holds changed (still NaN)."""


@dataclass
class _Armed:
    kind: str
    source: int
    receiver: int


_armed: _Armed | None = None


def arm(kind: str, source: int, receiver: int) -> None:
    """On rank ``receiver`` of the world (every rank may call it), corrupt the next block it gets
    from ``source`` (group positions), as ``kind``."""
    global _armed
    assert kind in KINDS, kind
    if uc.get_rank() == receiver:
        _armed = _Armed(kind, source, receiver)


def armed() -> bool:
    """Whether a corruption is still to happen."""
    return _armed is not None


def _corrupt(rows: np.ndarray, others: np.ndarray | None, kind: str) -> None:
    """Change ``rows`` (host view of one block, at least one row) in place as ``kind``."""
    flat = rows.reshape(rows.shape[0], -1).view(np.uint8)
    if kind == "bit":
        flat[0, flat.shape[1] // 2] ^= 0x10
    elif kind == "other rank":
        rows[...] = others[: rows.shape[0]]
    elif kind == "swapped rows":
        rows[[0, 1]] = rows[[1, 0]]
    elif kind == "zeros":
        rows[...] = 0
    else:  # nan bits: the block's NaNs get another payload
        words = rows.reshape(-1).view(np.uint32 if rows.dtype.itemsize == 4 else np.uint64)
        nans = np.flatnonzero(np.isnan(rows.reshape(-1)))
        words[nans[0]] ^= 1


class Corrupting(Wrapped):
    """``inner``, whose transfers change one block after :func:`arm`."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.name = "corrupting-" + inner.name

    def _after(self, out: Any, splits: Sequence[int], group: Any) -> None:
        """Corrupt ``out``'s block from the armed source, when this rank is the armed receiver."""
        global _armed
        if _armed is None or group.rank != _armed.receiver or splits[_armed.source] == 0:
            return
        rows = host_view(out)
        starts = np.concatenate([[0], np.cumsum(splits)])
        block = rows[starts[_armed.source] : starts[_armed.source + 1]]
        other = (_armed.source + 1) % len(splits)
        others = rows[starts[other] : starts[other + 1]]
        _corrupt(block, others, _armed.kind)
        _armed = None

    def alltoallv(
        self,
        out: Any,
        x: Any,
        out_splits: list[int],
        in_splits: list[int],
        group: Any,
        async_op: bool,
        calc_stream: bool = False,
    ) -> Work | None:
        self.inner.alltoallv(out, x, out_splits, in_splits, group, False)  # corrupted once it has arrived
        self._after(out, out_splits, group)
        return None if not async_op else _Done()

    def all_gather_even(self, out: Any, x: Any, group: Any, async_op: bool, calc_stream: bool = False) -> Work | None:
        self.inner.all_gather_even(out, x, group, False)
        self._after(out, [x.shape[0]] * group.world_size, group)
        return None if not async_op else _Done()

    def allreduce(self, x: Any, op: str, group: Any, async_op: bool, calc_stream: bool = False) -> Work | None:
        self.inner.allreduce(x, op, group, False)
        self._after(x.reshape(1, -1), [1 if r == 0 else 0 for r in range(group.world_size)], group)
        return None if not async_op else _Done()

    def reduce_scatter_even(
        self, out: Any, x: Any, op: str, group: Any, async_op: bool, calc_stream: bool = False
    ) -> Work | None:
        return self.inner.reduce_scatter_even(out, x, op, group, async_op)

    def bcast(self, x: Any, src: int, group: Any, async_op: bool, calc_stream: bool = False) -> Work | None:
        self.inner.bcast(x, src, group, False)
        self._after(x, [x.shape[0] if r == src else 0 for r in range(group.world_size)], group)
        return None if not async_op else _Done()


class _Done:
    """The work of a transfer that has completed (the corruption runs as it completes)."""

    def wait(self, timeout: float) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class CorruptingFactory:
    """Starts the backend ``base`` (a backend factory) starts, wrapped in :class:`Corrupting`."""

    def __init__(self, base: Any) -> None:
        self._base = base
        self.capabilities = base.capabilities

    def probe(self) -> str | None:
        return self._base.probe()

    def __call__(self, *, rank: int, world_size: int, timeout: float) -> Backend:
        return Corrupting(self._base(rank=rank, world_size=world_size, timeout=timeout))


def register() -> None:
    """Register ``corrupting-gloo``, ``corrupting-mpi`` (where mpi4py is installed) and
    ``corrupting-device-path`` (torch-nccl's transport driving gloo, a GPU backend's code path
    on the host: :func:`helpers.gpu_backends.device_path`)."""
    from helpers.gpu_backends import OnGloo, device_path
    from unicoll import registry
    from unicoll.backends.torch.transport import TorchNcclBackend

    built_in = registry.registered()
    uc.register_backend("corrupting-gloo", CorruptingFactory(built_in["gloo"]))
    uc.register_backend("corrupting-mpi", CorruptingFactory(built_in["mpi"]))
    uc.register_backend(
        "corrupting-device-path", CorruptingFactory(OnGloo(TorchNcclBackend, "torch-nccl", device_path()))
    )
