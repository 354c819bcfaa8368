"""The static-shape MoE step of a whole world on one process: every rank's layout
(:mod:`unicoll.static_layout`), the even all-to-alls simulated by slicing. In torch it is
differentiable, so it gives the gradients a spawned world must match."""

from __future__ import annotations

from unicoll.static_layout import counts_grid, expert_major, send_rows, source_major, static_layout, sum_slots


def world_dispatch(xp, xs, ids, experts_per_rank: int, capacity: int):
    """Every rank's layout, send buffer and counts, and what each rank receives from the even
    all-to-all (block r of every rank's buffer, in rank order)."""
    world = len(xs)
    layouts = [static_layout(xp, i, world * experts_per_rank, capacity) for i in ids]
    sent = [send_rows(xp, x, lay) for x, lay in zip(xs, layouts)]
    block = experts_per_rank * capacity
    rows, counts, demand = [], [], []
    for r in range(world):
        received = xp.concat([s[r * block : (r + 1) * block] for s in sent], axis=0)
        rows.append(expert_major(xp, received, world, experts_per_rank))
        got = xp.concat([lay.sent[r * experts_per_rank : (r + 1) * experts_per_rank] for lay in layouts])
        wanted = xp.concat([lay.demand[r * experts_per_rank : (r + 1) * experts_per_rank] for lay in layouts])
        counts.append(counts_grid(xp, got, world, experts_per_rank))
        demand.append(counts_grid(xp, wanted, world, experts_per_rank))
    return layouts, rows, counts, demand


def world_combine(xp, ys, layouts, weights, experts_per_rank: int, capacity: int):
    """Every rank's combine: each rank's blocks sent back by slicing, then its slots summed."""
    world = len(ys)
    block = experts_per_rank * capacity
    back_to = [source_major(xp, y, world, experts_per_rank) for y in ys]
    outs = []
    for c in range(world):
        back = xp.concat([b[c * block : (c + 1) * block] for b in back_to], axis=0)
        outs.append(sum_slots(xp, back, layouts[c], None if weights is None else weights[c]))
    return outs
