"""The point-to-point schedule of an uneven all-to-all, as a pure function of the sizes.

A backend that builds its all-to-all from grouped sends and receives (``cupy-nccl`` does, with
``ncclGroupStart``/``ncclGroupEnd``) issues exactly what :func:`alltoallv_schedule` lists.
Keeping it free of any transport lets the CPU tests check it against ``unicoll.reference`` by
simulating the transfers with numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate


@dataclass(frozen=True)
class Transfer:
    """This rank's exchange with one peer, in bytes from the start of the send and receive
    buffers. A side whose size is zero is not issued at all."""

    peer: int
    send_offset: int
    send_bytes: int
    recv_offset: int
    recv_bytes: int


def alltoallv_schedule(
    rank: int, world: int, send_rows: Sequence[int], recv_rows: Sequence[int], row_bytes: int
) -> list[Transfer]:
    """What rank ``rank`` of ``world`` sends and receives: ``send_rows[c]`` rows (consecutive,
    in peer order) go to peer c and ``recv_rows[c]`` rows arrive from it, each row
    ``row_bytes`` long.

    Peers come in ring order starting with this rank itself (``rank, rank+1, ..., rank-1``),
    so the ranks do not all start with the same peer. A peer with nothing to send or receive
    is left out; one whose sides are both zero does not appear. The entry for this rank
    itself is a local copy, so its two sizes must agree.

    >>> for transfer in alltoallv_schedule(1, 3, send_rows=[1, 0, 2], recv_rows=[0, 0, 3], row_bytes=4):
    ...     print(transfer)
    Transfer(peer=2, send_offset=4, send_bytes=8, recv_offset=0, recv_bytes=12)
    Transfer(peer=0, send_offset=0, send_bytes=4, recv_offset=0, recv_bytes=0)
    """
    if not 0 <= rank < world:
        raise ValueError(f"alltoallv_schedule: rank: expected 0 <= rank < {world}, got {rank}")
    if len(send_rows) != world or len(recv_rows) != world:
        raise ValueError(
            f"alltoallv_schedule: expected {world} send and receive sizes, got {len(send_rows)} and {len(recv_rows)}"
        )
    if min(*send_rows, *recv_rows, row_bytes) < 0:
        raise ValueError("alltoallv_schedule: sizes must be non-negative")
    if send_rows[rank] != recv_rows[rank]:
        raise ValueError(
            f"alltoallv_schedule: rank {rank} sends {send_rows[rank]} row(s) to itself but expects {recv_rows[rank]}"
        )
    # Python ints throughout: a handful of sizes per call, where numpy's per-call costs dominate.
    send_at = list(accumulate((int(n) * row_bytes for n in send_rows), initial=0))
    recv_at = list(accumulate((int(n) * row_bytes for n in recv_rows), initial=0))
    transfers = []
    for step in range(world):
        peer = (rank + step) % world
        sent, received = send_at[peer + 1] - send_at[peer], recv_at[peer + 1] - recv_at[peer]
        if sent or received:
            transfers.append(Transfer(peer, send_at[peer], sent, recv_at[peer], received))
    return transfers
