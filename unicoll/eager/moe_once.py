"""The top-k dispatch and combine of a host backend that send each token once per destination
rank (:mod:`unicoll.backends.once`): the transfers, the expansion into expert-major rows, the
sums on the expert ranks and on the source, and combine's backward.

A dispatch sends each rank its metadata and token rows (or the plain rows, where a pair moves
fewer that way) in one all-to-all, and the receiver takes its expert-major rows from them with
one gather. combine sums, on each expert rank, each token's weighted outputs of its local
experts (in the order of its experts), sends one row per token back, and the source adds the
rows of its ranks in slot order. The rows that come back are summed into the result by
:func:`unicoll.eager.moe.sum_at_once` with each slot's row and weight: the row a once rank
summed is read by the token's first slot to that rank with weight 1, and the token's other
slots to it read the zero row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from array_api_compat import array_namespace

from ..arrays import library_of
from ..backends.base import Backend, Pending, issued
from ..backends.host import host_view
from ..backends.layout import MoePlan
from ..backends.once import WEIGHT_DTYPES, Expansion, Incoming, Outgoing, meta_bytes, read_meta
from ..counts import host_as
from ..group import Group


@dataclass(eq=False)
class OnceLayout:
    """A handle's layout under :mod:`unicoll.backends.once`: both sides, and the expansion once
    the dispatch's rows have arrived (None before)."""

    outgoing: Outgoing
    incoming: Incoming
    row_bytes: int
    weighted: bool
    """Whether this rank's dispatch sent weights (combine's backward then gets their gradients back)."""
    expansion: Expansion | None = None

    def bytes_sent(self, rank: int) -> tuple[int, int]:
        """The bytes this rank's dispatch sent the other ranks, and what one row per slot would have."""
        return self.outgoing.bytes_sent(rank, self.row_bytes)


def _byte_rows(rows: Any) -> np.ndarray:
    """A native host array's rows as bytes: a ``(rows, row_bytes)`` uint8 view."""
    view = host_view(rows)
    return view.reshape(view.shape[0], math.prod(view.shape[1:])).view(np.uint8)


def dispatch(
    backend: Backend,
    group: Group,
    x: Any,
    layout: OnceLayout,
    plan: MoePlan,
    weights: Any,
    async_op: bool,
    calc_stream: bool,
) -> Pending:
    """The rows of a top-k dispatch of ``x`` (native, on a host backend) under ``layout``, in
    ``plan``'s expert-major order; the layout's expansion is read when they arrive. ``weights``:
    the native ``(T, k)`` weights the metadata carries, or None. The rows sent and received
    are lent by the backend's workspace and given back when the call finishes."""
    out, into = layout.outgoing, layout.incoming
    sent, sent_lent = backend.gather_rows(x, out.gather)
    if out.once.any():
        _write_meta(_byte_rows(sent), out, weights)
    received, received_lent = backend.scratch_rows(x, int(into.received.sum()))
    work = backend.alltoallv(received, sent, into.received.tolist(), out.sent.tolist(), group, async_op, calc_stream)

    def finish() -> Any:
        layout.expansion = read_meta(into, _byte_rows(received), plan.to_expert_major)
        rows = backend.take_rows(received, layout.expansion.rows)
        backend.give_back(sent_lent, received_lent)
        return rows

    return issued(work, finish)


def _write_meta(sent: np.ndarray, out: Outgoing, weights: Any) -> None:
    """Each once rank's metadata into its first rows of ``sent`` (the send buffer's bytes)."""
    firsts = np.concatenate([[0], np.cumsum(out.slots)])
    words = None if weights is None else host_view(weights).reshape(-1)
    for c in np.flatnonzero(out.once):
        rows = slice(firsts[c], firsts[c + 1])
        data = meta_bytes(out.positions[rows], None if words is None else words[out.row_slot[rows]])
        start = int(out.meta_at[c])
        sent[start:].reshape(-1)[: data.size] = data


def redispatch(
    backend: Backend, group: Group, x: Any, layout: OnceLayout, async_op: bool, calc_stream: bool
) -> Pending:
    """A redispatch of ``x`` along ``layout``: each rank's token rows (or plain rows) again,
    without the metadata, expanded as the dispatch's were."""
    out, into, expansion = layout.outgoing, layout.incoming, layout.expansion
    sent, sent_lent = backend.gather_rows(x, _without_meta(out))
    received, received_lent = backend.scratch_rows(x, int(into.back.sum()))
    work = backend.alltoallv(received, sent, into.back.tolist(), out.back.tolist(), group, async_op, calc_stream)

    def finish() -> Any:
        rows = backend.take_rows(received, expansion.rows_again)
        backend.give_back(sent_lent, received_lent)
        return rows

    return issued(work, finish)


def _without_meta(out: Outgoing) -> np.ndarray:
    """The rows of x a dispatch sends, without the metadata rows."""
    keep = np.ones(out.gather.size, dtype=bool)
    for c in np.flatnonzero(out.once):
        meta = int(out.sent[c] - out.back[c])
        keep[out.meta_at[c] : out.meta_at[c] + meta] = False
    return out.gather[keep]


def combine(
    backend: Backend,
    group: Group,
    y: Any,
    layout: OnceLayout,
    weighted: bool,
    async_op: bool,
    calc_stream: bool,
    lend: bool = True,
) -> Pending:
    """combine's transfer of expert rows ``y`` (native, the dispatch's expert-major order):
    each token's rows summed per rank (weighted by the metadata's weights where ``weighted``),
    sent back. Finishes as the rows that came back followed by a zero row, which the source
    sums with :func:`source_weights` (``slot_back`` of the layout's outgoing side), and the
    buffer of the workspace they lie in, to give back once they are summed (None where
    ``lend`` is False: rows a backward pass keeps)."""
    out, into, expansion = layout.outgoing, layout.incoming, layout.expansion
    summed, summed_lent = sum_by_target(backend, y, expansion, int(into.back.sum()), weighted)
    total = int(out.back.sum())
    back, back_lent = backend.scratch_rows(summed, total + 1) if lend else (backend.empty_rows(summed, total + 1), None)
    back[total:] = 0
    work = backend.alltoallv(back[:total], summed, out.back.tolist(), into.back.tolist(), group, async_op, calc_stream)

    def finish() -> tuple[Any, Any]:
        backend.give_back(summed_lent)
        return back, back_lent

    return issued(work, finish)


def sum_dtype(y: Any, expansion: Expansion, weighted: bool) -> Any:
    """The dtype an expert rank sums a token's rows in: y's unweighted; with weights, the
    promoted dtype of y's and the weights' (2-byte floats in float32), as the source's sums."""
    if not weighted or expansion.weights is None:
        return y.dtype
    xp = array_namespace(y)
    code_dtype = WEIGHT_DTYPES[expansion.weight_code - 1]
    if library_of(y) == "torch":
        import torch  # loaded already: y is a tensor

        dtype = torch.promote_types(y.dtype, getattr(torch, code_dtype))
        return torch.float32 if dtype.itemsize == 2 else dtype
    dtype = np.result_type(y.dtype, np.float32 if code_dtype == "bfloat16" else np.dtype(code_dtype))
    return np.float32 if dtype.itemsize == 2 and xp.isdtype(dtype, "real floating") else dtype


def sum_by_target(backend: Backend, y: Any, expansion: Expansion, rows: int, weighted: bool) -> tuple[Any, Any]:
    """``out[target[i]] = sum of w[i] * y[i]`` over the rows i of each target, in the order of
    their levels (``rows`` targets; w = 1 without ``weighted``), summed in :func:`sum_dtype`;
    returned as y's dtype, in rows the workspace lends where they are y's dtype, with the
    buffer to give back (or None)."""
    dtype = sum_dtype(y, expansion, weighted)
    if dtype == y.dtype:
        out, lent = backend.scratch_rows(y, rows)
    else:
        out, lent = array_namespace(y).empty((rows, *y.shape[1:]), dtype=dtype), None
    levels = int(expansion.level.max()) + 1 if expansion.level.size else 0
    for level in range(levels):
        at = np.flatnonzero(expansion.level == level)
        vals = _weighed(_take(y, at), expansion, at, weighted, dtype)
        where = host_as(expansion.target[at], y)
        if level == 0:
            out[where] = vals
        else:
            out[where] = out[where] + vals
    return (out, lent) if out.dtype == y.dtype else (_as_dtype(out, y.dtype), None)


def _take(rows: Any, at: np.ndarray) -> Any:
    index = host_as(at, rows)
    return rows.index_select(0, index) if library_of(rows) == "torch" else rows.take(index, axis=0)


def _as_dtype(a: Any, dtype: Any) -> Any:
    return a.to(dtype) if library_of(a) == "torch" else a.astype(dtype)


def _weighed(vals: Any, expansion: Expansion, at: np.ndarray, weighted: bool, dtype: Any) -> Any:
    """``vals`` (rows ``at`` of y) in ``dtype``, times their rows' weights where ``weighted``."""
    vals = vals if vals.dtype == dtype else _as_dtype(vals, dtype)
    if not weighted or expansion.weights is None:
        return vals
    column = host_as(expansion.weights[at], vals)
    column = _as_dtype(column, dtype).reshape(column.shape[0], *([1] * (vals.ndim - 1)))
    return vals * column


def source_weights(layout: OnceLayout, weights: Any) -> tuple[Any, Any]:
    """The weights and kept mask the source sums the rows that came back with: a plain rank's
    slot weighs its own weight, the slot that reads a once rank's sum weighs 1, and every other
    slot (a dropped one, or a token's later slot to a once rank) reads the zero row with
    weight 0 (``kept`` False)."""
    out = layout.outgoing
    xp = array_namespace(weights)
    tokens, k = weights.shape
    leads = out.slot_back < int(out.back.sum())
    here = host_as(out.weighed_here.reshape(tokens, k), weights)
    ones = xp.ones_like(weights)
    weighs = xp.where(here, weights, ones)
    return weighs, host_as(leads.reshape(tokens, k), weights)


def combine_backward(
    backend: Backend,
    group: Group,
    grad: Any,
    layout: OnceLayout,
    tokens: int,
    topk: int,
    y: Any,
    weights: Any,
    back: Any,
) -> tuple[Any, Any]:
    """The gradients of a once combine's expert rows ``y`` and weights (native ``(T, k)``, or
    None) from the gradient of its result, ``grad`` (``back``: the rows that came back in the
    forward call, a zero row after them). Two transfers, on every rank alike: each back row's
    gradient (its token's, times the slot's weight where the source weighed it) to the expert
    ranks, where each row's gradient is its token's times its metadata weight; then, for the
    slots a once rank weighed, ``<token's gradient, row>`` back to their source."""
    out, into, expansion = layout.outgoing, layout.incoming, layout.expansion
    zero_row = int(out.back.sum())
    leads = np.flatnonzero(out.slot_back < zero_row)
    lead_of_row = np.empty(zero_row, dtype=np.int64)
    lead_of_row[out.slot_back[leads]] = leads
    rows = _take(grad, lead_of_row // topk)
    if weights is not None:
        weighs, _ = source_weights(layout, weights)
        column = _take(weighs.reshape(-1), lead_of_row)
        rows = rows * _as_dtype(column, rows.dtype).reshape(-1, *([1] * (rows.ndim - 1)))
    there = backend.empty_rows(rows, int(into.back.sum()))
    backend.alltoallv(there, rows, into.back.tolist(), out.back.tolist(), group, False, True)
    per_row = _take(there, expansion.target)
    grad_y = per_row
    if expansion.weights is not None:
        grad_y = _weighed(per_row, expansion, np.arange(y.shape[0]), True, per_row.dtype)
    grad_y = grad_y if grad_y.dtype == y.dtype else _as_dtype(grad_y, y.dtype)
    remote = _remote_weight_grads(backend, group, layout, per_row, y)
    if weights is None:
        return grad_y, None
    grad_w = np.zeros(tokens * topk, dtype=np.float64)
    here = np.flatnonzero(out.weighed_here)
    if here.size:
        grad_w[here] = _row_dots(_take(back, out.slot_back[here]), _take(grad, here // topk))
    firsts = np.concatenate([[0], np.cumsum(out.slots)])
    at = 0
    for c in np.flatnonzero(out.once):  # in rank order, as they came
        rows_of_c = out.row_slot[firsts[c] : firsts[c + 1]]
        grad_w[rows_of_c] = remote[at : at + rows_of_c.size]
        at += rows_of_c.size
    shaped = host_as(grad_w.reshape(tokens, topk), weights)
    return grad_y, _as_dtype(shaped, weights.dtype)


def _row_dots(a: Any, b: Any) -> np.ndarray:
    """Each row's dot product of ``a`` and ``b`` (native, same shape) in float64, on the host."""
    if library_of(a) == "torch":
        import torch  # loaded already: a is a tensor

        return (a.to(torch.float64) * b.to(torch.float64)).reshape(a.shape[0], -1).sum(1).numpy()
    return (a.astype(np.float64) * b.astype(np.float64)).reshape(a.shape[0], -1).sum(1)


def _remote_weight_grads(backend: Backend, group: Group, layout: OnceLayout, per_row: Any, y: Any) -> np.ndarray:
    """The weights' gradients of the slots this rank's once ranks weighed, as they come back:
    per once rank in rank order, its slots in send order (nothing where this rank sent no
    weights). Each is ``<token's gradient, row>``, computed where the rows are (``per_row``:
    each expert row's token gradient, ``y``: the rows); every rank takes part, sending and
    receiving nothing where no weights travelled."""
    out, into, expansion = layout.outgoing, layout.incoming, layout.expansion
    weighted_from = into.once & (into.weight_code > 0)
    sends = np.where(weighted_from, into.slots, 0)
    receives = np.where(out.once, out.slots, 0) if layout.weighted else np.zeros_like(out.slots)
    parts = []
    if weighted_from.any():
        dots = _row_dots(per_row, y)
        in_rank_order = dots if expansion.to_expert_major is None else np.empty_like(dots)
        if expansion.to_expert_major is not None:
            in_rank_order[expansion.to_expert_major] = dots
        firsts = np.concatenate([[0], np.cumsum(into.slots)])
        parts = [in_rank_order[firsts[c] : firsts[c + 1]] for c in np.flatnonzero(weighted_from)]
    sent = np.concatenate(parts) if parts else np.zeros(0)
    sent_native = host_as(sent.reshape(-1, 1), y)
    got = host_as(np.empty((int(receives.sum()), 1)), y)
    backend.alltoallv(got, sent_native, receives.tolist(), sends.tolist(), group, False, True)
    return host_view(got).reshape(-1)
