"""What the ranks of a verified call tell each other, and how every rank compares it
(:mod:`unicoll.verify`).

Each rank's record of a call is ``5 + 4 W`` int64: the call's number, what it checks and the
group's size, the checksums of the blocks it sent (one per destination, :mod:`unicoll.checksums`),
those of the blocks it received (one per source), and, for a sum, its inputs' projections and
magnitudes as float64 bits. After the all-gather, every rank holds every record and finds the
same first mismatch, if any: a (sender, receiver) pair whose checksums differ, ranks whose
reductions differ, or a sum whose projection is not the sum of the inputs' within the rounding
its dtype allows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from array_api_compat import array_namespace, device

from .arrays import description_of

if TYPE_CHECKING:
    from .group import Group

ROUNDING = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}
"""The unit roundoff of each floating dtype: what one rounding of a sum may lose, relatively."""

_RECORD_INTS = 5
"""The ints of a record beside its ``4 W``: the call's number, what it checks, the group's size
and room for a reduction's two results."""

MOVED, BROADCAST, REDUCED, SCATTERED = 1, 2, 3, 4
"""What a record checks: blocks sent and received by every pair of ranks; the blocks of one
source; a reduction every rank holds whole; a reduction each rank holds a block of."""


@dataclass
class Record:
    """What one rank tells the others of one verified call, before the transfer and after."""

    op: str
    group: Group
    number: int
    kind: int
    sent: Any = None
    """int64 ``(W,)``, where the checksums are (:mod:`unicoll.checksums`): the checksum of the
    block sent to each rank (zeros: none)."""
    inputs: Any = None
    """float64 or int64 ``(2, W)``: each block's projection and magnitude (reductions)."""
    dtype: str = ""
    """A reduction's dtype (its rounding sets the tolerance of a sum)."""
    rows: int = 0
    """A reduction's rows (the rounding of the float64 projections grows with them)."""
    columns: int = 0
    """The values in each of a floating reduction's rows (each row's float64 sum rounds too)."""
    reduction: str = ""
    """A reduction's operation (``"sum"``, ``"avg"``, ...)."""
    src: int = 0
    """A broadcast's source position."""


def record_values(record: Record, received: Any) -> Any:
    """This rank's record of a verified call as ``5 + 4 W`` int64, where ``received`` (the
    checksums of what arrived) is (on the host for host rows): the call's number, what it checks and the group's size,
    the checksums sent, those received, and a reduction's projections of its inputs."""
    xp, where, world = array_namespace(received), device(received), record.group.world_size
    sent = record.sent if record.sent is not None else xp.zeros(world, dtype=xp.int64, device=where)
    parts = [sent, xp.reshape(received, (-1,))]
    if record.inputs is not None:
        parts.append(xp.reshape(as_int64(record.inputs), (-1,)))
    ours = xp.concat(parts)
    values = xp.zeros(_RECORD_INTS + 4 * world, dtype=xp.int64, device=where)
    values[0], values[1], values[2] = record.number, record.kind, world
    values[3 : 3 + ours.shape[0]] = ours
    return values


def as_int64(values: Any) -> Any:
    """float64 (or int64) values as int64 of the same bits."""
    if array_namespace(values).isdtype(values.dtype, "integral"):
        return values
    return description_of(values).row_words(values).reshape(values.shape)


def mismatch(record: Record, everyone: np.ndarray) -> str | None:
    """The first mismatch in every rank's record (rows of ``everyone``), in words, or None."""
    world = everyone.shape[0]
    numbers, kinds = everyone[:, 0], everyone[:, 1]
    if len(set(numbers.tolist())) > 1 or len(set(kinds.tolist())) > 1:
        calls = ", ".join(f"rank {r}: call {n}" for r, n in enumerate(numbers.tolist()))
        return (
            f"the ranks verified different calls ({calls}); every rank must issue the same calls on a group, in "
            "the same order"
        )
    sent, received = everyone[:, 3 : 3 + world], everyone[:, 3 + world : 3 + 2 * world]
    if record.kind in (MOVED, BROADCAST):
        sources = [record.src] if record.kind == BROADCAST else range(world)
        pairs = [(s, d) for s in sources for d in range(world)]
        wrong = [(s, d) for s, d in pairs if sent[s, d] != received[d, s]]
        if not wrong:
            return None
        s, d = wrong[0]
        more = f"; {len(wrong) - 1} more block(s) differ" if len(wrong) > 1 else ""
        return (
            f"the block rank {s} sent to rank {d} arrived different (checksum {_hex(sent[s, d])} sent, "
            f"{_hex(received[d, s])} received){more}"
        )
    return _reduction_mismatch(record, everyone)


def _reduction_mismatch(record: Record, everyone: np.ndarray) -> str | None:
    """:func:`mismatch` of a reduction: the results' bits across ranks (``all_reduce``), and
    the projections of sums within their rounding."""
    world = everyone.shape[0]
    base = 3 + world
    bits, projections = everyone[:, base], everyone[:, base + 1]
    if record.kind == REDUCED and len(set(bits.tolist())) > 1:
        odd = next(r for r in range(world) if bits[r] != bits[0])
        return (
            f"rank {odd}'s result differs from rank 0's (checksum {_hex(bits[odd])} against {_hex(bits[0])}): "
            "every rank must hold the same reduction"
        )
    if record.inputs is None:
        return None
    blocks = 1 if record.kind == REDUCED else world
    inputs = everyone[:, base + 2 : base + 2 + 2 * blocks].reshape(world, 2, blocks)
    floating = record.dtype in ROUNDING
    for d in range(world):
        block = 0 if record.kind == REDUCED else d
        if floating:
            expected = inputs[:, 0, block].view(np.float64).sum()
            magnitude = inputs[:, 1, block].view(np.float64).sum()
            got = projections[d : d + 1].view(np.float64)[0]
            if record.reduction == "avg":
                expected, magnitude = expected / world, magnitude / world
            if not (np.isfinite(expected) and np.isfinite(got)):
                continue  # an overflow or a NaN of the data's own: nothing to compare
            float64_sums = record.rows + record.columns + world
            tolerance = ((world + 2) * ROUNDING[record.dtype] + float64_sums * 2.0**-52) * magnitude
            if abs(got - expected) <= tolerance:
                continue
            return (
                f"rank {d}'s result is not the sum of the ranks' inputs (projection {got!r}, expected {expected!r} "
                f"within {tolerance:.3g})"
            )
        bits_wide = 8 * np.dtype(record.dtype).itemsize
        expected_int = int(inputs[:, 0, block].astype(np.uint64).sum(dtype=np.uint64))
        got_int = int(np.uint64(projections[d].astype(np.uint64)))
        if (expected_int - got_int) % (1 << bits_wide) != 0:
            return f"rank {d}'s result is not the sum of the ranks' inputs (its projection differs by the bits)"
    return None


def _hex(value: np.integer) -> str:
    """An int64 checksum as 16 hex digits."""
    return f"{int(value) & (2**64 - 1):016x}"
