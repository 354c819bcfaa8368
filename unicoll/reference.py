"""Whole-world numpy reference semantics for unicoll's collectives.

Every function here takes *every* rank's inputs (one entry per rank, rank order)
and returns *every* rank's outputs, computed with plain numpy on one process.
Nothing is communicated; these functions define what the real backends must
produce, and the conformance tests compare each backend against them.

Notation follows docs/semantics.md ("Notation"): ``W`` ranks, ``E`` experts per
rank, rows are dimension 0 (trailing dimensions are carried along unchanged),
count arrays have length ``W*E`` and are indexed by ``i = rank*E + expert``.

Example (docs/semantics.md's worked example, W=2, E=2)::

    >>> import numpy as np
    >>> from unicoll import reference
    >>> xs = [np.array([0, 1, 2, 3]), np.array([10, 11, 12, 13, 14])]
    >>> lcs = [[1, 0, 2, 1], [0, 2, 1, 2]]
    >>> [gc.tolist() for gc in reference.global_counts(lcs)]
    [[1, 0, 0, 2], [2, 1, 1, 2]]
    >>> [y.tolist() for y in reference.global_scatter(xs, lcs)]
    [[0, 10, 11], [1, 2, 12, 3, 13, 14]]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "global_scatter",
    "global_gather",
    "global_counts",
    "alltoall_single",
    "alltoall",
    "all_gather",
    "all_gather_backward",
    "moe_dispatch",
    "moe_combine",
    "moe_dispatch_static",
    "moe_combine_static",
    "all_reduce",
    "reduce",
    "reduce_backward",
    "reduce_scatter",
    "broadcast",
]


# --------------------------------------------------------------------------- helpers


def _as_counts(count: ArrayLike, what: str) -> np.ndarray:
    """Return ``count`` as a 1-d int64 array of non-negative values, or raise ValueError."""
    arr = np.asarray(count)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if (arr < 0).any():
        raise ValueError(f"{what} must be non-negative, got {arr.tolist()}")
    return arr


def _as_arrays(xs: Sequence[ArrayLike], what: str) -> list[np.ndarray]:
    """Return every rank's array, checking there is at least one rank and that all agree
    on dtype and trailing shape (as a real collective requires)."""
    arrays = [np.asarray(x) for x in xs]
    if not arrays:
        raise ValueError(f"{what} must hold one array per rank, got an empty sequence")
    for r, a in enumerate(arrays):
        if a.ndim == 0:
            raise ValueError(f"{what}[{r}] must have at least one dimension (rows), got a 0-d array")
    dtype, trailing = arrays[0].dtype, arrays[0].shape[1:]
    for r, a in enumerate(arrays[1:], start=1):
        if a.dtype != dtype:
            raise ValueError(f"{what}[{r}] has dtype {a.dtype}, rank 0 has {dtype}; all ranks must agree")
        if a.shape[1:] != trailing:
            raise ValueError(
                f"{what}[{r}] has trailing shape {a.shape[1:]}, rank 0 has {trailing}; all ranks must agree"
            )
    return arrays


def _count_matrix(local_counts: Sequence[ArrayLike], world: int) -> np.ndarray:
    """Validate every rank's local_count and return them as ``C[src, dst, expert]`` (int64)."""
    if len(local_counts) != world:
        raise ValueError(f"expected one local_count per rank ({world}), got {len(local_counts)}")
    counts = [_as_counts(lc, f"local_counts[{r}]") for r, lc in enumerate(local_counts)]
    length = counts[0].size
    for r, c in enumerate(counts):
        if c.size != length:
            raise ValueError(
                f"local_counts[{r}] has length {c.size}, local_counts[0] has {length}; all ranks must agree"
            )
    if length == 0 or length % world != 0:
        raise ValueError(f"local_count length {length} must be a positive multiple of the world size W={world} (W*E)")
    return np.stack(counts).reshape(world, world, length // world)


def _segments_index(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for each (s, n), without a Python loop."""
    total = int(lengths.sum())
    out_starts = np.cumsum(lengths) - lengths
    return np.repeat(starts - out_starts, lengths) + np.arange(total, dtype=np.int64)


def _scatter_plan(c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For ``C[src, dst, expert]`` return ``(perm, in_rows, out_rows)``.

    With every rank's input concatenated in rank order, ``concat[perm]`` is every
    rank's global_scatter output concatenated in rank order; ``in_rows[r]`` and
    ``out_rows[r]`` are rank r's input and output row counts.
    """
    # Chunk (src, dst, e) of the concatenated input starts at the exclusive cumsum of
    # C in (src, dst, e) order: each rank's rows are ordered by i = dst*E + e.
    flat = c.ravel()
    starts = (np.cumsum(flat) - flat).reshape(c.shape)
    # Output order: destination rank, then expert, then source rank.
    order = (1, 2, 0)
    perm = _segments_index(starts.transpose(order).ravel(), c.transpose(order).ravel())
    return perm, c.sum(axis=(1, 2)), c.sum(axis=(0, 2))


def _check_rows(arrays: list[np.ndarray], rows: np.ndarray, what: str, expected: str) -> None:
    for r, (a, n) in enumerate(zip(arrays, rows)):
        if a.shape[0] != n:
            raise ValueError(f"{what}[{r}] has {a.shape[0]} rows but {expected.format(r=r)} is {int(n)}")


def _split(concat: np.ndarray, rows: np.ndarray) -> list[np.ndarray]:
    return np.split(concat, np.cumsum(rows)[:-1])


# --------------------------------------------------------------------------- operators


def global_counts(local_counts: Sequence[ArrayLike]) -> list[np.ndarray]:
    """Return every rank's ``global_count`` derived from every rank's ``local_count``.

    ``global_count_r[c*E + e] = local_counts[c][r*E + e]``: the number of rows rank r's
    expert e receives from rank c. ``W = len(local_counts)``; results are int64.

    Example::

        >>> [g.tolist() for g in global_counts([[1, 0, 2, 1], [0, 2, 1, 2]])]
        [[1, 0, 0, 2], [2, 1, 1, 2]]
    """
    world = len(local_counts)
    if world == 0:
        raise ValueError("local_counts must hold one count per rank, got an empty sequence")
    c = _count_matrix(local_counts, world)
    # global_count on rank r, indexed (src, e), is C[src, r, e].
    return [np.ascontiguousarray(c[:, r, :]).ravel() for r in range(world)]


def global_scatter(xs: Sequence[np.ndarray], local_counts: Sequence[ArrayLike]) -> list[np.ndarray]:
    """MoE dispatch over the whole world: return every rank's global_scatter output.

    ``xs[r]`` is rank r's input, rows ordered by ``i = card*E + expert`` in chunks of
    ``local_counts[r][i]`` rows. ``W = len(xs)``, ``E = len(local_counts[0]) // W``.
    Rank r's output holds the rows sent to it, ordered expert-major, then source
    rank, each chunk in its original order. dtype and trailing shape are kept.

    Raises ValueError if the count lengths disagree or are not a multiple of W, or if
    ``sum(local_counts[r]) != len(xs[r])``.

    Example (W=2, E=1)::

        >>> ys = global_scatter([np.array([0, 1, 2]), np.array([10, 11])], [[1, 2], [2, 0]])
        >>> [y.tolist() for y in ys]
        [[0, 10, 11], [1, 2]]
    """
    arrays = _as_arrays(xs, "xs")
    c = _count_matrix(local_counts, len(arrays))
    perm, in_rows, out_rows = _scatter_plan(c)
    _check_rows(arrays, in_rows, "xs", "sum(local_counts[{r}])")
    return _split(np.concatenate(arrays, axis=0)[perm], out_rows)


def global_gather(xs: Sequence[np.ndarray], local_counts: Sequence[ArrayLike]) -> list[np.ndarray]:
    """MoE combine over the whole world: the exact inverse of :func:`global_scatter`.

    ``xs[r]`` is laid out like rank r's global_scatter output (expert-major, then
    source rank, ``sum(global_count_r)`` rows); each chunk goes back to the rank it
    came from. Rank r's output has ``sum(local_counts[r])`` rows ordered by
    ``i = card*E + expert``. ``global_gather(global_scatter(xs, lc), lc) == xs``.

    Raises ValueError on inconsistent counts or if ``len(xs[r]) != sum(global_count_r)``.

    Example (W=2, E=1)::

        >>> ys = global_gather([np.array([0, 10, 11]), np.array([1, 2])], [[1, 2], [2, 0]])
        >>> [y.tolist() for y in ys]
        [[0, 1, 2], [10, 11]]
    """
    arrays = _as_arrays(xs, "xs")
    c = _count_matrix(local_counts, len(arrays))
    perm, in_rows, out_rows = _scatter_plan(c)
    _check_rows(arrays, out_rows, "xs", "the sum of rank {r}'s global_count (derived from local_counts)")
    concat = np.concatenate(arrays, axis=0)
    out = np.empty_like(concat)
    out[perm] = concat
    return _split(out, in_rows)


def alltoall_single(xs: Sequence[np.ndarray], in_split_sizes: Sequence[ArrayLike] | None = None) -> list[np.ndarray]:
    """Uneven all-to-all over rows, for the whole world.

    Rank r sends rows ``[sum(in[:c]), sum(in[:c+1]))`` of ``xs[r]`` to rank c, where
    ``in = in_split_sizes[r]`` (length W). Rank c's output is the concatenation of what
    it received, in source-rank order. ``in_split_sizes=None`` means an even split on
    every rank (each row count must divide by W).

    Raises ValueError on a split-size list of the wrong length, splits that do not sum
    to the row count, or a row count that cannot be split evenly.

    Example (W=2)::

        >>> ys = alltoall_single([np.array([0, 1, 2]), np.array([10, 11])], [[1, 2], [0, 2]])
        >>> [y.tolist() for y in ys]
        [[0], [1, 2, 10, 11]]
    """
    arrays = _as_arrays(xs, "xs")
    world = len(arrays)
    if in_split_sizes is None:
        splits: list[ArrayLike] = []
        for r, a in enumerate(arrays):
            if a.shape[0] % world != 0:
                raise ValueError(
                    f"xs[{r}] has {a.shape[0]} rows, which cannot be split evenly over W={world} ranks; "
                    "pass in_split_sizes"
                )
            splits.append(np.full(world, a.shape[0] // world, dtype=np.int64))
    else:
        if len(in_split_sizes) != world:
            raise ValueError(f"expected one in_split_sizes per rank ({world}), got {len(in_split_sizes)}")
        splits = []
        for r, s in enumerate(in_split_sizes):
            s = _as_counts(s, f"in_split_sizes[{r}]")
            if s.size != world:
                raise ValueError(f"in_split_sizes[{r}] has length {s.size}, expected W={world}")
            splits.append(s)
        _check_rows(arrays, np.array([s.sum() for s in splits]), "xs", "sum(in_split_sizes[{r}])")
    # An all-to-all is global_scatter with one expert per rank.
    return global_scatter(arrays, splits)


def alltoall(xs: Sequence[Sequence[np.ndarray]]) -> list[list[np.ndarray]]:
    """All-to-all of arrays, for the whole world: ``xs[r][c]`` is what rank r sends rank c;
    rank c receives ``[xs[r][c] for r]``, entry r from rank r.

    Raises ValueError unless every rank gives one array per rank.

    Example (W=2)::

        >>> ys = alltoall([[np.array([0]), np.array([1, 2])], [np.array([10, 11]), np.array([])]])
        >>> [[y.tolist() for y in row] for row in ys]
        [[[0], [10, 11]], [[1, 2], []]]
    """
    world = len(xs)
    for r, row in enumerate(xs):
        if len(row) != world:
            raise ValueError(f"xs[{r}]: expected {world} arrays, one per rank, got {len(row)}")
    return [[np.asarray(xs[r][c]) for r in range(world)] for c in range(world)]


def all_gather(xs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Every rank receives all ranks' rows, concatenated along dimension 0 in rank order.

    Ranks may have different row counts (dtype and trailing shape must agree). Returns
    one independent copy per rank.

    Example (W=2)::

        >>> ys = all_gather([np.array([1, 2]), np.array([3])])
        >>> [y.tolist() for y in ys]
        [[1, 2, 3], [1, 2, 3]]
    """
    arrays = _as_arrays(xs, "xs")
    concat = np.concatenate(arrays, axis=0)
    return [concat.copy() for _ in arrays]


def all_gather_backward(grads: Sequence[np.ndarray], rows: Sequence[int]) -> list[np.ndarray]:
    """Gradient of :func:`all_gather` (a reduce-scatter).

    ``grads[k]`` is rank k's gradient of its all_gather output (``sum(rows)`` rows);
    ``rows[r]`` is rank r's input row count. Rank r's input gradient is the sum, over
    every rank k, of the rows of ``grads[k]`` that came from rank r. dtype is kept.

    Example (W=2)::

        >>> gs = all_gather_backward([np.array([1., 2., 3.]), np.array([10., 20., 30.])], [2, 1])
        >>> [g.tolist() for g in gs]
        [[11.0, 22.0], [33.0]]
    """
    arrays = _as_arrays(grads, "grads")
    sizes = _as_counts(rows, "rows")
    if sizes.size != len(arrays):
        raise ValueError(f"rows has {sizes.size} entries, expected one per rank ({len(arrays)})")
    total = int(sizes.sum())
    _check_rows(arrays, np.full(len(arrays), total), "grads", "sum(rows)")
    summed = np.stack(arrays).sum(axis=0, dtype=arrays[0].dtype)
    return [part.copy() for part in _split(summed, sizes)]


def _kept_slots(ids: np.ndarray, capacity: int | None) -> list[tuple[int, int, int]]:
    """``(token, slot, expert)`` of every kept slot of one rank, in slot order ``t * k + j``:
    -1 drops a slot, and each expert takes at most ``capacity`` slots, the first ones."""
    taken: dict[int, int] = {}
    kept = []
    for t, row in enumerate(ids):
        for j, expert in enumerate(row.tolist()):
            if expert < 0 or (capacity is not None and taken.get(expert, 0) >= capacity):
                continue
            taken[expert] = taken.get(expert, 0) + 1
            kept.append((t, j, expert))
    return kept


def _moe_layout(
    topk_idxs: Sequence[ArrayLike], experts_per_rank: int, capacity: int | None
) -> list[list[tuple[int, int, int]]]:
    """For each destination rank, its rows in order as ``(source rank, token, slot)``:
    expert-major, then source rank, then slot order."""
    ids = [np.asarray(i, dtype=np.int64) for i in topk_idxs]
    world, experts = len(ids), experts_per_rank
    for r, a in enumerate(ids):
        if a.ndim != 2:
            raise ValueError(f"topk_idxs[{r}] must be 2-D (tokens, k), got shape {a.shape}")
        if a.size and (a.min() < -1 or a.max() >= world * experts):
            raise ValueError(f"topk_idxs[{r}] holds an expert id outside -1 .. {world * experts - 1}")
    kept = [_kept_slots(a, capacity) for a in ids]
    return [
        [(c, t, j) for e in range(experts) for c in range(world) for t, j, i in kept[c] if i == r * experts + e]
        for r in range(world)
    ]


def moe_dispatch(
    xs: Sequence[np.ndarray], topk_idxs: Sequence[ArrayLike], experts_per_rank: int, capacity: int | None = None
) -> tuple[list[np.ndarray], list[list[int]]]:
    """Top-k dispatch over the whole world: every rank's rows and rows per local expert.

    ``topk_idxs[c][t, j]`` is the global expert (``rank * experts_per_rank + e``) of slot j of
    token t on rank c, or -1 (dropped); with ``capacity``, rank c sends each expert at most
    that many slots, the lowest ``t * k + j`` first. Rank r receives row t of ``xs[c]`` for
    each kept slot routed to it, ordered expert-major, then source rank c, then slot.

    Example (W=2, E=1, top-2)::

        >>> xs = [np.array([0, 1, 2]), np.array([10, 11])]
        >>> rows, per_expert = moe_dispatch(xs, [[[0, 1], [1, -1], [0, 0]], [[1, 0], [-1, -1]]], 1)
        >>> [r.tolist() for r in rows], per_expert
        ([[0, 2, 2, 10], [0, 1, 10]], [[4], [3]])
    """
    arrays = _as_arrays(xs, "xs")
    layout = _moe_layout(topk_idxs, experts_per_rank, capacity)
    rows = []
    for order in layout:
        taken = [arrays[c][t] for c, t, _ in order]
        rows.append(np.stack(taken) if taken else arrays[0][:0].copy())
    per_expert = [
        [sum(1 for c, t, j in order if topk_idxs[c][t][j] % experts_per_rank == e) for e in range(experts_per_rank)]
        for order in layout
    ]
    return rows, per_expert


def moe_combine(
    ys: Sequence[np.ndarray],
    topk_idxs: Sequence[ArrayLike],
    experts_per_rank: int,
    topk_weights: Sequence[ArrayLike] | None = None,
    capacity: int | None = None,
) -> list[np.ndarray]:
    """Top-k combine over the whole world: ``out_c[t] = sum_j w_c[t, j] * (output for slot (t, j))``.

    ``ys[r]`` is laid out like rank r's :func:`moe_dispatch` rows; a dropped slot contributes
    zero, ``w`` is 1 without weights. Sums are taken in int64 or float64 and the result has
    ``ys``'s dtype and trailing shape, one row per token of ``topk_idxs[c]``.

    Example (the dispatch example, each expert output doubled, unweighted)::

        >>> ids = [[[0, 1], [1, -1], [0, 0]], [[1, 0], [-1, -1]]]
        >>> [o.tolist() for o in moe_combine([np.array([0, 4, 4, 20]), np.array([0, 2, 20])], ids, 1)]
        [[0, 2, 8], [40, 0]]
    """
    arrays = _as_arrays(ys, "ys")
    layout = _moe_layout(topk_idxs, experts_per_rank, capacity)
    wide = np.int64 if np.issubdtype(arrays[0].dtype, np.integer) else np.float64
    trailing = arrays[0].shape[1:]
    outs = [np.zeros((len(ids), *trailing), dtype=wide) for ids in topk_idxs]
    _check_rows(arrays, np.array([len(order) for order in layout]), "ys", "the number of rows dispatched to rank {r}")
    for r, order in enumerate(layout):
        for row, (c, t, j) in zip(arrays[r], order):
            weight = 1 if topk_weights is None else np.float64(np.asarray(topk_weights[c])[t, j])
            outs[c][t] += row.astype(wide) * weight
    return [out.astype(arrays[0].dtype) for out in outs]


def _static_blocks(
    topk_idxs: Sequence[ArrayLike], experts_per_rank: int, capacity: int
) -> list[list[list[tuple[int, int, int]]]]:
    """``blocks[r][e * W + c]``: the kept ``(token, slot, expert)`` that rank c sends rank r's
    expert e, in slot order (at most ``capacity``)."""
    ids = [np.asarray(i, dtype=np.int64) for i in topk_idxs]
    world = len(ids)
    experts = world * experts_per_rank
    kept = [_kept_slots(np.where((a >= 0) & (a < experts), a, -1), capacity) for a in ids]
    return [
        [
            [s for s in kept[c] if s[2] == r * experts_per_rank + e]
            for e in range(experts_per_rank)
            for c in range(world)
        ]
        for r in range(world)
    ]


def moe_dispatch_static(
    xs: Sequence[np.ndarray], topk_idxs: Sequence[ArrayLike], experts_per_rank: int, capacity: int
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Static-shape top-k dispatch over the whole world: every rank's ``(E, W * C, ...)`` rows,
    its ``(E, W)`` counts of valid rows and its ``(E, W)`` counts before the capacity dropped any.

    Block ``[e, c * C:(c + 1) * C]`` of rank r holds the rows rank c sent r's expert e, its
    kept slots in slot order, then zeros; rank c sends each expert at most C slots, the lowest
    ``t * k + j`` first (:func:`moe_dispatch`'s capacity). Ids outside ``-1 .. W * E - 1`` are
    dropped slots.

    Example (W=2, E=1, top-2, C=2)::

        >>> xs = [np.array([1, 2, 3]), np.array([10, 20])]
        >>> rows, counts, demand = moe_dispatch_static(xs, [[[0, 1], [1, -1], [0, 0]], [[1, 0], [-1, -1]]], 1, 2)
        >>> [r.tolist() for r in rows], [c.tolist() for c in counts], [d.tolist() for d in demand]
        ([[[1, 3, 10, 0]], [[1, 2, 10, 0]]], [[[2, 1]], [[2, 1]]], [[[3, 1]], [[2, 1]]])
    """
    arrays = _as_arrays(xs, "xs")
    world, trailing = len(arrays), arrays[0].shape[1:]
    blocks = _static_blocks(topk_idxs, experts_per_rank, capacity)
    unlimited = _static_blocks(topk_idxs, experts_per_rank, sum(len(np.asarray(i).reshape(-1)) for i in topk_idxs))
    rows, counts, demand = [], [], []
    for r in range(world):
        out = np.zeros((experts_per_rank, world * capacity, *trailing), dtype=arrays[0].dtype)
        for b, block in enumerate(blocks[r]):
            e, c = divmod(b, world)
            for n, (t, _, _) in enumerate(block):
                out[e, c * capacity + n] = arrays[c][t]
        rows.append(out)
        counts.append(np.array([len(b) for b in blocks[r]], dtype=np.int64).reshape(experts_per_rank, world))
        demand.append(np.array([len(b) for b in unlimited[r]], dtype=np.int64).reshape(experts_per_rank, world))
    return rows, counts, demand


def moe_combine_static(
    ys: Sequence[np.ndarray],
    topk_idxs: Sequence[ArrayLike],
    experts_per_rank: int,
    capacity: int,
    topk_weights: Sequence[ArrayLike] | None = None,
) -> list[np.ndarray]:
    """Static-shape top-k combine over the whole world: ``ys[r]`` is laid out like rank r's
    :func:`moe_dispatch_static` rows (padding rows are never read); ``out_c[t]`` is the sum of
    ``w_c[t, j]`` times the output for each kept slot (t, j), summed in int64 or float64, as
    ``ys``'s dtype.

    Example (the dispatch example, each expert output doubled, unweighted)::

        >>> ids = [[[0, 1], [1, -1], [0, 0]], [[1, 0], [-1, -1]]]
        >>> ys = [np.array([[2, 6, 20, 99]]), np.array([[2, 4, 20, 99]])]
        >>> [o.tolist() for o in moe_combine_static(ys, ids, 1, 2)]
        [[4, 4, 6], [40, 0]]
    """
    arrays = _as_arrays(ys, "ys")
    world, trailing = len(arrays), arrays[0].shape[2:]
    wide = np.int64 if np.issubdtype(arrays[0].dtype, np.integer) else np.float64
    outs = [np.zeros((len(np.asarray(i)), *trailing), dtype=wide) for i in topk_idxs]
    for r, blocks in enumerate(_static_blocks(topk_idxs, experts_per_rank, capacity)):
        for b, block in enumerate(blocks):
            e, c = divmod(b, world)
            for n, (t, j, _) in enumerate(block):
                weight = 1 if topk_weights is None else np.float64(np.asarray(topk_weights[c])[t, j])
                outs[c][t] += arrays[r][e, c * capacity + n].astype(wide) * weight
    return [out.astype(arrays[0].dtype) for out in outs]


_UFUNCS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}
_LOGICAL = {"sum": "max", "prod": "min"}
"""On bool, a sum is logical or and a product logical and (numpy's add and multiply in bool)."""


def all_reduce(xs: Sequence[np.ndarray], op: str = "sum") -> list[np.ndarray]:
    """Every rank's array reduced elementwise with ``op``, on every rank.

    ``op``: ``"sum"``, ``"prod"``, ``"max"``, ``"min"`` computed in the arrays' dtype (integer
    sums and products wrap around; on bool, sum and max are logical or, prod and min logical
    and; on floats, max and min propagate NaN and order -0 below +0), or ``"avg"``: the sum
    divided by ``W``, rounded to the dtype (floating dtypes only).
    Every rank passes the same shape. Returns one independent copy per rank.

    Example (W=2)::

        >>> [y.tolist() for y in all_reduce([np.array([1, 5]), np.array([3, 2])], "max")]
        [[3, 5], [3, 5]]
        >>> all_reduce([np.array([1.0, 2.0]), np.array([2.0, 2.0])], "avg")[0].tolist()
        [1.5, 2.0]
    """
    arrays = _as_arrays(xs, "xs")
    for r, a in enumerate(arrays):
        if a.shape != arrays[0].shape:
            raise ValueError(f"xs[{r}] has shape {a.shape}, rank 0 has {arrays[0].shape}; all ranks must agree")
    dtype = arrays[0].dtype
    if op not in (*_UFUNCS, "avg"):
        raise ValueError(f"op must be one of sum, avg, max, min, prod, got {op!r}")
    if op == "avg" and not np.issubdtype(dtype, np.floating):
        raise ValueError(f"op 'avg' needs a floating dtype, got {dtype}")
    name = _LOGICAL.get(op, op) if dtype == np.bool_ else op
    stacked = np.stack(arrays)
    total = _UFUNCS["sum" if name == "avg" else name].reduce(stacked, axis=0, dtype=dtype)
    if name in ("max", "min") and np.issubdtype(dtype, np.floating):
        total = _ieee_extreme(total, stacked, name)
    if op == "avg":
        total = (total / len(arrays)).astype(dtype)
    return [total.copy() for _ in arrays]


def reduce(xs: Sequence[np.ndarray], dst: int, op: str = "sum") -> list[np.ndarray]:
    """PaddlePaddle's reduce: every rank's array reduced elementwise with ``op`` (as
    :func:`all_reduce` computes it) on rank ``dst`` (an index into ``xs``); every other rank
    keeps its own array. Returns one independent copy per rank.

    Example (W=2)::

        >>> [y.tolist() for y in reduce([np.array([1, 5]), np.array([3, 2])], dst=1)]
        [[1, 5], [4, 7]]
    """
    arrays = _as_arrays(xs, "xs")
    if not 0 <= dst < len(arrays):
        raise ValueError(f"dst must index one of the {len(arrays)} ranks, got {dst}")
    total = all_reduce(arrays, op)[0]
    return [total if r == dst else a.copy() for r, a in enumerate(arrays)]


def reduce_backward(grads: Sequence[np.ndarray], dst: int, op: str = "sum") -> list[np.ndarray]:
    """The gradient of each rank's input of :func:`reduce` (``sum`` or ``avg``) from each rank's
    output gradient ``grads``: ``dst``'s output is every input's sum (divided by W for avg), and
    every other rank's output is its own input.

    Example (W=2)::

        >>> [g.tolist() for g in reduce_backward([np.array([1.0]), np.array([10.0])], dst=0)]
        [[1.0], [11.0]]
    """
    arrays = _as_arrays(grads, "grads")
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg' (the reductions with a gradient), got {op!r}")
    share = arrays[dst] / len(arrays) if op == "avg" else arrays[dst]
    return [share + (0 if r == dst else g) for r, g in enumerate(arrays)]


def _ieee_extreme(total: np.ndarray, stacked: np.ndarray, op: str) -> np.ndarray:
    """Float ``max``/``min`` as IEEE 754-2019's ``maximum``/``minimum``, whatever the ranks'
    order: NaN wherever a rank holds one (the dtype's quiet NaN, whatever the NaN's sign or
    payload), and where the result is zero, +0 for ``max`` when any rank holds +0 and -0 for
    ``min`` when any rank holds -0 (numpy's ufuncs keep whichever zero came first)."""
    zeros = stacked == 0
    positive = (zeros & ~np.signbit(stacked)).any(axis=0)
    negative = (zeros & np.signbit(stacked)).any(axis=0)
    signed = np.where(positive if op == "max" else ~negative, 0.0, -0.0).astype(total.dtype)
    total = np.where(total == 0, signed, total)
    return np.where(np.isnan(total), np.nan, total).astype(total.dtype)


def reduce_scatter(
    xs: Sequence[np.ndarray], op: str = "sum", split_sizes: Sequence[int] | None = None
) -> list[np.ndarray]:
    """The dual of :func:`all_gather`: block r of the elementwise reduction (``op`` as for
    :func:`all_reduce`) on rank r.

    Every rank passes the same shape; the blocks are ``split_sizes[r]`` consecutive rows, or
    an even split when None (the rows must divide by ``W``).

    Example (W=2)::

        >>> ys = reduce_scatter([np.array([1, 2, 3]), np.array([10, 20, 30])], "sum", [1, 2])
        >>> [y.tolist() for y in ys]
        [[11], [22, 33]]
    """
    reduced = all_reduce(xs, op)[0]
    world = len(xs)
    if split_sizes is None:
        if reduced.shape[0] % world != 0:
            raise ValueError(f"{reduced.shape[0]} rows cannot be split evenly over W={world} ranks; pass split_sizes")
        sizes = np.full(world, reduced.shape[0] // world, dtype=np.int64)
    else:
        sizes = _as_counts(split_sizes, "split_sizes")
        if sizes.size != world or int(sizes.sum()) != reduced.shape[0]:
            expected = f"W={world} sizes summing to {reduced.shape[0]}"
            raise ValueError(f"split_sizes must hold {expected}, got {sizes.tolist()}")
    return [part.copy() for part in _split(reduced, sizes)]


def broadcast(xs: Sequence[np.ndarray], src: int) -> list[np.ndarray]:
    """Rank ``src``'s array on every rank (every rank passes the same shape and dtype).

    Example (W=2)::

        >>> [y.tolist() for y in broadcast([np.array([1, 2]), np.array([3, 4])], 1)]
        [[3, 4], [3, 4]]
    """
    arrays = _as_arrays(xs, "xs")
    if not 0 <= src < len(arrays):
        raise ValueError(f"src must be a rank from 0 to {len(arrays) - 1}, got {src}")
    for r, a in enumerate(arrays):
        if a.shape != arrays[src].shape:
            raise ValueError(f"xs[{r}] has shape {a.shape}, rank {src} has {arrays[src].shape}; all ranks must agree")
    return [arrays[src].copy() for _ in arrays]
