"""Verification: an opt-in check that what arrived is what was sent (``init(verify=...)``,
``$UNICOLL_VERIFY``).

With verification on, the session's backend is wrapped in :class:`VerifiedBackend`. Every
call of an operator on the backend's seam (the one the front end calls: ``alltoallv``,
``alltoall_single``, ``global_scatter``, ``global_gather``, ``all_gather``, ``broadcast``,
``all_reduce``, ``reduce_scatter``; unicoll.moe's dispatch and combine, both modes, are
composed from them, and the backward passes call them too) is numbered on its group, and the
calls the rate samples (from the number: the same calls on every rank) are checked: each rank
computes the checksum of every block it sends (per destination) before the transfer and of
every block it receives after it (:mod:`unicoll.checksums`, where the rows are), reads them in
one copy, and the ranks all-gather them in one exchange of ``5 + 4 W`` int64 per rank. Every
rank then compares every pair, so a block that arrived different raises the same
:class:`~unicoll.IntegrityError` on every rank, before the result is returned (for a Task, in
``wait()``).

A reduction's result is no copy of what was sent: a checked ``all_reduce`` compares each
rank's result bits with every other rank's (all must hold the same), and, for ``sum`` and
``avg``, its projection with the sum of the inputs' projections, within the rounding the
dtype allows (exact for integers); a checked ``reduce_scatter`` does the latter for each
rank's block. ``max``, ``min`` and ``prod`` are compared across ranks only (``all_reduce``).
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from array_api_compat import array_namespace, device

from .arrays import description_of
from .backends.base import Backend, Pending, Work
from .backends.wrapped import Wrapped
from .checksums import block_checksums, row_values, weighted_blocks
from .entry import current_operator
from .errors import IntegrityError, translated

if TYPE_CHECKING:
    from .backends.blocks import StaticLayout
    from .backends.layout import MoePlan, Routing
    from .group import Group

VERIFY_ENV_VAR = "UNICOLL_VERIFY"

_ROUNDING = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}
"""The unit roundoff of each floating dtype: what one rounding of a sum may lose, relatively."""

_RECORD_INTS = 5
"""The ints of a record beside its ``4 W``: the call's number, what it checks, the group's size
and room for a reduction's two results."""

_MOVED, _BROADCAST, _REDUCED, _SCATTERED = 1, 2, 3, 4
"""What a record checks: blocks sent and received by every pair of ranks; the blocks of one
source; a reduction every rank holds whole; a reduction each rank holds a block of."""


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


@dataclass
class _Record:
    """What one rank tells the others of one verified call, before the transfer and after."""

    op: str
    group: Group
    number: int
    kind: int
    sent: Any = None
    """Native int64 ``(W,)``: the checksum of the block sent to each rank (zeros: none)."""
    inputs: Any = None
    """Native float64 or int64 ``(2, W)``: each block's projection and magnitude (reductions)."""
    dtype: str = ""
    """A reduction's dtype (its rounding sets the tolerance of a sum)."""
    rows: int = 0
    """A reduction's rows (the rounding of the float64 projections grows with them)."""
    reduction: str = ""
    """A reduction's operation (``"sum"``, ``"avg"``, ...)."""
    src: int = 0
    """A broadcast's source position."""


class VerifiedBackend(Wrapped):
    """``inner`` with its operators checked as the module says, on the calls ``rate`` samples."""

    def __init__(self, inner: Backend, rate: float, timeout: float) -> None:
        super().__init__(inner)
        self.rate = rate
        self._timeout = timeout
        self._calls: weakref.WeakKeyDictionary[Group, int] = weakref.WeakKeyDictionary()

    def _record(self, group: Group, kind: int) -> _Record | None:
        """Number this call on ``group``; its record when it is one to verify, else None."""
        number = self._calls.get(group, 0)
        self._calls[group] = number + 1
        if not sampled(number, self.rate):
            return None
        return _Record(current_operator() or "a collective", group, number, kind)

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
        record = self._record(group, _MOVED)
        if record is None:
            return self.inner.alltoallv(out, x, out_splits, in_splits, group, async_op, calc_stream)
        record.sent = block_checksums(x, in_splits)
        work = self.inner.alltoallv(out, x, out_splits, in_splits, group, async_op, calc_stream)
        check = _once(lambda: self._compare(record, block_checksums(out, out_splits)))
        if work is None:
            check()
            return None
        return _CheckedWork(work, check)

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
        record = self._record(group, _MOVED)
        if record is not None:
            record.sent = block_checksums(x, in_splits)
        pending = self.inner.alltoall_single(out, x, out_splits, in_splits, group, async_op, calc_stream)
        if record is None:
            return pending
        return self._checked(pending, record, lambda result: block_checksums(result, out_splits))

    def global_scatter(
        self,
        x: Any,
        plan: MoePlan,
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
        rows: np.ndarray | None = None,
    ) -> Pending:
        record = self._record(group, _MOVED)
        if record is not None:
            record.sent = block_checksums(x, plan.send, rows)
        pending = self.inner.global_scatter(x, plan, group, async_op, calc_stream, rows)
        if record is None:
            return pending
        return self._checked(pending, record, lambda result: block_checksums(result, plan.recv, plan.to_rank_major))

    def global_gather(
        self,
        x: Any,
        plan: MoePlan,
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
        out: Any | None = None,
    ) -> Pending:
        record = self._record(group, _MOVED)
        if record is not None:
            record.sent = block_checksums(x, plan.recv, plan.to_rank_major)
        pending = self.inner.global_gather(x, plan, group, async_op, calc_stream, out)
        if record is None:
            return pending
        return self._checked(pending, record, lambda result: block_checksums(result, plan.send))

    def all_gather(
        self,
        out: Any | None,
        x: Any,
        rows: Sequence[int],
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
    ) -> Pending:
        record = self._record(group, _MOVED)
        if record is not None:
            xp = array_namespace(x)
            record.sent = xp.concat([block_checksums(x, [x.shape[0]])] * group.world_size)
        pending = self.inner.all_gather(out, x, rows, group, async_op, calc_stream)
        if record is None:
            return pending
        return self._checked(pending, record, lambda result: block_checksums(result, list(rows)))

    def broadcast(self, x: Any, src: int, group: Group, async_op: bool, calc_stream: bool = False) -> Pending:
        record = self._record(group, _BROADCAST)
        if record is not None:
            xp, world = array_namespace(x), group.world_size
            mine = block_checksums(x, [_rows(x)])
            record.src = src
            record.sent = xp.concat([mine] * world) if group.rank == src else xp.concat([mine * 0] * world)
        pending = self.inner.broadcast(x, src, group, async_op, calc_stream)
        if record is None:
            return pending
        return self._checked(pending, record, lambda result: _placed(block_checksums(result, [_rows(result)]), src))

    def all_reduce(self, x: Any, op: str, group: Group, async_op: bool, calc_stream: bool = False) -> Pending:
        record = self._record(group, _REDUCED)
        if record is not None:
            self._note_inputs(record, x, [_rows(x)], op)
        pending = self.inner.all_reduce(x, op, group, async_op, calc_stream)
        if record is None:
            return pending
        return self._checked(pending, record, lambda result: self._reduced(record, result, [_rows(result)]))

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
        record = self._record(group, _SCATTERED)
        if record is not None:
            self._note_inputs(record, x, list(rows), op)
        pending = self.inner.reduce_scatter(out, x, op, rows, group, async_op, calc_stream)
        if record is None:
            return pending
        return self._checked(pending, record, lambda result: self._reduced(record, result, [_rows(result)]))

    # -- how a call is checked ------------------------------------------------------------

    def moe_dispatch(
        self, x: Any, routing: Routing, plan: MoePlan, group: Group, async_op: bool, calc_stream: bool = False
    ) -> Pending:
        """The inner backend's own when it moves tokens itself (unchecked), else composed
        from the checked :meth:`global_scatter`."""
        if "moe_dispatch" in self.capabilities.moe:
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
        if "moe_combine" in self.capabilities.moe:
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
        if "moe_dispatch_static" in self.capabilities.moe:
            return self.inner.moe_dispatch_static(x, layout, group, async_op, calc_stream, valid)
        return super().moe_dispatch_static(x, layout, group, async_op, calc_stream, valid)

    def moe_combine_static(
        self, y: Any, layout: StaticLayout, valid: Any, group: Group, async_op: bool, calc_stream: bool = False
    ) -> Pending:
        """As :meth:`moe_dispatch_static`."""
        if "moe_combine_static" in self.capabilities.moe:
            return self.inner.moe_combine_static(y, layout, valid, group, async_op, calc_stream)
        return super().moe_combine_static(y, layout, valid, group, async_op, calc_stream)

    def _note_inputs(self, record: _Record, x: Any, splits: list[int], op: str) -> None:
        """Before a reduction (which may overwrite ``x``): each block's projection and
        magnitude, where the reduction is a sum (``sum``, ``avg``) of numbers (not bools)."""
        record.dtype = description_of(x).dtype(x)
        record.rows = _rows(x)
        record.reduction = op
        if op in ("sum", "avg") and record.dtype != "bool":
            projections = weighted_blocks(row_values(x), splits)
            magnitudes = weighted_blocks(row_values(x, absolute=True), splits)
            xp = array_namespace(projections)
            record.inputs = xp.stack([projections, xp.astype(magnitudes, projections.dtype)])

    def _reduced(self, record: _Record, result: Any, splits: list[int]) -> Any:
        """After a reduction: the result's bit checksum, then its projection (0 where the
        inputs' were not taken), as one native int64 array."""
        xp = array_namespace(result)
        bits = block_checksums(result, splits)
        if record.inputs is None:
            return xp.concat([bits, xp.zeros(1, dtype=xp.int64, device=device(bits))])
        projection = weighted_blocks(row_values(result), splits)
        return xp.concat([bits, _as_int64(projection)])

    def _checked(self, pending: Pending, record: _Record, received: Callable[[Any], Any]) -> Pending:
        """``pending`` whose finish compares ``record`` and what ``received(result)`` computes
        with every rank's, and raises :class:`~unicoll.IntegrityError` before returning."""

        failed: list[IntegrityError] = []

        def finish() -> Any:
            if failed:  # a Task waited for again after its check failed: the same error, no new exchange
                raise failed[0]
            result = pending.finish()
            try:
                self._compare(record, received(_result_array(result)))
            except IntegrityError as exc:
                failed.append(exc)
                raise
            return result

        return Pending(pending.works, finish)

    def _compare(self, record: _Record, received: Any) -> None:
        """Exchange ``record`` with ``received`` (native int64) and raise for any mismatch."""
        group, world = record.group, record.group.world_size
        xp = array_namespace(received)
        where = device(received)
        sent = record.sent if record.sent is not None else xp.zeros(world, dtype=xp.int64, device=where)
        parts = [sent, xp.reshape(received, (-1,))]
        if record.inputs is not None:
            parts.append(xp.reshape(_as_int64(record.inputs), (-1,)))
        ours = self.inner.read_ints(xp.concat(parts))
        values = np.zeros(_RECORD_INTS + 4 * world, dtype=np.int64)
        values[0], values[1], values[2] = record.number, record.kind, world
        values[3 : 3 + ours.size] = ours
        with translated(f"{record.op} (verification)", group, self._timeout):
            everyone = self.inner.gather_ints(values, group)
        problem = _mismatch(record, everyone)
        if problem is not None:
            raise IntegrityError(
                f"{record.op} on {group}, call {record.number} (verified): {problem}; "
                "the data that arrived is not what was sent"
            )

    # -- the rest of the inner backend's, which the base class would compose instead ----

    def scratch_rows(self, like: Any, rows: int) -> tuple[Any, np.ndarray | None]:
        return self.inner.scratch_rows(like, rows)

    def gather_rows(self, x: Any, index: np.ndarray) -> tuple[Any, np.ndarray | None]:
        return self.inner.gather_rows(x, index)

    def give_back(self, *buffers: np.ndarray | None) -> None:
        self.inner.give_back(*buffers)

    def all_gather_even(self, out: Any, x: Any, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        return self.inner.all_gather_even(out, x, group, async_op, calc_stream)

    def allreduce(self, x: Any, op: str, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        return self.inner.allreduce(x, op, group, async_op, calc_stream)

    def reduce_scatter_even(
        self, out: Any, x: Any, op: str, group: Group, async_op: bool, calc_stream: bool = False
    ) -> Work | None:
        return self.inner.reduce_scatter_even(out, x, op, group, async_op, calc_stream)

    def bcast(self, x: Any, src: int, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        return self.inner.bcast(x, src, group, async_op, calc_stream)

    def abandon(self) -> None:
        self.inner.abandon()


class _CheckedWork:
    """A transfer in flight whose ``wait`` also runs the call's check, once it has completed."""

    def __init__(self, work: Work, check: Callable[[], None]) -> None:
        self._work = work
        self._check = check

    def wait(self, timeout: float) -> Any:
        done = self._work.wait(timeout)
        self._check()
        return done

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, run by the first call only (a Task may wait for its work again); a later call
    raises the IntegrityError the first one raised, if it raised one."""
    ran: list[IntegrityError | None] = []

    def run() -> None:
        if ran:
            if ran[0] is not None:
                raise ran[0]
            return
        try:
            fn()
        except IntegrityError as exc:
            ran.append(exc)
            raise
        ran.append(None)

    return run


def _rows(x: Any) -> int:
    """The rows of ``x`` as the checksums count them (a 0-d array is one row)."""
    return x.shape[0] if x.ndim else 1


def _placed(checksum: Any, src: int) -> Any:
    """A one-block checksum as the received side of a broadcast record: at position ``src``."""
    xp = array_namespace(checksum)
    return checksum if src == 0 else xp.concat([xp.zeros(src, dtype=xp.int64, device=device(checksum)), checksum])


def _as_int64(values: Any) -> Any:
    """Native float64 (or int64) values as int64 of the same bits."""
    if array_namespace(values).isdtype(values.dtype, "integral"):
        return values
    return description_of(values).row_words(values).reshape(values.shape)


def _result_array(result: Any) -> Any:
    """The array a backend's finish returned (a tuple's first, for the MoE layouts)."""
    return result[0] if isinstance(result, tuple) else result


def _mismatch(record: _Record, everyone: np.ndarray) -> str | None:
    """The first mismatch in every rank's record (rows of ``everyone``), in words, or None."""
    world = everyone.shape[0]
    numbers, kinds = everyone[:, 0], everyone[:, 1]
    if len(set(numbers.tolist())) > 1 or len(set(kinds.tolist())) > 1:
        calls = ", ".join(f"rank {r}: call {n}" for r, n in enumerate(numbers.tolist()))
        return (
            f"the ranks verified different calls ({calls}); tasks must be waited for in the same order on every "
            "rank while verification is on"
        )
    sent, received = everyone[:, 3 : 3 + world], everyone[:, 3 + world : 3 + 2 * world]
    if record.kind in (_MOVED, _BROADCAST):
        sources = [record.src] if record.kind == _BROADCAST else range(world)
        pairs = [(s, d) for s in sources for d in range(world)]
        wrong = [(s, d) for s, d in pairs if sent[s, d] != received[d, s]]
        if not wrong:
            return None
        s, d = wrong[0]
        more = f"; {len(wrong) - 1} more block(s) differ" if len(wrong) > 1 else ""
        return (
            f"the block rank {s} sent to rank {d} arrived different (checksum {_hex(sent[s, d])} sent, "
            f"{_hex(received[d, s])} received){more}"
        )
    return _reduction_mismatch(record, everyone)


def _reduction_mismatch(record: _Record, everyone: np.ndarray) -> str | None:
    """:func:`_mismatch` of a reduction: the results' bits across ranks (``all_reduce``), and
    the projections of sums within their rounding."""
    world = everyone.shape[0]
    base = 3 + world
    bits, projections = everyone[:, base], everyone[:, base + 1]
    if record.kind == _REDUCED and len(set(bits.tolist())) > 1:
        odd = next(r for r in range(world) if bits[r] != bits[0])
        return (
            f"rank {odd}'s result differs from rank 0's (checksum {_hex(bits[odd])} against {_hex(bits[0])}): "
            "every rank must hold the same reduction"
        )
    if record.inputs is None:
        return None
    blocks = 1 if record.kind == _REDUCED else world
    inputs = everyone[:, base + 2 : base + 2 + 2 * blocks].reshape(world, 2, blocks)
    floating = record.dtype in _ROUNDING
    for d in range(world):
        block = 0 if record.kind == _REDUCED else d
        if floating:
            expected = inputs[:, 0, block].view(np.float64).sum()
            magnitude = inputs[:, 1, block].view(np.float64).sum()
            got = projections[d : d + 1].view(np.float64)[0]
            if record.reduction == "avg":
                expected, magnitude = expected / world, magnitude / world
            if not (np.isfinite(expected) and np.isfinite(got)):
                continue  # an overflow or a NaN of the data's own: nothing to compare
            tolerance = ((world + 2) * _ROUNDING[record.dtype] + (record.rows + world) * 2.0**-52) * magnitude
            if abs(got - expected) <= tolerance:
                continue
            return (
                f"rank {d}'s result is not the sum of the ranks' inputs (projection {got!r}, expected {expected!r} "
                f"within {tolerance:.3g})"
            )
        bits_wide = 8 * np.dtype(record.dtype).itemsize
        expected_int = int(inputs[:, 0, block].astype(np.uint64).sum(dtype=np.uint64))
        got_int = int(np.uint64(projections[d].astype(np.uint64)))
        if (expected_int - got_int) % (1 << bits_wide) != 0:
            return f"rank {d}'s result is not the sum of the ranks' inputs (its projection differs by the bits)"
    return None


def _hex(value: np.integer) -> str:
    """An int64 checksum as 16 hex digits."""
    return f"{int(value) & (2**64 - 1):016x}"
