"""The torch.distributed transport, shared by the ``gloo`` and ``torch-nccl`` backends.

Arrays are moved as torch tensors: numpy arrays through ``torch.from_numpy`` and cupy arrays
through DLPack, both zero-copy for contiguous data, and turned back into their own library
on the way out.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from .base import Backend, Capabilities, Work
from .rendezvous import is_loopback, listen, master_address

if TYPE_CHECKING:
    from ..group import Group


class _TorchWork:
    """A torch.distributed ``Work`` seen through unicoll's ``Work`` protocol (seconds, not timedelta)."""

    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self, timeout: float) -> Any:
        return self._work.wait(timedelta(seconds=timeout))

    def is_completed(self) -> bool:
        return self._work.is_completed()


class _StreamWork:
    """An NCCL work whose ``wait`` makes the current stream wait for it, without blocking the host.

    torch's ``Work.wait(timeout)`` blocks the host when given a timeout, so none is passed:
    the watchdog enforces the one given to ``init``.
    """

    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self, timeout: float) -> Any:
        return self._work.wait()

    def is_completed(self) -> bool:
        return self._work.is_completed()


def issue_on_stream(launch: Callable[[bool], Any], async_op: bool, calc_stream: bool) -> Work | None:
    """Run ``launch(async_op)`` (a torch.distributed call) on the stream the call asks for.

    ``calc_stream`` with a synchronous call: torch's synchronous form, on the current stream.
    Otherwise torch's asynchronous form, on the group's NCCL stream; a synchronous call makes
    the current stream wait for it at once, an asynchronous one returns the work for
    ``Task.wait()``. See :mod:`unicoll.backends.torch_nccl`.
    """
    if calc_stream and not async_op:
        launch(False)
        return None
    work = launch(True)
    if async_op:
        return _StreamWork(work)
    work.wait()
    return None


def _work(work: Any) -> Work | None:
    return None if work is None else _TorchWork(work)


def _to_torch(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return (x.detach() if x.requires_grad else x).contiguous()
    if isinstance(x, np.ndarray):
        if not (x.flags.c_contiguous and x.flags.writeable):
            x = np.array(x, order="C")
        return torch.from_numpy(x)
    return torch.from_dlpack(x).contiguous()  # a cupy array: zero-copy when it is contiguous


def _from_torch(t: torch.Tensor, library: str) -> Any:
    if library == "torch":
        return t
    if library == "numpy":
        return t.numpy()
    import cupy

    return cupy.from_dlpack(t)


def _rendezvous(rank: int, world_size: int, timeout: timedelta) -> tuple[dist.Store, str]:
    """The store every rank meets at, and the address the ranks listen on.

    Rank 0 hosts a TCPStore on a socket it binds to ``MASTER_ADDR:MASTER_PORT`` itself, so a
    loopback address (the launcher's default) is never reachable from another machine.
    """
    addr, port = master_address(world_size)
    listen_fd = listen(addr, port).detach() if rank == 0 else None
    return dist.TCPStore(addr, port, world_size, rank == 0, timeout, master_listen_fd=listen_fd), addr


def _gloo_options(addr: str) -> Any:
    """Gloo options that keep its connections on loopback when the rendezvous is on loopback
    (unless ``GLOO_SOCKET_IFNAME`` says otherwise); None leaves gloo's own choice."""
    if not is_loopback(addr) or "GLOO_SOCKET_IFNAME" in os.environ:
        return None
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return options


class TorchDistBackend(Backend):
    """torch.distributed with one process-group backend (``"gloo"`` or ``"nccl"``)."""

    def __init__(
        self, name: str, pg_backend: str, capabilities: Capabilities, *, rank: int, world_size: int, timeout: float
    ) -> None:
        self.name = name
        self.capabilities = capabilities
        self._timeout = timedelta(seconds=timeout)
        self._owns_default_group = not dist.is_initialized()
        self._options = None
        self._groups: list[Any] = []  # every process group this backend created
        if self._owns_default_group:
            self._start_default_group(pg_backend, rank, world_size)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if dist.get_backend() == pg_backend:
            self._world = dist.group.WORLD
        else:  # an adopted default group of another transport: keep our own group beside it
            self._world = self._new_pg(range(self.world_size), pg_backend)
        self._pg_backend = pg_backend

    def _start_default_group(self, pg_backend: str, rank: int, world_size: int) -> None:
        """Create torch's default group: in-process for a world of one, through torchrun's
        agent store under torchrun, else through our own loopback-by-default rendezvous."""
        if world_size == 1:
            store = dist.HashStore()
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            dist.init_process_group(
                pg_backend, init_method="env://", rank=rank, world_size=world_size, timeout=self._timeout
            )
            return
        else:
            store, addr = _rendezvous(rank, world_size, self._timeout)
            self._options = _gloo_options(addr) if pg_backend == "gloo" else None
        dist.init_process_group(
            pg_backend, store=store, rank=rank, world_size=world_size, timeout=self._timeout, pg_options=self._options
        )

    def _new_pg(self, ranks: Sequence[int], pg_backend: str) -> Any:
        handle = dist.new_group(list(ranks), backend=pg_backend, timeout=self._timeout, pg_options=self._options)
        self._groups.append(handle)
        return handle

    def _pg(self, group: Group) -> Any:
        return self._world if group.handle is None else group.handle

    def to_native(self, x: Any) -> torch.Tensor:
        return _to_torch(x)

    def from_native(self, t: torch.Tensor, library: str) -> Any:
        return _from_torch(t, library)

    def new_group(self, ranks: Sequence[int]) -> Any:
        return self._new_pg(ranks, self._pg_backend)

    def empty_rows(self, like: torch.Tensor, rows: int) -> torch.Tensor:
        return like.new_empty((rows, *like.shape[1:]))

    def take_rows(self, x: torch.Tensor, index: np.ndarray) -> torch.Tensor:
        return x.index_select(0, torch.from_numpy(index).to(x.device, non_blocking=True))

    def barrier(self, group: Group) -> None:
        dist.barrier(group=self._pg(group))

    def alltoallv(
        self,
        out: Any,
        x: Any,
        out_splits: list[int],
        in_splits: list[int],
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
    ) -> Work | None:
        """On CPU there are no streams: ``calc_stream`` has no effect (see torch_nccl for CUDA)."""
        return _work(dist.all_to_all_single(out, x, out_splits, in_splits, group=self._pg(group), async_op=async_op))

    def all_gather_even(self, out: Any, x: Any, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        return _work(dist.all_gather_single(out, x, group=self._pg(group), async_op=async_op))

    def _host_ints(self, values: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        return t.cuda() if self._pg_backend == "nccl" else t

    def exchange_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        send = self._host_ints(values)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self._pg(group))
        return recv.cpu().numpy()

    def gather_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        send = self._host_ints(values)
        recv = send.new_empty((group.world_size * send.numel(),))
        dist.all_gather_single(recv, send, group=self._pg(group))
        return recv.cpu().numpy().reshape(group.world_size, -1)

    def finalize(self) -> None:
        if not dist.is_initialized():
            return
        if self._owns_default_group:
            dist.destroy_process_group()  # every group with it
            return
        for handle in self._groups:  # an adopted default group stays; ours go
            if handle is not dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(handle)


class TorchNcclBackend(TorchDistBackend):
    """torch.distributed over NCCL, with each call's stream choice applied (:func:`issue_on_stream`)."""

    def alltoallv(
        self,
        out: Any,
        x: Any,
        out_splits: list[int],
        in_splits: list[int],
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
    ) -> Work | None:
        pg = self._pg(group)
        return issue_on_stream(
            lambda a: dist.all_to_all_single(out, x, out_splits, in_splits, group=pg, async_op=a), async_op, calc_stream
        )

    def all_gather_even(self, out: Any, x: Any, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        pg = self._pg(group)
        return issue_on_stream(lambda a: dist.all_gather_single(out, x, group=pg, async_op=a), async_op, calc_stream)
