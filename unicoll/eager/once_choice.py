"""Whether a host backend's top-k dispatch sends each token once per destination rank
(:mod:`unicoll.backends.once`): what each rank offers its peers with its counts, and the form
the ranks then agree on. Both MoE modes decide this way: the dynamic one beside its counts,
the static-shape one beside its blocks' counts.

Each rank tells each peer, in :data:`OFFER_INTS` ints beside its counts, the token rows it
would send it in the once form (or :data:`~unicoll.backends.once.PLAIN`), its weights' code, its
mode (:func:`once_mode`), the bytes the form saves it and those it sends with one row per
slot. Every rank hears every rank, so all of them decide alike: the form is used where no rank
is off, and one says always or the savings add up to :data:`ONCE_FROM_BYTES` and
:data:`ONCE_FROM_SHARE`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backends.host import row_bytes
from ..backends.layout import Routing
from ..backends.once import PLAIN, Outgoing, incoming, outgoing, weight_code
from ..errors import CrossRankMismatchError, bad_input
from .moe_once import OnceLayout

ONCE_ENV_VAR = "UNICOLL_MOE_ONCE"
"""Whether a dispatch sends each token once per rank (:mod:`unicoll.backends.once`): ``0``
never (every dispatch this rank takes part in sends one row per slot), ``1`` wherever it moves
fewer rows, unset (or ``auto``) where the ranks' dispatches save :data:`ONCE_FROM_BYTES` and
:data:`ONCE_FROM_SHARE` of their bytes or more between them."""

ONCE_FROM_BYTES = 1 << 20
"""The bytes the ranks' dispatches must save between them for the once form to be used by
default: below, its fixed costs (the metadata, a second small exchange in combine's backward)
outweigh the bytes it saves."""

ONCE_FROM_SHARE = 0.25
"""The share of one row per slot's bytes the ranks' dispatches must save between them for the
once form to be used by default: its local work (the expansion, the per-rank sums) grows with
the rows, and on gloo a saving of 22% (top-2 over 2 ranks) broke even, 10% (top-2 over 4
ranks) lost 8% (docs/performance.md)."""

ONCE_WEIGHED_FROM_BYTES = 64 << 10
"""The bytes of rows a rank's dispatch must send the other ranks for it to weigh the once
form by default (its layout costs about 50 µs on the host even for a few tokens): below, it
tells its peers the plain form and no savings, which every rank hears alike."""

OFFER_INTS = 5
"""The ints a rank tells each peer of the once form beside its counts (see above)."""

OFF, AUTO, ALWAYS, COMPILED, COMPILED_PLAIN = 0, 1, 2, 3, 4
"""The modes a rank tells its peers: :func:`once_mode`'s, or, from a compiled step, ``COMPILED``
where its graph sends each token once per rank and ``COMPILED_PLAIN`` where it sends one row
per slot by a transfer of its own after the layout (:func:`refuse_mixed`)."""


def once_mode(op: str, world: int, topk: int, native: Any, moved_by_backend: bool, by_default: bool = True) -> int:
    """What this rank says of the once form for a dispatch ``op`` over ``world`` ranks at
    top-``topk``: off where it cannot take part (a caller who moves the rows itself, or weights
    the metadata cannot carry: ``native`` None; one rank; top-1; rows of no bytes; a backend
    that moves the MoE rows itself) or :data:`ONCE_ENV_VAR` turns it off (or, without
    ``by_default``, does not turn it on); else auto, or always. Any other value of the variable
    is refused, naming ``op``, before anything is sent."""
    setting = os.environ.get(ONCE_ENV_VAR, "auto")
    if setting not in ("0", "1", "auto", ""):
        raise bad_input(op, f"${ONCE_ENV_VAR}", "0, 1 or auto (empty: auto)", repr(setting))
    if native is None or setting == "0" or world == 1 or topk == 1 or row_bytes(native) == 0 or moved_by_backend:
        return OFF
    if setting == "1":
        return ALWAYS
    return AUTO if by_default else OFF


@dataclass(frozen=True, eq=False)
class Offer:
    """What this rank tells its peers of the once form for one dispatch (:func:`offer`), and
    what it needs to make its side of the layout once the ranks agree (:meth:`agreed`)."""

    told: np.ndarray
    """``(W, OFFER_INTS)`` int64: row c is what this rank tells rank c."""
    routing: Routing
    rank: int
    row_bytes: int
    code: int
    sender: Outgoing | None
    """This rank's side, made where it weighed the form (None: it told every peer the plain form)."""

    def agreed(self, heard: np.ndarray, received: np.ndarray) -> OnceLayout | None:
        """The once layout where the ranks agree on it, else None: ``heard`` (``(W,
        OFFER_INTS)``: what each rank told this one) and ``received`` (``(W,)``: the rows of
        one row per slot each rank sends this one)."""
        if not agreed_on(heard):
            return None
        into = incoming(np.asarray(received, dtype=np.int64), heard[:, :2], self.row_bytes)
        world = self.told.shape[0]
        sending = self.sender or _side(self.routing, self.rank, world, self.code, self.row_bytes, False)
        return OnceLayout(sending, into, self.row_bytes, self.code > 0)


def agreed_on(heard: np.ndarray) -> bool:
    """Whether the ranks agree on the eager once form, from what every rank told (``heard``:
    ``(W, OFFER_INTS)``, the same on every rank but for the first column): every rank offers it
    eagerly, and one says always or the savings add up to :data:`ONCE_FROM_BYTES` and
    :data:`ONCE_FROM_SHARE`."""
    modes, saved, slots = heard[:, 2], int(heard[:, 3].sum()), int(heard[:, 4].sum())
    enough = saved >= ONCE_FROM_BYTES and saved >= ONCE_FROM_SHARE * slots
    return bool(modes.min() != OFF and modes.max() <= ALWAYS and (modes.max() == ALWAYS or enough))


def refuse_mixed(op: str, heard: np.ndarray) -> None:
    """The same :class:`~unicoll.errors.CrossRankMismatchError` on every rank where some ranks
    run a compiled step (mode ``COMPILED`` or ``COMPILED_PLAIN`` in ``heard``, what every rank
    told) and others run another form (eager, or the other compiled one): a graph cannot take
    another form, so their next transfers would not match. Raised before a row moves."""
    modes = heard[:, 2]
    compiled = (modes == COMPILED) | (modes == COMPILED_PLAIN)
    if not compiled.any() or (modes == modes[0]).all():
        return
    kinds = {COMPILED: "compiled to send each token once per rank", COMPILED_PLAIN: "compiled to send one row per slot"}
    runs = {}
    for rank, mode in enumerate(modes.tolist()):
        runs.setdefault(kinds.get(mode, "eager"), []).append(rank)
    told = "; ".join(f"ranks {ranks} run it {kind}" for kind, ranks in runs.items())
    raise CrossRankMismatchError(
        f"{op}: ranks disagree: {told}; compile the step on every rank, or on none, with the same {ONCE_ENV_VAR}"
    )


def _side(routing: Routing, rank: int, world: int, code: int, size: int, may_send_once: bool) -> Outgoing:
    """This rank's side of the once layout (:func:`~unicoll.backends.once.outgoing`)."""
    r = routing
    return outgoing(r.send_tokens, r.slot_rows, r.local_count, rank, world, r.topk, code, size, may_send_once)


def offer(
    op: str,
    routing: Routing,
    rank: int,
    world: int,
    native: Any,
    weights: Any,
    moved_by_backend: bool,
    compiled: int | None = None,
    by_default: bool = True,
) -> Offer:
    """What rank ``rank`` of ``world`` offers for the dispatch ``op`` of ``routing`` (host),
    whose rows are ``native``'s (None: a caller who moves the rows itself) weighed by native
    ``weights`` (or None); ``moved_by_backend``: the backend moves the MoE rows itself;
    ``compiled``: a compiled step's mode (``COMPILED`` or ``COMPILED_PLAIN``), or None for an
    eager dispatch; ``by_default``: whether the form is weighed where the variable is unset
    (:func:`once_mode`). A rank that would send the others fewer than
    :data:`ONCE_WEIGHED_FROM_BYTES` by default tells them the plain form without making its
    side."""
    code = 0 if weights is None else weight_code(str(weights.dtype).rsplit(".", 1)[-1])
    usable = native if code >= 0 else None  # weights the metadata cannot carry: as without rows
    mode = compiled
    if mode is None:
        mode = once_mode(op, world, routing.topk, usable, moved_by_backend, by_default)
    code, size = max(code, 0), 0 if native is None else row_bytes(native)
    sender, saved, slots = None, 0, 0
    if mode in (AUTO, ALWAYS):
        per_rank = routing.local_count.reshape(world, -1).sum(1)
        slots = (int(per_rank.sum()) - int(per_rank[rank])) * size
        if mode == ALWAYS or slots >= ONCE_WEIGHED_FROM_BYTES:
            sender = _side(routing, rank, world, code, size, True)
            saved = slots - sender.bytes_sent(rank, size)[0]
    told = np.zeros((world, OFFER_INTS), dtype=np.int64)
    told[:, 0] = PLAIN if sender is None else sender.tokens_told
    told[:, 1:] = code, mode, saved, slots
    return Offer(told, routing, rank, size, code, sender)
