"""Check mode: the ranks verify each other's arguments before an operator moves any data.

With ``init(check=True)`` or ``UNICOLL_CHECK=1``, every operator first all-gathers a small
integer description of each rank's call (operator, dtype, trailing shape, counts or split
sizes) and every rank runs the same comparison on the same data, so a mismatch raises the
same :class:`~unicoll.errors.CrossRankMismatchError` on every rank instead of a hang or
garbage. Rank numbers in the messages are positions in the group. The cost is one small
all-gather (two for global_scatter/global_gather, whose count length depends on E, so the
lengths are compared before the counts travel).
"""

from __future__ import annotations

import numpy as np

from .arrays import DTYPES, dtype_name
from .backends.base import Backend
from .errors import CrossRankMismatchError
from .spec import OPS, Call

MAX_TRAILING_DIMS = 8
# header: operator, dtype, number of trailing dims, the dims (padded with -1), payload length
_HEADER = 3 + MAX_TRAILING_DIMS + 1
_UNKNOWN = -1


def _header(op: str, x: object, payload: int) -> np.ndarray:
    trailing = tuple(x.shape[1:])
    if len(trailing) > MAX_TRAILING_DIMS:
        raise ValueError(f"{op}: check mode supports at most {MAX_TRAILING_DIMS} trailing dimensions, got {trailing}")
    dims = list(trailing) + [_UNKNOWN] * (MAX_TRAILING_DIMS - len(trailing))
    return np.array([list(OPS).index(op), DTYPES.index(dtype_name(x)), len(trailing), *dims, payload], dtype=np.int64)


def _fail(op: str, message: str) -> CrossRankMismatchError:
    return CrossRankMismatchError(f"{op}: ranks disagree (check mode): {message}")


def _compare_headers(op: str, headers: np.ndarray) -> None:
    """Operator, dtype, trailing shape and payload length must be the same on every rank."""
    ops, first = list(OPS), headers[0]
    for c in range(1, len(headers)):
        h = headers[c]
        if h[0] != first[0]:
            raise _fail(op, f"rank 0 calls {ops[first[0]]} but rank {c} calls {ops[h[0]]}")
        if h[1] != first[1]:
            raise _fail(op, f"rank 0 sends {DTYPES[first[1]]} rows but rank {c} sends {DTYPES[h[1]]}")
        if not np.array_equal(h[2 : 3 + MAX_TRAILING_DIMS], first[2 : 3 + MAX_TRAILING_DIMS]):
            shape = lambda row: tuple(int(d) for d in row[3 : 3 + row[2]])  # noqa: E731
            raise _fail(op, f"rank 0's rows have trailing shape {shape(first)} but rank {c}'s have {shape(h)}")
        if h[-1] != first[-1]:
            raise _fail(op, f"rank 0 passes {first[-1]} counts or sizes but rank {c} passes {h[-1]}")


def _gather(backend: Backend, call: Call, x: object, op: str, payload: np.ndarray, inline: bool) -> np.ndarray:
    """Every rank's payload, after checking that the headers agree; shape ``(W, len(payload))``.

    The first exchange has the same size for every operator (a header and ``2 * W`` slots),
    so ranks that call different operators still pair up and learn it. An ``inline`` payload
    (at most ``2 * W`` values) travels in those slots; any other (the MoE counts, whose length
    depends on E) follows in a second exchange once the ranks agree on its length.
    """
    slots = np.full(2 * call.W, _UNKNOWN, np.int64)
    if inline:
        slots[: payload.size] = payload
    first = backend.gather_ints(np.concatenate([_header(op, x, payload.size), slots]), call.group)
    _compare_headers(op, first[:, :_HEADER])
    if inline:
        return first[:, _HEADER : _HEADER + payload.size]
    return backend.gather_ints(payload, call.group)


def _moe(backend: Backend, call: Call, op: str) -> None:
    world = call.W
    both = _gather(backend, call, call.x, op, np.concatenate([call.local_count, call.global_count]), inline=False)
    local, glob = both[:, : both.shape[1] // 2], both[:, both.shape[1] // 2 :]
    experts = local.shape[1] // world
    for r in range(world):  # rank r receives (scatter) or returns (gather) rows of rank c
        for c in range(world):
            for e in range(experts):
                expects, sends = glob[r, c * experts + e], local[c, r * experts + e]
                if expects == sends:
                    continue
                if op == "global_scatter":
                    message = (
                        f"rank {r} expects {expects} row(s) from rank {c} for expert {e}, but rank {c} sends {sends}"
                    )
                else:
                    message = (
                        f"rank {c} expects {sends} row(s) back from rank {r} for expert {e}, "
                        f"but rank {r} returns {expects}"
                    )
                raise _fail(op, message)


def _alltoall(backend: Backend, call: Call, in_splits: list[int], out_splits: list[int] | None) -> None:
    world = call.W
    out = np.full(world, _UNKNOWN, np.int64) if out_splits is None else np.array(out_splits, np.int64)
    sizes = _gather(backend, call, call.in_tensor, "alltoall_single", np.concatenate([in_splits, out]), inline=True)
    sent, received = sizes[:, :world], sizes[:, world:]
    for r in range(world):
        for c in range(world):
            expects, sends = received[r, c], sent[c, r]
            if expects != _UNKNOWN and expects != sends:
                raise _fail(
                    "alltoall_single", f"rank {r} expects {expects} row(s) from rank {c}, but rank {c} sends {sends}"
                )


def _all_gather(backend: Backend, call: Call, expected_rows: list[int] | None) -> None:
    world, rows = call.W, int(call.tensor.shape[0])
    expected = np.full(world, _UNKNOWN, np.int64) if expected_rows is None else np.array(expected_rows, np.int64)
    sizes = _gather(backend, call, call.tensor, "all_gather", np.concatenate([[rows], expected]), inline=True)
    sends, expects = sizes[:, 0], sizes[:, 1:]
    for r in range(world):
        for c in range(world):
            if expects[r, c] != _UNKNOWN and expects[r, c] != sends[c]:
                raise _fail(
                    "all_gather",
                    f"rank {r} expects {expects[r, c]} row(s) from rank {c}, but rank {c} sends {sends[c]}",
                )


def verify(op: str, call: Call, **resolved: object) -> None:
    """Run the cross-rank check of ``op`` for a prepared ``call``; raises on every rank alike.

    ``resolved`` carries what the front end derived locally: for alltoall_single the
    ``in_splits`` and the ``out_splits`` it will use (None when they are exchanged), for
    all_gather the ``rows`` it expects from each rank (None when they are exchanged).
    """
    backend = call.backend
    if op in ("global_scatter", "global_gather"):
        _moe(backend, call, op)
    elif op == "alltoall_single":
        _alltoall(backend, call, resolved["in_splits"], resolved["out_splits"])
    else:
        _all_gather(backend, call, resolved["rows"])
