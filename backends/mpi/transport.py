"""The MPI transport behind the ``mpi`` backend: mpi4py's non-blocking collectives.

Arrays stay what the caller gave (numpy arrays, torch CPU tensors, made contiguous); each
transfer hands MPI a numpy view of their memory through the buffer protocol, zero-copy. Rows
travel as bytes, in a contiguous MPI datatype of one row (cached per row size), so counts and
displacements are row counts: a message of more than 2**31 - 1 *bytes* is fine, and mpi4py
passes even larger counts to an MPI-4 library's large-count routines. The dtype never matters
to MPI, which moves bfloat16 and float16 as 2-byte words and bool as bytes.

Reductions (all_reduce, reduce_scatter) cannot move bytes: they hand MPI the typed numpy view
(float16 as MPICH's 16-bit float, bool as ``C_BOOL`` with logical or and and). MPICH has no
bfloat16 arithmetic, so bfloat16 sums and products travel as 16-bit words reduced by
user-defined MPI operations (:func:`_bfloat16_reduction`, :mod:`unicoll.backends.mpi.bfloat16`)
that compute in float32 and round to bfloat16 after each step, as torch does (float max and
min arrive as integer keys: :mod:`unicoll.backends.float_keys`). reduce_scatter is MPI's
``Ireduce_scatter`` with per-rank counts, uneven blocks included.

global_scatter and global_gather are fused: one ``Ialltoallw`` whose receive (send) side
is, per peer, an indexed datatype that puts each expert's rows straight at their place in
expert-major order, so MPI's own copy does the reorder and no second buffer is needed. Below
:data:`_FUSED_FROM_BYTES` that side is contiguous rank-major rows and a reorder follows
(precedes), which costs less there. Both are an ``Ialltoallw``: each rank decides by its own
bytes, which differ between ranks, and every rank must call the same collective. The rows
staged or received are numpy arrays, handed back to a torch caller as one ``torch.from_numpy``.

Every collective is issued non-blocking (``Ialltoallv``, ``Iallgather``, ``Ialltoall``,
``Ibarrier``, ``Idup``) and waited for by polling ``Test()`` against a deadline, so no call
waits past the configured timeout; ``sync_op=True`` waits inside the primitive. The polling
never sleeps: MPI moves a large message only while some call drives its progress engine, so
a wait spins. Only when this node runs more ranks than this process may use cores does a wait
yield the CPU between polls once it has lasted :data:`_YIELD_AFTER_S`: there, the ranks it
waits for need the core, and elsewhere yielding only slows the transfer. docs/mpi.md has the
measurements behind both choices.

A transfer keeps its request and the arrays whose memory it uses until MPI completes it, whatever
becomes of its work: one dropped before it completed (a task never waited for, an exception
between issuing and waiting, the end of the session, an internal wait that timed out) is
adopted by :mod:`unicoll.backends.mpi.inflight` and reaped at later transfers and at finalize.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from unicoll.backends.base import Backend, Capabilities, Pending, Work, issued
from unicoll.backends.host import host_rows, host_view, row_bytes, rows_as
from unicoll.backends.mpi import inflight
from unicoll.backends.mpi.bfloat16 import reduce_words
from unicoll.errors import TransportError, TransportTimeoutError
from unicoll.workspace import Workspace

if TYPE_CHECKING:
    from unicoll.backends.layout import MoePlan
    from unicoll.group import Group

_YIELD_AFTER_S = 50e-6
"""On an oversubscribed node, how long a wait polls back to back before it yields the CPU
between polls. A small message completes within it; past it, a rank that waits lets the ranks
it waits for run (docs/mpi.md)."""

_FUSED_FROM_BYTES = 24 * 2**10
"""A global_scatter or global_gather side of fewer bytes than this is sent (received) as
contiguous rank-major rows and reordered by the call's plan
(:class:`unicoll.backends.layout.MoePlan`): below it, making the fused path's indexed
datatypes (2-3 us a call) costs more than the copy it saves; the two cross over between 16 and
32 KiB on 2 ranks, for both operators (docs/performance.md, "Sixth pass")."""

_ROW_TYPES_KEPT = 64
"""How many row datatypes (one per row size in bytes, a few hundred bytes each) a backend keeps."""

_LOCAL_SIZE_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE")
"""Where MPICH's Hydra, Open MPI and torchrun-style launchers say how many ranks run on this node."""


def yield_after(world_size: int) -> float:
    """How long a wait spins before yielding between polls: :data:`_YIELD_AFTER_S` when this
    node runs more ranks than this process may use cores, else never (infinity). The ranks on
    the node come from the launcher's variables; without them, every rank counts as local."""
    local = next((int(v) for v in map(os.environ.get, _LOCAL_SIZE_VARIABLES) if v and v.isdigit()), world_size)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # macOS
    return _YIELD_AFTER_S if local > cores else math.inf


def _fused(x: Any) -> bool:
    """Whether this rank's side of a global_scatter/global_gather whose rows need a reorder
    takes the fused way (:data:`_FUSED_FROM_BYTES`): ``x``'s bytes differ between ranks, so
    ranks may decide differently."""
    return x.nbytes >= _FUSED_FROM_BYTES


def _contiguous_side(buffer: Any, splits: list[int], row: MPI.Datatype) -> list[Any]:
    """One side of an ``Ialltoallw``: ``splits[c]`` consecutive rows of ``buffer`` for rank c."""
    extent, at, displacements = row.extent, 0, []
    for rows in splits:  # a loop: a comprehension over accumulate() costs two calls more
        displacements.append(at)
        at += rows * extent
    return [buffer, (splits, displacements), [row] * len(splits)]


def _wait(request: MPI.Request, timeout: float, what: str, spin: float) -> None:
    """Return once ``request`` completes; TransportTimeoutError after ``timeout`` seconds, and
    the TransportError of an MPI error (:func:`_failure`). Polls back to back for ``spin``
    seconds, then yields the CPU between polls."""
    try:
        if request.Test():
            return
        start = time.monotonic()
        while not request.Test():
            waited = time.monotonic() - start
            if waited > timeout:
                raise TransportTimeoutError(
                    f"mpi: {what} timed out after {timeout:g} s (a rank of the communicator has not called it)"
                )
            if waited > spin:
                os.sched_yield()
    except MPI.Exception as exc:
        raise _failure(exc, what) from exc


def _settle(request: MPI.Request, timeout: float, what: str, spin: float, keep: tuple[Any, ...] = ()) -> None:
    """:func:`_wait` for a request that no caller holds: one that times out may still complete
    later, so it is adopted with ``keep`` (:mod:`unicoll.backends.mpi.inflight`) before the
    error leaves."""
    try:
        _wait(request, timeout, what, spin)
    except TransportTimeoutError:
        inflight.adopt(request, keep)
        raise


def _failure(exc: MPI.Exception, what: str) -> TransportError:
    """The TransportError for MPI's error ``exc`` in ``what``: MPICH reports no lost peer (the
    launcher stops the job), so every MPI error is of no particular kind."""
    return TransportError(f"mpi: {what} failed: {exc.Get_error_string().splitlines()[0]}")


_REDUCE_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
"""MPI's reduction of each transport reduction (:meth:`Backend.allreduce`)."""

_BOOL_OPS = {"max": MPI.LOR, "min": MPI.LAND}
"""On bool, MPI defines only the logical reductions."""

_UFUNCS = {"sum": np.add, "prod": np.multiply}
"""The bfloat16 reductions run here (float max and min reach MPI as integer keys: :meth:`Backend.all_reduce`)."""


def _bfloat16_reduction(op: str) -> MPI.Op:
    """A commutative MPI operation that reduces bfloat16 words with ``op`` (see the module)."""
    ufunc = _UFUNCS[op]

    def reduce(inbuf: Any, inoutbuf: Any, datatype: MPI.Datatype) -> None:
        into = np.frombuffer(inoutbuf, np.uint16)
        into[...] = reduce_words(ufunc, np.frombuffer(inbuf, np.uint16), into)

    return MPI.Op.Create(reduce, commute=True)


class _MpiWork:
    """An MPI request seen through unicoll's ``Work`` protocol; ``keep``: the arrays whose
    memory the transfer uses (:func:`_buffer`). A work that goes before its transfer completed
    hands both to :mod:`unicoll.backends.mpi.inflight`."""

    _adopt = staticmethod(inflight.adopt)  # reachable from __del__ even during the interpreter's teardown

    def __init__(self, request: MPI.Request, what: str, spin: float, keep: tuple[Any, ...] = ()) -> None:
        self._request = request
        self._what = what
        self._spin = spin
        self._keep = keep

    def wait(self, timeout: float) -> None:
        _wait(self._request, timeout, self._what, self._spin)

    def is_completed(self) -> bool:
        try:
            return self._request.Test()
        except MPI.Exception as exc:
            raise _failure(exc, self._what) from exc

    def __del__(self) -> None:
        if self._request:  # not MPI_REQUEST_NULL: no test has seen it complete
            self._adopt(self._request, self._keep)


def _buffer(a: Any) -> Any:
    """What MPI moves of ``a`` (a contiguous numpy array or torch CPU tensor): a buffer over its
    memory. A tensor's buffer is made from its address, for a third of what a numpy view of it
    costs; it does not keep the tensor alive, so a transfer that outlives its call keeps the
    tensor in its work (:class:`_MpiWork`). A tensor of zero bytes has address 0, which MPI
    refuses with a non-zero count (rows of zero bytes: "Invalid buffer pointer"); it moves as an
    empty numpy array, whose address is its own, so a send and a receive side never alias."""
    if isinstance(a, np.ndarray):
        return a
    address = a.data_ptr()
    return MPI.buffer.fromaddress(address, a.nbytes) if address else np.empty(0, np.uint8)


class MpiBackend(Backend):
    """mpi4py on a duplicate of ``COMM_WORLD`` (so unicoll's traffic never matches the
    application's own), and one communicator per group."""

    name = "mpi"

    def __init__(self, capabilities: Capabilities, *, timeout: float) -> None:
        self.capabilities = capabilities
        self._timeout = timeout
        self._row_types: dict[int, MPI.Datatype] = {}
        self.workspace = Workspace()
        self._bfloat16_ops: dict[str, MPI.Op] = {}  # at most one per reduction
        try:
            self._world, request = MPI.COMM_WORLD.Idup()
        except MPI.Exception as exc:
            raise _failure(exc, "init") from exc
        self._spin = yield_after(MPI.COMM_WORLD.Get_size())
        _settle(request, timeout, "init (duplicating COMM_WORLD)", self._spin, (self._world,))
        self._comms: list[MPI.Intracomm] = [self._world]  # every communicator this backend made
        self.rank = self._world.Get_rank()
        self.world_size = self._world.Get_size()

    def _comm(self, group: Group) -> MPI.Intracomm:
        return self._world if group.handle is None else group.handle

    def _done(self, request: MPI.Request, what: str, async_op: bool, keep: tuple[Any, ...] = ()) -> Work | None:
        """The work of a transfer just issued, or None once it completed (``async_op`` False);
        lets go of the adopted transfers that have completed since (:mod:`inflight`)."""
        if inflight.ADOPTED:
            inflight.reap()
        if async_op:
            return _MpiWork(request, what, self._spin, keep)
        _settle(request, self._timeout, what, self._spin, keep)
        return None

    def _row_type(self, nbytes: int) -> MPI.Datatype:
        """The committed contiguous datatype of one row of ``nbytes`` bytes, cached per row
        size (at most :data:`_ROW_TYPES_KEPT` sizes; the oldest is freed first)."""
        row_type = self._row_types.get(nbytes)
        if row_type is None:
            if len(self._row_types) >= _ROW_TYPES_KEPT:  # MPI keeps a freed type until its transfers complete
                self._row_types.pop(next(iter(self._row_types))).Free()
            row_type = self._row_types[nbytes] = MPI.BYTE.Create_contiguous(nbytes).Commit()
        return row_type

    def to_native(self, x: Any) -> Any:
        if isinstance(x, np.ndarray):
            return x if x.flags.c_contiguous else np.ascontiguousarray(x)
        return (x.detach() if x.requires_grad else x).contiguous()

    def from_native(self, t: Any, library: str) -> Any:
        return t  # natives are the caller's own kind of array

    def empty_rows(self, like: Any, rows: int) -> Any:
        return rows_as(host_rows(like, rows, self.workspace), like)

    def take_rows(self, x: Any, index: np.ndarray, out: Any | None = None) -> Any:
        """numpy's ``take``, a tensor's on its numpy view (bfloat16 as 16-bit words): 0.7 µs less
        than ``index_select`` on 1 KB, the same on megabytes (one thread, as the ranks run).
        Into ``out`` with ``mode="clip"`` (the index is valid): numpy buffers the default mode's
        output, a copy more."""
        if out is None:
            out = self.empty_rows(x, len(index))
        np.take(host_view(x), index, axis=0, out=host_view(out), mode="clip")
        return out

    def new_group(self, ranks: Sequence[int]) -> MPI.Intracomm | None:
        """A communicator of ``ranks`` (None on the other ranks), split from the world once
        every rank has arrived, so a rank that never calls makes this time out, not hang."""
        self._barrier_on(self._world, "new_group")
        try:
            comm = self._world.Split(0 if self.rank in ranks else MPI.UNDEFINED, self.rank)
        except MPI.Exception as exc:
            raise _failure(exc, "new_group") from exc
        if comm == MPI.COMM_NULL:
            return None
        self._comms.append(comm)
        return comm

    def _barrier_on(self, comm: MPI.Intracomm, what: str) -> None:
        """Block until every rank of ``comm`` has called this, within the timeout."""
        try:
            request = comm.Ibarrier()
        except MPI.Exception as exc:
            raise _failure(exc, what) from exc
        _settle(request, self._timeout, what, self._spin)

    def barrier(self, group: Group) -> None:
        self._barrier_on(self._comm(group), "barrier")

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
        row = self._row_type(row_bytes(x))
        try:  # displacements None: mpi4py places the blocks one after another (in C)
            request = self._comm(group).Ialltoallv(
                [_buffer(x), in_splits, None, row], [_buffer(out), out_splits, None, row]
            )
        except MPI.Exception as exc:
            raise _failure(exc, "alltoallv") from exc
        return self._done(request, "alltoallv", async_op, (x, out))

    def all_gather_even(self, out: Any, x: Any, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        row, rows = self._row_type(row_bytes(x)), x.shape[0]
        try:
            request = self._comm(group).Iallgather([_buffer(x), rows, row], [_buffer(out), rows, row])
        except MPI.Exception as exc:
            raise _failure(exc, "allgather") from exc
        return self._done(request, "allgather", async_op, (x, out))

    def _reduction(self, op: str, x: Any) -> MPI.Op:
        """MPI's operation for the transport reduction ``op`` on ``x``: the logical ones on bool,
        this backend's own on bfloat16 (made on first use, freed by :meth:`finalize`)."""
        if x.dtype == np.bool_ or str(x.dtype) == "torch.bool":
            return _BOOL_OPS[op]
        if str(x.dtype) != "torch.bfloat16":
            return _REDUCE_OPS[op]
        if op not in self._bfloat16_ops:
            self._bfloat16_ops[op] = _bfloat16_reduction(op)
        return self._bfloat16_ops[op]

    def allreduce(self, x: Any, op: str, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        view = host_view(x).reshape(-1)
        try:
            request = self._comm(group).Iallreduce(MPI.IN_PLACE, view, op=self._reduction(op, x))
        except MPI.Exception as exc:
            raise _failure(exc, "allreduce") from exc
        return self._done(request, "allreduce", async_op, (view,))  # a request keeps no in-place buffer

    def reduce_scatter_even(
        self, out: Any, x: Any, op: str, group: Group, async_op: bool, calc_stream: bool = False
    ) -> Work | None:
        return self._reduce_scatter(out, x, op, [out.shape[0]] * group.world_size, group, async_op)

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
        """MPI's ``Ireduce_scatter`` takes unequal blocks as they are: no padding."""
        return issued(self._reduce_scatter(out, x, op, list(rows), group, async_op), lambda: out)

    def _reduce_scatter(self, out: Any, x: Any, op: str, rows: list[int], group: Group, async_op: bool) -> Work | None:
        send, recv = host_view(x), host_view(out)
        per_row = math.prod(send.shape[1:])
        try:
            request = self._comm(group).Ireduce_scatter(
                send.reshape(-1), recv.reshape(-1), [r * per_row for r in rows], op=self._reduction(op, x)
            )
        except MPI.Exception as exc:
            raise _failure(exc, "reduce_scatter") from exc
        return self._done(request, "reduce_scatter", async_op, (send, recv))

    def bcast(self, x: Any, src: int, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        view = host_view(x)
        try:
            request = self._comm(group).Ibcast([view, view.shape[0], self._row_type(row_bytes(view))], root=src)
        except MPI.Exception as exc:
            raise _failure(exc, "broadcast") from exc
        return self._done(request, "broadcast", async_op, (view,))

    def global_scatter(
        self,
        x: Any,
        plan: MoePlan,
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
        rows: np.ndarray | None = None,
    ) -> Pending:
        """One ``Ialltoallw`` whose receive side places each rank's rows in expert-major order
        (fused), or below :data:`_FUSED_FROM_BYTES` receives them rank-major for a
        reorder after (see the module). ``rows``: gathered first, into a lent buffer (an
        indexed datatype of one row per block packs several times slower than ``take``)."""
        if not plan.reordered:
            return super().global_scatter(x, plan, group, async_op, calc_stream, rows)
        sent, lent = (x, None) if rows is None else self.gather_rows(x, rows)
        if _fused(sent):
            received = host_rows(x, plan.expert_major_rows, self.workspace)
            if plan.capacity is not None:
                received[plan.padding_rows] = 0  # the transfer writes every other row
            work = self._moe_alltoallw(sent, received, plan, True, True, group, async_op)
            return issued(work, lambda: self._returned(rows_as(received, x), lent))
        padded = int(plan.capacity is not None)  # one zero row after the received ones, for the padding
        received = host_rows(x, sum(plan.recv) + padded, self.workspace)
        received[sum(plan.recv) :] = 0
        work = self._moe_alltoallw(sent, received[: sum(plan.recv)], plan, True, False, group, async_op)
        return issued(work, lambda: self._returned(rows_as(received.take(plan.to_expert_major, axis=0), x), lent))

    def global_gather(
        self,
        x: Any,
        plan: MoePlan,
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
        out: Any | None = None,
    ) -> Pending:
        """The mirror image of :meth:`global_scatter`: each rank's rows sent from their
        expert-major places (fused), or below :data:`_FUSED_FROM_BYTES` reordered to
        rank-major first."""
        if not plan.reordered:
            return super().global_gather(x, plan, group, async_op, calc_stream, out)
        back, fused = host_rows(x, sum(plan.send), self.workspace) if out is None else out, _fused(x)
        rows = x if fused else host_view(x).take(plan.to_rank_major, axis=0)
        work = self._moe_alltoallw(back, rows, plan, False, fused, group, async_op)
        return issued(work, lambda: back if out is not None else rows_as(back, x))

    def _moe_alltoallw(
        self, ours: Any, theirs: Any, plan: MoePlan, scatter: bool, placed: bool, group: Group, async_op: bool
    ) -> Work | None:
        """One ``Ialltoallw`` between ``ours``, rank-major rows of this rank's tokens
        (``plan.send[c]`` for rank c), and ``theirs``, the rows of this rank's experts: from
        the first to the second when ``scatter``, else back. ``theirs`` is expert-major when
        ``placed`` (each rank's chunk for each expert reached through an indexed datatype over
        ``plan.expert_major_chunks``, made per call), else rank-major (``plan.recv[c]`` for rank
        c). Both ways are the same collective, so ranks may take different ways in one call
        (each decides by its own bytes); the type signatures match: rows of one size."""
        row = self._row_type(row_bytes(ours))
        ours_side, datatypes = _contiguous_side(_buffer(ours), plan.send, row), []
        if placed:
            datatypes = [row.Create_indexed(counts, starts).Commit() for counts, starts in plan.expert_major_chunks]
            theirs_side = [_buffer(theirs), ([1] * len(datatypes), [0] * len(datatypes)), datatypes]
        else:
            theirs_side = _contiguous_side(_buffer(theirs), plan.recv, row)
        what = "alltoallw (global_scatter)" if scatter else "alltoallw (global_gather)"
        try:
            comm = self._comm(group)
            request = comm.Ialltoallw(ours_side, theirs_side) if scatter else comm.Ialltoallw(theirs_side, ours_side)
        except MPI.Exception as exc:
            raise _failure(exc, what) from exc
        finally:
            for datatype in datatypes:  # MPI keeps them until the transfer that uses them completes
                datatype.Free()
        return self._done(request, what, async_op, (ours, theirs))

    def exchange_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        send = np.ascontiguousarray(values, dtype=np.int64)
        recv = np.empty_like(send)
        per_rank = send.size // group.world_size
        try:
            request = self._comm(group).Ialltoall([send, per_rank, MPI.INT64_T], [recv, per_rank, MPI.INT64_T])
        except MPI.Exception as exc:
            raise _failure(exc, "alltoall of counts") from exc
        _settle(request, self._timeout, "alltoall of counts", self._spin, (send, recv))
        return recv

    def gather_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        send = np.ascontiguousarray(values, dtype=np.int64)
        recv = np.empty((group.world_size, send.size), dtype=np.int64)
        try:
            request = self._comm(group).Iallgather([send, MPI.INT64_T], [recv, MPI.INT64_T])
        except MPI.Exception as exc:
            raise _failure(exc, "allgather of counts") from exc
        _settle(request, self._timeout, "allgather of counts", self._spin, (send, recv))
        return recv

    def finalize(self) -> None:
        """Free the communicators, datatypes and operations made here; MPI itself stays
        initialized (mpi4py finalizes it when the process exits), so ``init`` can run again.

        Waits for nothing: transfers still in flight (tasks not waited for, which the session's
        end has just let go of, and internal waits that timed out) stay adopted
        (:mod:`inflight`), with their arrays, and keep all of these until they complete."""
        self.workspace.clear()
        if MPI.Is_finalized():
            return
        made = (*self._comms, *self._row_types.values(), *self._bfloat16_ops.values())
        self._comms, self._row_types, self._bfloat16_ops = [], {}, {}
        if inflight.reap():
            inflight.hold(made)
            return
        for handle in made:
            handle.Free()
