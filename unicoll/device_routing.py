"""The routing of a top-k dispatch computed where the router's ids are (a GPU, or the host),
with array-API operations only, so torch and cupy (and numpy, and torch.compile's tracing)
share one code path and nothing is read to the host.

:func:`order_slots` is what both MoE modes start from: each slot's expert, the slots sorted
by expert and then slot number (a stable sort), where each expert's slots start, how many
each expert was given and how many the capacity keeps. The static-shape layout
(:mod:`unicoll.static_layout`) places them in fixed blocks; :func:`device_routing` places them
as the dynamic ``moe.dispatch`` does (:mod:`unicoll.routing`'s layout, the same rows in the
same order), and :func:`expert_major_orders` gives the reorders of what arrives, from the
received counts on the device. Counts are cumulative sums and ``searchsorted`` over sorted
keys, never ``bincount``, ``nonzero``, a boolean mask or a ``repeat`` without its size: each
of those reads the device on the host.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

from .arrays import place


class SlotOrder(NamedTuple):
    """A top-k routing's slots sorted by expert, as arrays of topk_idx's library and device.

    ``ids[s]``: slot s's expert id (the index dtype); ``routed[s]``: whether it names a global
    expert (not -1, not outside ``0 .. experts - 1``); ``order``: the slots by expert, then by
    slot number, unrouted slots last; ``starts[i]``: where expert i's slots start in ``order``
    (``experts + 1`` of them); ``demand[i]``: the slots routed to expert i; ``sent[i]``: those
    the capacity keeps (``min(demand, capacity)``); ``place[s]``: slot s's place among its
    expert's slots; ``kept[s]``: whether slot s is sent.
    """

    ids: Any
    routed: Any
    order: Any
    starts: Any
    demand: Any
    sent: Any
    place: Any
    kept: Any


def index_dtype(xp: Any) -> Any:
    """int64, the routing's index dtype; for JAX the int it gives for int64 (int32 unless
    ``jax_enable_x64`` is set), asked without the warning that an int64 it truncates gives."""
    if getattr(xp, "__name__", "") == "jax.numpy":
        return sys.modules["jax"].dtypes.canonicalize_dtype(xp.int64)
    return xp.int64


def order_slots(xp: Any, topk_idx: Any, experts: int, capacity: int | None) -> SlotOrder:
    """The :class:`SlotOrder` of ``topk_idx`` (a ``(T, k)`` int array) for ``experts`` global
    experts, at most ``capacity`` slots kept per expert (None: every routed slot). ``xp``:
    topk_idx's array namespace (array-api-compat's).

    >>> import array_api_compat.numpy as xp, numpy as np
    >>> s = order_slots(xp, np.array([[1, 0], [1, -1], [0, 1]]), 2, 2)
    >>> s.order.tolist(), s.demand.tolist(), s.sent.tolist(), s.place.tolist()
    ([1, 4, 0, 2, 5, 3], [2, 3], [2, 2], [0, 0, 1, 0, 1, 2])
    """
    tokens, k = topk_idx.shape
    slots, where, index = tokens * k, place(topk_idx), index_dtype(xp)
    ids = xp.astype(xp.reshape(topk_idx, (slots,)), index)
    routed = (ids >= 0) & (ids < experts)
    key = xp.where(routed, ids, xp.full_like(ids, experts))  # unrouted ids sort last, in a bucket of their own
    order = xp.argsort(_narrow(xp, key, experts), stable=True)  # by expert, then by slot
    sorted_key = _at(key, order)
    starts = xp.searchsorted(sorted_key, xp.arange(experts + 1, dtype=index, device=where))
    demand = starts[1:] - starts[:-1]
    sent = demand if capacity is None else xp.clip(demand, max=capacity)
    in_sorted = xp.arange(slots, dtype=index, device=where) - _at(starts, sorted_key)
    slot_place = _at(in_sorted, xp.argsort(_narrow(xp, order, slots - 1), stable=True))  # in slot order
    kept = routed if capacity is None else routed & (slot_place < capacity)
    return SlotOrder(ids, routed, order, starts, demand, sent, slot_place, kept)


def _at(values: Any, index: Any) -> Any:
    """The elements of 1-D ``values`` at the int array ``index`` (every index in range): one
    gather, which an array library runs on the arrays' device (array-api-compat's ``take``
    adds a pass over the indices for negative ones, which never occur here)."""
    return values[index]


def _narrow(xp: Any, values: Any, largest: int) -> Any:
    """Int values from 0 to ``largest`` as int16 where they fit, which sort two to three times
    faster (numpy sorts 16-bit keys by radix); else as they are."""
    return xp.astype(values, xp.int16) if largest <= 2**15 - 1 else values


FAULTS = 4
"""The ints :class:`DeviceRouting` keeps about its ids' range: the lowest and highest id, and
the slot of each (0 without slots)."""


class DeviceRouting(NamedTuple):
    """Where each slot's row goes in a dynamic dispatch, as arrays on topk_idx's device (the
    layout of :func:`unicoll.routing.route`, before anything is read to the host).

    ``local_count[i]``: rows sent to global expert i. ``send_tokens[n]``: the token of the n-th
    row sent, for n below the rows sent (``sum(local_count)``), padding after them (one entry
    per slot: the size is known before the count is read). ``slot_rows[s]``: slot s's row among
    the rows sent, or the number of rows sent for a dropped slot. ``faults``: :data:`FAULTS`
    ints (see there), which the counts' exchange carries so every rank learns of ids out of
    range without a read of its own.
    """

    local_count: Any
    send_tokens: Any
    slot_rows: Any
    faults: Any


def device_routing(xp: Any, topk_idx: Any, experts: int, capacity: int | None) -> DeviceRouting:
    """The :class:`DeviceRouting` of ``topk_idx`` (a ``(T, k)`` int array, not yet checked
    against the experts: an id outside ``-1 .. experts - 1`` is dropped here and reported by
    ``faults``) for ``experts`` global experts and ``capacity`` (None: no limit).

    >>> import array_api_compat.numpy as xp, numpy as np
    >>> r = device_routing(xp, np.array([[1, 0], [1, -1], [0, 1]]), 2, None)
    >>> r.local_count.tolist(), r.send_tokens.tolist()[:5], r.slot_rows.tolist()
    ([2, 3], [0, 2, 0, 1, 2], [2, 0, 3, 5, 1, 4])
    >>> device_routing(xp, np.array([[1, 0], [1, -1], [0, 1]]), 2, 1).slot_rows.tolist()
    [1, 0, 2, 2, 2, 2]
    """
    tokens, k = topk_idx.shape
    s = order_slots(xp, topk_idx, experts, capacity)
    slots, where, index = tokens * k, place(topk_idx), index_dtype(xp)
    ends = xp.cumulative_sum(s.sent)  # where each expert's rows end among the rows sent
    firsts = ends - s.sent
    total = ends[-1]
    expert = xp.where(s.routed, s.ids, xp.zeros_like(s.ids))
    slot_rows = xp.where(s.kept, _at(firsts, expert) + s.place, xp.broadcast_to(total, s.ids.shape))
    row = xp.arange(slots, dtype=index, device=where)  # the n-th row sent is the n-th kept slot by expert
    of = xp.clip(xp.searchsorted(ends, row, side="right"), max=max(experts - 1, 0))
    at = xp.clip(_at(s.starts, of) + row - _at(firsts, of), min=0, max=max(slots - 1, 0))
    send_tokens = _at(s.order, at) // k
    return DeviceRouting(s.sent, send_tokens, slot_rows, _faults(xp, s.ids))


def _faults(xp: Any, ids: Any) -> Any:
    """The lowest and highest id and the slot of each (zeros without slots), as :data:`FAULTS` ints."""
    if ids.shape[0] == 0:
        return xp.zeros((FAULTS,), dtype=ids.dtype, device=place(ids))
    ends = [xp.min(ids), xp.max(ids), xp.argmin(ids), xp.argmax(ids)]
    return xp.stack([xp.astype(end, ids.dtype) for end in ends])


def expert_major_orders(xp: Any, received: Any, rows: int) -> tuple[Any, Any]:
    """The reorders of ``rows`` received rows, from the counts received (``received``:
    ``(W, E)`` on the rows' device, ``[c, e]`` rows from rank c for local expert e): indices
    that take the rank-major rows to expert-major order, and back. Each is one gather of the
    rows (:func:`unicoll.backends.layout.rank_major_to_expert_major` on the host).

    >>> import array_api_compat.numpy as xp, numpy as np
    >>> [o.tolist() for o in expert_major_orders(xp, np.array([[1, 2], [1, 0]]), 4)]
    [[0, 3, 1, 2], [0, 2, 3, 1]]
    """
    rank_major = xp.reshape(received, (-1,))
    expert_major = xp.reshape(xp.permute_dims(received, (1, 0)), (-1,))
    starts = xp.cumulative_sum(rank_major) - rank_major
    starts_em = xp.reshape(xp.permute_dims(xp.reshape(starts, received.shape), (1, 0)), (-1,))
    to_expert_major = _segments(xp, expert_major, starts_em, rows)
    world, experts = received.shape
    moved = xp.reshape(xp.permute_dims(xp.reshape(xp.arange(world * experts, device=place(received)),
                                                  (experts, world)), (1, 0)), (-1,))  # fmt: skip
    starts_rm = _at(xp.cumulative_sum(expert_major) - expert_major, moved)
    return to_expert_major, _segments(xp, rank_major, starts_rm, rows)


def _segments(xp: Any, lengths: Any, sources: Any, rows: int) -> Any:
    """For each of ``rows`` output rows laid out as consecutive segments of ``lengths``, the
    input row it comes from: segment i's rows come from ``sources[i]`` on."""
    ends = xp.cumulative_sum(lengths)
    row = xp.arange(rows, dtype=ends.dtype, device=place(lengths))
    segment = xp.clip(xp.searchsorted(ends, row, side="right"), max=max(lengths.shape[0] - 1, 0))
    return row - _at(ends - lengths, segment) + _at(sources, segment)
