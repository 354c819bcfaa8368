"""The top-k dispatch and combine of a host backend that send each token once per destination
rank (:mod:`unicoll.backends.once`): the transfers, the expansion into expert-major rows, the
sums on the expert ranks and on the source, and combine's backward.

A dispatch sends each rank its metadata and token rows (or the plain rows, where a pair moves
fewer that way) in one all-to-all, and the receiver takes its expert-major rows from them with
one gather. combine sums, on each expert rank, each token's weighted outputs of its local
experts (one sparse product, or one ``index_add`` unweighted), sends one row per token back,
and the source adds the rows of its ranks (:func:`sum_at_source`), a plain rank's weighed by
its slot. The sums run in torch on every host backend (a numpy array is viewed as a tensor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..arrays import description_of
from ..backends.base import Backend, Pending, issued
from ..backends.host import host_view
from ..backends.layout import MoePlan
from ..backends.once import WEIGHT_DTYPES, Expansion, Incoming, Outgoing, bounds, meta_bytes, read_meta
from ..counts import host_as
from ..group import Group
from ..libraries.native import TORCH


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
    _made: dict[Any, Any] = field(default_factory=dict)
    """Index tensors and the weighing matrix, made on first use (combine and its backward)."""

    def bytes_sent(self, rank: int) -> tuple[int, int]:
        """The bytes this rank's dispatch sent the other ranks, and what one row per slot would have."""
        return self.outgoing.bytes_sent(rank, self.row_bytes)

    def torch_index(self, name: str) -> Any:
        """An index as a torch tensor: ``target`` (each expert row's row among those sent back)
        or ``row_token`` (the token of each row that comes back)."""
        if name not in self._made:
            import torch

            host = self.expansion.target if name == "target" else self.outgoing.row_lead // self.outgoing.topk
            self._made[name] = torch.from_numpy(host)
        return self._made[name]

    def weighing(self, dtype: Any) -> Any:
        """The sparse ``(rows sent back, expert rows)`` matrix of the metadata's weights in
        ``dtype``, whose product with the expert rows is combine's per-rank sum."""
        if dtype not in self._made:
            import torch

            expansion = self.expansion
            rows = torch.from_numpy(np.stack([expansion.target, np.arange(expansion.target.size)]))
            values = torch.from_numpy(expansion.weights).to(dtype)
            shape = (int(self.incoming.back.sum()), expansion.target.size)
            self._made[dtype] = torch.sparse_coo_tensor(rows, values, shape, check_invariants=False).coalesce()
        return self._made[dtype]


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
    placed: np.ndarray | None = None,
) -> Pending:
    """The rows of a top-k dispatch of ``x`` (native, on a host backend) under ``layout``, in
    ``plan``'s expert-major order; the layout's expansion is read when they arrive. ``weights``:
    the native ``(T, k)`` weights the metadata carries, or None. ``placed``: where the static
    mode wants them instead (see :func:`_received_rows`). The rows sent and received are lent
    by the backend's workspace and given back when the call finishes."""
    out, into = layout.outgoing, layout.incoming
    sent, sent_lent = backend.gather_rows(x, out.gather)
    own = _write_meta(_byte_rows(sent), out, weights, group.rank) if out.once.any() else None
    received, received_lent, zero = _receiving(backend, x, int(into.received.sum()), placed)
    work = backend.alltoallv(
        received[:zero], sent, into.received.tolist(), out.sent.tolist(), group, async_op, calc_stream
    )

    def finish() -> Any:
        layout.expansion = read_meta(into, _byte_rows(received[:zero]), plan.to_expert_major, group.rank, own)
        rows = _received_rows(backend, received, layout.expansion.rows, placed, zero)
        backend.give_back(sent_lent, received_lent)
        return rows

    return issued(work, finish)


def _receiving(backend: Backend, like: Any, rows: int, placed: np.ndarray | None) -> tuple[Any, Any, int]:
    """Rows like ``like``'s that ``rows`` rows arrive into (lent by the workspace: returned
    beside them), followed by a row of zeros where ``placed`` is given; and where that row is."""
    received, lent = backend.scratch_rows(like, rows + (placed is not None))
    if placed is not None:
        received[rows:] = 0
    return received, lent, rows


def _received_rows(backend: Backend, received: Any, rows: np.ndarray, placed: np.ndarray | None, zero: int) -> Any:
    """The expert-major rows ``received[rows]``; or where ``placed`` is given (the static
    mode's blocks: each result row's expert-major row, or -1 for a row of zeros), those rows
    placed so, reading the zero row at ``zero`` for the rest."""
    if placed is None:
        return backend.take_rows(received, rows)
    index = np.full(placed.size, zero, dtype=np.int64)
    valid = placed >= 0
    index[valid] = rows[placed[valid]]
    return backend.take_rows(received, index)


def _write_meta(sent: np.ndarray, out: Outgoing, weights: Any, rank: int) -> np.ndarray | None:
    """Each once rank's metadata into its first rows of ``sent`` (the send buffer's bytes);
    returns this rank's own (None where it sends itself the plain form)."""
    words = None if weights is None else host_view(weights).reshape(-1)
    own = None
    for c in np.flatnonzero(out.once):
        rows = out.plain_rows(c)
        data = meta_bytes(out.positions[rows], None if words is None else words[out.row_slot[rows]])
        start = int(out.sent_at[c])
        sent[start:].reshape(-1)[: data.size] = data
        own = data if c == rank else own
    return own


def redispatch(
    backend: Backend,
    group: Group,
    x: Any,
    layout: OnceLayout,
    async_op: bool,
    calc_stream: bool,
    placed: np.ndarray | None = None,
) -> Pending:
    """A redispatch of ``x`` along ``layout``: each rank's token rows (or plain rows) again,
    without the metadata, expanded as the dispatch's were (``placed``: as :func:`dispatch`'s)."""
    out, into, expansion = layout.outgoing, layout.incoming, layout.expansion
    sent, sent_lent = backend.gather_rows(x, _without_meta(out))
    received, received_lent, zero = _receiving(backend, x, int(into.back.sum()), placed)
    work = backend.alltoallv(received[:zero], sent, into.back.tolist(), out.back.tolist(), group, async_op, calc_stream)

    def finish() -> Any:
        rows = _received_rows(backend, received, expansion.rows_again, placed, zero)
        backend.give_back(sent_lent, received_lent)
        return rows

    return issued(work, finish)


def _without_meta(out: Outgoing) -> np.ndarray:
    """The rows of x a dispatch sends, without the metadata rows."""
    keep = np.ones(out.gather.size, dtype=bool)
    for c in np.flatnonzero(out.once):
        meta = int(out.sent[c] - out.back[c])
        keep[out.sent_at[c] : out.sent_at[c] + meta] = False
    return out.gather[keep]


def combine(
    backend: Backend,
    group: Group,
    y: Any,
    layout: OnceLayout,
    weighted: bool,
    async_op: bool,
    calc_stream: bool,
) -> Pending:
    """combine's transfer of expert rows ``y`` (native, the dispatch's expert-major order):
    each token's rows summed per rank (weighted by the weights their ranks sent, where
    ``weighted``: combine's, not dispatch's backward) and sent back; finishes as the rows that
    came back (``layout.outgoing.back`` per rank), which :func:`sum_at_source` adds up."""
    out, into = layout.outgoing, layout.incoming
    summed = sum_by_target(y, layout, weighted)
    back = backend.empty_rows(summed, int(out.back.sum()))
    work = backend.alltoallv(back, summed, out.back.tolist(), into.back.tolist(), group, async_op, calc_stream)
    return issued(work, lambda: back)


def as_torch(a: Any) -> Any:
    """A host native array as a torch tensor over the same memory."""
    if description_of(a) is TORCH:
        return a
    import torch  # the sums below are torch's on every host backend

    return torch.from_numpy(np.ascontiguousarray(a))


def _flat(t: Any) -> Any:
    """A tensor's rows as a 2-D tensor (one column per element of a row)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def as_native(t: Any, like: Any) -> Any:
    """A torch result as ``like``'s library (a numpy array shares its memory)."""
    return t if description_of(like) is TORCH else t.numpy()


def sum_dtype(rows_dtype: Any, weights_dtype: Any) -> Any:
    """The torch dtype a once combine sums rows of ``rows_dtype`` in with weights of
    ``weights_dtype`` (None: unweighted, the rows' own dtype): the promoted dtype, 2-byte floats
    in float32, as every combine sums. The host form, the device form and compiled code share it."""
    import torch

    if weights_dtype is None:
        return rows_dtype
    dtype = torch.promote_types(rows_dtype, weights_dtype)
    return torch.float32 if dtype.is_floating_point and dtype.itemsize == 2 else dtype


def weights_dtype(code: int) -> Any:
    """The torch dtype of weights of ``code`` (:data:`~unicoll.backends.once.WEIGHT_DTYPES`), None for 0."""
    import torch

    return getattr(torch, WEIGHT_DTYPES[code - 1]) if code else None


def sum_by_target(y: Any, layout: OnceLayout, weighted: bool) -> Any:
    """``out[target[i]] = sum of w[i] * y[i]`` over the expert rows i of each row combine sends
    back (w: the metadata's weight, 1 for a plain rank's row or without ``weighted``), as y's
    library and dtype: one ``index_add`` unweighted, one sparse product weighted (in the
    promoted dtype, 2-byte floats in float32), each reading y once."""
    import torch

    expansion, rows = layout.expansion, int(layout.incoming.back.sum())
    ty = as_torch(y)
    flat = _flat(ty)
    if weighted and expansion.weights is not None:
        dtype = sum_dtype(ty.dtype, weights_dtype(expansion.weight_code))
        summed = torch.sparse.mm(layout.weighing(dtype), flat.to(dtype)).to(ty.dtype)
    else:
        summed = flat.new_zeros((rows, flat.shape[1])).index_add_(0, layout.torch_index("target"), flat)
    return as_native(summed.reshape(rows, *ty.shape[1:]), y)


def sum_at_source(layout: OnceLayout, back: Any, tokens: int, weights: Any) -> Any:
    """Each token's result from the rows that came back (``back``, native): the sum of its
    rows, a plain rank's weighed by the slot's weight (``weights``, native ``(T, k)``, or None)
    and a once rank's as they are (weighed there), in the promoted dtype; back's library and
    dtype. A token with no row (every slot dropped) gets zeros."""

    out = layout.outgoing
    tb = as_torch(back)
    flat = _flat(tb)
    vals = flat
    if weights is not None:
        tw = as_torch(weights)
        dtype = sum_dtype(tb.dtype, tw.dtype)
        vals = flat.to(dtype)
        column = _source_column(out, tw, dtype)
        if column is not None:
            vals = vals * column[:, None]
    summed = vals.new_zeros((tokens, flat.shape[1])).index_add_(0, layout.torch_index("row_token"), vals)
    return as_native(summed.to(tb.dtype).reshape(tokens, *tb.shape[1:]), back)


def _source_column(out: Outgoing, weights: Any, dtype: Any) -> Any:
    """The weight of each row that comes back, as the source applies it (``weights``: torch
    ``(T, k)``): a plain rank's row its slot's weight, a once rank's 1 (weighed there); None
    where every row is a once rank's."""
    import torch

    plain = out.weighed_here[out.row_lead]
    if not plain.any():
        return None
    column = torch.ones(plain.size, dtype=dtype)
    leads = torch.from_numpy(out.row_lead[plain])
    column[torch.from_numpy(np.flatnonzero(plain))] = weights.reshape(-1).index_select(0, leads).to(dtype)
    return column


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
    forward call). Two transfers, on every rank alike: each row's gradient (its token's, times
    the slot's weight where the source weighed it) to the expert ranks, where each expert row's
    gradient is its token's times its metadata weight; then, for the slots a once rank weighed,
    ``<token's gradient, expert row>`` back to their source."""
    import torch

    out, into, expansion = layout.outgoing, layout.incoming, layout.expansion
    tg = as_torch(grad)
    flat = _flat(tg)
    rows = flat.index_select(0, layout.torch_index("row_token"))
    column = None if weights is None else _source_column(out, as_torch(weights), rows.dtype)
    if column is not None:
        rows = rows * column[:, None]
    sent = as_native(rows, grad)
    there = backend.empty_rows(sent, int(into.back.sum()))
    backend.alltoallv(there, sent, into.back.tolist(), out.back.tolist(), group, False, True)
    per_row = _flat(as_torch(there)).index_select(0, layout.torch_index("target"))
    ty = _flat(as_torch(y))
    remote = _remote_weight_grads(backend, group, layout, per_row, ty, y)
    if expansion.weights is not None:
        per_row = per_row.mul_(torch.from_numpy(expansion.weights).to(per_row.dtype)[:, None])
    grad_y = as_native(per_row.to(ty.dtype).reshape(as_torch(y).shape), y)
    if weights is None:
        return grad_y, None
    grad_w = torch.zeros(tokens * topk, dtype=torch.float64)
    here = np.flatnonzero(out.weighed_here[out.row_lead])
    if here.size:
        leads = torch.from_numpy(out.row_lead[here])
        mine = _flat(as_torch(back)).index_select(0, torch.from_numpy(here))
        grad_w[leads] = (mine * flat.index_select(0, leads // topk)).sum(1).to(torch.float64)
    at = 0
    for c in np.flatnonzero(out.once):  # in rank order, as they came
        rows_of_c = torch.from_numpy(out.row_slot[out.plain_rows(c)])
        grad_w[rows_of_c] = torch.from_numpy(remote[at : at + rows_of_c.numel()])
        at += rows_of_c.numel()
    shaped = grad_w.reshape(tokens, topk).to(as_torch(weights).dtype)
    return grad_y, as_native(shaped, weights)


def _remote_weight_grads(
    backend: Backend, group: Group, layout: OnceLayout, per_row: Any, rows: Any, like: Any
) -> np.ndarray:
    """The weights' gradients of the slots this rank's once ranks weighed, as they come back:
    per once rank in rank order, its slots in send order (nothing where this rank sent no
    weights). Each is ``<token's gradient, expert row>``, computed where the rows are
    (``per_row``: each expert row's token gradient, ``rows``: the expert rows, both torch and
    flat; ``like``: a native array of the backend); every rank takes part, sending and
    receiving nothing where no weights travelled."""
    out, into, expansion = layout.outgoing, layout.incoming, layout.expansion
    weighted_from = into.once & (into.weight_code > 0)
    sends = np.where(weighted_from, into.slots, 0)
    receives = np.where(out.once, out.slots, 0) if layout.weighted else np.zeros_like(out.slots)
    parts = []
    if weighted_from.any():
        dots = (per_row * rows.to(per_row.dtype)).sum(1).double().numpy()
        in_rank_order = dots if expansion.to_expert_major is None else np.empty_like(dots)
        if expansion.to_expert_major is not None:
            in_rank_order[expansion.to_expert_major] = dots
        firsts = bounds(into.slots)
        parts = [in_rank_order[firsts[c] : firsts[c + 1]] for c in np.flatnonzero(weighted_from)]
    sent = np.concatenate(parts) if parts else np.zeros(0)
    sent_native = host_as(sent.reshape(-1, 1), like)
    got = host_as(np.empty((int(receives.sum()), 1)), like)
    backend.alltoallv(got, sent_native, receives.tolist(), sends.tolist(), group, False, True)
    return host_view(got).reshape(-1)
