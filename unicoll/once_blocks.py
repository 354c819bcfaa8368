"""The static-shape MoE step with each token sent once per destination rank, on torch tensors,
with every shape fixed by the arguments: what a device backend's eager calls and compiled code
run where ``moe.dispatch_static`` is given ``max_tokens_per_rank`` (docs/semantics.md).

A rank's kept slots on a peer fill at most that peer's ``E * C`` block rows, and come from at
most ``max_tokens_per_rank`` tokens, so every rank sends every rank ``B = min(max_tokens_per_rank,
E * C)`` rows (:func:`rows_per_rank`): the rows of its tokens with a kept slot there, in token
order, then padding (:class:`Sent`). Beside each row travel ``k`` ints, each slot's row in the
peer's blocks (``local expert * C + place``) or -1 (with the blocks' counts, in one exchange of
ints). The receiver lays each row into the blocks of its slots with one gather
(:class:`Laid`). combine sends each slot's weight (float64: every weights dtype exactly; 1
where a rank has none) to its expert rank, weighs and sums there each token's rows into its one
row (:meth:`Laid.summed`), sends it back, and the source adds the rows of its ranks
(:func:`summed_at_source`). The sums are in y's dtype promoted with float32.

Eager calls (:mod:`unicoll.eager.device_static_once`) move the arrays with the backend and write
the backward passes out; compiled code composes the same functions around an
:data:`~unicoll.static_layout.Exchange` whose gradient is the exchange back
(:func:`dispatch_blocks`, :func:`redispatch_blocks`, :func:`combine_blocks`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import array_api_compat.torch as xpt
import torch

from .backends.blocks import StaticLayout, counts_heard, counts_told
from .static_layout import Arrived, Exchange

META_BYTES = 8
"""The bytes of one slot's int beside a row sent."""


def rows_per_rank(bound: int, experts: int, capacity: int) -> int:
    """``B``: the rows every rank sends every rank with at most ``bound`` tokens per rank."""
    return min(bound, experts * capacity)


def saves(bound: int, experts: int, capacity: int, k: int, row_bytes: int) -> bool:
    """Whether ``B`` rows of ``row_bytes`` and their slots' ints are fewer bytes per peer than
    the whole blocks' ``E * C`` rows (every rank decides alike from the arguments they share).

    >>> saves(4096, 4, 10240, 8, 4096), saves(4096, 4, 1024, 2, 4096)  # B = 4096 of 40960 rows; of 4096
    (True, False)
    """
    return rows_per_rank(bound, experts, capacity) * (row_bytes + META_BYTES * k) < experts * capacity * row_bytes


def chosen(bound: int | None, world: int, experts: int, capacity: int, x: torch.Tensor, k: int) -> bool:
    """Whether a static dispatch of ``x`` with ``k`` slots per token sends each token once per
    rank: given a ``bound`` (``max_tokens_per_rank``), over more than one rank, where that
    :func:`saves` bytes. Every input is an argument every rank shares, so all decide alike."""
    return bound is not None and world > 1 and saves(bound, experts, capacity, k, row_bytes(x))


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype this form weighs and sums rows of ``dtype`` in: promoted with float32."""
    return torch.promote_types(dtype, torch.float32)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A tensor's rows as a 2-D tensor."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def _with_zero_row(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((1, *t.shape[1:]))])


@dataclass(frozen=True, eq=False)
class Sent:
    """What a dispatch sends: ``token`` (``W * B``): the token of each row, ``T`` for padding;
    ``slots`` (``W * B, k`` int64): each slot's row in its destination's blocks, or -1 (a slot
    elsewhere, dropped, or padding); ``world`` and ``tokens`` (T)."""

    token: torch.Tensor
    slots: torch.Tensor
    world: int
    tokens: int

    @property
    def rows_per_rank(self) -> int:
        """``B``."""
        return self.token.shape[0] // self.world

    @classmethod
    def of(cls, layout: StaticLayout, world: int, bound: int) -> Sent:
        """What a dispatch by ``layout`` (torch tensors) sends with at most ``bound`` tokens per rank.

        >>> import array_api_compat.torch as xpt
        >>> from unicoll.static_layout import static_layout
        >>> s = Sent.of(static_layout(xpt, torch.tensor([[1, 0], [1, -1], [0, 1]]), 2, 2), 2, 3)
        >>> s.token.tolist(), s.slots.tolist()  # rank 0 holds expert 0, rank 1 expert 1; C = 2 drops (2, 1)
        ([0, 2, 0, 1], [[-1, 0], [1, -1], [0, -1], [1, -1]])
        """
        tokens, k = layout.kept.shape
        experts, capacity = layout.blocks(world)
        per_rank, place = rows_per_rank(bound, experts, capacity), layout.kept.device
        slot_rows = layout.slot_rows.reshape(tokens, k)
        dest = torch.div(slot_rows, max(experts * capacity, 1), rounding_mode="floor")
        ranks = torch.arange(world, device=place)
        has = (layout.kept[:, :, None] & (dest[:, :, None] == ranks)).any(1)  # (T, W)
        where = torch.where(has, ranks * per_rank + has.cumsum(0) - 1, world * per_rank)
        token = torch.full((world * per_rank + 1,), tokens, dtype=torch.int64, device=place)
        every = torch.arange(tokens, device=place).repeat_interleave(world)
        token = token.scatter(0, where.reshape(-1), every)[:-1]
        rows = token.clamp(max=max(tokens - 1, 0))
        if not tokens:
            return cls(token, torch.full((token.shape[0], k), -1, dtype=torch.int64, device=place), world, tokens)
        row_rank = torch.div(torch.arange(token.shape[0], device=place), max(per_rank, 1), rounding_mode="floor")
        mine = layout.kept[rows] & (dest[rows] == row_rank[:, None]) & (token < tokens)[:, None]
        local = slot_rows[rows] - row_rank[:, None] * (experts * capacity)
        return cls(token, torch.where(mine, local, -1), world, tokens)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The rows sent: x's row of each token (a padding row holds whatever it holds; no block
        reads it). With no tokens, zeros still joined to x, so a backward pass reaches it."""
        if not self.tokens:
            return _with_zero_row(x).index_select(0, self.token.clamp(max=0))
        return x.index_select(0, self.token.clamp(max=self.tokens - 1))

    def weights(self, weights: torch.Tensor | None) -> torch.Tensor:
        """Each row's slots' weights, as float64 (``W * B, k``): 0 where the slot is not there,
        1 for a kept slot where there are no ``weights``."""
        there = self.slots >= 0
        if weights is None:
            return there.to(torch.float64)
        per_row = _with_zero_row(weights.to(torch.float64)).index_select(0, self.token)
        return torch.where(there, per_row, torch.zeros_like(per_row))

    def told(self, layout: StaticLayout) -> torch.Tensor:
        """The ints told each rank: the blocks' counts (:func:`~unicoll.backends.blocks.counts_told`)
        then its rows' slots (``W * (1 + 2E + B * k)``)."""
        counts = counts_told(xpt, layout, self.world).reshape(self.world, -1)
        return torch.cat([counts, self.slots.reshape(self.world, -1)], 1).reshape(-1)

    def bytes_sent(self, row_bytes: int) -> int:
        """The bytes of rows (of ``row_bytes``) and ints a dispatch sends the other ranks."""
        per_rank, k = self.rows_per_rank, self.slots.shape[1]
        return (self.world - 1) * per_rank * (row_bytes + META_BYTES * k)


@dataclass(frozen=True, eq=False)
class Laid:
    """Where the rows a dispatch received go: ``slots`` (``E * W * C``), the slot among the
    ``rows * k`` slots of the rows received that fills each block row (``rows * k`` for
    padding); ``rows``: the rows received (``W * B``), ``k`` slots each."""

    slots: torch.Tensor
    rows: int
    k: int

    @classmethod
    def of(cls, slots: torch.Tensor, world: int, experts: int, capacity: int) -> Laid:
        """Where the rows go that arrived with ``slots`` (``W * B, k``: each one's slots' rows
        in this rank's blocks, or -1). A value outside the blocks (a peer that disagrees)
        fills nothing.

        >>> Laid.of(torch.tensor([[1, -1], [0, -1], [1, 0], [-1, -1]]), 2, 1, 2).slots.tolist()
        [2, 0, 5, 4]
        """
        received, k = slots.shape
        per_rank = received // world
        where = slots.device
        source = torch.div(torch.arange(received, device=where), max(per_rank, 1), rounding_mode="floor")
        expert, place = torch.div(slots, max(capacity, 1), rounding_mode="floor"), slots % max(capacity, 1)
        blocks = experts * world * capacity
        target = expert * (world * capacity) + source[:, None] * capacity + place
        target = torch.where((slots >= 0) & (slots < experts * capacity), target, blocks)
        index = torch.full((blocks + 1,), received * k, dtype=torch.int64, device=where)
        return cls(index.scatter(0, target.reshape(-1), torch.arange(received * k, device=where))[:-1], received, k)

    @property
    def row_of(self) -> torch.Tensor:
        """Each block row's received row (``rows`` for padding)."""
        return torch.div(self.slots, self.k, rounding_mode="floor")

    def expanded(self, received: torch.Tensor, blocks: tuple[int, int]) -> torch.Tensor:
        """The blocks ``(E, W * C, ...)`` (``blocks``: E and W * C) of the rows ``received``:
        zeros in the padding."""
        rows = _with_zero_row(received).index_select(0, self.row_of)
        return rows.reshape(*blocks, *received.shape[1:])

    def weights(self, received: torch.Tensor) -> torch.Tensor:
        """Each block row's weight from the received rows' slots' weights (``rows, k``), 0 for padding."""
        return _with_zero_row(received.reshape(-1)).index_select(0, self.slots)

    def summed(self, y: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        """Each received row's one row back (``rows`` of them): the sum of its block rows of
        ``y`` (``(E, W * C, ...)``) weighed by ``weights`` (:meth:`weights`, or 1), in
        :func:`sum_dtype`, as y's dtype. The padding's rows (a bias, nan) land beyond them."""
        dtype = sum_dtype(y.dtype)
        flat = _flat(y.reshape(-1, *y.shape[2:])).to(dtype)
        if weights is not None:
            flat = flat * weights.to(dtype)[:, None]
        out = flat.new_zeros((self.rows + 1, flat.shape[1])).index_add(0, self.row_of, flat)[:-1]
        return out.to(y.dtype).reshape(self.rows, *y.shape[2:])


def summed_at_source(back: torch.Tensor, sent: Sent) -> torch.Tensor:
    """Each token's result from the rows that came back: their sum in :func:`sum_dtype`, as
    back's dtype (zeros for a token with no kept slot)."""
    dtype = sum_dtype(back.dtype)
    flat = _flat(back).to(dtype)
    out = flat.new_zeros((sent.tokens + 1, flat.shape[1])).index_add(0, sent.token, flat)[:-1]
    return out.to(back.dtype).reshape(sent.tokens, *back.shape[1:])


@dataclass(frozen=True, eq=False)
class BlocksOnce:
    """What a static handle keeps of a dispatch that sent each token once per rank in fixed
    shapes: what it ``sent`` and where the rows it received were ``laid``, and the bytes of one
    dispatched row."""

    sent: Sent
    laid: Laid
    row_bytes: int

    def bytes_sent(self, rank: int) -> int:
        """The bytes of rows and ints the dispatch sent the other ranks (the same for every
        ``rank``: the shapes are fixed)."""
        return self.sent.bytes_sent(self.row_bytes)


def told_apart(ints: torch.Tensor, world: int, experts: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ints every rank told this one (:meth:`Sent.told`, rows of ``k`` slots) apart: the
    blocks' counts (``W * (1 + 2E)``) and the slots of the rows received (``W * B, k``)."""
    per_rank = ints.reshape(world, -1)
    return per_rank[:, : 1 + 2 * experts].reshape(-1), per_rank[:, 1 + 2 * experts :].reshape(-1, k)


def row_bytes(x: torch.Tensor) -> int:
    """The bytes of one row of x."""
    return x.element_size() * math.prod(x.shape[1:])


def dispatch_blocks(
    x: torch.Tensor, layout: StaticLayout, world: int, bound: int, exchange: Exchange
) -> tuple[Arrived, BlocksOnce]:
    """A static dispatch of ``x`` by ``layout`` whose rows and ints move by ``exchange``: what
    arrived, and what the handle keeps."""
    experts, capacity = layout.blocks(world)
    sent = Sent.of(layout, world, bound)
    received = exchange(sent.rows(x))
    counts, slots = told_apart(exchange(sent.told(layout)), world, experts, sent.slots.shape[1])
    _, valid, before = counts_heard(xpt, counts, world, experts)
    laid = Laid.of(slots, world, experts, capacity)
    blocks = laid.expanded(received, (experts, world * capacity))
    return Arrived(blocks, valid, before), BlocksOnce(sent, laid, row_bytes(x))


def redispatch_blocks(x: torch.Tensor, once: BlocksOnce, blocks: tuple[int, int], exchange: Exchange) -> torch.Tensor:
    """A static redispatch of ``x`` along ``once`` by ``exchange`` (``blocks``: E and W * C)."""
    return once.laid.expanded(exchange(once.sent.rows(x)), blocks)


def combine_blocks(y: torch.Tensor, once: BlocksOnce, weights: torch.Tensor | None, exchange: Exchange) -> torch.Tensor:
    """A static combine of blocks ``y`` along ``once`` by ``exchange``: the slots' weights to
    their expert ranks, each token's rows weighed and summed there, one row per rank back, summed."""
    there = exchange(once.sent.weights(weights))
    back = exchange(once.laid.summed(y, once.laid.weights(there)))
    return summed_at_source(back, once.sent)
