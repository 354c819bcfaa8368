"""Checksums of the blocks a collective moves, and projections of the arrays it reduces: what
verification (:mod:`unicoll.verify`) compares across the ranks.

Both are computed where the rows are, in a few passes over the data. The results are small
arrays: numpy arrays for rows in host memory (numpy's, or a CPU tensor's, read in place), else
arrays of the rows' library on their device (cupy, a CUDA tensor), so that a device's rows are
never read by the host.

A block's checksum reads its rows' bits: each row's words (:attr:`~unicoll.libraries.native.NativeLibrary.row_words`)
are summed into one int64 ``h_j``, plus a constant (wrapping), and the block's ``n`` rows into
``sum((2 j + 1) * h_j for j in range(n))`` (wrapping). A flipped bit changes one ``h_j`` by a power
of two, which an odd weight never cancels; a row moved to another place in its block changes
its weight; the constant counts every row, zeros too, so a block of zeros, or one that arrived
with rows more or fewer, sums to another value; NaN's payload bits count like any others. Rows
with the same word sum swapped, and words moved within a row, are not seen.

A projection is the same weighted sum of the rows' values (in float64, or int64 for integers),
linear in the array: the projection of a sum is the sum of the projections, to rounding. A
magnitude bounds the projection of the values' magnitudes (each row's length times its largest
one), which sets how much rounding a sum may bring.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from array_api_compat import array_namespace, device

from .arrays import description_of

_BUFFERED = 16
"""Rows narrower than this are folded column by column on the host (:func:`_across`): numpy's
reduction along a short axis costs a loop per row."""

_ROW = -0x61C8864680B583EB
"""Added to every row's hash (2**64 / the golden ratio, as int64): a row of zeros counts, so a
block with rows of zeros more or fewer (counts the ranks disagree on) sums to another value."""


def row_hashes(x: Any) -> Any:
    """Each row's words summed, plus :data:`_ROW` (int64, wrapping): ``(rows,)``, summed by x's
    own library."""
    words = description_of(x).row_words(x)
    host = host_numbers(words)
    if host is not None and (host.shape[1] == 1 or host.itemsize < 8):
        # numpy sums narrow words faster than torch
        with np.errstate(all="ignore"):
            return _across(host, np.add, np.int64) + _ROW
    xp = array_namespace(words)
    hashes = xp.sum(words, axis=1, dtype=xp.int64) + _ROW
    return _on_host_if_there(hashes)


def row_values(x: Any) -> Any:
    """Each row's values summed (float64 for floats, int64 for integers and bools, wrapping):
    ``(rows,)``. On the host the values are summed in float64 as they are read, without a
    float64 copy of the array."""
    host = host_numbers(x)
    if host is not None:
        rows = _as_rows(host)
        total = np.float64 if rows.dtype.kind == "f" else np.int64
        with np.errstate(all="ignore"):  # infinities and NaNs are the data's own
            return _across(rows, np.add, total)
    xp = array_namespace(x)
    floating = xp.isdtype(x.dtype, "real floating")
    return xp.sum(xp.astype(_as_rows(x), xp.float64 if floating else xp.int64), axis=1)


def row_magnitudes(x: Any) -> Any:
    """A bound on each row's sum of magnitudes, for a floating ``x``: the row's length times
    its largest magnitude (float64, ``(rows,)``; on the host, two passes without a copy, or for
    narrow rows one over their magnitudes)."""
    host = host_numbers(x)
    rows = _as_rows(x if host is None else host)
    if host is not None:
        if rows.shape[1] == 0:
            return np.zeros(rows.shape[0])
        with np.errstate(all="ignore"):
            if rows.shape[1] < _BUFFERED:
                largest = _across(np.abs(rows), np.maximum, rows.dtype)
            else:
                largest = np.maximum(np.maximum.reduce(rows, axis=1), -np.minimum.reduce(rows, axis=1))
            return largest.astype(np.float64) * rows.shape[1]
    xp = array_namespace(x)
    if rows.shape[1] == 0:
        return xp.zeros(rows.shape[0], dtype=xp.float64, device=device(x))
    return xp.astype(xp.max(xp.abs(rows), axis=1), xp.float64) * rows.shape[1]


def weighted_blocks(per_row: Any, splits: Sequence[int]) -> Any:
    """For each block of ``splits[c]`` consecutive rows, ``sum((2 j + 1) * per_row[j])`` with
    ``j`` the row's place in its block, in ``per_row``'s dtype (int64 wraps). On a device,
    nothing is uploaded from the host (an upload from pageable memory waits for the device):
    the blocks' bounds are taken from the running sums by place."""
    splits = list(splits)
    host = host_numbers(per_row)
    if host is not None:
        with np.errstate(all="ignore"):
            return _host_weighted(host, splits)
    xp = array_namespace(per_row)
    where = device(per_row)
    if _equal(per_row.shape[0], splits):
        weights = 2 * xp.arange(splits[0], dtype=per_row.dtype, device=where) + 1
        return xp.sum(xp.reshape(per_row, (len(splits), splits[0])) * weights, axis=1)
    ends = np.cumsum(splits, dtype=np.int64).tolist()
    starts = [end - count for end, count in zip(ends, splits)]
    # With g the row's place in the whole array and s its block's first row:
    # sum((2 (g - s) + 1) h_g) = sum((2 g + 1) h_g) - 2 s sum(h_g), from two running sums.
    places = xp.arange(per_row.shape[0] + 1, dtype=per_row.dtype, device=where)
    zero = xp.zeros(1, dtype=per_row.dtype, device=where)
    weighted = xp.concat([zero, xp.cumulative_sum((2 * places[:-1] + 1) * per_row)])
    plain = xp.concat([zero, xp.cumulative_sum(per_row)])
    spans = _at(weighted, ends) - _at(weighted, starts)
    return spans - 2 * _at(places, starts) * (_at(plain, ends) - _at(plain, starts))


def block_checksums(x: Any, splits: Sequence[int]) -> Any:
    """The checksum of each block of x's rows (int64, ``(len(splits),)``): ``splits[c]``
    consecutive rows in block c."""
    return weighted_blocks(row_hashes(x), splits)


def reordered(per_row: Any, order: Any, take_rows: Callable[[Any, Any], Any]) -> Any:
    """``per_row[order]`` (``order``: an int index on the host or per_row's device): numpy's
    indexing on the host, else ``take_rows(rows, order)`` on ``per_row`` as rows of one value
    (a transport's row gather, which uploads a host index without waiting for the device)."""
    host = host_numbers(per_row)
    if host is not None:
        return host[description_of(order).to_host(order)]
    return take_rows(per_row[:, None], order)[:, 0]


def host_numbers(x: Any) -> np.ndarray | None:
    """``x`` as a numpy array over the same memory when it is in host memory in a dtype numpy
    has (not bfloat16), else None."""
    if isinstance(x, np.ndarray):
        return x
    described = description_of(x)
    if described is None or described.device(x) != "cpu" or described.dtype(x) == "bfloat16":
        return None
    return described.to_host(x)


def _host_weighted(per_row: np.ndarray, splits: list[int]) -> np.ndarray:
    """:func:`weighted_blocks` of a numpy ``per_row``: blocks of one size as one product with
    the weights, others from two running sums."""
    if _equal(per_row.shape[0], splits):
        blocks, size = len(splits), splits[0]
        if size % _SPAN or size == _SPAN:
            return per_row.reshape(blocks, size) @ np.arange(1, 2 * size, 2, dtype=per_row.dtype)
        # Row j = _SPAN i + e of a block: sum((2 j + 1) h_j) = 2 _SPAN sum(i P_i) + sum((2 e + 1) c_e),
        # with P_i the sum of span i and c_e that of place e in every span: weights of a span's
        # length and of a block's spans, not of its rows (a long block's weights cost more than the sums).
        spans = per_row.reshape(blocks, size // _SPAN, _SPAN)
        across = spans.sum(axis=2) @ np.arange(size // _SPAN, dtype=per_row.dtype)
        along = spans.sum(axis=1) @ np.arange(1, 2 * _SPAN, 2, dtype=per_row.dtype)
        return 2 * _SPAN * across + along
    counts = np.asarray(splits, dtype=np.int64)
    ends = np.cumsum(counts)
    starts = ends - counts
    places = np.arange(per_row.shape[0], dtype=np.int64) - np.repeat(starts, counts)
    running = np.concatenate([np.zeros(1, per_row.dtype), np.cumsum((2 * places + 1) * per_row)])
    return running[ends] - running[starts]


_SPAN = 256
"""The rows of a long block summed together on the host before they are weighted (:func:`_host_weighted`)."""


def _equal(rows: int, splits: list[int]) -> bool:
    """Whether ``splits`` are blocks of one size (at least one row) that cover ``rows``."""
    return bool(splits) and splits[0] > 0 and rows == len(splits) * splits[0] and splits.count(splits[0]) == len(splits)


def _at(values: Any, places: list[int]) -> Any:
    """``values[p]`` for each host place ``p``, where ``values`` are: each an indexed view,
    stacked into one array, so that no index travels from the host."""
    xp = array_namespace(values)
    if not places:
        return xp.zeros(0, dtype=values.dtype, device=device(values))
    return xp.stack([values[p] for p in places])


def _across(rows: np.ndarray, fold: np.ufunc, dtype: Any) -> np.ndarray:
    """``fold`` (``np.add``, ``np.maximum``) over each row of ``rows`` (2-D, at least one
    column), in ``dtype``: column by column for narrow rows, else numpy's reduction."""
    if rows.shape[1] >= _BUFFERED or rows.shape[1] == 0:
        return fold.reduce(rows, axis=1, dtype=dtype)
    total = rows[:, 0].astype(dtype)
    for column in range(1, rows.shape[1]):  # in dtype's own loop: unsigned words wrap as int64
        fold(total, rows[:, column], out=total, dtype=dtype, casting="unsafe")
    return total


def _as_rows(x: Any) -> Any:
    """``x`` as a 2-D array of its rows (a 0-d array is one row of one value)."""
    if not x.ndim:
        return array_namespace(x).reshape(x, (1, 1))
    return array_namespace(x).reshape(x, (x.shape[0], math.prod(x.shape[1:])))


def _on_host_if_there(values: Any) -> Any:
    """``values`` as numpy when they are in host memory, else as they are (on their device)."""
    host = host_numbers(values)
    return values if host is None else host
