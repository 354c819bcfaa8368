"""Each token sent once per destination rank on a device backend (torch tensors): the layout
computed where the tokens are, the transfers, the sums on the expert ranks and on the source,
and the backward passes, with no host read beyond the dispatch's one read of its counts.

The layout is made on the device before that read (:func:`pairs`): which (token, rank) pairs
a dispatch has (a token with a kept slot on the rank), in rank-major then token order, and
each plain row's position among its rank's token rows. The counts' exchange carries each
rank's token rows per peer and its offer (:mod:`unicoll.eager.once_choice`'s columns), so the
one read tells every rank the form and every split size. Unlike the host form
(:mod:`unicoll.backends.once`), the metadata does not ride in the rows: each plain row's
``source rank * 2**40 + position`` travels as one int64 column along the plain form's own
plan (one small transfer), so every pair of ranks sends token rows, never more rows than one
row per slot, and the expansion is one gather on the receiver. combine sends each slot's
weight to its expert rank along the same plan, sums there with one ``index_add`` and sends one
row per (token, rank) back; the source adds them with another. Backward: combine's sends each
token's gradient once per rank and the weights' gradients back along the plan; dispatch's is
an unweighted combine of the gradient rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backends.base import Backend, Pending
from ..backends.layout import MoePlan
from ..group import Group
from .moe_once import sum_dtype, weights_dtype
from .once_choice import agreed_on

SOURCE = 1 << 40
"""The factor of the source rank in a plain row's metadata (``source * SOURCE + position``)."""


@dataclass(frozen=True, eq=False)
class Pairs:
    """The (token, rank) pairs of a dispatch on the device, made before its counts are read.

    ``told``: ``(W, OFFER_INTS)`` ints to tell the peers beside the counts (each peer's token
    rows, then this rank's weights' code, mode, bytes saved and bytes of one row per slot);
    ``pair_token``: the token of each pair in rank-major then token order (``W * T``: padding
    after the pairs); ``meta``: each plain row's ``rank * 2**40 + position`` and ``row_slot``:
    its slot (one per slot, padding after the rows sent)."""

    told: Any
    pair_token: Any
    meta: Any
    row_slot: Any


def pairs(torch: Any, ids: Any, slot_rows: Any, local_count: Any, rank: int, world: int, experts: int,
          row_bytes: int, code: int, mode: int) -> Pairs:  # fmt: skip
    """The :class:`Pairs` of a routing on the device (``ids``: ``(T, k)``; ``slot_rows`` and
    ``local_count``: the device routing's) for rows of ``row_bytes``, weights of ``code`` and
    this rank's ``mode`` (:func:`~unicoll.eager.once_choice.once_mode`)."""
    tokens, k = ids.shape
    where = ids.device
    total = local_count.sum()
    kept = slot_rows.reshape(tokens, k) < total
    rank_of = torch.where(kept, ids // experts, world)
    has = (rank_of.unsqueeze(2) == torch.arange(world, device=where)).any(1)  # (T, W): the pairs
    per_rank = has.sum(0)
    flat = has.T.reshape(-1).to(torch.int64)
    ends = flat.cumsum(0)
    pair_token = torch.searchsorted(ends, torch.arange(world * tokens, device=where), right=True)
    pair_token = pair_token.clamp(max=max(world * tokens - 1, 0)) % max(tokens, 1)
    position = has.to(torch.int64).cumsum(0) - has.to(torch.int64)  # (T, W): a pair's place among its rank's
    # the plain rows, by expert then slot: their token and rank, from the device routing
    row = torch.arange(tokens * k, device=where)
    row_ends = local_count.cumsum(0)
    expert = torch.searchsorted(row_ends, row, right=True).clamp(max=max(world * experts - 1, 0))
    row_slot = torch.argsort(slot_rows, stable=True)  # kept slots' rows are 0 .. sent - 1, dropped last
    token = row_slot // k
    row_rank = expert // experts
    meta = rank * SOURCE + position.reshape(-1)[(token * world + row_rank).clamp(max=max(tokens * world - 1, 0))]
    slots = local_count.reshape(world, experts).sum(1)
    others = torch.arange(world, device=where) != rank
    one_per_slot = (slots * others).sum() * row_bytes
    saved = one_per_slot - (per_rank * others).sum() * row_bytes
    columns = [per_rank, torch.full_like(per_rank, code), torch.full_like(per_rank, mode)]
    columns += [saved.expand(world), one_per_slot.expand(world)]
    told = torch.stack([c.to(torch.int64) for c in columns], 1)
    return Pairs(told, pair_token, meta, row_slot)


@dataclass(eq=False)
class DeviceOnce:
    """A handle's layout where each token went once per rank on a device backend.

    ``pair_token``: the token of each pair this rank sent (device); ``sent`` / ``received``:
    the token rows sent to and received from each rank (host ints); ``meta``: each plain row's
    metadata (device, sent by the dispatch, then let go); ``index``: each expert-major row's
    row among the token rows received (device, set when the dispatch finishes); ``row_slot``:
    the slot of each plain row sent and ``slot_rows`` each slot's plain row, or the rows sent for
    a dropped slot (device); ``plan``: the plain form's, along which the metadata, the weights
    and their gradients travel; ``row_bytes``: the bytes of a dispatched row; ``codes``: every
    rank's weights' code (:data:`~unicoll.backends.once.WEIGHT_DTYPES`, 0 unweighted): where any
    rank's dispatch was weighted, every rank's combine sends weights (1s for an unweighted one),
    so the ranks' transfers match."""

    pair_token: Any
    sent: list[int]
    received: list[int]
    meta: Any
    row_slot: Any
    slot_rows: Any
    plan: MoePlan
    row_bytes: int
    codes: list[int]
    index: Any = None

    def bytes_sent(self, rank: int) -> tuple[int, int]:
        """The bytes this rank's dispatch sent the other ranks, and what one row per slot would have."""
        sent = sum(self.sent) - self.sent[rank]
        slots = sum(self.plan.send) - self.plan.send[rank]
        return sent * self.row_bytes, slots * self.row_bytes


def made(found: Pairs, heard: np.ndarray, told: np.ndarray, plan: MoePlan, slot_rows: Any, row_bytes: int
         ) -> DeviceOnce | None:  # fmt: skip
    """The layout where the ranks agree on the form (``heard``: ``(W, OFFER_INTS)`` each rank
    told this one, ``told``: what this one told each; host), else None."""
    if not agreed_on(heard):
        return None
    sent, received, rows = told[:, 0].tolist(), heard[:, 0].tolist(), sum(plan.send)
    return DeviceOnce(found.pair_token[: sum(sent)], sent, received, found.meta[:rows], found.row_slot[:rows],
                      slot_rows, plan, row_bytes, heard[:, 1].tolist())  # fmt: skip


def _flat(rows: Any) -> Any:
    """Rows as a 2-D tensor, one column per element of a row (zero rows included)."""
    return rows.reshape(rows.shape[0], math.prod(rows.shape[1:]))


def _widest(once: DeviceOnce) -> Any:
    """The widest weights' dtype of the ranks (None where no rank's dispatch was weighted)."""
    return weights_dtype(max(once.codes))


def expansion_index(meta: Any, received: list[int]) -> Any:
    """Each expert row's row among the token rows received (``received[c]`` from rank c, in
    rank order), from the metadata that arrived with it (``meta``: ``source * SOURCE +
    position``, a tensor)."""
    import torch

    firsts = torch.as_tensor(np.concatenate([[0], np.cumsum(received)[:-1]]), device=meta.device)
    return firsts[meta // SOURCE] + meta % SOURCE


def dispatch(backend: Backend, group: Group, x: Any, once: DeviceOnce, async_op: bool, calc_stream: bool) -> Pending:
    """The rows of a dispatch of ``x`` (native) under ``once``, expert-major: the token rows to
    each rank, and each plain row's metadata along the plain form's plan; on arrival the
    expansion's index is read from the metadata and the rows taken with one gather."""
    tokens = backend.alltoall_single(
        None, backend.take_rows(x, once.pair_token), once.received, once.sent, group, async_op, calc_stream
    )
    meta = backend.global_scatter(once.meta.reshape(-1, 1), once.plan, group, async_op, calc_stream)
    once.meta = None

    def finish() -> Any:
        arrived = tokens.finish()
        once.index = expansion_index(meta.finish().reshape(-1), once.received)
        return backend.take_rows(arrived, once.index)

    return Pending(tokens.works + meta.works, finish)


def redispatch(backend: Backend, group: Group, x: Any, once: DeviceOnce, async_op: bool, calc_stream: bool) -> Pending:
    """Other rows of the same tokens along ``once``: the token rows again, expanded as the dispatch's were."""
    sent = backend.take_rows(x, once.pair_token)
    moved = backend.alltoall_single(None, sent, once.received, once.sent, group, async_op, calc_stream)
    return Pending(moved.works, lambda: backend.take_rows(moved.finish(), once.index))


@dataclass(eq=False)
class Weighed:
    """What a combine keeps for its backward: the weight of each expert row, as float64 (None
    where no weights travelled)."""

    rows: Any = None


def combine(
    backend: Backend, group: Group, y: Any, once: DeviceOnce, weights: Any, kept: Weighed | None, async_op: bool,
    calc_stream: bool,
) -> Pending:  # fmt: skip
    """combine's transfers of expert rows ``y`` (native, expert-major), weighted where ``kept``
    is given (else dispatch's backward): each slot's weight (native ``(T, k)`` ``weights``, or 1s
    without them) to its expert rank along the plan where any rank's dispatch was weighted, each
    token's rows there weighed and summed into one row per (token, rank), sent back; finishes as
    those rows (:func:`sum_at_source` adds them up). The expert rows' weights are kept in ``kept``."""
    import torch

    widest = _widest(once) if kept is not None else None
    dtype = sum_dtype(y.dtype, widest)
    flat = _flat(y).to(dtype)
    if widest is not None:
        if weights is None:
            column = torch.ones((once.row_slot.shape[0], 1), dtype=torch.float64, device=y.device)
        else:
            column = weights.reshape(-1).index_select(0, once.row_slot).to(torch.float64).reshape(-1, 1)
        kept.rows = backend.global_scatter(column, once.plan, group, False, True).finish().reshape(-1)
        flat = flat * kept.rows.to(dtype)[:, None]
    summed = flat.new_zeros((sum(once.received), flat.shape[1])).index_add_(0, once.index, flat)
    summed = summed.to(y.dtype).reshape(-1, *y.shape[1:])
    return backend.alltoall_single(None, summed, once.sent, once.received, group, async_op, calc_stream)


def sum_at_source(once: DeviceOnce, back: Any, tokens: int, weights: Any) -> Any:
    """Each token's result from the rows that came back (``back``, native): the sum of its
    rows (weighed on their ranks), in the dtype combine sums in with ``weights`` (native, or
    None), as back's dtype; zeros for a token with no row."""

    dtype = sum_dtype(back.dtype, None if weights is None else weights.dtype)
    flat = _flat(back).to(dtype)
    out = flat.new_zeros((tokens, flat.shape[1])).index_add_(0, once.pair_token, flat)
    return out.to(back.dtype).reshape(tokens, *back.shape[1:])


def combine_backward(
    backend: Backend, group: Group, grad: Any, once: DeviceOnce, y: Any, weights: Any, kept: Weighed
) -> tuple[Any, Any]:
    """The gradients of a combine's expert rows ``y`` and ``weights`` (native ``(T, k)``, or None)
    from the gradient of its result: each token's gradient once to each of its ranks, where an
    expert row's is its token's times its weight; where weights travelled, the weights'
    gradients ``<token's gradient, expert row>`` back to their source along the plan (every
    rank takes part; one whose dispatch was unweighted lets its own go). A dropped slot's is zero."""
    import torch

    pairs = grad.index_select(0, once.pair_token)
    there = backend.alltoall_single(None, pairs, once.received, once.sent, group, False, True).finish()
    rows = there.index_select(0, once.index)
    if kept.rows is None:
        return rows, None
    dtype = sum_dtype(y.dtype, _widest(once))
    flat, ys = _flat(rows).to(dtype), _flat(y).to(dtype)
    grad_y = (flat * kept.rows.to(dtype)[:, None]).to(y.dtype).reshape(y.shape)
    dots = (flat * ys).sum(1, keepdim=True).to(torch.float64)
    back = backend.global_gather(dots, once.plan, group, False, True).finish().reshape(-1)
    if weights is None:
        return grad_y, None
    with_zero = torch.cat([back, back.new_zeros(1)])  # a dropped slot's row is the rows sent: zero
    grad_w = with_zero.index_select(0, once.slot_rows).reshape(weights.shape).to(weights.dtype)
    return grad_y, grad_w


def dispatch_backward(backend: Backend, group: Group, grad: Any, once: DeviceOnce, tokens: int) -> Any:
    """dispatch's backward: the rows' gradients (native, expert-major) summed per (token, rank)
    there, sent back and summed per token (a combine without weights)."""
    back = combine(backend, group, grad, once, None, None, False, True).finish()
    return sum_at_source(once, back, tokens, None)
