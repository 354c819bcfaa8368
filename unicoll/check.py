"""The ranks compare their calls before an operator moves any data: the handshake, and check mode.

Before every operator (``exchange_counts``, ``barrier`` and every backward pass included) the
ranks all-gather one small record of fixed size, the same size for every entry point, so ranks
that call different operators still pair up and learn it: the entry point, the call's number on
its group, dtype, trailing shape, the operator's own scalars (reduction, source, rows,
experts_per_rank, capacity, overflow, the dispatch a handle came from) and, per peer, what this
rank sends it and expects from it (split sizes, rows, or a digest of each block of MoE counts).
Every rank runs the same comparison on the same records, so a disagreement raises the same
:class:`~unicoll.errors.CrossRankMismatchError` on every rank, before a row moves, instead of a
crash, a hang or wrong rows; the ranks are in step again afterwards. Where a call exchanges split
sizes or row counts anyway (``alltoall_single`` without ``out_split_sizes``, ``all_gather``
into a new array or an empty list), the record carries them, so the handshake costs nothing
more there.

The **handshake** runs on the host backends unless turned off (``init(handshake=False)`` or
``UNICOLL_HANDSHAKE=0``); **check mode** (``init(check=True)`` or ``UNICOLL_CHECK=1``) runs it
on every backend and adds what costs more or is legal without it: the issuing threads' names,
and the static mode's expert ids read on the host. Rank numbers in the messages are positions in
the group. Counts of the MoE operators travel as digests; where two blocks differ, a second
exchange brings the counts themselves, to name the expert.

``new_group`` is compared whether the ranks compare their calls or not
(:func:`verify_new_group`): it is rare, and ranks that disagree on a group's members would
otherwise pair up wrongly.
"""

from __future__ import annotations

import threading
import weakref
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .arrays import DTYPES, dtype_name
from .backends.base import REDUCE_OPS, Backend
from .counts import on_host
from .errors import CrossRankMismatchError
from .group import Group
from .kinds import REDUCE_OP
from .spec import (
    ALL_GATHER,
    ALL_REDUCE,
    ALLTOALL_SINGLE,
    BROADCAST,
    EXCHANGE_COUNTS,
    GLOBAL_GATHER,
    GLOBAL_SCATTER,
    MOE_COMBINE,
    MOE_COMBINE_STATIC,
    MOE_DISPATCH,
    MOE_DISPATCH_STATIC,
    MOE_REDISPATCH,
    MOE_REDISPATCH_STATIC,
    REDUCE_SCATTER,
    SPECS,
    Call,
    OpSpec,
)

if TYPE_CHECKING:
    from .routing import Handle

#: Every entry point check mode describes, by its index in the header: those with a spec, their
#: backward passes, then barrier and new_group.
ENTRY_POINTS: tuple[str, ...] = (*SPECS, *(f"{name} (backward)" for name in SPECS), "barrier", "new_group")
_ENTRY_NUMBERS = {name: i for i, name in enumerate(ENTRY_POINTS)}
_DTYPE_NUMBERS = {name: i for i, name in enumerate(DTYPES)}

MAX_TRAILING_DIMS = 8
# header: entry point, issuing thread, call number, dtype, number of trailing dims, the dims (padded with -1),
# length of the counts; then the operator's scalars; then two slots per peer
_HEADER = 5 + MAX_TRAILING_DIMS + 1
_DIMS = slice(4, 5 + MAX_TRAILING_DIMS)
_SCALARS = 8
_UNKNOWN = -1
_NO_ROWS = np.empty(0, np.int64)
"""What barrier describes as its rows: none, of int64."""
OVERFLOWS = ("drop", "error")
"""The static mode's overflow settings, by their number in the record."""


_calls: weakref.WeakKeyDictionary[Group, int] = weakref.WeakKeyDictionary()
"""How many collectives this rank has entered on each group, while the ranks compare their calls."""


def count_call(group: Group) -> None:
    """Note that this rank entered a collective on ``group`` (while the ranks compare their
    calls), before its arguments are read: a rank that skips a call after a local error is then
    found out."""
    _calls[group] = _calls.get(group, 0) + 1


def call_number(group: Group) -> int:
    """The number of the collective this rank entered last on ``group`` (while the ranks compare
    their calls): the same on every rank once its comparison passed, so it names that call
    across the ranks."""
    return _calls.get(group, 0)


def _thread_tag() -> int:
    """A number for the issuing thread's name, the same on every rank for threads named alike."""
    return zlib.crc32(threading.current_thread().name.encode())


def _header(op: str, group: Group, x: object, length: int, thread: bool) -> list[int]:
    trailing = tuple(x.shape[1:])
    if len(trailing) > MAX_TRAILING_DIMS:
        raise ValueError(
            f"{op}: the ranks compare at most {MAX_TRAILING_DIMS} trailing dimensions of rows, got {trailing}"
        )
    dims = list(trailing) + [_UNKNOWN] * (MAX_TRAILING_DIMS - len(trailing))
    entry, dtype = _ENTRY_NUMBERS[op], _DTYPE_NUMBERS[dtype_name(x)]
    tag = _thread_tag() if thread else 0
    return [entry, tag, _calls.get(group, 0), dtype, len(trailing), *dims, length]


def _fail(op: str, message: str) -> CrossRankMismatchError:
    return CrossRankMismatchError(f"{op}: ranks disagree: {message}")


def _compare_headers(op: str, headers: np.ndarray) -> None:
    """Call number, entry point, thread, dtype, trailing shape and length of counts must agree."""
    if (headers == headers[0]).all():  # every call's path: one comparison, the loop only to word a mismatch
        return
    first = headers[0]
    for c in range(1, len(headers)):
        h = headers[c]
        if h[2] != first[2]:
            raise _fail(
                op,
                f"rank 0 is at its collective number {first[2]} on this group but rank {c} at number {h[2]}: "
                "a rank skipped or added a call (an error caught on one rank and the loop went on?)",
            )
        if h[0] != first[0]:
            raise _fail(op, f"rank 0 calls {ENTRY_POINTS[first[0]]} but rank {c} calls {ENTRY_POINTS[h[0]]}")
        if h[1] != first[1]:
            raise _fail(
                op,
                f"rank 0 and rank {c} issue it from differently named threads (this is thread "
                f"{threading.current_thread().name!r}); collectives must come from one thread, in the same "
                "order on every rank",
            )
        if h[3] != first[3]:
            raise _fail(op, f"rank 0 sends {DTYPES[first[3]]} rows but rank {c} sends {DTYPES[h[3]]}")
        if not np.array_equal(h[_DIMS], first[_DIMS]):
            shape = lambda row: tuple(int(d) for d in row[5 : 5 + row[4]])  # noqa: E731
            raise _fail(op, f"rank 0's rows have trailing shape {shape(first)} but rank {c}'s have {shape(h)}")
        if h[_HEADER - 1] != first[_HEADER - 1]:
            raise _fail(op, f"rank 0 passes {first[_HEADER - 1]} counts or sizes but rank {c} passes {h[_HEADER - 1]}")


class Records:
    """Every rank's record of one call, after their headers agreed: ``scalars`` (W, 6), and the
    per-peer slots ``sends`` and ``expects`` (W, W) (row c: what rank c sends to, and expects
    from, each rank)."""

    def __init__(self, gathered: np.ndarray, world: int) -> None:
        self.scalars = gathered[:, _HEADER : _HEADER + _SCALARS]
        self.sends = gathered[:, _HEADER + _SCALARS : _HEADER + _SCALARS + world]
        self.expects = gathered[:, _HEADER + _SCALARS + world :]


def _gather(
    backend: Backend,
    group: Group,
    x: object,
    op: str,
    *,
    scalars: Sequence[int] = (),
    sends: Sequence[int] | np.ndarray | None = None,
    expects: Sequence[int] | np.ndarray | None = None,
    length: int = 0,
    thread: bool = False,
) -> Records:
    """Every rank's record of this call, gathered in one exchange of fixed size (a header,
    :data:`_SCALARS` scalars and two slots per peer: the same size for every entry point), after checking that
    the headers agree. ``length``: the number of counts the call passes; ``thread``: compare the
    issuing threads' names (check mode)."""
    world = group.world_size
    if len(scalars) > _SCALARS:
        raise ValueError(f"{op}: {len(scalars)} scalars to compare, room for {_SCALARS}")
    record = np.full(_HEADER + _SCALARS + 2 * world, _UNKNOWN, np.int64)
    record[:_HEADER] = _header(op, group, x, length, thread)
    record[_HEADER : _HEADER + len(scalars)] = scalars
    if sends is not None:
        record[_HEADER + _SCALARS : _HEADER + _SCALARS + world] = sends
    if expects is not None:
        record[_HEADER + _SCALARS + world :] = expects
    gathered = backend.gather_ints(record, group)
    _calls[group] = int(gathered[:, 2].max())  # ranks whose counts of calls differ are in step again after the error
    _compare_headers(op, gathered[:, :_HEADER])
    return Records(gathered, world)


_MIX = tuple(np.uint64(k) for k in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def digests(counts: np.ndarray, world: int) -> np.ndarray:
    """One int64 per rank's block of ``counts`` (``world`` blocks of equal length): equal blocks
    give equal digests; blocks that differ anywhere give different ones but with odds of 2**-64."""
    blocks = counts.reshape(world, -1).astype(np.uint64)
    mixed = blocks * _MIX[1] + np.arange(blocks.shape[1], dtype=np.uint64) * _MIX[0]
    mixed ^= mixed >> np.uint64(31)
    mixed *= _MIX[2]
    mixed ^= mixed >> np.uint64(29)
    return mixed.sum(axis=1, dtype=np.uint64).view(np.int64)


def _scatter_mismatch(r: int, c: int, e: int, expects: int, sends: int) -> str:
    return f"rank {r} expects {expects} row(s) from rank {c} for expert {e}, but rank {c} sends {sends}"


def _gather_mismatch(r: int, c: int, e: int, expects: int, sends: int) -> str:
    return f"rank {c} expects {sends} row(s) back from rank {r} for expert {e}, but rank {r} returns {expects}"


def _moe_counts_compared(
    op: str,
    call: Call,
    mismatch: Callable[[int, int, int, int, int], str],
    rows: object = None,
    handle: Handle | None = None,
) -> None:
    """Rank r's global_count against every rank c's local_count: digests of each rank's blocks
    in the record, and the counts themselves in a second exchange where two digests differ, to
    name the expert; ``mismatch(r, c, e, expects, sends)`` words a disagreement. ``rows`` default
    to the call's ``x``; with a ``handle``, its counts are compared, and first the number of the
    dispatch that made it (handles of two dispatches may have equal counts)."""
    world = call.W
    local_count, global_count = (call.local_count, call.global_count) if handle is None else handle.counts()
    scalars = () if handle is None else (handle.dispatch_number,)
    records = _gather(
        call.backend, call.group, call.x if rows is None else rows, op, scalars=scalars,
        sends=digests(local_count, world), expects=digests(global_count, world),
        length=local_count.size + global_count.size, thread=call.check,
    )  # fmt: skip
    if handle is not None:
        dispatched = lambda row: f"passes the handle of the dispatch that was collective number {row[0]} on this group"  # noqa: E731
        _agree(op, records.scalars[:, :1], dispatched)
    if np.array_equal(records.expects, records.sends.T):
        return
    gathered = call.backend.gather_ints(np.concatenate([local_count, global_count]), call.group)
    local, glob = gathered[:, : local_count.size], gathered[:, local_count.size :]
    experts = local.shape[1] // world
    for r in range(world):  # rank r receives (scatter) or returns (gather) rows of rank c
        for c in range(world):
            for e in range(experts):
                expects, sends = glob[r, c * experts + e], local[c, r * experts + e]
                if expects != sends:
                    raise _fail(op, mismatch(r, c, e, expects, sends))


def _global_scatter(op: str, call: Call) -> None:
    _moe_counts_compared(op, call, _scatter_mismatch)


def _global_gather(op: str, call: Call) -> None:
    _moe_counts_compared(op, call, _gather_mismatch)


def _pairs(op: str, records: Records) -> None:
    """Every rank's known expectation from each peer (not -1) equal to what that peer sends it."""
    sent = records.sends.T  # sent[r, c]: what rank c sends rank r
    wrong = np.argwhere((records.expects != _UNKNOWN) & (records.expects != sent))
    if wrong.size:
        r, c = wrong[0]  # the first pair, rank by rank
        expects, sends = records.expects[r, c], sent[r, c]
        raise _fail(op, f"rank {r} expects {expects} row(s) from rank {c}, but rank {c} sends {sends}")


def _alltoall_single(op: str, call: Call, in_splits: list[int], out_splits: list[int] | None) -> list[int]:
    """The split sizes every rank sends and expects, paired; returns the rows this rank receives
    from each rank (the exchange of ``out_splits`` where they are None)."""
    records = _gather(
        call.backend, call.group, call.in_tensor, op, sends=in_splits, expects=out_splits, thread=call.check
    )
    _pairs(op, records)
    return records.sends[:, call.group.rank].tolist()


def _all_gather(op: str, call: Call, rows: list[int] | None) -> list[int]:
    """The rows every rank sends and expects from each, paired; returns every rank's rows (the
    exchange of ``rows`` where they are None)."""
    here = int(call.tensor.shape[0])
    records = _gather(call.backend, call.group, call.tensor, op, sends=[here] * call.W, expects=rows, thread=call.check)
    _pairs(op, records)
    return records.sends[:, 0].tolist()


def _agree(op: str, values: np.ndarray, what: Callable[[np.ndarray], str]) -> None:
    """Every rank's row of ``values`` equal to rank 0's; ``what(row)`` words one rank's."""
    if (values == values[0]).all():
        return
    for c in range(1, len(values)):
        if not np.array_equal(values[c], values[0]):
            raise _fail(op, f"rank 0 {what(values[0])} but rank {c} {what(values[c])}")


def _reduction(row: np.ndarray) -> str:
    return f"reduces with {REDUCE_OPS[row[0]]!r} over {row[1]} rows"


def _all_reduce(op: str, call: Call) -> None:
    """The same reduction of the same number of rows everywhere (dtype and trailing shape are
    in the header)."""
    scalars = (REDUCE_OPS.index(call.op), call.tensor.shape[0])
    records = _gather(call.backend, call.group, call.tensor, op, scalars=scalars, thread=call.check)
    _agree(op, records.scalars[:, :2], _reduction)


def _reduce_scatter(op: str, call: Call, rows: list[int]) -> None:
    """The same reduction and the same blocks of rows everywhere."""
    scalars = (REDUCE_OPS.index(call.op),)
    records = _gather(call.backend, call.group, call.tensor, op, scalars=scalars, sends=rows, thread=call.check)
    values = np.concatenate([records.scalars[:, :1], records.sends], axis=1)
    _agree(op, values, lambda row: f"reduces with {REDUCE_OPS[row[0]]!r} blocks of {row[1:].tolist()} rows")


def _broadcast(op: str, call: Call) -> None:
    """The same source and the same number of rows everywhere."""
    scalars = (call.src, call.tensor.shape[0])
    records = _gather(call.backend, call.group, call.tensor, op, scalars=scalars, thread=call.check)
    _agree(op, records.scalars[:, :2], lambda row: f"broadcasts {row[1]} rows from position {row[0]}")


def _exchange_counts(op: str, call: Call) -> None:
    """Every rank passes as many counts (the all-to-all of counts of different lengths would
    crash gloo and read garbage on MPI)."""
    counts = call.local_count
    _gather(call.backend, call.group, counts, op, length=counts.size, thread=call.check)


def _given(op: str, values: np.ndarray, names: Sequence[str], shown: Callable[[int], object] = int) -> None:
    """Each column of ``values`` (W rows), the parameter ``names[i]``, equal on every rank."""
    if (values[:, : len(names)] == values[0, : len(names)]).all():
        return
    for c in range(1, len(values)):
        for i, name in enumerate(names):
            mine, theirs = values[0, i], values[c, i]
            if theirs != mine:
                raise _fail(op, f"rank 0 passes {name}={shown(mine)} but rank {c} passes {shown(theirs)}")


def _moe_dispatch(op: str, call: Call) -> None:
    """Every rank passes the same experts_per_rank and capacity (the counts are exchanged by
    the call itself, so they agree by construction)."""
    scalars = (call.experts_per_rank, _UNKNOWN if call.capacity is None else call.capacity)
    records = _gather(call.backend, call.group, call.x, op, scalars=scalars, thread=call.check)
    _given(op, records.scalars, ("experts_per_rank", "capacity"), lambda v: "None" if v == _UNKNOWN else int(v))


def _moe_redispatch(op: str, call: Call) -> None:
    """Every rank redispatches with the handle of the same dispatch, whose counts pair up."""
    _moe_counts_compared(op, call, _scatter_mismatch, call.x, call.handle)


def _moe_combine(op: str, call: Call) -> None:
    """Every rank combines with the handle of the same dispatch, whose counts pair up."""
    _moe_counts_compared(op, call, _gather_mismatch, call.y, call.handle)


def _moe_dispatch_static(op: str, call: Call, topk_idx: object) -> None:
    """Every rank passes the same experts_per_rank, capacity, overflow and max_tokens_per_rank
    (and, with the latter, the same k: each token's slots travel beside its row); in check mode
    also expert ids from -1 to W * experts_per_rank - 1 (outside it, other ids are dropped
    slots: finding them reads the ids on the host). ``topk_idx``: the caller's ids. Without
    max_tokens_per_rank k (topk_idx's columns) may differ: each rank routes its own tokens."""
    experts = call.W * call.experts_per_rank
    where = [_UNKNOWN] * 3
    if call.check:
        ids = np.asarray(on_host(topk_idx), dtype=np.int64)
        bad = np.flatnonzero((ids < -1) | (ids >= experts))
        if bad.size:
            where = [int(ids.flat[bad[0]]), *divmod(int(bad[0]), ids.shape[1])]
    bound = _UNKNOWN if call.max_tokens_per_rank is None else call.max_tokens_per_rank
    k = _UNKNOWN if call.max_tokens_per_rank is None else int(topk_idx.shape[1])
    scalars = (call.experts_per_rank, call.capacity, OVERFLOWS.index(call.overflow), *where, bound, k)
    records = _gather(call.backend, call.group, call.x, op, scalars=scalars, thread=call.check)
    _given(op, records.scalars, ("experts_per_rank", "capacity"))
    _given(op, records.scalars[:, 2:3], ("overflow",), lambda v: repr(OVERFLOWS[v]))
    _given(op, records.scalars[:, 6:7], ("max_tokens_per_rank",), lambda v: "None" if v == _UNKNOWN else str(v))
    _given(op, records.scalars[:, 7:8], ("topk_idx.shape[1]",))
    for c in range(call.W):
        bad_row = records.scalars[c, 4]
        if bad_row != _UNKNOWN:
            place = f"topk_idx[{bad_row}, {records.scalars[c, 5]}]"
            raise _fail(op, f"rank {c} passes expert id {records.scalars[c, 3]} at {place}, outside -1 .. "
                        f"{experts - 1} (W * experts_per_rank - 1)")  # fmt: skip


def _moe_static_handle(op: str, call: Call, rows: object) -> None:
    """Every rank passes the handle of the same static dispatch."""
    h = call.handle
    scalars = (h.dispatch_number, h.experts_per_rank, h.capacity)
    records = _gather(call.backend, call.group, rows, op, scalars=scalars, thread=call.check)
    _agree(op, records.scalars[:, :3], lambda row: f"passes the handle of the dispatch that was collective number "
           f"{row[0]} on this group (experts_per_rank={row[1]}, capacity={row[2]})")  # fmt: skip


def _agreed(spec: OpSpec, call: Call) -> None:
    """The comparison of an operator without one of its own in :data:`CHECKS`: the values of
    the parameters its spec says every rank passes alike (:attr:`~unicoll.spec.OpSpec.agree`):
    an array by its rows (its dtype and trailing shape are in the header), a reduction by its
    name, an int as it is."""
    array, scalars = None, []
    for name in spec.agree:
        value, kind = getattr(call, name), spec.kinds[name]
        if kind.passed_through:
            array = value
        scalars.append(value.shape[0] if kind.passed_through else REDUCE_OPS.index(value) if kind is REDUCE_OP
                       else int(value))  # fmt: skip
    records = _gather(call.backend, call.group, array, spec.name, scalars=scalars, thread=call.check)

    def what(row: np.ndarray) -> str:
        shown = [f"{name} of {v} rows" if spec.kinds[name].passed_through
                 else f"{name}={REDUCE_OPS[v]!r}" if spec.kinds[name] is REDUCE_OP else f"{name}={v}"
                 for name, v in zip(spec.agree, row.tolist())]  # fmt: skip
        return f"passes {', '.join(shown)}"

    _agree(spec.name, records.scalars[:, : len(scalars)], what)


#: The cross-rank comparison of each spec: ``check(op_name, call, **resolved)``; an operator
#: without one here is compared by :func:`_agreed`.
CHECKS: dict[OpSpec, Callable[..., list[int] | None]] = {
    GLOBAL_SCATTER: _global_scatter,
    GLOBAL_GATHER: _global_gather,
    ALLTOALL_SINGLE: _alltoall_single,
    ALL_GATHER: _all_gather,
    ALL_REDUCE: _all_reduce,
    REDUCE_SCATTER: _reduce_scatter,
    BROADCAST: _broadcast,
    EXCHANGE_COUNTS: _exchange_counts,
    MOE_DISPATCH: _moe_dispatch,
    MOE_REDISPATCH: _moe_redispatch,
    MOE_COMBINE: _moe_combine,
    MOE_DISPATCH_STATIC: _moe_dispatch_static,
    MOE_REDISPATCH_STATIC: lambda op, call: _moe_static_handle(op, call, call.x),
    MOE_COMBINE_STATIC: lambda op, call: _moe_static_handle(op, call, call.y),
}


def verify(spec: OpSpec, call: Call, **resolved: object) -> list[int] | None:
    """Compare the ranks' calls of ``spec`` (a prepared ``call``, on the ranks that compare their
    calls: :attr:`Call.compare`); raises on every rank alike, before anything is sent.

    ``resolved`` carries what the front end derived locally: for alltoall_single the
    ``in_splits`` and the ``out_splits`` it will use (None when they are exchanged), for
    all_gather the ``rows`` it expects from each rank (None when they are exchanged), for
    reduce_scatter the ``rows`` of each position's block. Returns, for alltoall_single, the
    rows this rank receives from each rank, and for all_gather every rank's rows (what the
    records exchanged); None for the others.
    """
    check = CHECKS.get(spec.checked_as or spec)
    if check is None:
        return _agreed(spec, call)
    return check(spec.name, call, **resolved)


def verify_backward(op: str, backend: Backend, group: Group, grad: object, forward: int) -> None:
    """The comparison for the backward pass ``op`` (``"<operator> (backward)"``) of the call
    that was collective number ``forward`` on ``group``: the ranks are all in the backward pass
    of that same call, with gradients of one dtype and trailing shape. A rank whose autograd
    graph lacks the call (it skipped an expert that received no rows, say) is then found at its
    next collective, by every rank, instead of pairing its peers' backward with another
    transfer. Counts as a collective of its own."""
    count_call(group)
    records = _gather(backend, group, grad, op, scalars=(forward,))
    _agree(op, records.scalars[:, :1], lambda row: f"is in the backward pass of its collective number {row[0]} on "
           "this group")  # fmt: skip


def verify_barrier(backend: Backend, group: Group) -> None:
    """The comparison for ``barrier``: every rank of ``group`` is in a barrier, not another operator."""
    _gather(backend, group, _NO_ROWS, "barrier")


def verify_new_group(backend: Backend, world: Group, members: Sequence[int] | None) -> None:
    """Compare the ranks of a new group across the world (always, whether the ranks compare
    their calls or not).

    ``members`` is this rank's sorted list, or None when it was invalid here (that rank then
    raises its own error, and the others raise CrossRankMismatchError naming it). Raises
    :class:`~unicoll.errors.CrossRankMismatchError` on every rank when the lists differ.
    """
    mask = np.full(world.world_size, _UNKNOWN, np.int64)
    if members is not None:
        mask[:] = 0
        mask[list(members)] = 1
    masks = _gather(backend, world, _NO_ROWS, "new_group", sends=mask).sends
    invalid = [c for c in range(world.world_size) if masks[c, 0] == _UNKNOWN]
    if members is None:
        return
    if invalid:
        raise CrossRankMismatchError(
            f"new_group: ranks: rank {invalid[0]} passed an invalid list of ranks (see its error)"
        )
    for c in range(1, world.world_size):
        if not np.array_equal(masks[c], masks[0]):
            listed = lambda row: np.flatnonzero(row).tolist()  # noqa: E731
            raise CrossRankMismatchError(
                f"new_group: ranks: expected the same ranks on every rank of the world, got {listed(masks[0])} "
                f"on rank 0 and {listed(masks[c])} on rank {c}"
            )
