"""The torch.distributed transport, shared by the ``gloo`` and ``torch-nccl`` backends.

Arrays are moved as torch tensors: numpy arrays through ``torch.from_numpy`` and cupy arrays
through DLPack, both zero-copy for contiguous data, and turned back into their own library
on the way out.

On gloo every transfer is issued asynchronously and waited for in slices of
:data:`_SLICE_S` (:func:`wait_gloo`): a call that completes within the first slice costs what
a synchronous one does; one that takes longer looks between slices whether a rank of its group
is gone (:class:`~unicoll.backends.torch.liveness.PeerWatch`), since gloo itself does not fail the
transfer it is in the middle of when a peer dies.

``init`` carries one deadline, the timeout, through the rendezvous store, the creation of the
process group and the watch's connections, so a rank that never starts fails the others within
the timeout; the process group keeps the whole timeout for its collectives.

Every way in from the front end is a :func:`~unicoll.backends.torch.errors.torch_boundary`:
``_launch``, :func:`issue_on_stream` and ``_new_pg``, which every primitive goes through, the
works' ``wait`` and ``init``. torch's transport failures leave this module as unicoll's
:class:`~unicoll.errors.TransportError` kinds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from unicoll.backends.base import Backend, Capabilities, Pending, Work, issued
from unicoll.backends.host import host_rows, row_bytes, rows_as
from unicoll.backends.rendezvous import init_hint, open_store, remaining, stop_listening
from unicoll.backends.torch import compat, workers
from unicoll.backends.torch.errors import torch_boundary
from unicoll.backends.torch.gloo_world import connect_world, listen_interface, listening_on
from unicoll.backends.torch.liveness import PeerWatch, start_watch
from unicoll.errors import TransportError, TransportPeerLostError, TransportTimeoutError, init_error
from unicoll.forking import keep_forever
from unicoll.workspace import FROM_BYTES, Workspace

if TYPE_CHECKING:
    from unicoll.group import Group

_SLICE_S = 0.05
"""How long a gloo wait runs before it looks whether a peer is gone: what a dead peer costs a
transfer stuck on it, beyond :data:`_GRACE`."""

_SLICE = timedelta(seconds=_SLICE_S)

_GRACE = timedelta(seconds=0.1)
"""How long a transfer may still complete once a rank of its group is seen gone: a peer that
finished the call and exited normally may have rows still on their way here."""


def _wait_for(seconds: float) -> timedelta:
    """``seconds`` as a timeout for torch's ``Work.wait``: at least a millisecond, since torch
    counts milliseconds and takes 0 for "no timeout"."""
    return timedelta(seconds=max(seconds, 1e-3))


def wait_gloo(work: Any, timeout: float, watch: PeerWatch | None, ranks: Sequence[int]) -> None:
    """Return once the gloo ``work`` completes, waiting in slices of :data:`_SLICE_S`; between
    slices, TransportPeerLostError when one of the world ``ranks`` is gone (``watch``), and
    TransportTimeoutError once ``timeout`` seconds have passed. gloo's own errors (a closed
    connection, its timeout) pass through, for the caller's boundary to convert."""
    step = _SLICE if timeout >= _SLICE_S else _wait_for(timeout)
    if not _expired(work, step):  # most calls end here: no clock, no watch
        return
    deadline = time.monotonic() + timeout - step.total_seconds()
    while True:
        gone = None if watch is None else watch.lost(ranks)
        if gone is not None:
            _last_chance(work, gone)
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportTimeoutError(f"gloo: the transfer timed out after {timeout:g} s")
        if not _expired(work, _SLICE if left >= _SLICE_S else _wait_for(left)):
            return


def _expired(work: Any, step: timedelta) -> bool:
    """Wait for ``work`` at most ``step``: False once it completed, True while it still runs.
    torch's ``Work.wait`` raises both when the time runs out and when the work failed; a work
    that has completed is waited for again, which raises its failure."""
    try:
        work.wait(step)
    except RuntimeError:
        if not work.is_completed():
            return True
        work.wait()
    return False


def _last_chance(work: Any, gone: int) -> None:
    """Wait :data:`_GRACE` more for ``work`` now that world rank ``gone`` is gone; a
    TransportPeerLostError saying so when it still runs."""
    if _expired(work, _GRACE):
        raise TransportPeerLostError(
            f"gloo: world rank {gone} closed its connections (connection closed by peer) "
            "while this rank waited for the transfer"
        )


class _GlooWork:
    """A gloo ``Work`` of ``backend``, waited for by its :meth:`TorchDistBackend._wait`, for ``Task.wait()``."""

    def __init__(self, work: Any, backend: TorchDistBackend, ranks: Sequence[int]) -> None:
        self._work = work
        self._backend = backend
        self._ranks = ranks

    @torch_boundary
    def wait(self, timeout: float) -> None:
        self._backend._wait(self._work, timeout, self._ranks)

    def is_completed(self) -> bool:
        return self._work.is_completed()


class _StreamWork:
    """An NCCL work whose ``wait`` makes the current stream wait for it, without blocking the host.

    torch's ``Work.wait(timeout)`` blocks the host when given a timeout, so none is passed:
    the watchdog enforces the one given to ``init``.
    """

    def __init__(self, work: Any) -> None:
        self._work = work

    @torch_boundary
    def wait(self, timeout: float) -> Any:
        return self._work.wait()

    def is_completed(self) -> bool:
        return self._work.is_completed()


@torch_boundary
def issue_on_stream(launch: Callable[[bool], Any], async_op: bool, calc_stream: bool) -> Work | None:
    """Run ``launch(async_op)`` (a torch.distributed call) on the stream the call asks for.

    ``calc_stream`` with a synchronous call: torch's synchronous form, on the current stream.
    Otherwise torch's asynchronous form, on the group's NCCL stream; a synchronous call makes
    the current stream wait for it at once, an asynchronous one returns the work for
    ``Task.wait()``. See :mod:`unicoll.backends.torch.nccl`.
    """
    if calc_stream and not async_op:
        launch(False)
        return None
    work = launch(True)
    if async_op:
        return _StreamWork(work)
    work.wait()
    return None


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


_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}
"""torch.distributed's reduction of each transport reduction (:meth:`Backend.allreduce`)."""


class TorchDistBackend(Backend):
    """torch.distributed with one process-group backend (``"gloo"`` or ``"nccl"``)."""

    def __init__(
        self, name: str, pg_backend: str, capabilities: Capabilities, *, rank: int, world_size: int, timeout: float
    ) -> None:
        deadline = time.monotonic() + timeout
        self.name = name
        self.capabilities = capabilities
        self._seconds = timeout
        self._timeout = timedelta(seconds=timeout)
        self._owns_default_group = not dist.is_initialized()
        self._interface: str | None = None  # where gloo listens (see unicoll.backends.torch.gloo)
        self._groups: list[Any] = []  # every process group this backend created
        self._pg_backend = pg_backend
        self._watch: PeerWatch | None = None
        self._given_up: list[Any] = []  # gloo works that a wait gave up on while they ran
        self._listen_fd: int | None = None  # rank 0's store socket, which a forked child closes (abandon)
        if pg_backend == "gloo":
            self.workspace = Workspace()
        try:
            self._start(rank, world_size, deadline)
        except RuntimeError as exc:
            self.finalize()
            if isinstance(exc, TransportError):
                raise init_error(exc, name, rank, world_size, timeout, init_hint(world_size)) from exc
            raise

    @torch_boundary
    def _start(self, rank: int, world_size: int, deadline: float) -> None:
        """Join the default group (or adopt it), make the world's group and connect the watch."""
        if self._owns_default_group:
            self._start_default_group(self._pg_backend, rank, world_size, deadline)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if dist.get_backend() == self._pg_backend:
            self._world = dist.group.WORLD
        else:  # an adopted default group of another transport: keep our own group beside it
            self._world = self._new_pg(range(self.world_size), self._pg_backend)
        if self._pg_backend == "gloo" and self.world_size > 1 and "MASTER_ADDR" in os.environ:
            share = lambda values: self._broadcast(values, deadline)  # noqa: E731
            self._watch = start_watch(self.rank, self.world_size, os.environ["MASTER_ADDR"], deadline, share)

    def _start_default_group(self, pg_backend: str, rank: int, world_size: int, deadline: float) -> None:
        """Create torch's default group: in-process for a world of one, through torchrun's
        agent store under torchrun, else through our own loopback-by-default rendezvous, whose
        gloo group is created within ``deadline`` and then given the whole timeout. gloo listens
        where this rank reaches ``MASTER_ADDR`` from (a world of one on loopback): see
        :mod:`unicoll.backends.torch.gloo`."""
        gloo = pg_backend == "gloo"
        if world_size == 1:
            store = dist.HashStore()
            self._interface = listen_interface("127.0.0.1")[0] if gloo else None
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            store = None  # torchrun's, from the environment
            self._interface = listen_interface(os.environ["MASTER_ADDR"])[0] if gloo else None
        else:
            store, addr, self._listen_fd = open_store(rank, world_size, self._seconds, deadline)
            if gloo:
                self._interface = connect_world(store, addr, rank, world_size, deadline)
                _set_pg_timeout(self._timeout)
                return
        with listening_on(self._interface):
            dist.init_process_group(pg_backend, store=store, rank=rank, world_size=world_size, timeout=self._timeout)

    def _broadcast(self, values: list[int], deadline: float) -> list[int]:
        """Rank 0's ``values`` on every rank, over the world's gloo group, by ``deadline``."""
        shared = torch.tensor(values, dtype=torch.int64)
        wait_gloo(dist.broadcast(shared, src=0, group=self._world, async_op=True), remaining(deadline), None, ())
        return shared.tolist()

    @torch_boundary
    def _launch(self, launch: Callable[[bool], Any], group: Group, async_op: bool, calc_stream: bool) -> Work | None:
        """Run ``launch(async_op)``, a torch.distributed call, as every primitive does: on gloo
        it is issued asynchronously and waited for by :func:`wait_gloo`, now or in
        ``Task.wait()`` (CPU has no streams: ``calc_stream`` has no effect).
        :class:`TorchNcclBackend` overrides this, and only this, to put the call on the stream
        it asks for."""
        work = launch(True)
        if async_op:
            return _GlooWork(work, self, group.ranks)
        self._wait(work, self._seconds, group.ranks)
        return None

    def _wait(self, work: Any, timeout: float, ranks: Sequence[int]) -> None:
        """:func:`wait_gloo` with this backend's watch, remembering a work it gave up on while
        the work still ran (see :meth:`finalize`)."""
        try:
            wait_gloo(work, timeout, self._watch, ranks)
        except TransportError:
            self._given_up = [w for w in self._given_up if not w.is_completed()] + [work]
            raise

    @torch_boundary
    def _new_pg(self, ranks: Sequence[int], pg_backend: str) -> Any:
        with listening_on(self._interface):
            handle = dist.new_group(list(ranks), backend=pg_backend, timeout=self._timeout)
        self._groups.append(handle)
        return handle

    def _pg(self, group: Group) -> Any:
        return self._world if group.handle is None else group.handle

    to_native = staticmethod(_to_torch)  # one call less on every operator's path

    def from_native(self, t: torch.Tensor, library: str) -> Any:
        return _from_torch(t, library)

    def new_group(self, ranks: Sequence[int]) -> Any:
        return self._new_pg(ranks, self._pg_backend)

    def empty_rows(self, like: torch.Tensor, rows: int) -> torch.Tensor:
        """New rows; on the CPU, from :data:`~unicoll.workspace.FROM_BYTES` up, lent by the
        workspace until they are garbage (:func:`~unicoll.backends.host.host_rows`)."""
        if like.device.type == "cpu" and rows * row_bytes(like) >= FROM_BYTES:
            return rows_as(host_rows(like, rows, self.workspace), like)
        return like.new_empty((rows, *like.shape[1:]))

    def take_rows(
        self, x: torch.Tensor, index: np.ndarray | torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``index_select`` (``index``: host int64, or a tensor on x's device), into rows of
        :meth:`empty_rows` where those come from numpy."""
        rows = index if isinstance(index, torch.Tensor) else torch.from_numpy(index)
        if x.device.type != "cpu":
            return torch.index_select(x, 0, rows.to(x.device, non_blocking=True), out=out)
        if out is None:
            if len(index) * row_bytes(x) < FROM_BYTES:
                return x.index_select(0, rows)
            out = self.empty_rows(x, len(index))
        return torch.index_select(x, 0, rows, out=out)

    def barrier(self, group: Group) -> None:
        pg = self._pg(group)
        self._launch(lambda a: dist.barrier(group=pg, async_op=a), group, False, True)

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
        launch = lambda a: dist.all_to_all_single(out, x, out_splits, in_splits, group=pg, async_op=a)  # noqa: E731
        return self._launch(launch, group, async_op, calc_stream)

    def all_gather_even(self, out: Any, x: Any, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        pg = self._pg(group)
        return self._launch(
            lambda a: compat.all_gather_single(out, x, group=pg, async_op=a), group, async_op, calc_stream
        )

    def allreduce(self, x: Any, op: str, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        pg, reduction = self._pg(group), _REDUCE_OPS[op]
        return self._launch(
            lambda a: dist.all_reduce(x, op=reduction, group=pg, async_op=a), group, async_op, calc_stream
        )

    def reduce_scatter_even(
        self, out: Any, x: Any, op: str, group: Group, async_op: bool, calc_stream: bool = False
    ) -> Work | None:
        pg, reduction = self._pg(group), _REDUCE_OPS[op]
        launch = lambda a: compat.reduce_scatter_single(out, x, op=reduction, group=pg, async_op=a)  # noqa: E731
        return self._launch(launch, group, async_op, calc_stream)

    def bcast(self, x: Any, src: int, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        pg = self._pg(group)
        return self._launch(
            lambda a: dist.broadcast(x, group=pg, async_op=a, group_src=src), group, async_op, calc_stream
        )

    def reduce_scatter_uneven(
        self,
        out: Any,
        x: Any,
        op: str,
        rows: Sequence[int],
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
    ) -> Pending:
        """torch.distributed's list form takes unequal blocks as they are: no padding."""
        pg, reduction, blocks = self._pg(group), _REDUCE_OPS[op], list(x.split(list(rows)))
        launch = lambda a: dist.reduce_scatter(out, blocks, op=reduction, group=pg, async_op=a)  # noqa: E731
        return issued(self._launch(launch, group, async_op, calc_stream), lambda: out)

    def _host_ints(self, values: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        return t.cuda() if self._pg_backend == "nccl" else t

    def exchange_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        send = self._host_ints(values)
        recv = torch.empty_like(send)
        pg = self._pg(group)
        self._launch(lambda a: dist.all_to_all_single(recv, send, group=pg, async_op=a), group, False, True)
        return recv.cpu().numpy()

    def gather_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        send = self._host_ints(values)
        recv = send.new_empty((group.world_size * send.numel(),))
        pg = self._pg(group)
        self._launch(lambda a: compat.all_gather_single(recv, send, group=pg, async_op=a), group, False, True)
        return recv.cpu().numpy().reshape(group.world_size, -1)

    def finalize(self) -> None:
        """Close the watch, shut rank 0's store socket down (its port is then free for a new
        session whatever keeps this one's store alive: :func:`~unicoll.backends.rendezvous.stop_listening`),
        then destroy the process groups this backend made (the default group with them when it
        made that too).

        A transfer that a wait gave up on (its peer gone, its timeout run out) may still hold a
        thread of gloo until gloo's own timeout, and destroying its process group would wait for
        that thread: such groups are unregistered but never freed
        (:func:`~unicoll.forking.keep_forever`), so neither this call nor the process's exit waits
        out the timeout. The transfer itself is never freed either: its thread would otherwise
        free its tensors when it ends, which takes the interpreter's lock, and once the
        interpreter has begun to shut down that aborts the process (see
        :mod:`~unicoll.backends.torch.workers`).
        """
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self.workspace is not None:
            self.workspace.clear()
        world, groups = getattr(self, "_world", None), self._groups
        self._world, self._groups = None, []  # tasks and autograd graphs that outlive the session hold none of it
        if self._listen_fd is not None:
            stop_listening(self._listen_fd)  # before the store goes: then the descriptor may be another file's
            self._listen_fd = None  # closed with the store
        if not dist.is_initialized():
            return
        running = [work for work in self._given_up if not work.is_completed()]
        if running:
            for handle in (world, *groups, *running):
                keep_forever(handle)
        self._given_up = []
        if self._owns_default_group:
            dist.destroy_process_group()  # every group with it
        else:
            for handle in groups:  # an adopted default group stays; ours go
                if handle is not dist.GroupMember.NON_GROUP_MEMBER:
                    dist.destroy_process_group(handle)
        if self._pg_backend == "gloo":
            workers.settle()  # groups that torch keeps alive: no worker left freeing tensors at exit

    def abandon(self) -> None:
        """As :meth:`Backend.abandon`, and torch's default group is kept too, whoever made it:
        torch would free it when the child exits, joining threads that only the parent has. The
        child closes its copy of rank 0's store socket, which would keep the port bound while it
        lives, so that the parent can ``init`` again after ``finalize``."""
        super().abandon()
        if dist.is_initialized():
            keep_forever(dist.group.WORLD)
        if self._listen_fd is not None:
            os.close(self._listen_fd)
            self._listen_fd = None


class TorchNcclBackend(TorchDistBackend):
    """torch.distributed over NCCL: every primitive of :class:`TorchDistBackend`, each call put on
    the stream it asks for (:func:`issue_on_stream`)."""

    host_memory = False  # a device transport, even driving gloo in the tests

    def read_ints(self, values: torch.Tensor) -> np.ndarray:
        """As :meth:`Backend.read_ints`; a CUDA tensor is copied into pinned memory on the
        current stream, and the host waits on an event recorded after that copy (the one
        synchronization a dynamic top-k dispatch declares, allowed under
        ``torch.cuda.set_sync_debug_mode("error")``)."""
        if values.device.type != "cuda":
            return super().read_ints(values)
        pinned = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        pinned.copy_(values, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            copied.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(mode)
        return pinned.numpy().copy()  # the pinned block goes back to torch's cache now, not with the handle

    def _launch(self, launch: Callable[[bool], Any], group: Group, async_op: bool, calc_stream: bool) -> Work | None:
        return issue_on_stream(launch, async_op, calc_stream)
