"""The raw transports the benchmarks measure unicoll against, on torch tensors in host memory:
torch.distributed's own calls on gloo (the process group unicoll's gloo backend started),
mpi4py's on mpi, and the counting a top-k step written by hand on them does. Imported by the
benchmark scripts beside it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def raw_transport(backend: str) -> tuple[Callable[[Any, list[int], list[int]], Any], Callable[[Any], None]]:
    """``(alltoallv, all_reduce_)`` of ``backend``'s raw transport: ``alltoallv(send,
    send_splits, recv_splits)`` returns the rows received (the uneven all-to-all of send's rows);
    ``all_reduce_(flat)`` sums a 1-D tensor over the ranks in place."""
    import numpy as np
    import torch

    if backend == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD.Dup()

        def alltoallv(send, send_splits, recv_splits):
            row = int(np.prod(send.shape[1:]))
            recv = torch.empty(sum(recv_splits), *send.shape[1:], dtype=send.dtype)
            s, r = np.array(send_splits) * row, np.array(recv_splits) * row
            comm.Alltoallv([send.contiguous().numpy(), (s, np.cumsum(s) - s)], [recv.numpy(), (r, np.cumsum(r) - r)])
            return recv

        def all_reduce_(flat):
            comm.Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)

        return alltoallv, all_reduce_
    import torch.distributed as dist

    def alltoallv(send, send_splits, recv_splits):
        recv = torch.empty(sum(recv_splits), *send.shape[1:], dtype=send.dtype)
        dist.all_to_all_single(recv, send.contiguous(), recv_splits, send_splits)
        return recv

    return alltoallv, dist.all_reduce


def counted_by_hand(ids: Any, world: int, experts: int, alltoallv: Callable[..., Any]) -> tuple[Any, Any, list, list]:
    """What a top-k step written by hand on the raw transport does before it sends rows, for
    (tokens, k) global expert ids: ``(order, heard, send_splits, recv_splits)``, the slots
    sorted by expert (slot ``order[i]`` is row ``i`` sent), the counts every rank sends this
    rank's ``experts`` experts (``(world, experts)``, exchanged by ``alltoallv``) and the rows
    sent to and received from each rank."""
    import torch

    slots = ids.reshape(-1)
    order = torch.argsort(slots, stable=True)
    counts = torch.bincount(slots, minlength=world * experts)
    heard = alltoallv(counts.reshape(-1, 1), [experts] * world, [experts] * world).reshape(world, experts)
    return order, heard, counts.reshape(world, experts).sum(1).tolist(), heard.sum(1).tolist()
