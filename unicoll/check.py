"""Check mode: the ranks verify each other's arguments before an operator moves any data.

With ``init(check=True)`` or ``UNICOLL_CHECK=1``, every operator (``exchange_counts`` and
``barrier`` included) first all-gathers a small integer description of each rank's call
(operator, issuing thread, the call's number in its group, dtype, trailing shape, counts or
split sizes, and for the reductions and broadcast the reduction, the rows and the source) and every rank runs
the same comparison on the same data, so a mismatch raises the same
:class:`~unicoll.errors.CrossRankMismatchError` on every rank instead of a hang, a crash or
garbage. Rank numbers in the messages are positions in the group. The cost is one small
all-gather (two for global_scatter/global_gather, whose count length depends on E, so the
lengths are compared before the counts travel).

``new_group`` is checked whether check mode is on or not (:func:`verify_new_group`): it is
rare, and ranks that disagree on a group's members would otherwise pair up wrongly.
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

MAX_TRAILING_DIMS = 8
# header: entry point, issuing thread, call number, dtype, number of trailing dims, the dims (padded with -1),
# payload length
_HEADER = 5 + MAX_TRAILING_DIMS + 1
_DIMS = slice(4, 5 + MAX_TRAILING_DIMS)
_UNKNOWN = -1
_NO_ROWS = np.empty(0, np.int64)
"""What barrier describes as its rows: none, of int64."""


_calls: weakref.WeakKeyDictionary[Group, int] = weakref.WeakKeyDictionary()
"""How many collectives this rank has entered on each group, in check mode."""


def count_call(group: Group) -> None:
    """Note that this rank entered a collective on ``group`` (check mode only), before its
    arguments are read: a rank that skips a call after a local error is then found out."""
    _calls[group] = _calls.get(group, 0) + 1


def call_number(group: Group) -> int:
    """The number of the collective this rank entered last on ``group`` (check mode only): the
    same on every rank once its check passed, so it names that call across the ranks."""
    return _calls.get(group, 0)


def _thread_tag() -> int:
    """A number for the issuing thread's name, the same on every rank for threads named alike."""
    return zlib.crc32(threading.current_thread().name.encode())


def _header(op: str, group: Group, x: object, payload: int) -> np.ndarray:
    trailing = tuple(x.shape[1:])
    if len(trailing) > MAX_TRAILING_DIMS:
        raise ValueError(f"{op}: check mode supports at most {MAX_TRAILING_DIMS} trailing dimensions, got {trailing}")
    dims = list(trailing) + [_UNKNOWN] * (MAX_TRAILING_DIMS - len(trailing))
    entry, dtype = ENTRY_POINTS.index(op), DTYPES.index(dtype_name(x))
    number = _calls.get(group, 0)
    return np.array([entry, _thread_tag(), number, dtype, len(trailing), *dims, payload], dtype=np.int64)


def _fail(op: str, message: str) -> CrossRankMismatchError:
    return CrossRankMismatchError(f"{op}: ranks disagree (check mode): {message}")


def _compare_headers(op: str, headers: np.ndarray) -> None:
    """Call number, entry point, thread, dtype, trailing shape and payload length must agree."""
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
        if h[-1] != first[-1]:
            raise _fail(op, f"rank 0 passes {first[-1]} counts or sizes but rank {c} passes {h[-1]}")


def _gather(
    backend: Backend, group: Group, x: object, op: str, payload: np.ndarray, inline: bool, length: int | None = None
) -> np.ndarray:
    """Every rank's payload, after checking that the headers agree; shape ``(W, len(payload))``.

    The first exchange has the same size for every entry point (a header and ``2 * W``
    slots), so ranks that call different operators still pair up and learn it. An ``inline``
    payload (at most ``2 * W`` values) travels in those slots; any other (the MoE counts,
    whose length depends on E) follows in a second exchange once the ranks agree on its
    length. ``length`` overrides the length the header states (default: the payload's).
    """
    slots = np.full(2 * group.world_size, _UNKNOWN, np.int64)
    if inline:
        slots[: payload.size] = payload
    header = _header(op, group, x, payload.size if length is None else length)
    first = backend.gather_ints(np.concatenate([header, slots]), group)
    _calls[group] = int(first[:, 2].max())  # ranks whose counts of calls differ are in step again after the error
    _compare_headers(op, first[:, :_HEADER])
    if inline:
        return first[:, _HEADER : _HEADER + payload.size]
    return backend.gather_ints(payload, group)


def _scatter_mismatch(r: int, c: int, e: int, expects: int, sends: int) -> str:
    return f"rank {r} expects {expects} row(s) from rank {c} for expert {e}, but rank {c} sends {sends}"


def _gather_mismatch(r: int, c: int, e: int, expects: int, sends: int) -> str:
    return f"rank {c} expects {sends} row(s) back from rank {r} for expert {e}, but rank {r} returns {expects}"


def _moe(
    op: str,
    call: Call,
    mismatch: Callable[[int, int, int, int, int], str],
    rows: object = None,
    handle: Handle | None = None,
) -> None:
    """Rank r's global_count against every rank c's local_count; ``mismatch(r, c, e, expects,
    sends)`` words a disagreement. ``rows`` default to the call's ``x``; with a ``handle``, its
    counts are compared, and first the number of the dispatch that made it (handles of two
    dispatches may have equal counts)."""
    world = call.W
    local_count, global_count = (call.local_count, call.global_count) if handle is None else handle.counts()
    number = [] if handle is None else [handle.dispatch_number]
    payload = np.concatenate([local_count, global_count, number])
    gathered = _gather(call.backend, call.group, call.x if rows is None else rows, op, payload, inline=False)
    if handle is not None:
        dispatched = lambda row: f"passes the handle of the dispatch that was collective number {row[0]} on this group"  # noqa: E731
        _agree(op, gathered[:, -1:], dispatched)
        gathered = gathered[:, :-1]
    local, glob = gathered[:, : gathered.shape[1] // 2], gathered[:, gathered.shape[1] // 2 :]
    experts = local.shape[1] // world
    for r in range(world):  # rank r receives (scatter) or returns (gather) rows of rank c
        for c in range(world):
            for e in range(experts):
                expects, sends = glob[r, c * experts + e], local[c, r * experts + e]
                if expects != sends:
                    raise _fail(op, mismatch(r, c, e, expects, sends))


def _global_scatter(op: str, call: Call) -> None:
    _moe(op, call, _scatter_mismatch)


def _global_gather(op: str, call: Call) -> None:
    _moe(op, call, _gather_mismatch)


def _alltoall_single(op: str, call: Call, in_splits: list[int], out_splits: list[int] | None) -> None:
    world = call.W
    out = np.full(world, _UNKNOWN, np.int64) if out_splits is None else np.array(out_splits, np.int64)
    sizes = _gather(call.backend, call.group, call.in_tensor, op, np.concatenate([in_splits, out]), inline=True)
    sent, received = sizes[:, :world], sizes[:, world:]
    for r in range(world):
        for c in range(world):
            expects, sends = received[r, c], sent[c, r]
            if expects != _UNKNOWN and expects != sends:
                raise _fail(op, f"rank {r} expects {expects} row(s) from rank {c}, but rank {c} sends {sends}")


def _all_gather(op: str, call: Call, rows: list[int] | None) -> None:
    world, here = call.W, int(call.tensor.shape[0])
    expected = np.full(world, _UNKNOWN, np.int64) if rows is None else np.array(rows, np.int64)
    sizes = _gather(call.backend, call.group, call.tensor, op, np.concatenate([[here], expected]), inline=True)
    sends, expects = sizes[:, 0], sizes[:, 1:]
    for r in range(world):
        for c in range(world):
            if expects[r, c] != _UNKNOWN and expects[r, c] != sends[c]:
                raise _fail(op, f"rank {r} expects {expects[r, c]} row(s) from rank {c}, but rank {c} sends {sends[c]}")


def _agree(op: str, values: np.ndarray, what: Callable[[np.ndarray], str]) -> None:
    """Every rank's row of ``values`` equal to rank 0's; ``what(row)`` words one rank's."""
    for c in range(1, len(values)):
        if not np.array_equal(values[c], values[0]):
            raise _fail(op, f"rank 0 {what(values[0])} but rank {c} {what(values[c])}")


def _reduction(row: np.ndarray) -> str:
    return f"reduces with {REDUCE_OPS[row[0]]!r} over {row[1]} rows"


def _all_reduce(op: str, call: Call) -> None:
    """The same reduction of the same number of rows everywhere (dtype and trailing shape are
    in the header)."""
    payload = np.array([REDUCE_OPS.index(call.op), call.tensor.shape[0]], np.int64)
    _agree(op, _gather(call.backend, call.group, call.tensor, op, payload, inline=True), _reduction)


def _reduce_scatter(op: str, call: Call, rows: list[int]) -> None:
    """The same reduction and the same blocks of rows everywhere."""
    payload = np.array([REDUCE_OPS.index(call.op), *rows], np.int64)
    values = _gather(call.backend, call.group, call.tensor, op, payload, inline=True)
    _agree(op, values, lambda row: f"reduces with {REDUCE_OPS[row[0]]!r} blocks of {row[1:].tolist()} rows")


def _broadcast(op: str, call: Call) -> None:
    """The same source and the same number of rows everywhere."""
    payload = np.array([call.src, call.tensor.shape[0]], np.int64)
    values = _gather(call.backend, call.group, call.tensor, op, payload, inline=True)
    _agree(op, values, lambda row: f"broadcasts {row[1]} rows from position {row[0]}")


def _exchange_counts(op: str, call: Call) -> None:
    """Every rank passes as many counts (the all-to-all of counts of different lengths would
    crash gloo and read garbage on MPI)."""
    counts = call.local_count
    _gather(call.backend, call.group, counts, op, _NO_ROWS, inline=True, length=counts.size)


def _moe_dispatch(op: str, call: Call) -> None:
    """Every rank passes the same experts_per_rank and capacity (the counts are exchanged by
    the call itself, so they agree by construction)."""
    mine = np.array([call.experts_per_rank, _UNKNOWN if call.capacity is None else call.capacity], np.int64)
    given = _gather(call.backend, call.group, call.x, op, mine, inline=True)
    for c in range(1, call.W):
        for i, name in enumerate(("experts_per_rank", "capacity")):
            if given[c, i] != given[0, i]:
                shown = lambda v: "None" if v == _UNKNOWN else int(v)  # noqa: E731
                raise _fail(op, f"rank 0 passes {name}={shown(given[0, i])} but rank {c} passes {shown(given[c, i])}")


def _moe_redispatch(op: str, call: Call) -> None:
    """Every rank redispatches with the handle of the same dispatch, whose counts pair up."""
    _moe(op, call, _scatter_mismatch, call.x, call.handle)


def _moe_combine(op: str, call: Call) -> None:
    """Every rank combines with the handle of the same dispatch, whose counts pair up."""
    _moe(op, call, _gather_mismatch, call.y, call.handle)


def _exchanged(call: Call, rows: object, op: str, payload: np.ndarray) -> np.ndarray:
    """:func:`_gather` of a small payload, inline where it fits in the first exchange."""
    return _gather(call.backend, call.group, rows, op, payload, inline=payload.size <= 2 * call.W)


def _moe_dispatch_static(op: str, call: Call, topk_idx: object) -> None:
    """Every rank passes the same experts_per_rank, capacity and k, and expert ids from -1 to
    W * experts_per_rank - 1 (outside check mode, other ids are dropped slots: finding them
    reads the ids on the host, which only check mode does). ``topk_idx``: the caller's ids."""
    ids = np.asarray(on_host(topk_idx), dtype=np.int64)
    experts = call.W * call.experts_per_rank
    bad = np.flatnonzero((ids < -1) | (ids >= experts))
    where = [-1, -1, -1] if bad.size == 0 else [int(ids.flat[bad[0]]), *divmod(int(bad[0]), ids.shape[1])]
    payload = np.array([call.experts_per_rank, call.capacity, ids.shape[1], *where], np.int64)
    given = _exchanged(call, call.x, op, payload)
    for c in range(1, call.W):
        for i, name in enumerate(("experts_per_rank", "capacity", "k (topk_idx's columns)")):
            if given[c, i] != given[0, i]:
                raise _fail(op, f"rank 0 passes {name}={given[0, i]} but rank {c} passes {given[c, i]}")
    for c in range(call.W):
        if given[c, 4] != -1:
            raise _fail(op, f"rank {c} passes expert id {given[c, 3]} at topk_idx[{given[c, 4]}, {given[c, 5]}], "
                        f"outside -1 .. {experts - 1} (W * experts_per_rank - 1)")  # fmt: skip


def _moe_static_handle(op: str, call: Call, rows: object) -> None:
    """Every rank passes the handle of the same static dispatch."""
    h = call.handle
    given = _exchanged(call, rows, op, np.array([h.dispatch_number, h.experts_per_rank, h.capacity], np.int64))
    _agree(op, given, lambda row: f"passes the handle of the dispatch that was collective number {row[0]} on this "
           f"group (experts_per_rank={row[1]}, capacity={row[2]})")  # fmt: skip


#: The cross-rank comparison of each spec: ``check(op_name, call, **resolved)``.
CHECKS: dict[OpSpec, Callable[..., None]] = {
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


def verify(spec: OpSpec, call: Call, **resolved: object) -> None:
    """Run the cross-rank check of ``spec`` for a prepared ``call``; raises on every rank alike.

    ``resolved`` carries what the front end derived locally: for alltoall_single the
    ``in_splits`` and the ``out_splits`` it will use (None when they are exchanged), for
    all_gather the ``rows`` it expects from each rank (None when they are exchanged), for
    reduce_scatter the ``rows`` of each position's block.
    """
    CHECKS[spec.checked_as or spec](spec.name, call, **resolved)


def verify_backward(op: str, backend: Backend, group: Group, grad: object, forward: int) -> None:
    """Check mode for the backward pass ``op`` (``"<operator> (backward)"``) of the call that was
    collective number ``forward`` on ``group``: the ranks are all in the backward pass of that
    same call, with gradients of one dtype and trailing shape. A rank whose autograd graph
    lacks the call (it skipped an expert that received no rows, say) is then found at its next
    collective, by every rank, instead of pairing its peers' backward with another transfer.
    Counts as a collective of its own."""
    count_call(group)
    numbers = _gather(backend, group, grad, op, np.array([forward], np.int64), inline=True)
    _agree(op, numbers, lambda row: f"is in the backward pass of its collective number {row[0]} on this group")


def verify_barrier(backend: Backend, group: Group) -> None:
    """Check mode for ``barrier``: every rank of ``group`` is in a barrier, not another operator."""
    _gather(backend, group, _NO_ROWS, "barrier", _NO_ROWS, inline=True)


def verify_new_group(backend: Backend, world: Group, members: Sequence[int] | None) -> None:
    """Compare the ranks of a new group across the world (always, check mode or not).

    ``members`` is this rank's sorted list, or None when it was invalid here (that rank then
    raises its own error, and the others raise CrossRankMismatchError naming it). Raises
    :class:`~unicoll.errors.CrossRankMismatchError` on every rank when the lists differ.
    """
    mask = np.full(world.world_size, _UNKNOWN, np.int64)
    if members is not None:
        mask[:] = 0
        mask[list(members)] = 1
    masks = _gather(backend, world, _NO_ROWS, "new_group", mask, inline=True)
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
