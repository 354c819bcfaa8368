"""What a backend is: a capability table, a handful of byte-moving primitives, and the
operators composed from them once, here, for every backend.

A backend implements the abstract primitives (an uneven all-to-all over rows, an even
all-gather, an in-place all-reduce, an even reduce-scatter, a broadcast, small integer
exchanges, a barrier, groups, conversion to and from its native array type). The operators
below are written with those primitives plus local work in the array namespace (a reorder,
padding, the division of ``avg``); a backend may override one with a fused path, and the
conformance matrix holds it to the same results.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
from array_api_compat import array_namespace, device

from unicoll.backends import float_keys
from unicoll.backends.blocks import (
    StaticLayout,
    counts_heard,
    counts_told,
    expert_major,
    refuse_other_capacities,
    send_rows,
    slot_index,
    source_major,
)
from unicoll.backends.host import row_bytes, rows_over
from unicoll.backends.layout import moe_plan
from unicoll.counts import on_host
from unicoll.forking import keep_forever
from unicoll.workspace import FROM_BYTES, Workspace

if TYPE_CHECKING:
    from unicoll.backends.layout import MoePlan, Routing
    from unicoll.group import Group


#: The reductions of all_reduce and reduce_scatter, in the order the docs list them.
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min", "prod")

FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
"""The dtypes ``avg`` is defined for: an average of integers or bools is no integer or bool."""


def reductions(dtypes: frozenset[str]) -> dict[str, frozenset[str]]:
    """The usual reduction table for ``dtypes``: every reduction on each of them, but ``avg``
    on floating dtypes only (for bool, ``sum`` is logical or and ``prod`` logical and)."""
    return {op: dtypes & FLOAT_DTYPES if op == "avg" else dtypes for op in REDUCE_OPS}


@dataclass(frozen=True)
class Capabilities:
    """What a backend can move: the conformance matrix and the validator read this table.

    ``reductions`` maps each reduction of all_reduce and reduce_scatter (``"sum"``, ``"avg"``,
    ``"max"``, ``"min"``, ``"prod"``) to the dtypes the backend reduces with it; a reduction or
    a dtype missing from it is refused before anything is sent.

    ``ops`` names the data operators the backend runs; None: every one this base class composes
    from the primitives (a backend that implements them all, as the built-in ones do).
    ``moe`` names the MoE entry points (:data:`MOE_ENTRY_POINTS`) the backend moves itself,
    overriding :meth:`Backend.moe_dispatch` or :meth:`Backend.moe_combine` (a transport that
    moves tokens on its own); the others are composed from its primitives.
    """

    ops: frozenset[str] | None
    dtypes: frozenset[str]
    devices: frozenset[str]
    libraries: frozenset[str]
    reductions: dict[str, frozenset[str]] = field(default_factory=dict, hash=False)
    moe: frozenset[str] = frozenset()

    def provides(self, op: str) -> bool:
        """Whether the backend runs the data operator ``op`` (see :attr:`ops`)."""
        return self.ops is None or op in self.ops


MOE_ENTRY_POINTS = ("moe_dispatch", "moe_combine", "moe_dispatch_static", "moe_combine_static")
"""The backend's MoE entry points, which :attr:`Capabilities.moe` may name."""


class Work(Protocol):
    """A communication in flight, as the transport reports it."""

    def wait(self, timeout: float) -> Any: ...

    def is_completed(self) -> bool: ...


class Pending(NamedTuple):
    """An operator issued on a backend: the transfers in flight and how to finish the result.

    ``finish`` runs once every work has completed and returns the native result. (A named
    tuple: one is made per call, and a frozen dataclass costs several times more to build.)
    """

    works: tuple[Work, ...]
    finish: Callable[[], Any]


def issued(work: Work | None, finish: Callable[[], Any]) -> Pending:
    """The :class:`Pending` of a transfer ``work`` (None once it is done) that ``finish`` completes."""
    return Pending(() if work is None else (work,), finish)


class Backend(ABC):
    """A running backend, bound to this process's rank in the world.

    For a failure of its transport, a backend's primitives and its works' ``wait`` and
    ``is_completed`` raise only :class:`~unicoll.errors.TransportError` or one of its kinds
    (:class:`~unicoll.errors.TransportPeerLostError`, :class:`~unicoll.errors.TransportTimeoutError`):
    the backend converts its library's exceptions where it calls the library
    (:func:`~unicoll.errors.converting`), and the front end reports each kind by its type. Its
    constructor raises what :func:`~unicoll.errors.init_error` makes of such a failure. Every
    other exception (a bug, bad input) passes through unchanged.
    """

    name: str
    capabilities: Capabilities
    rank: int
    world_size: int
    workspace: Workspace | None = None
    """The host buffers this backend lends its calls' intermediate rows (:mod:`unicoll.workspace`);
    None where new memory costs nothing more (a device allocator keeps its own)."""

    @property
    def host_memory(self) -> bool:
        """Whether the arrays this backend moves live in host memory (numpy, CPU tensors), where
        reading a count waits for no device: the static-shape MoE mode then sends only the valid
        rows of its blocks. From the capability table; a device transport says False."""
        return self.capabilities.devices == frozenset({"cpu"})

    # -- primitives ------------------------------------------------------------------------

    @abstractmethod
    def to_native(self, x: Any) -> Any:
        """The array the transport moves, sharing memory with ``x`` where the layout allows."""

    @abstractmethod
    def from_native(self, t: Any, library: str) -> Any:
        """``t`` as an array of ``library``, sharing memory where possible."""

    @abstractmethod
    def new_group(self, ranks: Sequence[int]) -> Any:
        """A transport handle for the sorted world ``ranks`` (called on every rank)."""

    @abstractmethod
    def barrier(self, group: Group) -> None:
        """Block until every rank of ``group`` has reached this call."""

    @abstractmethod
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
        """Send ``in_splits[c]`` consecutive rows of ``x`` to rank c, receive ``out_splits[c]``
        rows from each rank c into ``out`` in rank order. Returns the work when ``async_op``.

        ``calc_stream`` (only with ``async_op=False``) asks a device backend to run on the
        caller's current stream; otherwise it runs on a communication stream ordered after the
        caller's, and the caller's stream waits for it (at once, or at the work's ``wait()``).
        CPU backends ignore it."""

    @abstractmethod
    def all_gather_even(self, out: Any, x: Any, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        """Fill ``out`` (``W * rows`` rows) with every rank's ``x`` in rank order; every rank
        passes the same shape. ``calc_stream`` as for :meth:`alltoallv`."""

    @abstractmethod
    def allreduce(self, x: Any, op: str, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        """Reduce ``x`` in place across ``group`` with ``op`` (``"sum"``, ``"max"``, ``"min"`` or
        ``"prod"``; for bool only ``"max"`` and ``"min"``, logical or and and); every rank holds
        the same result. ``calc_stream`` as for :meth:`alltoallv`."""

    @abstractmethod
    def reduce_scatter_even(
        self, out: Any, x: Any, op: str, group: Group, async_op: bool, calc_stream: bool = False
    ) -> Work | None:
        """Fill ``out`` (``rows / W`` rows) with block ``group.rank`` of ``x`` reduced with ``op``
        across ``group``; ``x`` has ``W * rows(out)`` rows on every rank, ``op`` as for
        :meth:`allreduce`. ``calc_stream`` as for :meth:`alltoallv`."""

    @abstractmethod
    def bcast(self, x: Any, src: int, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        """Overwrite ``x`` with the rows of position ``src`` of ``group``, in place (any dtype:
        the bytes move). ``calc_stream`` as for :meth:`alltoallv`."""

    @abstractmethod
    def exchange_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        """All-to-all of a host int64 array of ``W * k`` values: block c goes to rank c."""

    @abstractmethod
    def gather_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        """All-gather of a host int64 array of k values, returned with shape ``(W, k)``."""

    def exchange_native_ints(self, values: Any, group: Group) -> Any:
        """:meth:`exchange_ints` of a native int array of ``W * k`` values, where the transport's
        arrays live (a device backend's counts stay on the device): returns a new one."""
        out = self.empty_rows(values, values.shape[0])
        splits = [values.shape[0] // group.world_size] * group.world_size
        self.alltoallv(out, values, splits, splits, group, False, True)
        return out

    def read_ints(self, values: Any) -> np.ndarray:
        """A native int array (where the transport's arrays live) read on the host, in one
        copy: the one host read of a top-k dispatch whose routing runs on the device (its
        counts, after their exchange). A device transport copies into pinned memory and waits
        on an event for that copy alone."""
        return np.array(on_host(values))

    @abstractmethod
    def finalize(self) -> None:
        """Release every resource the backend holds, the groups it made included."""

    def abandon(self) -> None:
        """Give up the transport in a child forked from this process, without touching it: the
        parent still uses the connections, and the child has none of the threads that serve
        them. The backend, and every handle it holds, stays alive until the child exits, since
        their destructors would join those threads or release what the parent uses."""
        keep_forever(self)

    # -- local array work, through the array API; a backend may use its library directly ---

    def empty_rows(self, like: Any, rows: int) -> Any:
        """An uninitialized native array of ``rows`` rows with ``like``'s dtype, trailing shape
        and device."""
        xp = array_namespace(like)
        return xp.empty((rows, *like.shape[1:]), dtype=like.dtype, device=device(like))

    def take_rows(self, x: Any, index: np.ndarray, out: Any | None = None) -> Any:
        """The rows ``x[index]`` (``index``: int64, on the host or on x's device), into ``out``
        when given, else new."""
        xp = array_namespace(x)
        taken = xp.take(x, xp.asarray(index, device=device(x)), axis=0)
        if out is None:
            return taken
        out[...] = taken
        return out

    def scratch_rows(self, like: Any, rows: int) -> tuple[Any, np.ndarray | None]:
        """Native rows like ``like``'s for a call's own use, never its result: over a buffer the
        workspace lends, returned beside them for :meth:`give_back` once the call is done with
        them; or new rows and None (no workspace, or fewer than
        :data:`~unicoll.workspace.FROM_BYTES`)."""
        lent = self._lend(like, rows)
        return (self.empty_rows(like, rows), None) if lent is None else (rows_over(lent, like, rows), lent)

    def gather_rows(self, x: Any, index: np.ndarray) -> tuple[Any, np.ndarray | None]:
        """The rows ``x[index]`` for a call's own use, as :meth:`scratch_rows` lends them."""
        lent = self._lend(x, len(index))
        if lent is None:
            return self.take_rows(x, index), None
        return self.take_rows(x, index, rows_over(lent, x, len(index))), lent

    def _lend(self, like: Any, rows: int) -> np.ndarray | None:
        """A buffer the workspace lends for ``rows`` rows like ``like``'s, or None (see
        :meth:`scratch_rows`; fewer bytes are counted as a loan all the same)."""
        if self.workspace is None:
            return None
        nbytes = rows * row_bytes(like)
        if nbytes < FROM_BYTES:
            self.workspace.count_fresh(nbytes)
            return None
        return self.workspace.lend(nbytes)

    def give_back(self, *buffers: np.ndarray | None) -> None:
        """Return the buffers :meth:`scratch_rows` lent (None: nothing was lent)."""
        for buffer in buffers:
            if buffer is not None:
                self.workspace.give_back(buffer)

    # -- operators, composed from the primitives --------------------------------------------

    def global_scatter(
        self,
        x: Any,
        plan: MoePlan,
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
        rows: np.ndarray | None = None,
    ) -> Pending:
        """MoE dispatch; see docs/semantics.md. ``plan``: what the front end derived from the
        validated counts (:class:`~unicoll.backends.layout.MoePlan`: the rows per rank, the
        counts received, the reorder). ``calc_stream`` on every operator: see :meth:`alltoallv`.
        ``rows`` (host int64, or None for all of x in order): the rows sent are ``x[rows]``, the
        gather of a top-k dispatch, done here so that it lands in a lent buffer (or is fused
        with the transfer)."""
        sent, sent_lent = (x, None) if rows is None else self.gather_rows(x, rows)
        order = plan.to_expert_major
        if order is None:
            out = self.empty_rows(x, sum(plan.recv))
            work = self.alltoallv(out, sent, plan.recv, plan.send, group, async_op, calc_stream)
            return issued(work, (lambda: out) if sent_lent is None else lambda: self._returned(out, sent_lent))
        padded = int(plan.capacity is not None)  # one zero row after the received ones, for the padding
        received, received_lent = self.scratch_rows(x, sum(plan.recv) + padded)
        if padded:
            received[sum(plan.recv) :] = 0
        head = received[: sum(plan.recv)]
        work = self.alltoallv(head, sent, plan.recv, plan.send, group, async_op, calc_stream)
        return issued(work, lambda: self._returned(self.take_rows(received, order), sent_lent, received_lent))

    def moe_dispatch(
        self, x: Any, routing: Routing, plan: MoePlan, group: Group, async_op: bool, calc_stream: bool = False
    ) -> Pending:
        """A top-k dispatch's rows: the rows ``routing.send_tokens`` of x sent along ``plan``, which
        arrive expert-major (global_scatter's layout, ``plan.expert_major_rows`` rows). The
        routing's index arrays are on the host or on x's device, as the front end computed them;
        ``plan`` holds the counts both ways on the host (and, for a routing on the device, its
        reorders there). Composed from :meth:`global_scatter`; a transport that moves tokens
        itself overrides it (and lists it in :attr:`Capabilities.moe`)."""
        return self.global_scatter(x, plan, group, async_op, calc_stream, routing.send_tokens)

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
        """The inverse of :meth:`moe_dispatch`: expert rows ``y`` (its layout) sent back to the
        ranks of their tokens, where they arrive in send order (``len(routing.send_tokens)``
        rows, into ``out`` when given); the front end then sums each token's slots. Composed
        from :meth:`global_gather`; a transport that moves tokens itself overrides it."""
        return self.global_gather(y, plan, group, async_op, calc_stream, out)

    def moe_dispatch_static(
        self,
        x: Any,
        layout: StaticLayout,
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
        valid: Any | None = None,
    ) -> Pending:
        """A static-shape dispatch's rows: x's rows (one per token, or one per slot: a combine's
        backward) laid into blocks by ``layout`` (:mod:`unicoll.backends.blocks`: numpy arrays on a
        :attr:`host_memory` backend, else arrays of x's library on x's device) and moved, arriving
        as ``(E, W * C, ...)`` blocks, expert-major then source rank, zeros after each block's valid
        rows. With ``valid`` None every rank also tells the others its counts
        (:func:`~unicoll.backends.blocks.counts_told`), and the call finishes as ``(blocks,
        heard)``: ``heard``, the ``W * (1 + 2E)`` ints every rank told this one. With ``valid``
        (``(E, W)``: the valid rows of each block this rank receives, known from the dispatch of the
        same layout) it finishes as ``(blocks, None)``.

        Composed from the primitives: where the arrays live in host memory
        (:attr:`host_memory`), the counts travel first, every rank refuses capacities that
        differ, and only the valid rows follow (:meth:`global_scatter` with a padded plan);
        elsewhere the whole blocks and the counts travel as two even all-to-alls, whose sizes
        the arguments fix, so nothing is read to the host. A transport that moves tokens itself
        overrides it (and lists it in :attr:`Capabilities.moe`)."""
        if self.host_memory:
            return self._valid_rows_out(x, layout, group, async_op, calc_stream, valid)
        xp, world = array_namespace(x), group.world_size
        experts, _ = layout.blocks(world)
        rows = self.even_alltoall(send_rows(xp, x, layout), group, async_op, calc_stream)
        heard = None
        if valid is None:
            heard = self.even_alltoall(counts_told(xp, layout, world), group, async_op, calc_stream)
        works = rows.works + (() if heard is None else heard.works)
        return Pending(
            works, lambda: (expert_major(xp, rows.finish(), world, experts), None if heard is None else heard.finish())
        )

    def moe_combine_static(
        self,
        y: Any,
        layout: StaticLayout,
        valid: Any,
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
    ) -> Pending:
        """The inverse of :meth:`moe_dispatch_static`: expert blocks ``y`` (``(E, W * C, ...)``,
        ``valid[e, c]`` rows of block ``(e, c)`` hold rows) sent back to the ranks of their
        tokens, finishing as ``(back, index)``: the rows that came back and a zero row,
        ``back[index[s]]`` slot s's row (:func:`~unicoll.backends.blocks.slot_index`: ``T * k``
        ints in slot order, on the host or on y's device; a dropped slot's is the zero row). The
        front end weighs and sums each token's slots from them, without making the ``T * k``
        rows where it need not. Composed like :meth:`moe_dispatch_static`: only the valid rows
        in host memory (:meth:`global_gather` with the padded plan), else the even all-to-all
        of the whole blocks into rows followed by the zero row."""
        if self.host_memory:
            return self._valid_rows_back(y, layout, valid, group, async_op, calc_stream)
        xp, world = array_namespace(y), group.world_size
        sent = source_major(xp, y, world, y.shape[0])
        rows = sent.shape[0]
        back = self._rows_then_zeros(sent, rows)
        splits = [rows // world] * world
        pending = self.alltoall_single(back[:rows], sent, splits, splits, group, async_op, calc_stream)

        def finish() -> tuple[Any, Any]:
            pending.finish()
            return back, slot_index(xp, layout, rows)

        return Pending(pending.works, finish)

    def _rows_then_zeros(self, like: Any, rows: int) -> Any:
        """New rows like ``like``'s (:meth:`empty_rows`): ``rows`` of them for a combine's
        transfer to fill, then one row of zeros, which a dropped slot reads."""
        back = self.empty_rows(like, rows + 1)
        back[rows:] = 0
        return back

    def even_alltoall(self, x: Any, group: Group, async_op: bool, calc_stream: bool = False) -> Pending:
        """The even all-to-all of ``x``'s rows: ``W`` equal blocks, block c to rank c (composed
        from :meth:`alltoall_single`; the static-shape mode's transfers)."""
        splits = [x.shape[0] // group.world_size] * group.world_size
        return self.alltoall_single(None, x, splits, splits, group, async_op, calc_stream)

    def _valid_rows_out(
        self, x: Any, layout: StaticLayout, group: Group, async_op: bool, calc_stream: bool, valid: Any | None
    ) -> Pending:
        """:meth:`moe_dispatch_static` in host memory: the counts first, then the valid rows."""
        world = group.world_size
        experts, capacity = layout.blocks(world)
        heard = None
        if valid is None:
            told = on_host(counts_told(array_namespace(layout.sent), layout, world))
            heard = self.exchange_ints(told, group)
            capacities, valid, _ = counts_heard(array_namespace(heard), heard, world, experts)
            refuse_other_capacities(capacities, capacity)
        received = np.ascontiguousarray(on_host(valid).T).reshape(-1)
        plan = moe_plan(on_host(layout.sent), received, world, capacity)
        rows = on_host(layout.row_index(x.shape[0]))[on_host(layout.filled)]
        pending = self.global_scatter(x, plan, group, async_op, calc_stream, rows)
        told_here = None if heard is None else array_namespace(x).asarray(heard, device=device(x))

        def finish() -> tuple[Any, Any]:
            blocks = pending.finish()
            return blocks.reshape(experts, world * capacity, *blocks.shape[1:]), told_here

        return Pending(pending.works, finish)

    def _valid_rows_back(
        self, y: Any, layout: StaticLayout, valid: Any, group: Group, async_op: bool, calc_stream: bool
    ) -> Pending:
        """:meth:`moe_combine_static` in host memory: the valid rows back, in send order, then a
        zero row, which a dropped slot reads (host ``index``)."""
        world = group.world_size
        _, capacity = layout.blocks(world)
        sent = on_host(layout.sent)
        plan = moe_plan(sent, np.ascontiguousarray(on_host(valid).T).reshape(-1), world, capacity)
        kept = on_host(layout.kept).reshape(-1)
        where = on_host(layout.slot_rows).reshape(-1)
        total = int(sent.sum())
        firsts = np.zeros_like(sent)
        np.cumsum(sent[:-1], out=firsts[1:])
        index = np.where(kept, firsts[where // max(capacity, 1)] + where % max(capacity, 1), total)
        rows = y.reshape(-1, *y.shape[2:])
        back = self._rows_then_zeros(rows, total)
        pending = self.global_gather(rows, plan, group, async_op, calc_stream, back[:total])

        def finish() -> tuple[Any, np.ndarray]:
            pending.finish()
            return back, index

        return Pending(pending.works, finish)

    def global_gather(
        self,
        x: Any,
        plan: MoePlan,
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
        out: Any | None = None,
    ) -> Pending:
        """MoE combine, the inverse of :meth:`global_scatter` with the same plan (x: its
        ``plan.expert_major_rows`` rows), into ``out`` (native rows, ``sum(plan.send)`` of them)
        when given."""
        order, staged = plan.to_rank_major, None
        if order is not None:
            x, staged = self.gather_rows(x, order)
        if out is None:
            out = self.empty_rows(x, sum(plan.send))
        work = self.alltoallv(out, x, plan.send, plan.recv, group, async_op, calc_stream)
        return issued(work, (lambda: out) if staged is None else lambda: self._returned(out, staged))

    def _returned(self, result: Any, *lent: np.ndarray | None) -> Any:
        """``result``, once the buffers ``lent`` to its call are given back."""
        self.give_back(*lent)
        return result

    def alltoall_single(
        self,
        out: Any | None,
        x: Any,
        out_splits: list[int],
        in_splits: list[int],
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
    ) -> Pending:
        """Uneven all-to-all of rows with resolved split sizes; allocates ``out`` when None.
        A synchronous call into a given output is :meth:`alltoallv` alone, and the front end
        calls that primitive directly for it: an override here shapes the other calls only."""
        if out is None:
            out = self.empty_rows(x, sum(out_splits))
        work = self.alltoallv(out, x, out_splits, in_splits, group, async_op, calc_stream)
        return issued(work, lambda: out)

    def all_gather(
        self,
        out: Any | None,
        x: Any,
        rows: Sequence[int],
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
    ) -> Pending:
        """Every rank's ``x`` (``rows[c]`` rows on rank c) concatenated in rank order.

        Equal row counts go straight into ``out``; unequal ones travel padded to the largest
        count and are compacted after the transfer.
        """
        if out is None:
            out = self.empty_rows(x, int(sum(rows)))
        widest = max(rows)
        if all(r == widest for r in rows):
            return issued(self.all_gather_even(out, x, group, async_op, calc_stream), lambda: out)
        xp = array_namespace(x)
        padded = xp.zeros((widest, *x.shape[1:]), dtype=x.dtype, device=device(x))
        padded[: x.shape[0], ...] = x
        buffer = self.empty_rows(x, widest * len(rows))
        work = self.all_gather_even(buffer, padded, group, async_op, calc_stream)
        keep = np.concatenate([np.arange(c * widest, c * widest + r, dtype=np.int64) for c, r in enumerate(rows)])

        def finish() -> Any:
            out[...] = self.take_rows(buffer, keep)
            return out

        return issued(work, finish)

    def all_reduce(self, x: Any, op: str, group: Group, async_op: bool, calc_stream: bool = False) -> Pending:
        """Reduce ``x`` in place with ``op`` (one of :data:`REDUCE_OPS`): ``avg`` is ``sum``
        divided by the group size, on bool ``sum`` is ``max`` and ``prod`` is ``min``, and float
        ``max`` and ``min`` travel as integer keys (:mod:`~unicoll.backends.float_keys`: NaN
        propagates, the same bits on every rank). Empty arrays move nothing (every rank passes
        the same shape)."""
        if _numel(x) == 0:
            return issued(None, lambda: x)
        native_op = _transport_op(op, x)
        if float_keys.applies(native_op, x):
            keys = float_keys.to_keys(x, native_op)
            work = self.allreduce(keys, native_op, group, async_op, calc_stream)
            return issued(work, lambda: float_keys.from_keys(keys, x, native_op))
        work = self.allreduce(x, native_op, group, async_op, calc_stream)
        if op != "avg":
            return issued(work, lambda: x)
        return issued(work, lambda: _divide(x, group.world_size))

    def reduce_scatter(
        self,
        out: Any | None,
        x: Any,
        op: str,
        rows: Sequence[int],
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
    ) -> Pending:
        """Block c of ``x`` (``rows[c]`` consecutive rows) reduced with ``op`` across ``group``
        into ``out`` on position c (allocated when None): equal blocks through
        :meth:`reduce_scatter_even`, unequal ones through :meth:`reduce_scatter_uneven`; float
        ``max`` and ``min`` as integer keys, as in :meth:`all_reduce`."""
        if out is None:
            out = self.empty_rows(x, int(rows[group.rank]))
        if _numel(x) == 0:
            return issued(None, lambda: out)
        native_op = _transport_op(op, x)
        if float_keys.applies(native_op, x):
            keys = float_keys.to_keys(x, native_op)
            mine = self.empty_rows(keys, int(rows[group.rank]))
            pending = self._reduce_scatter_blocks(mine, keys, native_op, rows, group, async_op, calc_stream)
            return Pending(pending.works, lambda: float_keys.from_keys(pending.finish(), out, native_op))
        pending = self._reduce_scatter_blocks(out, x, native_op, rows, group, async_op, calc_stream)
        if op != "avg":
            return pending
        return Pending(pending.works, lambda: _divide(pending.finish(), group.world_size))

    def _reduce_scatter_blocks(
        self, out: Any, x: Any, op: str, rows: Sequence[int], group: Group, async_op: bool, calc_stream: bool
    ) -> Pending:
        """:meth:`reduce_scatter` with a transport reduction ``op``, into ``out``."""
        if all(r == rows[0] for r in rows):
            return issued(self.reduce_scatter_even(out, x, op, group, async_op, calc_stream), lambda: out)
        return self.reduce_scatter_uneven(out, x, op, rows, group, async_op, calc_stream)

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
        """:meth:`reduce_scatter` of unequal blocks with a transport reduction ``op``: the blocks
        travel padded to the largest one, and the padding rows are dropped after the transfer.
        A transport that reduces unequal blocks itself overrides this."""
        widest, world = max(rows), group.world_size
        xp = array_namespace(x)
        padded = xp.zeros((widest * world, *x.shape[1:]), dtype=x.dtype, device=device(x))
        starts = np.concatenate([[0], np.cumsum(rows)]).tolist()
        for c in range(world):
            padded[c * widest : c * widest + rows[c], ...] = x[starts[c] : starts[c + 1], ...]
        mine = self.empty_rows(x, widest)
        work = self.reduce_scatter_even(mine, padded, op, group, async_op, calc_stream)

        def unpad() -> Any:
            out[...] = mine[: rows[group.rank], ...]
            return out

        return issued(work, unpad)

    def broadcast(self, x: Any, src: int, group: Group, async_op: bool, calc_stream: bool = False) -> Pending:
        """Overwrite ``x`` with position ``src``'s rows on every rank of ``group``, in place."""
        if _numel(x) == 0:
            return issued(None, lambda: x)
        return issued(self.bcast(x, src, group, async_op, calc_stream), lambda: x)


def _numel(x: Any) -> int:
    return math.prod(x.shape)


def _transport_op(op: str, x: Any) -> str:
    """The reduction a transport runs for ``op`` on ``x``: ``avg`` is a ``sum`` divided
    afterwards; on bool, ``sum`` is logical or (``max``) and ``prod`` logical and (``min``)."""
    if op == "avg":
        return "sum"
    if str(x.dtype).endswith("bool"):
        return {"sum": "max", "prod": "min"}.get(op, op)
    return op


def _divide(x: Any, world: int) -> Any:
    """``x`` divided by ``world`` in place, in its own dtype (the last step of ``avg``)."""
    x[...] = x / world
    return x


def devices_short(devices: int) -> str | None:
    """Why NCCL cannot run here when this machine has more local ranks (``$LOCAL_WORLD_SIZE``,
    default 1) than CUDA ``devices``, else None: NCCL needs one device per rank."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_ranks <= devices:
        return None
    return (
        f"{local_ranks} ranks on this machine ($LOCAL_WORLD_SIZE) but {devices} CUDA device(s); NCCL needs one per rank"
    )


class BackendFactory(Protocol):
    """What :func:`unicoll.register_backend` takes: reports if it can run here, and starts it."""

    capabilities: Capabilities

    def probe(self) -> str | None:
        """None when the backend can run on this machine, else the reason it cannot."""

    def __call__(self, *, rank: int, world_size: int, timeout: float) -> Backend:
        """Start the backend for this process (rendezvous with the other ranks)."""
