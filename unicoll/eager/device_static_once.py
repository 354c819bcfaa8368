"""The static-shape mode's eager calls on a device backend (torch tensors) with each token sent
once per destination rank: :mod:`unicoll.once_blocks`'s layout and sums around the backend's
even all-to-alls, and the backward passes written out, so that every rank runs the same
transfers in its backward pass whatever its own arguments were (a rank without weights still
sends its peers their weights' gradients). Nothing is read to the host.
"""

from __future__ import annotations

import torch

from ..backends.base import Backend, Pending
from ..backends.blocks import StaticLayout
from ..group import Group
from ..once_blocks import BlocksOnce, Laid, Sent, row_bytes, sum_dtype, summed_at_source, told_apart


def dispatch(
    backend: Backend,
    group: Group,
    x: torch.Tensor,
    layout: StaticLayout,
    bound: int,
    async_op: bool,
    calc_stream: bool,
) -> Pending:
    """A static dispatch of ``x`` by ``layout`` with at most ``bound`` tokens per rank: the rows
    and the ints (the blocks' counts and the rows' slots) in two even all-to-alls. Finishes as
    ``(blocks, counts, once)``: the blocks ``(E, W * C, ...)``, the ``W * (1 + 2E)`` counts every
    rank told this one, and what the handle keeps."""
    world = group.world_size
    experts, capacity = layout.blocks(world)
    sent = Sent.of(layout, world, bound)
    rows = backend.even_alltoall(sent.rows(x), group, async_op, calc_stream)
    ints = backend.even_alltoall(sent.told(layout), group, async_op, calc_stream)

    def finish() -> tuple[torch.Tensor, torch.Tensor, BlocksOnce]:
        counts, slots = told_apart(ints.finish(), world, experts, sent.slots.shape[1])
        laid = Laid.of(slots, world, experts, capacity)
        blocks = laid.expanded(rows.finish(), (experts, world * capacity))
        return blocks, counts, BlocksOnce(sent, laid, row_bytes(x))

    return Pending(rows.works + ints.works, finish)


def redispatch(
    backend: Backend, group: Group, x: torch.Tensor, once: BlocksOnce, blocks: tuple[int, int], async_op: bool,
    calc_stream: bool,
) -> Pending:  # fmt: skip
    """A static redispatch of ``x`` along ``once``; finishes as ``(blocks, None)``
    (``blocks``: E and W * C)."""
    rows = backend.even_alltoall(once.sent.rows(x), group, async_op, calc_stream)
    return Pending(rows.works, lambda: (once.laid.expanded(rows.finish(), blocks), None))


def dispatch_backward(backend: Backend, group: Group, grad: torch.Tensor, once: BlocksOnce) -> torch.Tensor:
    """dispatch's (and redispatch's) backward: each received row's gradient, the sum of its
    block rows', sent back and summed per token (a combine without weights)."""
    back = backend.even_alltoall(once.laid.summed(grad, None), group, False, True).finish()
    return summed_at_source(back, once.sent)


class Combined:
    """A combine's transfers and what its backward needs: the block rows' weights (float64)."""

    def __init__(self, backend: Backend, group: Group, once: BlocksOnce) -> None:
        self.backend, self.group, self.once = backend, group, once
        self.weights: torch.Tensor | None = None

    def issue(self, y: torch.Tensor, weights: torch.Tensor | None, async_op: bool, calc_stream: bool) -> Pending:
        """Each slot's weight (1 without ``weights``) to its expert rank, each received row's
        block rows of ``y`` weighed and summed there, and those rows sent back; finishes as the
        rows that came back (:func:`~unicoll.once_blocks.summed_at_source` adds them up)."""
        there = self.backend.even_alltoall(self.once.sent.weights(weights), self.group, False, True).finish()
        self.weights = self.once.laid.weights(there)
        summed = self.once.laid.summed(y, self.weights)
        return self.backend.even_alltoall(summed, self.group, async_op, calc_stream)

    def backward(
        self, grad: torch.Tensor, y: torch.Tensor, weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The gradients of the expert blocks ``y`` and the caller's ``weights`` (or None) from
        the gradient of combine's result: each token's gradient once to each of its ranks,
        where a block row's is it times the row's weight and its weight's is their dot
        product, summed over the received row's slots and sent back (every rank takes part)."""
        sent, laid = self.once.sent, self.once.laid
        there = self.backend.even_alltoall(sent.rows(grad), self.group, False, True).finish()
        blocks = laid.expanded(there, y.shape[:2])
        dtype = sum_dtype(y.dtype)
        flat, ys = blocks.reshape(laid.slots.shape[0], -1).to(dtype), y.reshape(laid.slots.shape[0], -1).to(dtype)
        grad_y = (flat * self.weights.to(dtype)[:, None]).to(y.dtype).reshape(y.shape)
        dots = (flat * ys).sum(1).to(torch.float64)
        per_slot = dots.new_zeros(laid.rows * laid.k + 1).index_add(0, laid.slots, dots)[:-1]
        back = self.backend.even_alltoall(per_slot.reshape(laid.rows, laid.k), self.group, False, True).finish()
        if weights is None:
            return grad_y, None
        back = torch.where(sent.slots >= 0, back, torch.zeros_like(back))
        grad_w = back.new_zeros((sent.tokens + 1, back.shape[1])).index_add(0, sent.token, back)[:-1]
        return grad_y, grad_w.to(weights.dtype)
