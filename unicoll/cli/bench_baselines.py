"""The raw baselines that ``unicoll bench`` times beside unicoll: the transport's own calls.

torch.distributed for the backends built on it (``gloo``, ``torch-nccl``) and for ``cupy-nccl``
(the bench starts torch's NCCL beside it, on the same GPUs), and bare mpi4py for
``mpi`` (the sums of all_reduce and reduce_scatter on the typed numpy view of the tensor). A
baseline prepares each raw collective on fixed buffers (torch tensors of the bench), so a timed
call is the transport call and nothing else, and gives the bench its barrier and the slowest
rank's figures. Imported only inside the ranks.
"""

from __future__ import annotations

import atexit
import math
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from unicoll.backends.torch import compat


class Baseline(Protocol):
    """The raw transport of one backend, as the bench uses it."""

    name: str
    """How the table names it: ``"torch.distributed"`` or ``"mpi4py"``."""
    device: torch.device
    """Where the bench's tensors live."""
    moe_reorder: bool
    """Whether the raw MoE calls include the hand-written reorder into (out of) expert-major
    order, or are the bare all-to-all of the same bytes."""

    def barrier(self) -> None: ...

    def slowest(self, values: Sequence[float]) -> list[float]:
        """Each value's maximum over the ranks."""

    def alltoallv(
        self, out: torch.Tensor, x: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> Callable[[], Any]:
        """The raw uneven all-to-all of ``x``'s rows into ``out``, ready to call."""

    def all_gather(self, out: Tensor, x: Tensor) -> Callable[[], Any]:
        """The raw all-gather of ``x`` into ``out``, ready to call."""

    def all_reduce(self, x: Tensor) -> Callable[[], Any]:
        """The raw in-place sum of ``x`` over the ranks, ready to call."""

    def reduce_scatter(self, out: Tensor, x: Tensor) -> Callable[[], Any]:
        """The raw sum of ``x`` over the ranks, block r into ``out`` on rank r, ready to call."""

    def broadcast(self, x: Tensor) -> Callable[[], Any]:
        """The raw broadcast of rank 0's ``x``, in place, ready to call."""


def for_backend(backend: str) -> Baseline:
    """The baseline of the running unicoll backend; SystemExit for one the bench cannot compare."""
    if backend == "mpi":
        return MpiBaseline()
    import torch.distributed as dist

    if not dist.is_initialized():
        if backend != "cupy-nccl":
            raise SystemExit(
                f"unicoll bench: backend {backend!r} runs neither on torch.distributed nor on MPI, "
                "the baselines this tool compares with; use gloo, torch-nccl, cupy-nccl or mpi"
            )
        _start_torch_nccl_beside()
    return TorchDistBaseline()


def _start_torch_nccl_beside() -> None:
    """Start torch.distributed's NCCL on the ranks of unicoll's cupy-nccl world, on the same
    GPUs, for the raw baseline. Rank 0 hosts a store on a free port and tells the others the
    port through unicoll's own broadcast; a world of one needs no store but a local one."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    import unicoll as uc

    rank, world = uc.get_rank(), uc.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    timeout = timedelta(seconds=300)
    if world == 1:
        store: Any = dist.HashStore()
    else:
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        host = dist.TCPStore(addr, 0, world, True, timeout, wait_for_workers=False) if rank == 0 else None
        port = torch.tensor([host.port if host is not None else 0], device=device)
        uc.broadcast(port, 0)
        store = host if host is not None else dist.TCPStore(addr, int(port.item()), world, False, timeout)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, timeout=timeout, device_id=device)
    atexit.register(_destroy_torch_world)


def _destroy_torch_world() -> None:
    """At exit, the process group started by :func:`_start_torch_nccl_beside`, unless gone."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class TorchDistBaseline:
    """torch.distributed's default group (gloo or NCCL), the one unicoll's backend created."""

    name = "torch.distributed"
    moe_reorder = True

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        cuda = dist.get_backend() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def barrier(self) -> None:
        self._dist.barrier()

    def slowest(self, values: Sequence[float]) -> list[float]:
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX)
        return t.tolist()

    def alltoallv(
        self, out: torch.Tensor, x: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> Callable[[], Any]:
        return lambda: self._dist.all_to_all_single(out, x, out_splits, in_splits)

    def all_gather(self, out: Tensor, x: Tensor) -> Callable[[], Any]:
        return lambda: compat.all_gather_single(out, x)

    def all_reduce(self, x: Tensor) -> Callable[[], Any]:
        return lambda: self._dist.all_reduce(x)

    def reduce_scatter(self, out: Tensor, x: Tensor) -> Callable[[], Any]:
        return lambda: compat.reduce_scatter_single(out, x)

    def broadcast(self, x: Tensor) -> Callable[[], Any]:
        return lambda: self._dist.broadcast(x, src=0)


class MpiBaseline:
    """Bare mpi4py on a duplicate of ``COMM_WORLD``: ``Alltoallv`` and ``Allgather`` of bytes,
    the buffers' numpy views and byte counts made once."""

    name = "mpi4py"
    moe_reorder = False
    device = torch.device("cpu")

    def __init__(self) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self._comm = MPI.COMM_WORLD.Dup()

    def barrier(self) -> None:
        self._comm.Barrier()

    def slowest(self, values: Sequence[float]) -> list[float]:
        mine = np.array(values, dtype=np.float64)
        result = np.empty_like(mine)
        self._comm.Allreduce(mine, result, op=self._mpi.MAX)
        return result.tolist()

    def alltoallv(
        self, out: torch.Tensor, x: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> Callable[[], Any]:
        row = x.element_size() * math.prod(x.shape[1:])
        send = [_bytes(x), _counts_and_displacements(in_splits, row), self._mpi.BYTE]
        recv = [_bytes(out), _counts_and_displacements(out_splits, row), self._mpi.BYTE]
        return lambda: self._comm.Alltoallv(send, recv)

    def all_gather(self, out: Tensor, x: Tensor) -> Callable[[], Any]:
        send, recv = [_bytes(x), self._mpi.BYTE], [_bytes(out), self._mpi.BYTE]
        return lambda: self._comm.Allgather(send, recv)

    def all_reduce(self, x: Tensor) -> Callable[[], Any]:
        values = _summable(x)
        return lambda: self._comm.Allreduce(self._mpi.IN_PLACE, values, op=self._mpi.SUM)

    def reduce_scatter(self, out: Tensor, x: Tensor) -> Callable[[], Any]:
        send, recv = _summable(x), _summable(out)
        return lambda: self._comm.Reduce_scatter_block(send, recv, op=self._mpi.SUM)

    def broadcast(self, x: Tensor) -> Callable[[], Any]:
        data = [_bytes(x), self._mpi.BYTE]
        return lambda: self._comm.Bcast(data, root=0)


def _summable(t: torch.Tensor) -> np.ndarray:
    """A typed numpy view of a contiguous CPU tensor, for MPI's own SUM; SystemExit for bfloat16,
    which neither numpy nor MPICH can sum."""
    if t.dtype == torch.bfloat16:
        raise SystemExit(
            "unicoll bench: bare mpi4py has no bfloat16 sum to time unicoll's against; "
            "leave all_reduce and reduce_scatter out (--op) or pick another --dtype"
        )
    return t.reshape(-1).numpy()


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A numpy byte view of a contiguous CPU tensor."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _counts_and_displacements(splits: list[int], row_bytes: int) -> tuple[list[int], list[int]]:
    counts = [s * row_bytes for s in splits]
    return counts, list(accumulate(counts[:-1], initial=0))
