"""The ``cupy-nccl`` transport: CuPy's NCCL bindings; torch only for the rendezvous store.

- **Rendezvous.** A world of more than one rank meets at torch's TCPStore, which rank 0 hosts
  on ``MASTER_ADDR:MASTER_PORT`` (:func:`~unicoll.backends.rendezvous.open_store`, as the
  torch backends do; torch is imported then, and only then); each communicator's NCCL unique
  id travels through it as bytes. Every group, the world and each ``new_group``, is its own
  NCCL communicator with its own communication stream.
- **Bytes.** Arrays move as raw bytes (``ncclInt8`` counts), so every dtype of the same size
  moves alike, bool included. The uneven all-to-all is the grouped send/recv that
  :func:`~unicoll.backends.cupy.schedule.alltoallv_schedule` lists (zero sizes skipped on both
  sides, this rank's own rows copied on the device).
- **Reductions** (all_reduce, reduce_scatter) hand NCCL the element type (bool as ``uint8``,
  reduced by max for logical or and min for logical and); uneven reduce_scatter blocks travel
  padded (:meth:`~unicoll.backends.base.Backend.reduce_scatter_uneven`). ``broadcast`` moves bytes.
- **Streams.** ``calc_stream`` runs on cupy's current stream. Otherwise the group's stream
  waits for the current one, runs the transfer, and the current stream waits for it: at once
  for a synchronous call, in ``Task.wait()`` for an asynchronous one; the host never blocks.
  The arrays of an asynchronous call are held until then, so the memory pool cannot hand
  their memory to other work while NCCL still uses it.
- **Host waits.** Where the host needs a result (the integer exchanges, ``barrier``,
  ``finalize``) it polls a CUDA event, checks NCCL for asynchronous errors (a peer gone),
  and gives up after the ``init`` timeout, aborting that communicator.
- **Errors.** Every way in from the front end is :func:`_cupy_boundary`: cupy's ``NcclError``
  and CUDA runtime errors leave as unicoll's :class:`~unicoll.errors.TransportError` kinds
  (:func:`_failure`), the store's as :mod:`~unicoll.backends.rendezvous` converts them.
- **Torch tensors** cross in and out zero-copy (:mod:`~unicoll.backends.cupy.torch_bridge`),
  ordered against cupy's current stream as DLPack's stream handshake orders them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import cupy
import numpy as np
from cupy.cuda import nccl

from unicoll.backends.base import Backend, Capabilities, Work
from unicoll.backends.cupy import rows as row_gather
from unicoll.backends.cupy import torch_bridge
from unicoll.backends.cupy.schedule import Transfer, alltoallv_schedule
from unicoll.backends.rendezvous import init_hint, open_store, share_bytes
from unicoll.errors import TransportError, TransportPeerLostError, TransportTimeoutError, converting, init_error

if TYPE_CHECKING:
    from unicoll.group import Group


_NCCL_REMOTE_ERROR = 6
"""``ncclRemoteError`` (nccl.h): a peer's process exited, or the network to it failed."""


def _failure(exc: Exception) -> TransportError | None:
    """The TransportError of cupy's ``exc``: an ``NcclError`` by its NCCL status
    (:func:`_nccl_failure`), a CUDA runtime error of no particular kind; None for anything else
    (a bug, bad input)."""
    if isinstance(exc, nccl.NcclError):
        return _nccl_failure(exc)
    if isinstance(exc, cupy.cuda.runtime.CUDARuntimeError):
        return TransportError(str(exc))
    return None


def _nccl_failure(exc: nccl.NcclError) -> TransportError:
    """TransportPeerLostError for ``ncclRemoteError``, else a TransportError of no particular kind."""
    kind = TransportPeerLostError if exc.status == _NCCL_REMOTE_ERROR else TransportError
    return kind(str(exc))


_cupy_boundary = converting(_failure)
"""The decorator of every way in from the front end (see the module)."""


_NCCL_TYPES = {
    "float16": nccl.NCCL_FLOAT16,
    "float32": nccl.NCCL_FLOAT32,
    "float64": nccl.NCCL_FLOAT64,
    "int8": nccl.NCCL_INT8,
    "uint8": nccl.NCCL_UINT8,
    "int32": nccl.NCCL_INT32,
    "int64": nccl.NCCL_INT64,
    "bool": nccl.NCCL_UINT8,
}
"""NCCL's element type of each dtype a reduction runs on."""

_NCCL_OPS = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN, "prod": nccl.NCCL_PROD}
"""NCCL's reduction of each transport reduction (:meth:`~unicoll.backends.base.Backend.allreduce`)."""


def _words(nbytes: int) -> tuple[int, int]:
    """``nbytes`` as a count of NCCL words, the widest that divides it: cupy passes a
    broadcast's count as a C int, so 8-byte words carry 8 times more than bytes."""
    for size, word in ((8, nccl.NCCL_INT64), (4, nccl.NCCL_INT32)):
        if nbytes % size == 0:
            return nbytes // size, word
    return nbytes, nccl.NCCL_INT8


class _Communicator:
    """One NCCL communicator (a group's members), with the stream its transfers run on."""

    def __init__(self, size: int, unique_id: bytes, rank: int) -> None:
        self.nccl = nccl.NcclCommunicator(size, unique_id, rank)
        self.size = size
        self.rank = rank
        self.stream = cupy.cuda.Stream(non_blocking=True)
        # A synchronous call's two events, recorded again by every call (a stream's wait takes
        # the event as it stands when the wait is queued); without timing, which costs to record.
        self.queued = cupy.cuda.Event(disable_timing=True)
        self.done = cupy.cuda.Event(disable_timing=True)
        self.failure: TransportError | None = None  # why it was aborted


class _EventWork:
    """A transfer on a communication stream. ``wait`` makes the caller's current stream wait for
    it without blocking the host, and releases the arrays the transfer uses."""

    def __init__(self, done: cupy.cuda.Event, arrays: tuple[Any, ...]) -> None:
        self._done = done
        self._arrays = arrays

    @_cupy_boundary
    def wait(self, timeout: float) -> None:
        cupy.cuda.get_current_stream().wait_event(self._done)
        self._arrays = ()

    @_cupy_boundary
    def is_completed(self) -> bool:
        return self._done.done


def _abort(comm: _Communicator, failure: TransportError) -> None:
    """Abort ``comm`` (its kernels in flight exit) and remember why; it is not used again."""
    comm.failure = failure
    comm.nccl.abort()


def _row_bytes(x: cupy.ndarray) -> int:
    return x.itemsize * math.prod(x.shape[1:])


def _run_plan(comm: _Communicator, plan: list[Transfer], x: cupy.ndarray, out: cupy.ndarray, stream: Any) -> None:
    """Issue ``plan`` on ``stream``: this rank's own rows as a device copy, the rest as one
    NCCL group of sends and receives."""
    src, dst = x.data.ptr, out.data.ptr
    peers = []
    for t in plan:
        if t.peer == comm.rank:
            cupy.cuda.runtime.memcpyAsync(
                dst + t.recv_offset,
                src + t.send_offset,
                t.send_bytes,
                cupy.cuda.runtime.memcpyDeviceToDevice,
                stream.ptr,
            )
        else:
            peers.append(t)
    if not peers:
        return
    nccl.groupStart()
    try:
        for t in peers:
            if t.send_bytes:
                comm.nccl.send(src + t.send_offset, t.send_bytes, nccl.NCCL_INT8, t.peer, stream.ptr)
            if t.recv_bytes:
                comm.nccl.recv(dst + t.recv_offset, t.recv_bytes, nccl.NCCL_INT8, t.peer, stream.ptr)
    finally:
        nccl.groupEnd()


class CupyNcclBackend(Backend):
    """NCCL through ``cupy.cuda.nccl``, bound to this process's rank and CUDA device."""

    name = "cupy-nccl"

    def __init__(self, capabilities: Capabilities, *, rank: int, world_size: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self.capabilities = capabilities
        self.rank = rank
        self.world_size = world_size
        self._timeout = timeout
        self._store: Any = None  # torch's TCPStore, for a world of more than one rank
        self._groups_made = 0
        self._communicators: list[_Communicator] = []
        try:
            self._world = self._start(deadline)
        except RuntimeError as exc:
            self.finalize()
            if isinstance(exc, TransportError):
                raise init_error(exc, self.name, rank, world_size, timeout, init_hint(world_size)) from exc
            raise

    @_cupy_boundary
    def _start(self, deadline: float) -> _Communicator:
        """Meet the other ranks (by ``deadline``, a ``time.monotonic()`` value) and make the
        world's communicator."""
        if self.world_size > 1:
            self._store = open_store(self.rank, self.world_size, self._timeout, deadline).store
        world = self._communicator(tuple(range(self.world_size)))
        assert world is not None  # every rank is in the world
        return world

    def _communicator(self, members: tuple[int, ...]) -> _Communicator | None:
        """The NCCL communicator of ``members`` (every world rank calls this, in the same order);
        None on a rank outside them. Its first member makes the unique id and shares it."""
        key = f"unicoll/nccl-id/{self._groups_made}"
        self._groups_made += 1
        if self.rank not in members:
            return None
        position = members.index(self.rank)
        unique_id = nccl.get_unique_id() if position == 0 else None
        if len(members) > 1:
            unique_id = share_bytes(self._store, key, unique_id)
        comm = _Communicator(len(members), unique_id, position)
        self._communicators.append(comm)
        return comm

    def _comm(self, group: Group) -> _Communicator:
        comm = self._world if group.handle is None else group.handle
        if comm.failure is not None:
            raise type(comm.failure)(f"the NCCL communicator of {group} was aborted: {comm.failure}")
        return comm

    # -- arrays ----------------------------------------------------------------------------

    def read_ints(self, values: cupy.ndarray) -> np.ndarray:
        """As :meth:`Backend.read_ints`: copied into pinned memory on the current stream, and
        the host waits on an event recorded after that copy alone."""
        memory = cupy.cuda.alloc_pinned_memory(values.nbytes)
        pinned = np.frombuffer(memory, values.dtype, values.size).reshape(values.shape)
        stream = cupy.cuda.get_current_stream()
        values.get(stream=stream, out=pinned, blocking=False)
        copied = cupy.cuda.Event()
        copied.record(stream)
        copied.synchronize()
        return pinned.copy()  # the pinned block is freed now, not with the handle that keeps the counts

    def to_native(self, x: Any) -> cupy.ndarray:
        if isinstance(x, cupy.ndarray):
            return cupy.ascontiguousarray(x)
        return torch_bridge.as_cupy(x)  # a CUDA torch tensor, zero-copy

    def from_native(self, a: cupy.ndarray, library: str) -> Any:
        return a if library == "cupy" else torch_bridge.as_torch(a)

    def empty_rows(self, like: cupy.ndarray, rows: int) -> cupy.ndarray:
        """New rows; torch's where ``like`` views a torch tensor, so that a result goes back to
        the caller without DLPack (:func:`~unicoll.backends.cupy.torch_bridge.empty_like`)."""
        made = torch_bridge.empty_like(like, rows)
        return cupy.empty((rows, *like.shape[1:]), dtype=like.dtype) if made is None else made

    def take_rows(
        self, x: cupy.ndarray, index: np.ndarray | cupy.ndarray, out: cupy.ndarray | None = None
    ) -> cupy.ndarray:
        """The gather of :mod:`~unicoll.backends.cupy.rows` (copied into ``out`` when given)."""
        taken = row_gather.take_rows(x, index)
        if out is None:
            return taken
        out[...] = taken
        return out

    # -- transfers -------------------------------------------------------------------------

    def _issue(
        self,
        comm: _Communicator,
        launch: Callable[[Any], None],
        arrays: tuple[Any, ...],
        async_op: bool,
        calc_stream: bool,
    ) -> Work | None:
        """Run ``launch(stream)`` on the stream the call asks for (see the module text)."""
        caller = cupy.cuda.get_current_stream()
        if calc_stream and not async_op:
            launch(caller)
            return None
        comm.queued.record(caller)
        comm.stream.wait_event(comm.queued)
        launch(comm.stream)
        done = cupy.cuda.Event(disable_timing=True) if async_op else comm.done
        done.record(comm.stream)
        if async_op:
            return _EventWork(done, arrays)
        caller.wait_event(done)
        return None

    @_cupy_boundary
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
        comm = self._comm(group)
        plan = alltoallv_schedule(comm.rank, comm.size, in_splits, out_splits, _row_bytes(x))
        return self._issue(comm, lambda s: _run_plan(comm, plan, x, out, s), (out, x), async_op, calc_stream)

    @_cupy_boundary
    def all_gather_even(self, out: Any, x: Any, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        comm = self._comm(group)

        def launch(stream: Any) -> None:
            if x.nbytes:  # the same on every rank: all or none skip
                comm.nccl.allGather(x.data.ptr, out.data.ptr, x.nbytes, nccl.NCCL_INT8, stream.ptr)

        return self._issue(comm, launch, (out, x), async_op, calc_stream)

    @_cupy_boundary
    def allreduce(self, x: Any, op: str, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        comm, kind, reduction = self._comm(group), _NCCL_TYPES[x.dtype.name], _NCCL_OPS[op]

        def launch(stream: Any) -> None:
            comm.nccl.allReduce(x.data.ptr, x.data.ptr, x.size, kind, reduction, stream.ptr)

        return self._issue(comm, launch, (x,), async_op, calc_stream)

    @_cupy_boundary
    def reduce_scatter_even(
        self, out: Any, x: Any, op: str, group: Group, async_op: bool, calc_stream: bool = False
    ) -> Work | None:
        comm, kind, reduction = self._comm(group), _NCCL_TYPES[x.dtype.name], _NCCL_OPS[op]

        def launch(stream: Any) -> None:
            comm.nccl.reduceScatter(x.data.ptr, out.data.ptr, out.size, kind, reduction, stream.ptr)

        return self._issue(comm, launch, (out, x), async_op, calc_stream)

    @_cupy_boundary
    def bcast(self, x: Any, src: int, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        comm = self._comm(group)

        count, word = _words(x.nbytes)

        def launch(stream: Any) -> None:
            comm.nccl.broadcast(x.data.ptr, x.data.ptr, count, word, src, stream.ptr)

        return self._issue(comm, launch, (x,), async_op, calc_stream)

    # -- small host exchanges --------------------------------------------------------------

    def _wait_host(self, comm: _Communicator, done: cupy.cuda.Event) -> None:
        """Block the host until ``done``; an NCCL error or the timeout aborts ``comm`` and
        raises the TransportError of its kind."""
        deadline = time.monotonic() + self._timeout
        pause = 1e-5
        while not done.done:
            try:
                comm.nccl.check_async_error()  # raises NcclError once a peer has failed
            except nccl.NcclError as exc:
                error = _nccl_failure(exc)
                _abort(comm, type(error)(f"NCCL reported an error: {exc}"))
                raise error from exc
            if time.monotonic() > deadline:
                _abort(comm, TransportTimeoutError(f"an operation timed out after {self._timeout:g} s"))
                raise TransportTimeoutError(
                    f"NCCL: {comm.failure}; a peer may not have called it (communicator aborted)"
                )
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    def _on_host(self, comm: _Communicator, launch: Callable[[], cupy.ndarray]) -> np.ndarray:
        """Run ``launch()`` with the group's stream current and return its result on the host."""
        with comm.stream:
            result = launch()
        self._wait_host(comm, comm.stream.record())
        return result.get(stream=comm.stream)

    @_cupy_boundary
    def exchange_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        comm = self._comm(group)
        k = len(values) // comm.size
        plan = alltoallv_schedule(comm.rank, comm.size, [k] * comm.size, [k] * comm.size, 8)

        def launch() -> cupy.ndarray:
            send = cupy.asarray(np.ascontiguousarray(values, dtype=np.int64))
            recv = cupy.empty_like(send)
            _run_plan(comm, plan, send, recv, comm.stream)
            return recv

        return self._on_host(comm, launch)

    @_cupy_boundary
    def gather_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        comm = self._comm(group)

        def launch() -> cupy.ndarray:
            send = cupy.asarray(np.ascontiguousarray(values, dtype=np.int64))
            recv = cupy.empty((comm.size, send.size), dtype=cupy.int64)
            comm.nccl.allGather(send.data.ptr, recv.data.ptr, send.nbytes, nccl.NCCL_INT8, comm.stream.ptr)
            return recv

        return self._on_host(comm, launch)

    # -- groups and lifetime ---------------------------------------------------------------

    @_cupy_boundary
    def new_group(self, ranks: Sequence[int]) -> _Communicator | None:
        return self._communicator(tuple(ranks))

    def barrier(self, group: Group) -> None:
        self.gather_ints(np.zeros(1, dtype=np.int64), group)

    def finalize(self) -> None:
        """Let every communicator finish its queued work (up to the timeout), then destroy it;
        one that fails or times out is aborted instead. The store closes last (on rank 0, its
        server with it)."""
        for comm in self._communicators:
            if comm.failure is not None:
                continue
            try:
                self._wait_host(comm, comm.stream.record())
                comm.nccl.destroy()
            except Exception as exc:  # NcclError and the timeout abort in _wait_host; else abort here
                if comm.failure is None:
                    _abort(comm, TransportError(f"finalize failed: {exc}"))
        self._communicators = []
        self._store = None
