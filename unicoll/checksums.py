"""Checksums of the blocks a collective moves, and projections of the arrays it reduces: what
verification (:mod:`unicoll.verify`) compares across the ranks.

Both are computed where the rows are (numpy, torch or cupy arrays, on the host or a device), in
a few passes over the data, and come back as small arrays of that library on that device.

A block's checksum reads its rows' bits: each row's words (:attr:`~unicoll.libraries.native.NativeLibrary.row_words`)
are summed into one int64 ``h_j`` (wrapping), and the block's ``n`` rows into
``sum((2 j + 1) * h_j for j in range(n))`` (wrapping). A flipped bit changes one ``h_j`` by a power
of two, which an odd weight never cancels; a row moved to another place in its block changes
its weight; a block of zeros sums to zero; NaN's payload bits count like any others. Rows with
the same word sum swapped, and words moved within a row, are not seen.

A projection is the same weighted sum of the rows' values (in float64, or int64 for integers),
linear in the array: the projection of a sum is the sum of the projections, to rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from array_api_compat import array_namespace, device

from .arrays import description_of


def row_hashes(x: Any) -> Any:
    """Each row's words summed (int64, wrapping): ``(rows,)``, of x's library, on its device."""
    words = description_of(x).row_words(x)
    xp = array_namespace(words)
    return xp.sum(words, axis=1, dtype=xp.int64)


def row_values(x: Any, absolute: bool = False) -> Any:
    """Each row's values summed (float64 for floats, int64 for integers and bools; with
    ``absolute``, their magnitudes): ``(rows,)``, of x's library, on its device."""
    xp = array_namespace(x)
    rows = xp.reshape(x, (x.shape[0] if x.ndim else 1, -1))
    floating = xp.isdtype(x.dtype, "real floating")
    values = xp.astype(rows, xp.float64 if floating else xp.int64)
    return xp.sum(xp.abs(values) if absolute else values, axis=1)


def weighted_blocks(per_row: Any, splits: Sequence[int], order: Any | None = None) -> Any:
    """For each block of ``splits[c]`` consecutive rows (of ``per_row[order]`` when ``order`` is
    given: an int index on ``per_row``'s device or the host), ``sum((2 j + 1) * per_row[j])``
    with ``j`` the row's place in its block, in ``per_row``'s dtype (int64 wraps)."""
    xp = array_namespace(per_row)
    where = device(per_row)
    if order is not None:
        per_row = xp.take(per_row, xp.asarray(order, device=where), axis=0)
    ends = np.cumsum(np.asarray(splits, dtype=np.int64))
    starts = ends - np.asarray(splits, dtype=np.int64)
    # With g the row's place in the whole array and s its block's first row:
    # sum((2 (g - s) + 1) h_g) = sum((2 g + 1) h_g) - 2 s sum(h_g), from two running sums.
    places = xp.arange(per_row.shape[0], dtype=per_row.dtype, device=where)
    zero = xp.zeros(1, dtype=per_row.dtype, device=where)
    weighted = xp.concat([zero, xp.cumulative_sum((2 * places + 1) * per_row)])
    plain = xp.concat([zero, xp.cumulative_sum(per_row)])
    at_ends, at_starts = xp.asarray(ends, device=where), xp.asarray(starts, device=where)
    first = xp.asarray(starts, dtype=per_row.dtype, device=where)
    spans = xp.take(weighted, at_ends) - xp.take(weighted, at_starts)
    return spans - 2 * first * (xp.take(plain, at_ends) - xp.take(plain, at_starts))


def block_checksums(x: Any, splits: Sequence[int], order: Any | None = None) -> Any:
    """The checksum of each block of x's rows (int64, ``(len(splits),)``): the rows in
    ``order`` when given, ``splits[c]`` consecutive ones in block c."""
    return weighted_blocks(row_hashes(x), splits, order)
