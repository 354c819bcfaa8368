"""Verification: an opt-in check that what arrived is what was sent (``init(verify=...)``,
``$UNICOLL_VERIFY``).

With verification on, the session's backend is wrapped in :class:`VerifiedBackend`. Every
call of an operator on the backend's seam (the one the front end calls: ``alltoallv``,
``alltoall_single``, ``global_scatter``, ``global_gather``, ``all_gather``, ``broadcast``,
``all_reduce``, ``reduce_scatter``; unicoll.moe's dispatch and combine, both modes, are
composed from them, and the backward passes call them too) is numbered on its group, and the
calls the rate samples (from the number: the same calls on every rank) are checked: each rank
computes the checksum of every block it sends (per destination) before the transfer and of
every block it receives after it (:mod:`unicoll.checksums`, where the rows are), and the ranks
all-gather them where the rows are, in one exchange of ``5 + 4 W`` int64 per rank, on a group
of the checks' own with the same members (made with the world at ``init`` and with every
:func:`~unicoll.new_group`), so that no check can ever pair with another call's transfer. Each
rank reads the gathered records in one copy and compares every pair, so a block that arrived
different raises the same :class:`~unicoll.IntegrityError` on every rank, before the result is
returned (for a Task, in ``wait()``). A Task's check starts at its wait, or at the rank's next
call that blocks, in the order the calls were issued (:meth:`VerifiedBackend._settle`): the
ranks may wait for their tasks in any order.

A reduction's result is no copy of what was sent: a checked ``all_reduce`` compares each
rank's result bits with every other rank's (all must hold the same), and, for ``sum`` and
``avg``, its projection with the sum of the inputs' projections, within the rounding the
dtype allows (exact for integers); a checked ``reduce_scatter`` does the latter for each
rank's block. ``max``, ``min`` and ``prod`` are compared across ranks only (``all_reduce``).
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from array_api_compat import array_namespace, device

from .arrays import description_of
from .backends.base import Backend, Pending, Work
from .backends.wrapped import Wrapped
from .checksums import block_checksums, reordered, row_hashes, row_magnitudes, row_values, weighted_blocks
from .entry import current_operator
from .errors import IntegrityError, TransportError, TransportTimeoutError, init_error, reported, translated
from .group import Group
from .records import BROADCAST, MOVED, REDUCED, ROUNDING, SCATTERED, Record, as_int64, mismatch, record_values

if TYPE_CHECKING:
    from .backends.blocks import StaticLayout
    from .backends.layout import MoePlan, Routing

VERIFY_ENV_VAR = "UNICOLL_VERIFY"

_SAME_SETTING = (
    "verification makes a group of its own as it starts, which every rank must join: start every rank with "
    "verification on, or every rank with it off (init(verify=...), $UNICOLL_VERIFY)"
)


def verify_setting(given: bool | float | None) -> float:
    """The share of calls verified (0: none, 1: every call), from ``init``'s ``verify`` or
    ``$UNICOLL_VERIFY`` (``0``, ``1``, or a share such as ``0.01``; unset or empty is 0)."""
    source = "verify"
    if given is None:
        raw = os.environ.get(VERIFY_ENV_VAR, "").strip().lower()
        if raw in ("", "0", "false"):
            return 0.0
        if raw in ("1", "true"):
            return 1.0
        source = f"${VERIFY_ENV_VAR}"
        try:
            given = float(raw)
        except ValueError:
            raise ValueError(
                f"unicoll.init: {source}: expected 0, 1 or the share of calls to verify (such as 0.01), got {raw!r}"
            ) from None
    if isinstance(given, bool):
        return float(given)
    if not isinstance(given, (int, float)):
        raise TypeError(f"unicoll.init: {source}: expected True, False, None or a share from 0 to 1, got {given!r}")
    if not 0 <= given <= 1:  # NaN fails too
        raise ValueError(f"unicoll.init: {source}: expected a share of calls from 0 to 1, got {given!r}")
    return float(given)


def sampled(number: int, rate: float) -> bool:
    """Whether call ``number`` (from 0, on its group) is verified at ``rate``: the first call,
    then one call in every ``1 / rate``, evenly spaced, decided alike on every rank."""
    return rate > 0 and (number == 0 or math.floor(number * rate) != math.floor((number - 1) * rate))


class VerifiedBackend(Wrapped):
    """``inner`` with its operators checked as the module says, on the calls ``rate`` samples."""

    def __init__(self, inner: Backend, rate: float, timeout: float) -> None:
        super().__init__(inner)
        self.rate = rate
        self._timeout = timeout
        self._calls: weakref.WeakKeyDictionary[Group, int] = weakref.WeakKeyDictionary()
        self._checks: weakref.WeakKeyDictionary[Group, Group] = weakref.WeakKeyDictionary()
        try:
            self._world_checks = inner.new_group(tuple(range(inner.world_size)))
        except TransportError as exc:
            inner.finalize()
            raise init_error(exc, inner.name, inner.rank, inner.world_size, timeout, _SAME_SETTING) from exc
        self._unseen: list[tuple[Any, Any]] = []
        """The handles :meth:`new_group` made on this rank, each with its checks' handle, until
        a call on the group links them (:meth:`_checks_of`)."""
        self._open: deque[_Check] = deque()
        """The checks whose exchange is not issued yet, in the order their calls were issued."""
        self._lock = threading.Lock()

    def new_group(self, ranks: Sequence[int]) -> Any:
        """The inner backend's group of ``ranks``, and a second one for its checks' exchanges."""
        self._settle()
        handle = self.inner.new_group(ranks)
        checks = self.inner.new_group(ranks)
        if self.rank in ranks:
            self._unseen.append((handle, checks))
        return handle

    def _checks_of(self, group: Group) -> Group:
        """The group the checks of ``group``'s calls exchange their records on: the same
        members, a transport group of its own."""
        checks = self._checks.get(group)
        if checks is None:
            handle = group.handle
            if handle is None:
                made = self._world_checks
            else:
                place = next(i for i, (seen, _) in enumerate(self._unseen) if seen is handle)
                made = self._unseen.pop(place)[1]
            checks = self._checks[group] = Group(group.ranks, made, self.rank, group.session)
        return checks

    def _record(self, group: Group, kind: int, async_op: bool) -> Record | None:
        """Number this call on ``group``; its record when it is one to verify, else None. A
        call that blocks starts the open checks first (:meth:`_settle`)."""
        if not async_op:
            self._settle()
        number = self._calls.get(group, 0)
        self._calls[group] = number + 1
        if not sampled(number, self.rate):
            return None
        return Record(current_operator() or "a collective", group, number, kind)

    # -- the seam's operators, checked ----------------------------------------------------

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
        record = self._record(group, MOVED, async_op)
        if record is None:
            return self.inner.alltoallv(out, x, out_splits, in_splits, group, async_op, calc_stream)
        record.sent = block_checksums(x, in_splits)
        work = self.inner.alltoallv(out, x, out_splits, in_splits, group, async_op, calc_stream)
        moved = Pending(() if work is None else (work,), lambda: out)
        pending = self._opened(moved, record, lambda result: block_checksums(result, out_splits))
        if work is None:
            pending.finish()
            return None
        return pending.works[0]

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
        record = self._record(group, MOVED, async_op)
        if record is not None:
            record.sent = block_checksums(x, in_splits)
        pending = self.inner.alltoall_single(out, x, out_splits, in_splits, group, async_op, calc_stream)
        if record is None:
            return pending
        return self._opened(pending, record, lambda result: block_checksums(result, out_splits))

    def global_scatter(
        self,
        x: Any,
        plan: MoePlan,
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
        rows: np.ndarray | None = None,
    ) -> Pending:
        record = self._record(group, MOVED, async_op)
        if record is not None:
            record.sent = self._checksums(x, plan.send, rows)
        pending = self.inner.global_scatter(x, plan, group, async_op, calc_stream, rows)
        if record is None:
            return pending
        return self._opened(pending, record, lambda result: self._checksums(result, plan.recv, plan.to_rank_major))

    def global_gather(
        self,
        x: Any,
        plan: MoePlan,
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
        out: Any | None = None,
    ) -> Pending:
        record = self._record(group, MOVED, async_op)
        if record is not None:
            record.sent = self._checksums(x, plan.recv, plan.to_rank_major)
        pending = self.inner.global_gather(x, plan, group, async_op, calc_stream, out)
        if record is None:
            return pending
        return self._opened(pending, record, lambda result: block_checksums(result, plan.send))

    def all_gather(
        self,
        out: Any | None,
        x: Any,
        rows: Sequence[int],
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
    ) -> Pending:
        record = self._record(group, MOVED, async_op)
        if record is not None:
            mine = block_checksums(x, [x.shape[0]])
            record.sent = array_namespace(mine).concat([mine] * group.world_size)
        pending = self.inner.all_gather(out, x, rows, group, async_op, calc_stream)
        if record is None:
            return pending
        return self._opened(pending, record, lambda result: block_checksums(result, list(rows)))

    def broadcast(self, x: Any, src: int, group: Group, async_op: bool, calc_stream: bool = False) -> Pending:
        record = self._record(group, BROADCAST, async_op)
        if record is not None:
            mine = block_checksums(x, [_rows(x)])
            xp, world = array_namespace(mine), group.world_size
            record.src = src
            record.sent = xp.concat([mine] * world) if group.rank == src else xp.concat([mine * 0] * world)
        pending = self.inner.broadcast(x, src, group, async_op, calc_stream)
        if record is None:
            return pending
        return self._opened(pending, record, lambda result: _placed(block_checksums(result, [_rows(result)]), src))

    def all_reduce(self, x: Any, op: str, group: Group, async_op: bool, calc_stream: bool = False) -> Pending:
        record = self._record(group, REDUCED, async_op)
        if record is not None:
            self._note_inputs(record, x, [_rows(x)], op)
        pending = self.inner.all_reduce(x, op, group, async_op, calc_stream)
        if record is None:
            return pending
        return self._opened(pending, record, lambda result: self._reduced(record, result, [_rows(result)]))

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
        record = self._record(group, SCATTERED, async_op)
        if record is not None:
            self._note_inputs(record, x, list(rows), op)
        pending = self.inner.reduce_scatter(out, x, op, rows, group, async_op, calc_stream)
        if record is None:
            return pending
        return self._opened(pending, record, lambda result: self._reduced(record, result, [_rows(result)]))

    # -- the MoE entry points: the inner backend's own where it moves tokens itself ---------

    def _moves_tokens(self, op: str, async_op: bool) -> bool:
        """Whether the inner backend moves tokens itself in ``op`` (its capability table says
        so), so that the call goes to it unchecked; a blocking one starts the open checks first."""
        if op not in self.capabilities.moe:
            return False
        if not async_op:
            self._settle()
        return True

    def moe_dispatch(
        self, x: Any, routing: Routing, plan: MoePlan, group: Group, async_op: bool, calc_stream: bool = False
    ) -> Pending:
        """The inner backend's own when it moves tokens itself (unchecked), else composed
        from the checked :meth:`global_scatter`."""
        if self._moves_tokens("moe_dispatch", async_op):
            return self.inner.moe_dispatch(x, routing, plan, group, async_op, calc_stream)
        return super().moe_dispatch(x, routing, plan, group, async_op, calc_stream)

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
        """As :meth:`moe_dispatch`, from the checked :meth:`global_gather`."""
        if self._moves_tokens("moe_combine", async_op):
            return self.inner.moe_combine(y, routing, plan, group, async_op, calc_stream, out)
        return super().moe_combine(y, routing, plan, group, async_op, calc_stream, out)

    def moe_dispatch_static(
        self,
        x: Any,
        layout: StaticLayout,
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
        valid: Any | None = None,
    ) -> Pending:
        """As :meth:`moe_dispatch`, from the checked operators the static mode is composed of."""
        if self._moves_tokens("moe_dispatch_static", async_op):
            return self.inner.moe_dispatch_static(x, layout, group, async_op, calc_stream, valid)
        return super().moe_dispatch_static(x, layout, group, async_op, calc_stream, valid)

    def moe_combine_static(
        self, y: Any, layout: StaticLayout, valid: Any, group: Group, async_op: bool, calc_stream: bool = False
    ) -> Pending:
        """As :meth:`moe_dispatch_static`."""
        if self._moves_tokens("moe_combine_static", async_op):
            return self.inner.moe_combine_static(y, layout, valid, group, async_op, calc_stream)
        return super().moe_combine_static(y, layout, valid, group, async_op, calc_stream)

    def _checksums(self, x: Any, splits: Sequence[int], order: Any | None) -> Any:
        """:func:`~unicoll.checksums.block_checksums` of x's rows taken in ``order`` (an int
        index, on the host or x's device; None: as they are), reordered by the inner backend's
        row gather where the rows are on a device."""
        hashes = row_hashes(x)
        if order is not None:
            hashes = reordered(hashes, order, self.inner.take_rows)
        return weighted_blocks(hashes, splits)

    def _note_inputs(self, record: Record, x: Any, splits: list[int], op: str) -> None:
        """Before a reduction (which may overwrite ``x``): each block's projection and
        magnitude, where the reduction is a sum (``sum``, ``avg``) of numbers (not bools)."""
        record.dtype = description_of(x).dtype(x)
        record.rows = _rows(x)
        record.reduction = op
        if op in ("sum", "avg") and record.dtype != "bool":
            projections = weighted_blocks(row_values(x), splits)
            xp = array_namespace(projections)
            if record.dtype in ROUNDING:
                record.columns = math.prod(x.shape[1:]) if x.ndim else 1
                magnitudes = weighted_blocks(row_magnitudes(x), splits)
            else:  # integers: compared exactly, modulo their width
                magnitudes = xp.zeros_like(projections)
            record.inputs = xp.stack([projections, magnitudes])

    def _reduced(self, record: Record, result: Any, splits: list[int]) -> Any:
        """After a reduction: the result's bit checksum, then its projection (0 where the
        inputs' were not taken), as one int64 array (where the checksums are)."""
        bits = block_checksums(result, splits)
        xp = array_namespace(bits)
        if record.inputs is None:
            return xp.concat([bits, xp.zeros(1, dtype=xp.int64, device=device(bits))])
        projection = weighted_blocks(row_values(result), splits)
        return xp.concat([bits, as_int64(projection)])

    # -- the checks, from the call's issue to its verdict ------------------------------------

    def _opened(self, pending: Pending, record: Record, received: Callable[[Any], Any]) -> Pending:
        """``pending``, checked: its finish (or, when it has transfers in flight, their wait)
        gives the verdict of :meth:`_conclude`, with ``received(result)`` the native int64
        checksums of what arrived."""
        check = _Check(record, pending, received)
        self._open.append(check)
        finish = lambda: self._conclude(check, self._timeout)  # noqa: E731
        return Pending((_CheckWork(self, check),) if pending.works else (), finish)

    def _settle(self) -> None:
        """Start every open check (wait for its transfers, issue its exchange), before this rank
        blocks on a call that communicates: so no rank blocks while a peer's wait for an earlier
        task waits for this rank's exchange of it. A check's failure here is kept for its own
        wait."""
        if self._open:
            self._start_through(None, self._timeout)

    def _start_through(self, check: _Check | None, timeout: float) -> None:
        """Start the open checks in the order their calls were issued (so every rank issues
        the exchanges on each group in the same order, whatever order it waits in), up to
        ``check`` (all of them when None). A check whose start fails keeps the failure for its
        verdict; one whose transfers are not done within a ``timeout`` shorter than ``init``'s
        stays open, and the TransportTimeoutError propagates (the task may be waited for again)."""
        with self._lock:
            while self._open and not (check is not None and check.started):
                first = self._open[0]
                try:
                    self._start(first, timeout)
                except TransportError as exc:
                    if isinstance(exc, TransportTimeoutError) and timeout < self._timeout:
                        raise

                    first.failure = reported(exc, first.record.op, first.record.group, timeout)
                except Exception as exc:  # a failure of the call's own finish: raised at its wait
                    first.failure = exc
                first.started = True
                self._open.popleft()

    def _start(self, check: _Check, timeout: float) -> None:
        """Wait for ``check``'s transfers, finish its result, and issue the all-gather of its
        record (``5 + 4 W`` native int64 per rank, on the checks' group) without waiting."""
        record, pending = check.record, check.pending
        for work in pending.works:
            work.wait(timeout)
        check.result = pending.finish()
        ours = self.inner.to_native(record_values(record, check.received(_result_array(check.result))))
        everyone = self.inner.empty_rows(ours, record.group.world_size * ours.shape[0])
        check.exchange = self.inner.all_gather_even(everyone, ours, self._checks_of(record.group), True)
        check.arrays = (ours, everyone)
        check.pending = check.received = None
        check.started = True

    def _conclude(self, check: _Check, timeout: float) -> Any:
        """``check``'s verdict: its result, or :class:`~unicoll.IntegrityError` when any pair
        of ranks disagrees (raised again whenever it is asked again)."""
        self._start_through(check, timeout)
        record = check.record
        if check.failure is None and not check.judged:
            with translated(f"{record.op} (verification of call {record.number})", record.group, timeout):
                if check.exchange is not None:
                    check.exchange.wait(timeout)
            everyone = self.inner.read_ints(check.arrays[1]).reshape(record.group.world_size, -1)
            check.arrays, check.exchange, check.judged = (), None, True
            problem = mismatch(record, everyone)
            if problem is not None:
                check.failure = IntegrityError(
                    f"{record.op} on {record.group}, call {record.number} (verified): {problem}; "
                    "the data that arrived is not what was sent"
                )
        if check.failure is not None:
            raise check.failure
        return check.result

    # -- the rest of the inner backend's, which the base class would compose instead ----

    def scratch_rows(self, like: Any, rows: int) -> tuple[Any, np.ndarray | None]:
        return self.inner.scratch_rows(like, rows)

    def gather_rows(self, x: Any, index: np.ndarray) -> tuple[Any, np.ndarray | None]:
        return self.inner.gather_rows(x, index)

    def give_back(self, *buffers: np.ndarray | None) -> None:
        self.inner.give_back(*buffers)

    # The inner backend's transfers that are no operator of the seam: each that blocks starts
    # the open checks first, as the seam's operators do (:meth:`_settle`).

    def all_gather_even(self, out: Any, x: Any, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        if not async_op:
            self._settle()
        return self.inner.all_gather_even(out, x, group, async_op, calc_stream)

    def allreduce(self, x: Any, op: str, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        if not async_op:
            self._settle()
        return self.inner.allreduce(x, op, group, async_op, calc_stream)

    def reduce_scatter_even(
        self, out: Any, x: Any, op: str, group: Group, async_op: bool, calc_stream: bool = False
    ) -> Work | None:
        if not async_op:
            self._settle()
        return self.inner.reduce_scatter_even(out, x, op, group, async_op, calc_stream)

    def bcast(self, x: Any, src: int, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        if not async_op:
            self._settle()
        return self.inner.bcast(x, src, group, async_op, calc_stream)

    def barrier(self, group: Group) -> None:
        self._settle()
        self.inner.barrier(group)

    def exchange_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        self._settle()
        return self.inner.exchange_ints(values, group)

    def exchange_native_ints(self, values: Any, group: Group) -> Any:
        self._settle()
        return self.inner.exchange_native_ints(values, group)

    def gather_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        self._settle()
        return self.inner.gather_ints(values, group)

    def finalize(self) -> None:
        self._open.clear()
        self.inner.finalize()

    def abandon(self) -> None:
        self._open.clear()
        self.inner.abandon()


class _Check:
    """One verified call, from its issue (:meth:`VerifiedBackend._opened`) to its verdict."""

    def __init__(self, record: Record, pending: Pending, received: Callable[[Any], Any]) -> None:
        self.record = record
        self.pending: Pending | None = pending
        self.received: Callable[[Any], Any] | None = received
        self.result: Any = None
        self.started = False
        """Whether its transfers are done and its exchange issued (or its start failed)."""
        self.exchange: Work | None = None
        self.arrays: tuple[Any, ...] = ()
        """This rank's record and the gathered ones, alive while the exchange is in flight."""
        self.judged = False
        self.failure: BaseException | None = None


class _CheckWork:
    """The work of a checked call with transfers in flight: waiting for it starts the checks
    issued before it and its own, waits for its exchange and gives the verdict."""

    def __init__(self, backend: VerifiedBackend, check: _Check) -> None:
        self._backend = backend
        self._check = check

    def wait(self, timeout: float) -> None:
        self._backend._conclude(self._check, timeout)

    def is_completed(self) -> bool:
        """Whether :meth:`wait` will not block: the transfers of this check and of the open
        ones before it are done (its exchange is then issued here), and its exchange too."""
        check = self._check
        if not check.started:
            for earlier in list(self._backend._open):  # a copy: another thread may start checks meanwhile
                pending = earlier.pending  # None once another thread has started it
                if pending is not None and not all(work.is_completed() for work in pending.works):
                    return False
                if earlier is check:
                    break
            self._backend._start_through(check, self._backend._timeout)
        return check.exchange is None or check.exchange.is_completed()


def _rows(x: Any) -> int:
    """The rows of ``x`` as the checksums count them (a 0-d array is one row)."""
    return x.shape[0] if x.ndim else 1


def _placed(checksum: Any, src: int) -> Any:
    """A one-block checksum as the received side of a broadcast record: at position ``src``."""
    xp = array_namespace(checksum)
    return checksum if src == 0 else xp.concat([xp.zeros(src, dtype=xp.int64, device=device(checksum)), checksum])


def _result_array(result: Any) -> Any:
    """The array a backend's finish returned (a tuple's first, for the MoE layouts)."""
    return result[0] if isinstance(result, tuple) else result
