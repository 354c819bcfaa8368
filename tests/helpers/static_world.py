"""The static-shape MoE step of a whole world on one process: every rank's half of the step
before its exchange (:mod:`unicoll.static_layout`, as every caller runs it), the even
all-to-alls simulated by slicing, then every rank's half after it. In torch it is
differentiable, so it gives the gradients a spawned world must match."""

from __future__ import annotations

from unicoll.backends.blocks import counts_heard, slot_index, slots_of, source_major, weighted_sum, with_zero_row
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


def world_once(xs, ids, weights, experts_per_rank: int, capacity: int, bound: int):
    """Every rank's static step with each token sent once per rank (:mod:`unicoll.once_blocks`,
    torch), the even all-to-alls simulated by slicing: each rank's blocks, counts and the
    combine of ``2 * blocks + 1`` (padding rows never read) weighed by ``weights`` (a list with
    None for an unweighted rank), and what each rank sent."""
    import array_api_compat.torch as xpt

    from unicoll import once_blocks
    from unicoll.static_layout import static_layout

    world = len(xs)
    layouts = [static_layout(xpt, i, world * experts_per_rank, capacity) for i in ids]
    sent = [once_blocks.Sent.of(layout, world, bound) for layout in layouts]
    received = _even_exchange(xpt, [s.rows(x) for s, x in zip(sent, xs)])
    told = _even_exchange(xpt, [s.told(layout) for s, layout in zip(sent, layouts)])
    k = ids[0].shape[1]
    apart = [once_blocks.told_apart(t, world, experts_per_rank, k) for t in told]
    counts = [counts_heard(xpt, c, world, experts_per_rank)[1] for c, _ in apart]
    laid = [once_blocks.Laid.of(s, world, experts_per_rank, capacity) for _, s in apart]
    blocks = [lay.expanded(r, (experts_per_rank, world * capacity)) for lay, r in zip(laid, received)]
    there = _even_exchange(xpt, [s.weights(w) for s, w in zip(sent, weights)])
    ys = [2 * b + 1 for b in blocks]
    summed = [lay.summed(y, lay.weights(t)) for lay, y, t in zip(laid, ys, there)]
    back = _even_exchange(xpt, summed)
    outs = [once_blocks.summed_at_source(b, s) for b, s in zip(back, sent)]
    return blocks, counts, outs, sent
