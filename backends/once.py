"""Each token sent once per destination rank: the layout of a top-k dispatch whose rows to a
rank travel once per token, on the host.

A plain top-k dispatch sends one row per kept slot, so a token whose slots go to several
experts of one rank crosses to that rank several times, and combine brings as many rows back.
Under this layout, for each destination rank c the sender picks one of two forms:

- **once**: ``meta`` rows of metadata, then one row per token that has a kept slot on c, in
  token order. The metadata is, for each row c would have received in the plain form (its
  send order: by expert, then slot), an ``int32`` position among those token rows, followed by
  the slot's weight in the weights' own dtype where dispatch is weighted. The rank expands
  the token rows into the plain form's rows with one gather, and combine sums the weighted
  outputs of a token's local experts there, so one row per token comes back.
- **plain**: the rows of the plain dispatch, unchanged (no metadata).

A pair of ranks uses the once form where it moves fewer rows (``meta + tokens < slots``): the
sender decides from its own routing and tells the receiver with the counts, so the two ranks
of a pair always agree, and nothing else need be agreed. Rows of zero bytes and top-1 routing
always go plain. A rank's rows to itself take the same form (it makes the per-rank sums
smaller there too), and it reads its own metadata from what it wrote, not from the transfer.

:func:`outgoing` is the sender's side, :func:`incoming` the receiver's (from what each rank
told it), :func:`read_meta` reads the metadata that arrived.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WEIGHT_DTYPES = ("float16", "bfloat16", "float32", "float64")
"""The weights' dtypes the metadata carries; a rank tells each peer ``1 + index`` of its
weights' dtype, or 0 for an unweighted dispatch."""

WEIGHT_BYTES = (2, 2, 4, 8)
"""The bytes of one weight of each of :data:`WEIGHT_DTYPES`."""

PLAIN = -1
"""What a rank tells a peer in place of its token count where the pair uses the plain form."""

_SEEN_TABLE_LIMIT = 1 << 24
"""The most (rank, token) pairs :func:`_group_rows` marks in a table; above, it sorts."""


def bounds(counts: np.ndarray) -> np.ndarray:
    """Where each of consecutive runs of ``counts`` starts, then where the last one ends.

    >>> bounds(np.array([2, 0, 3])).tolist()
    [0, 2, 2, 5]
    """
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])


def meta_rows(slots: int, weight_code: int, row_bytes: int) -> int:
    """The rows of metadata for ``slots`` slots: an int32 and a weight each (:data:`WEIGHT_BYTES`
    of ``weight_code``, none for 0), in rows of ``row_bytes``."""
    per_slot = 4 + (WEIGHT_BYTES[weight_code - 1] if weight_code else 0)
    return -(-slots * per_slot // row_bytes)


@dataclass(frozen=True, eq=False)
class Outgoing:
    """What this rank sends each rank, and where each of its slots finds its row when combine
    brings the rows back.

    ``once[c]``: whether rank c gets the once form. ``slots[c]``: the rows the plain form sends
    c. ``sent[c]``: the rows this rank sends c (metadata and token rows, or the plain rows).
    ``gather``: the row of x of each row sent, in the order sent (metadata rows read row 0,
    then are overwritten). ``sent_at[c]``: where c's rows start in the send buffer (its
    metadata first, for a once rank). ``positions``: each plain row's position among its rank's token
    rows (send order, int32), and ``row_slot``: the slot of each plain row (send order), from
    which the metadata is written. ``back[c]``: the rows combine brings back from c (its token
    rows, or its plain rows). ``row_lead``: the slot each of those rows stands for (a plain
    rank's: its own; a once rank's: the token's first slot there, that rank having summed the
    token's slots on it), whose token is ``row_lead // topk``. ``weighed_here[s]``: whether the source weighs slot s
    itself (a plain rank's kept slot); a once rank weighed it already.
    """

    once: np.ndarray
    slots: np.ndarray
    sent: np.ndarray
    gather: np.ndarray
    sent_at: np.ndarray
    positions: np.ndarray
    row_slot: np.ndarray
    back: np.ndarray
    row_lead: np.ndarray
    weighed_here: np.ndarray
    topk: int

    def plain_rows(self, rank: int) -> slice:
        """The plain form's rows for ``rank`` among all of them (send order): where ``positions``
        and ``row_slot`` hold that rank's."""
        start = int(self.slots[:rank].sum())
        return slice(start, start + int(self.slots[rank]))

    @property
    def tokens_told(self) -> np.ndarray:
        """What this rank tells each rank of the form it gets: its token rows, or :data:`PLAIN`."""
        return np.where(self.once, self.back, PLAIN)

    def bytes_sent(self, rank: int, row_bytes: int) -> tuple[int, int]:
        """The bytes this rank's dispatch sends the other ranks, and what one row per slot would."""
        others = np.arange(self.sent.size) != rank
        return int(self.sent[others].sum()) * row_bytes, int(self.slots[others].sum()) * row_bytes


def _group_rows(
    rank_of_row: np.ndarray, token_of_row: np.ndarray, world: int, tokens: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For rows sent (each to ``rank_of_row``, of ``token_of_row``): each row's group (the
    (rank, token) pairs, numbered in (rank, token) order), and each group's rank and token. A
    table of every pair marks them where it is small enough, else a sort finds them."""
    key = rank_of_row * tokens + token_of_row
    if world * tokens <= _SEEN_TABLE_LIMIT:
        seen = np.zeros(world * tokens, dtype=bool)
        seen[key] = True
        number = np.cumsum(seen, dtype=np.int64) - 1
        pairs = np.flatnonzero(seen)
        group = number[key]
    else:
        pairs, group = np.unique(key, return_inverse=True)
        group = group.reshape(-1)
    width = max(tokens, 1)
    return group, pairs // width, pairs % width


def outgoing(
    send_tokens: np.ndarray,
    slot_rows: np.ndarray,
    local_count: np.ndarray,
    rank: int,
    world: int,
    topk: int,
    weight_code: int,
    row_bytes: int,
    may_send_once: bool = True,
) -> Outgoing:
    """The sender's layout of a routing (:class:`~unicoll.backends.layout.Routing`'s
    ``send_tokens``, ``slot_rows`` and ``local_count``, on the host) of rank ``rank`` of
    ``world``, for rows of ``row_bytes`` and weights of ``weight_code`` (:data:`WEIGHT_DTYPES`;
    0 unweighted); every rank gets the plain form where ``may_send_once`` is False (what a rank
    told its peers when it did not weigh the once form).

    >>> # rank 0 of two, two experts each: tokens 0 and 1 both go to experts 2 and 3, on rank 1
    >>> out = outgoing(np.array([0, 1, 0, 1]), np.array([0, 2, 1, 3]), np.array([0, 0, 2, 2]), 0, 2, 2, 0, 64)
    >>> out.once.tolist(), out.sent.tolist(), out.gather.tolist(), out.positions.tolist()
    ([False, True], [0, 3], [0, 0, 1], [0, 1, 0, 1])
    >>> out.back.tolist(), out.row_lead.tolist()   # one row per token comes back, for its first slot
    ([0, 2], [0, 2])
    """
    tokens = slot_rows.size // topk
    slots = local_count.reshape(world, -1).sum(1)
    firsts = bounds(slots)
    rank_of_row = np.repeat(np.arange(world, dtype=np.int64), slots)
    group, group_rank, group_token = _group_rows(rank_of_row, send_tokens, world, tokens)
    per_rank_tokens = np.bincount(group_rank, minlength=world)
    group_first = bounds(per_rank_tokens)
    meta = np.array([meta_rows(int(n), weight_code, row_bytes) if row_bytes else 0 for n in slots], dtype=np.int64)
    once = (
        (meta + per_rank_tokens < slots) if (may_send_once and topk > 1 and row_bytes) else np.zeros(world, dtype=bool)
    )
    sent = np.where(once, meta + per_rank_tokens, slots)
    sent_first = bounds(sent)
    gather = np.zeros(int(sent.sum()), dtype=np.int64)
    for c in range(world):
        at = int(sent_first[c])
        if once[c]:
            gather[at + meta[c] : at + sent[c]] = group_token[group_first[c] : group_first[c + 1]]
        else:
            gather[at : at + sent[c]] = send_tokens[firsts[c] : firsts[c + 1]]
    positions = (group - group_first[rank_of_row]).astype(np.int32)
    row_slot = np.empty(send_tokens.size, dtype=np.int64)
    kept = slot_rows < send_tokens.size
    row_slot[slot_rows[kept]] = np.flatnonzero(kept)
    back = np.where(once, per_rank_tokens, slots)
    back_first = bounds(back)
    within = np.where(once[rank_of_row], positions, np.arange(send_tokens.size) - firsts[rank_of_row])
    row_back = back_first[rank_of_row] + within
    first_slot = np.full(group_token.size, slot_rows.size, dtype=np.int64)
    np.minimum.at(first_slot, group, row_slot)
    leads = ~once[rank_of_row] | (first_slot[group] == row_slot)
    row_lead = np.empty(int(back.sum()), dtype=np.int64)
    row_lead[row_back[leads]] = row_slot[leads]
    weighed_here = np.zeros(slot_rows.size, dtype=bool)
    weighed_here[row_slot[~once[rank_of_row]]] = True
    return Outgoing(once, slots, sent, gather, sent_first[:-1], positions, row_slot, back, row_lead, weighed_here, topk)


@dataclass(frozen=True, eq=False)
class Incoming:
    """What this rank receives from each rank under the layout its peers chose.

    ``once[c]``, ``slots[c]`` (the plain form's rows from c), ``weight_code[c]``, ``meta[c]``
    (c's metadata rows), ``received[c]`` (the rows that arrive from c: metadata and token rows,
    or the plain rows) and ``back[c]`` (the rows combine sends c back). ``received_at[c]``:
    where c's rows start in the received buffer.
    """

    once: np.ndarray
    slots: np.ndarray
    weight_code: np.ndarray
    meta: np.ndarray
    received: np.ndarray
    back: np.ndarray
    received_at: np.ndarray


def incoming(slots: np.ndarray, told: np.ndarray, row_bytes: int) -> Incoming:
    """The receiver's side: ``slots[c]`` rows of the plain form from each rank c, and what c
    told (``told[c]``: its token rows or :data:`PLAIN`, and its weights' code)."""
    tokens, codes = told[:, 0], told[:, 1]
    once = tokens != PLAIN
    meta = np.array(
        [meta_rows(int(n), int(w), row_bytes) if o else 0 for n, w, o in zip(slots, codes, once)], dtype=np.int64
    )
    received = np.where(once, meta + tokens, slots)
    back = np.where(once, tokens, slots)
    return Incoming(once, slots, codes, meta, received, back, bounds(received)[:-1])


@dataclass(frozen=True, eq=False)
class Expansion:
    """Where the plain form's rows of this rank come from, and where combine sums them, in
    expert-major order (:func:`read_meta`).

    ``rows``: each row's row in the received buffer (of a dispatch: its metadata included).
    ``rows_again``: the same for a buffer without the metadata (a redispatch's). ``target``:
    each row's row in what combine sends back (per rank c, ``back[c]`` rows). ``weights``:
    each row's weight from its source's metadata, as float64, or None where no rank sent
    weights; rows of a plain or unweighted rank weigh 1. ``weight_code``:
    the widest weights' code among them. ``to_expert_major``: the reorder these were read with
    (rank-major rows to expert-major; None where they are the same).
    """

    rows: np.ndarray
    rows_again: np.ndarray
    target: np.ndarray
    weights: np.ndarray | None
    weight_code: int
    to_expert_major: np.ndarray | None


def read_meta(
    incoming: Incoming, received: np.ndarray, to_expert_major: np.ndarray | None, rank: int, own: np.ndarray | None
) -> Expansion:
    """The :class:`Expansion` of the rows that arrived (``received``: the buffer's bytes, a
    ``(rows, row_bytes)`` uint8 view), ``to_expert_major`` taking rank-major rows to expert-major
    (None: they are). Rank ``rank`` reads its own metadata from ``own`` (what it wrote for
    itself; None where it sent itself the plain form)."""
    world = incoming.slots.size
    rows, again, target, weights = [], [], [], []
    again_at = bounds(incoming.back)
    weighted = bool(incoming.weight_code[incoming.once].any())
    for c in range(world):
        n, at = int(incoming.slots[c]), int(incoming.received_at[c])
        if not incoming.once[c]:
            within = np.arange(n, dtype=np.int64)
            rows.append(at + within)
            again.append(again_at[c] + within)
            target.append(again_at[c] + within)
            weights.append(np.ones(n))
            continue
        meta = own if c == rank else received[at : at + incoming.meta[c]].reshape(-1)
        position = meta[: 4 * n].view(np.int32).astype(np.int64)
        rows.append(at + incoming.meta[c] + position)
        again.append(again_at[c] + position)
        target.append(again_at[c] + position)
        code = int(incoming.weight_code[c])
        if code:
            dtype = np.dtype("uint16") if WEIGHT_DTYPES[code - 1] == "bfloat16" else np.dtype(WEIGHT_DTYPES[code - 1])
            raw = meta[4 * n : 4 * n + n * dtype.itemsize].copy().view(dtype)
            weights.append(_bfloat16_as_float64(raw) if dtype == np.uint16 else raw.astype(np.float64))
        else:
            weights.append(np.ones(n))
    order = slice(None) if to_expert_major is None else to_expert_major
    rows_em = _joined(rows)[order]
    target_em = _joined(target)[order]
    codes = incoming.weight_code[incoming.once & (incoming.weight_code > 0)]
    return Expansion(
        rows_em,
        _joined(again)[order],
        target_em,
        _joined(weights, np.float64)[order] if weighted else None,
        int(codes.max()) if codes.size else 0,
        to_expert_major,
    )


def _joined(parts: list[np.ndarray], dtype: type = np.int64) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


def _bfloat16_as_float64(words: np.ndarray) -> np.ndarray:
    """bfloat16 weights (as 16-bit words) as float64, exactly."""
    return (words.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def meta_bytes(positions: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
    """The metadata of one once rank as bytes: ``positions`` (int32), then ``weights`` (host
    words of the weights' dtype, or None)."""
    parts = [positions.astype(np.int32, copy=False).view(np.uint8)]
    if weights is not None:
        parts.append(np.ascontiguousarray(weights).view(np.uint8).reshape(-1))
    return np.concatenate(parts)


def weight_code(dtype_name: str | None) -> int:
    """The code of a weights' dtype (:data:`WEIGHT_DTYPES`), 0 for None (unweighted), -1 for a
    dtype the metadata does not carry.

    >>> weight_code("float32"), weight_code(None), weight_code("int64")
    (3, 0, -1)
    """
    if dtype_name is None:
        return 0
    return 1 + WEIGHT_DTYPES.index(dtype_name) if dtype_name in WEIGHT_DTYPES else -1
