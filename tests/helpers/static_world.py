"""The static-shape MoE step of a whole world on one process: every rank's half of the step
before its exchange (:mod:`unicoll.static_layout`, as every caller runs it), the even
all-to-alls simulated by slicing, then every rank's half after it. In torch it is
differentiable, so it gives the gradients a spawned world must match."""

from __future__ import annotations

from unicoll.backends.blocks import slot_index, slots_of, source_major, weighted_sum, with_zero_row
from unicoll.static_layout import dispatch_arrived, dispatch_outgoing


def _even_exchange(xp, sent: list) -> list:
    """What each rank receives from an even all-to-all of every rank's ``sent``: block r of
    every rank's array, in rank order."""
    world = len(sent)
    block = sent[0].shape[0] // world
    return [xp.concat([s[r * block : (r + 1) * block] for s in sent], axis=0) for r in range(world)]


def world_dispatch(xp, xs, ids, experts_per_rank: int, capacity: int):
    """Every rank's layout and what it receives: its blocks of rows, each block's valid rows and
    each block's slots before the capacity."""
    world = len(xs)
    outgoing = [dispatch_outgoing(xp, x, i, world, experts_per_rank, capacity) for x, i in zip(xs, ids)]
    rows = _even_exchange(xp, [o.rows for o in outgoing])
    counts = _even_exchange(xp, [o.counts for o in outgoing])
    arrived = [dispatch_arrived(xp, r, c, world, experts_per_rank) for r, c in zip(rows, counts)]
    layouts = [o.layout for o in outgoing]
    return layouts, [a.rows for a in arrived], [a.counts for a in arrived], [a.received_before_drop for a in arrived]


def world_combine(xp, ys, layouts, weights, experts_per_rank: int, capacity: int):
    """Every rank's combine: each rank's blocks sent back by slicing, then its slots summed."""
    world = len(ys)
    back = _even_exchange(xp, [source_major(xp, y, world, experts_per_rank) for y in ys])
    slots = [slots_of(xp, with_zero_row(xp, b), slot_index(xp, layouts[c], b.shape[0])) for c, b in enumerate(back)]
    return [weighted_sum(xp, s, layouts[c].kept, None if weights is None else weights[c]) for c, s in enumerate(slots)]
