"""``pairwise``: a unicoll backend written outside unicoll, against ``unicoll.backends.base`` only.

Every transfer is a batch of point-to-point messages of torch.distributed over gloo, one per
pair of ranks that exchange rows, each moving the rows as bytes (so every dtype moves, bool and
bfloat16 included); reductions gather the blocks they need and fold them here, in rank order,
in the array's dtype. It implements the primitives; the operators (``global_scatter``,
``global_gather``, ``alltoall_single``, ``all_gather``, ``all_reduce``, ``reduce_scatter``,
``broadcast``) come from the base class, and unicoll's conformance matrix holds them to the same
results as the built-in backends. It moves the rows of a top-k dispatch and combine itself, in
both MoE modes (the MoE entry points, named in its table's ``moe`` column): one message per
(rank, expert) chunk, received straight into the chunk's place, so no rows are staged or
reordered after the transfer; in the static-shape mode only each block's valid rows travel.

    pip install ./examples/backend_plugin
    UNICOLL_BACKEND=pairwise unicoll run -n 2 examples/moe_dispatch.py
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from itertools import accumulate
from typing import Any

import numpy as np
from array_api_compat import array_namespace

from unicoll.arrays import DTYPES
from unicoll.backends.base import Backend, Capabilities, Pending, Work, issued, reductions
from unicoll.backends.blocks import StaticLayout, counts_heard, counts_told, refuse_other_capacities, slot_index
from unicoll.backends.layout import MoePlan, Routing
from unicoll.backends.torch.errors import torch_boundary
from unicoll.errors import TransportError, init_error
from unicoll.group import Group

CAPABILITIES = Capabilities(
    ops=None,  # every operator the base class composes
    dtypes=frozenset(DTYPES),
    devices=frozenset({"cpu"}),
    libraries=frozenset({"numpy", "torch"}),
    reductions=reductions(frozenset(DTYPES)),
    moe=frozenset({"moe_dispatch", "moe_combine", "moe_dispatch_static", "moe_combine_static"}),
)


class PairwiseFactory:
    """What the entry point names: the capability table, whether it runs here, how to start it."""

    capabilities = CAPABILITIES

    def probe(self) -> str | None:
        try:
            import torch.distributed as dist
        except ImportError as exc:
            return f"torch is not installed ({exc})"
        return None if dist.is_available() and dist.is_gloo_available() else "this torch build has no gloo"

    def __call__(self, *, rank: int, world_size: int, timeout: float) -> Backend:
        return PairwiseBackend(rank=rank, world_size=world_size, timeout=timeout)


factory = PairwiseFactory()


class _Batch:
    """The point-to-point works of one transfer, waited for together (``Task.wait()``), then
    ``then()`` once (the local fold of a reduction)."""

    def __init__(self, works: list[Any], then: Callable[[], None] | None = None) -> None:
        self._works = works
        self._then = then

    @torch_boundary
    def wait(self, timeout: float) -> None:
        for work in self._works:
            work.wait(timedelta(seconds=timeout))
        then, self._then = self._then, None
        if then is not None:
            then()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def _as_bytes(t: Any) -> Any:
    """The rows of contiguous tensor ``t`` as rows of bytes, sharing its memory (as a flat
    view first: torch keeps any stride for dimensions of size 0 or 1, and views bytes only
    with stride 1)."""
    import torch

    flat = t.as_strided((t.numel(),), (1,))
    return flat.view(torch.uint8).reshape(t.shape[0], t.element_size() * math.prod(t.shape[1:]))


_FOLDS = {"sum": "add", "prod": "mul", "max": "maximum", "min": "minimum"}
"""The elementwise function of torch that folds each reduction (on bool: or, and, or, and)."""


def _fold(blocks: Any, op: str) -> Any:
    """``blocks[0] op blocks[1] op ...``, left to right, in the blocks' dtype (integers wrap)."""
    import torch

    step = getattr(torch, _FOLDS[op])
    total = blocks[0].clone()
    for block in blocks[1:]:
        total = step(total, block)
    return total


def _starts(splits: Sequence[int]) -> list[int]:
    return [0, *accumulate(splits)]


_Chunks = list[tuple[list[int], list[int]]]
"""Per rank: the rows of each of its (rank, expert) chunks, and the row where each starts."""


def _sent_by_expert(routing: Routing, group: Group) -> np.ndarray:
    """The rows sent to each rank's experts, as a ``(W, E)`` array."""
    return routing.local_count.reshape(group.world_size, -1)


def _chunks(per_rank: list[int], counts: np.ndarray) -> _Chunks:
    """Per rank: the rows of each of its expert chunks and where each starts, in a buffer laid
    out rank by rank (``per_rank`` rows each), then expert by expert (``counts``: ``(W, E)``)."""
    firsts = _starts(per_rank)
    return [(row.tolist(), [firsts[c] + s for s in _starts(row.tolist())[:-1]]) for c, row in enumerate(counts)]


def _chunk_pieces(group: Group, sends: _Chunks, send: Any, recvs: _Chunks, recv: Any) -> list[tuple[int, Any, Any]]:
    """One ``(peer, rows out, rows in)`` per rank and expert chunk: chunk ``e`` of what goes to
    rank ``p`` (``sends[p]``: rows and starts in ``send``) and of what comes from it
    (``recvs[p]``, in ``recv``). Both sides order a pair's chunks by expert, so the messages
    between two ranks pair up in order; empty chunks are skipped by :meth:`_exchange`."""
    pieces = []
    for p, peer in enumerate(group.ranks):
        (out_rows, out_starts), (in_rows, in_starts) = sends[p], recvs[p]
        for n_out, at_out, n_in, at_in in zip(out_rows, out_starts, in_rows, in_starts):
            pieces.append((peer, send[at_out : at_out + n_out], recv[at_in : at_in + n_in]))
    return pieces


class PairwiseBackend(Backend):
    """torch.distributed's default group over gloo (created here), transfers as send/recv pairs."""

    name = "pairwise"
    capabilities = CAPABILITIES

    def __init__(self, *, rank: int, world_size: int, timeout: float) -> None:
        self.rank, self.world_size = rank, world_size
        self._timeout = timedelta(seconds=timeout)
        try:
            self._start()
        except TransportError as exc:
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            raise init_error(
                exc, self.name, rank, world_size, timeout, f"check that every rank meets at {where}"
            ) from exc

    @torch_boundary
    def _start(self) -> None:
        import torch.distributed as dist

        if self.world_size == 1:
            store = dist.HashStore()
        else:
            addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            store = dist.TCPStore(addr, port, self.world_size, self.rank == 0, timeout=self._timeout)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size, timeout=self._timeout)

    # -- arrays ------------------------------------------------------------------------------

    def to_native(self, x: Any) -> Any:
        import torch

        if isinstance(x, torch.Tensor):
            return x.detach().contiguous()
        return torch.from_numpy(np.array(x, order="C") if not x.flags.c_contiguous or not x.flags.writeable else x)

    def from_native(self, t: Any, library: str) -> Any:
        return t if library == "torch" else t.numpy()

    # -- transfers ---------------------------------------------------------------------------

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
        """Rows ``in_splits[p]`` of ``x`` to the group's rank ``p``, rows ``out_splits[p]`` of
        ``out`` from it; this rank's own rows are copied."""
        send, recv = _as_bytes(x), _as_bytes(out)
        sends, recvs = _starts(in_splits), _starts(out_splits)
        pieces = [
            (peer, send[sends[p] : sends[p + 1]], recv[recvs[p] : recvs[p + 1]]) for p, peer in enumerate(group.ranks)
        ]
        return self._exchange(pieces, group, async_op)

    def all_gather_even(self, out: Any, x: Any, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        """``x`` to every rank of the group, rank ``p``'s rows into block ``p`` of ``out``."""
        send, recv, rows = _as_bytes(x), _as_bytes(out), x.shape[0]
        pieces = [(peer, send, recv[p * rows : (p + 1) * rows]) for p, peer in enumerate(group.ranks)]
        return self._exchange(pieces, group, async_op)

    def allreduce(self, x: Any, op: str, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        """Every rank's ``x`` gathered, then folded into ``x`` in rank order."""
        gathered = self.empty_rows(x, group.world_size * x.shape[0])
        blocks = gathered.view(group.world_size, *x.shape)
        return self._then(self.all_gather_even(gathered, x, group, True), lambda: x.copy_(_fold(blocks, op)), async_op)

    def reduce_scatter_even(
        self, out: Any, x: Any, op: str, group: Group, async_op: bool, calc_stream: bool = False
    ) -> Work | None:
        """Block ``p`` of every rank's ``x`` sent to position ``p``, then folded into ``out``."""
        rows, world = out.shape[0], group.world_size
        received = self.empty_rows(x, world * rows)
        work = self.alltoallv(received, x, [rows] * world, [rows] * world, group, True)
        blocks = received.view(world, *out.shape)
        return self._then(work, lambda: out.copy_(_fold(blocks, op)), async_op)

    def bcast(self, x: Any, src: int, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        """Position ``src`` sends its rows to every other rank of the group."""
        rows, source = _as_bytes(x), group.ranks[src]
        nothing = rows[:0]
        if source == self.rank:
            pieces = [(peer, rows, nothing) for peer in group.ranks if peer != self.rank]
        else:
            pieces = [(source, nothing, rows)]
        return self._exchange(pieces, group, async_op)

    def _then(self, work: _Batch, then: Callable[[], Any], async_op: bool) -> Work | None:
        """``then()`` once ``work`` (a :class:`_Batch`) completes: now, or in ``Task.wait()``."""
        batch = _Batch(work._works, then)  # work: what _exchange returned asynchronously
        if async_op:
            return batch
        batch.wait(self._timeout.total_seconds())
        return None

    @torch_boundary
    def _exchange(self, pieces: list[tuple[int, Any, Any]], group: Group, async_op: bool) -> Work | None:
        """Send and receive each ``(world peer, rows out, rows in)``, skipping empty messages."""
        import torch.distributed as dist

        ops = []
        for peer, outgoing, incoming in pieces:
            if peer == self.rank:
                incoming.copy_(outgoing)
                continue
            if outgoing.shape[0]:
                ops.append(dist.P2POp(dist.isend, outgoing, peer, group=self._pg(group)))
            if incoming.shape[0]:
                ops.append(dist.P2POp(dist.irecv, incoming, peer, group=self._pg(group)))
        batch = _Batch(dist.batch_isend_irecv(ops) if ops else [])
        if async_op:
            return batch
        batch.wait(self._timeout.total_seconds())
        return None

    # -- the MoE entry points: chunks straight to their places --------------------------------

    def moe_dispatch(
        self, x: Any, routing: Routing, plan: MoePlan, group: Group, async_op: bool, calc_stream: bool = False
    ) -> Pending:
        """The rows sent (x's rows in send order: by destination rank, then local expert), one
        message per (rank, expert) chunk, each received into its expert-major place."""
        sent = self.take_rows(x, routing.send_tokens)
        out = self.empty_rows(x, plan.expert_major_rows)
        pieces = _chunk_pieces(group, _chunks(plan.send, _sent_by_expert(routing, group)), _as_bytes(sent),
                               plan.expert_major_chunks, _as_bytes(out))  # fmt: skip
        return issued(self._exchange(pieces, group, async_op), lambda: out)

    def moe_combine(
        self,
        y: Any,
        routing: Routing,
        plan: MoePlan,
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
        out: Any | None = None,
    ) -> Pending:
        """The inverse of :meth:`moe_dispatch`: each expert-major chunk sent back to its rank,
        received into its place among the rows in send order."""
        y = y.contiguous()
        if out is None:
            out = self.empty_rows(y, sum(plan.send))
        pieces = _chunk_pieces(group, plan.expert_major_chunks, _as_bytes(y),
                               _chunks(plan.send, _sent_by_expert(routing, group)), _as_bytes(out))  # fmt: skip
        return issued(self._exchange(pieces, group, async_op), lambda: out)

    # -- the static mode's entry points: the valid rows of each block straight to their places --

    def moe_dispatch_static(
        self,
        x: Any,
        layout: StaticLayout,
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
        valid: Any | None = None,
    ) -> Pending:
        """The valid rows of each (rank, expert) block, one message each, received into the
        block's place among the ``(E, W * C)`` rows, which start as zeros; the counts travel
        first where the receivers do not know them yet (``valid`` None)."""
        world = group.world_size
        experts, capacity = layout.blocks(world)
        heard = None
        if valid is None:
            heard = self.exchange_ints(counts_told(np, layout, world), group)
            capacities, valid, _ = counts_heard(array_namespace(heard), heard, world, experts)
            refuse_other_capacities(capacities, capacity)
        received = np.asarray(valid).T
        sent = layout.sent.reshape(world, experts)
        rows = self.take_rows(x, layout.row_index(x.shape[0])[layout.filled])
        out = x.new_zeros((experts * world * capacity, *x.shape[1:]))
        firsts = _starts(sent.reshape(-1).tolist())
        send, recv = _as_bytes(rows), _as_bytes(out)
        pieces = []
        for p, peer in enumerate(group.ranks):
            for e in range(experts):
                at_out, at_in = firsts[p * experts + e], (e * world + p) * capacity
                pieces.append((peer, send[at_out : at_out + sent[p, e]], recv[at_in : at_in + received[p, e]]))
        told = None if heard is None else self.to_native(heard)
        blocks = out.view(experts, world * capacity, *x.shape[1:])
        return issued(self._exchange(pieces, group, async_op), lambda: (blocks, told))

    def moe_combine_static(
        self,
        y: Any,
        layout: StaticLayout,
        valid: Any,
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
    ) -> Pending:
        """The inverse of :meth:`moe_dispatch_static`: each block's valid rows back to their
        rank, one message each, received into their place in the send buffer's layout, which a
        zero row follows: each slot's row is there (:func:`slot_index`)."""
        world = group.world_size
        experts, capacity = layout.blocks(world)
        rows = experts * world * capacity
        y = y.contiguous().view(rows, *y.shape[2:])
        back = y.new_zeros((rows + 1, *y.shape[1:]))
        sent, valid = layout.sent.reshape(world, experts), valid.numpy()
        send, recv = _as_bytes(y), _as_bytes(back)
        pieces = []
        for p, peer in enumerate(group.ranks):
            for e in range(experts):
                at_out, at_in = (e * world + p) * capacity, (p * experts + e) * capacity
                pieces.append((peer, send[at_out : at_out + valid[e, p]], recv[at_in : at_in + sent[p, e]]))
        work = self._exchange(pieces, group, async_op)
        return issued(work, lambda: (back, slot_index(np, layout, rows)))

    def exchange_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        send = self.to_native(np.ascontiguousarray(values, dtype=np.int64))
        recv = send.new_empty(send.shape)
        k = send.shape[0] // group.world_size
        self.alltoallv(recv, send, [k] * group.world_size, [k] * group.world_size, group, False)
        return recv.numpy()

    def gather_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        send = self.to_native(np.ascontiguousarray(values, dtype=np.int64))
        recv = send.new_empty((group.world_size * send.shape[0],))
        self.all_gather_even(recv, send, group, False)
        return recv.numpy().reshape(group.world_size, -1)

    # -- groups ------------------------------------------------------------------------------

    def _pg(self, group: Group) -> Any:
        import torch.distributed as dist

        return dist.group.WORLD if group.handle is None else group.handle

    @torch_boundary
    def new_group(self, ranks: Sequence[int]) -> Any:
        import torch.distributed as dist

        return dist.new_group(list(ranks), timeout=self._timeout)

    @torch_boundary
    def barrier(self, group: Group) -> None:
        import torch.distributed as dist

        dist.barrier(group=self._pg(group))

    def finalize(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
