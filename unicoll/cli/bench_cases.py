"""What every rank of ``unicoll bench`` measures (:mod:`unicoll.cli.bench`): one :class:`Case`
per operator and size, the same buffers driven by unicoll and by the raw baseline
(:mod:`unicoll.cli.bench_baselines`), with the expected results from :mod:`unicoll.reference`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ..backends.layout import rank_major_to_expert_major
from .bench_config import OPS, Config


@dataclass
class Case:
    """One operator at one size on this rank: the same buffers driven by unicoll and by the raw
    baseline. Each callable returns its result; ``out`` is an in-place output that is cleared
    before the correctness check, so a call that writes nothing cannot pass."""

    op: str
    nbytes: int
    count: int
    unicoll: Callable[[], Any]
    raw: Callable[[], Any]
    expected: Callable[[], np.ndarray]
    out: Any = None
    raw_expected: Callable[[], np.ndarray] | None = None
    """The raw call's own expected result when it does less than unicoll (the bare transfer of
    an MoE operator); None when it is ``expected``."""
    reset: Callable[[], None] | None = None
    """Restores the input of an in-place operator before each call of the correctness check."""
    transfer: Callable[[], Any] | None = None
    """The MoE operators: the bare transfers of the bytes they move (even all-to-alls of the
    rows sent, one per all-to-all the operator makes), timed beside them; None for the others."""
    sent: Callable[[], tuple[int, int]] | None = None
    """``moe_topk``: the bytes this rank's last dispatch sent the other ranks, and what one row
    per slot would have (the handle's); None for the others."""


class World:
    """This rank's view of the run: where tensors live and how every rank's data is made."""

    def __init__(self, config: Config) -> None:
        import torch

        import unicoll as uc

        from .bench_baselines import for_backend

        uc.init(config.backend)
        self.baseline = for_backend(uc.get_backend())
        self.config, self.rank, self.world = config, uc.get_rank(), uc.get_world_size()
        self.device = self.baseline.device
        self.cuda = self.device.type == "cuda"
        if not self.cuda:  # share the cores, as torchrun does: N ranks of 2 threads on 2 cores stall
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world))
        self.dtype = getattr(torch, config.dtype)
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()

    def sync(self) -> None:
        """Wait for the device (CUDA), so a timer sees the whole operation."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def shape(self, nbytes: int) -> tuple[int, int]:
        """``(rows, hidden)`` for about ``nbytes`` per rank: rows of at most ``config.hidden``
        elements, narrower at small sizes so each rank still holds about W*E rows."""
        count = max(1, nbytes // self.itemsize)
        hidden = max(1, min(self.config.hidden, count // (self.world * self.config.experts)))
        return count // hidden, hidden

    def bits(self, rank: int, tag: str, nbytes: int, rows: int, hidden: int) -> np.ndarray:
        """Rank ``rank``'s data for (``tag``, ``nbytes``): random bytes of shape
        ``(rows, hidden * itemsize)``, the same on every rank that asks."""
        rng = np.random.default_rng([self.config.seed, rank, nbytes, OPS.index(tag)])
        return rng.integers(0, 256, (rows, hidden * self.itemsize), dtype=np.uint8)

    def small(self, rank: int, tag: str, nbytes: int, rows: int, hidden: int) -> np.ndarray:
        """Rank ``rank``'s data of a summing operator: integers 0..7 in float32 (bfloat16) or
        the benchmark's dtype, so any order of summing them over the ranks is exact."""
        rng = np.random.default_rng([self.config.seed, rank, nbytes, OPS.index(tag)])
        return rng.integers(0, 8, (rows, hidden)).astype(
            "float32" if self.config.dtype == "bfloat16" else self.config.dtype
        )

    def as_bits(self, values: np.ndarray) -> np.ndarray:
        """``values`` (as :meth:`small` makes them) as bytes of the benchmark's dtype."""
        import torch

        return torch.from_numpy(values).to(self.dtype).view(torch.uint8).numpy()

    def tensor(self, bits: np.ndarray) -> Any:
        """``bits`` as a tensor of the benchmark's dtype on the benchmark's device."""
        import torch

        return torch.from_numpy(bits).view(self.dtype).to(self.device)

    def local_counts(self, nbytes: int, rows: int) -> list[np.ndarray]:
        """Every rank's seeded ``local_count`` (W*E entries, ``rows`` in all, close to even)."""
        slots = self.world * self.config.experts
        return [
            np.random.default_rng([self.config.seed, rank, nbytes]).multinomial(rows, np.full(slots, 1 / slots))
            for rank in range(self.world)
        ]


def _same_bits(result: Any, expected: np.ndarray) -> bool:
    import torch

    got = result.detach().cpu().contiguous().view(torch.uint8).numpy()
    return got.shape == expected.shape and bool(np.array_equal(got, expected))


def _alltoall_single(w: World, nbytes: int, reorder: bool) -> Case:
    import unicoll as uc

    rows, hidden = w.shape(nbytes)
    rows -= rows % w.world
    x = w.tensor(w.bits(w.rank, "alltoall_single", nbytes, rows, hidden))
    out = x.new_empty(x.shape)
    splits = [rows // w.world] * w.world
    transfer = w.baseline.alltoallv(out, x, splits, splits)

    def raw() -> Any:
        transfer()
        return out

    def expected() -> np.ndarray:
        every = [w.bits(r, "alltoall_single", nbytes, rows, hidden) for r in range(w.world)]
        return uc.reference.alltoall_single(every)[w.rank]

    return Case(
        "alltoall_single", x.numel() * w.itemsize, x.numel(), lambda: uc.alltoall_single(out, x), raw, expected, out
    )


def _all_gather(w: World, nbytes: int, reorder: bool) -> Case:
    import unicoll as uc

    rows, hidden = w.shape(nbytes)
    rows = max(1, rows // w.world)  # nbytes is the gathered output; each rank sends 1/W of it
    x = w.tensor(w.bits(w.rank, "all_gather", nbytes, rows, hidden))
    out = x.new_empty((w.world * rows, hidden))
    transfer = w.baseline.all_gather(out, x)

    def raw() -> Any:
        transfer()
        return out

    def expected() -> np.ndarray:
        return uc.reference.all_gather([w.bits(r, "all_gather", nbytes, rows, hidden) for r in range(w.world)])[0]

    return Case("all_gather", out.numel() * w.itemsize, out.numel(), lambda: uc.all_gather(out, x), raw, expected, out)


def _all_reduce(w: World, nbytes: int, reorder: bool) -> Case:
    import torch

    import unicoll as uc

    rows, hidden = w.shape(nbytes)
    start = w.small(w.rank, "all_reduce", nbytes, rows, hidden)
    x = torch.from_numpy(start).to(w.dtype).to(w.device)
    pristine = x.clone()
    transfer = w.baseline.all_reduce(x)

    def raw() -> Any:
        transfer()
        return x

    def expected() -> np.ndarray:
        every = [w.small(r, "all_reduce", nbytes, rows, hidden) for r in range(w.world)]
        return w.as_bits(uc.reference.all_reduce(every)[w.rank])

    return Case(
        "all_reduce", x.numel() * w.itemsize, x.numel(), lambda: uc.all_reduce(x), raw, expected,
        reset=lambda: x.copy_(pristine),
    )  # fmt: skip


def _reduce_scatter(w: World, nbytes: int, reorder: bool) -> Case:
    import torch

    import unicoll as uc

    rows, hidden = w.shape(nbytes)
    rows = max(w.world, rows - rows % w.world)  # nbytes is the input; each rank receives 1/W of it
    x = torch.from_numpy(w.small(w.rank, "reduce_scatter", nbytes, rows, hidden)).to(w.dtype).to(w.device)
    out = x.new_empty((rows // w.world, hidden))
    transfer = w.baseline.reduce_scatter(out, x)

    def raw() -> Any:
        transfer()
        return out

    def expected() -> np.ndarray:
        every = [w.small(r, "reduce_scatter", nbytes, rows, hidden) for r in range(w.world)]
        return w.as_bits(uc.reference.reduce_scatter(every)[w.rank])

    return Case(
        "reduce_scatter", x.numel() * w.itemsize, x.numel(), lambda: uc.reduce_scatter(out, x), raw, expected, out
    )


def _broadcast(w: World, nbytes: int, reorder: bool) -> Case:
    import unicoll as uc

    rows, hidden = w.shape(nbytes)
    mine = w.bits(w.rank, "broadcast", nbytes, rows, hidden)
    x = w.tensor(mine)
    transfer = w.baseline.broadcast(x)

    def raw() -> Any:
        transfer()
        return x

    def expected() -> np.ndarray:
        return uc.reference.broadcast([w.bits(r, "broadcast", nbytes, rows, hidden) for r in range(w.world)], 0)[0]

    return Case(
        "broadcast", x.numel() * w.itemsize, x.numel(), lambda: uc.broadcast(x, 0), raw, expected,
        reset=lambda: x.copy_(w.tensor(mine)),
    )  # fmt: skip


def _moe_case(op: str, w: World, nbytes: int, reorder: bool) -> Case:
    """global_scatter or global_gather. The raw baseline is one all-to-all on per-rank sums
    into a new array, plus an index_select into (or out of) expert-major order; its split
    sizes and index are computed once, outside the timing, as the counts stay fixed. ``reorder=False``
    leaves the index_select out: the bare all-to-all of the same bytes (the front-end
    measurement, and baselines that compare with the bare transfer), checked as such."""
    import torch

    import unicoll as uc

    rows, hidden = w.shape(nbytes)
    lcs = w.local_counts(nbytes, rows)
    gcs = uc.reference.global_counts(lcs)
    lc, gc = lcs[w.rank], gcs[w.rank]
    send = lc.reshape(w.world, -1).sum(1).tolist()
    recv = gc.reshape(w.world, -1).sum(1).tolist()
    order = rank_major_to_expert_major(gc.reshape(w.world, -1))  # the library's own reorder
    if op == "global_gather":  # the inverse permutation: expert-major back to rank-major
        order = np.argsort(order)
    index = torch.from_numpy(order).to(w.device)
    scatter = op == "global_scatter"
    in_rows = [rows] * w.world if scatter else [int(g.sum()) for g in gcs]
    x = w.tensor(w.bits(w.rank, op, nbytes, in_rows[w.rank], hidden))

    def raw_scatter() -> Any:
        buffer = x.new_empty((sum(recv), hidden))
        w.baseline.alltoallv(buffer, x, recv, send)()
        return buffer.index_select(0, index) if reorder else buffer

    def raw_gather() -> Any:
        y = x.index_select(0, index) if reorder else x
        out = x.new_empty((sum(send), hidden))
        w.baseline.alltoallv(out, y, send, recv)()
        return out

    def every_input() -> list[np.ndarray]:
        return [w.bits(r, op, nbytes, in_rows[r], hidden) for r in range(w.world)]

    def expected() -> np.ndarray:
        reference = uc.reference.global_scatter if scatter else uc.reference.global_gather
        return reference(every_input(), lcs)[w.rank]

    def transferred() -> np.ndarray:  # what the bare all-to-all delivers
        splits = [c.reshape(w.world, -1).sum(1) for c in (lcs if scatter else gcs)]
        return uc.reference.alltoall_single(every_input(), splits)[w.rank]

    call = getattr(uc, op)
    count = rows * hidden
    raw = raw_scatter if scatter else raw_gather
    return Case(
        op, count * w.itemsize, count, lambda: call(x, lc, gc), raw, expected, None, None if reorder else transferred,
        transfer=_even_transfers(w, rows, hidden, 1),
    )  # fmt: skip


def _even_transfers(w: World, rows: int, hidden: int, times: int) -> Callable[[], None]:
    """``times`` raw even all-to-alls of ``rows`` rows of ``hidden`` elements (less the rows
    that do not divide evenly among the ranks), on buffers made once: the transport's own
    cost for the bytes of a MoE operator."""
    even = rows - rows % w.world
    a = w.tensor(w.bits(w.rank, "alltoall_single", even * hidden * w.itemsize, even, hidden))
    b = a.new_empty(a.shape)
    splits = [even // w.world] * w.world
    there, back = w.baseline.alltoallv(b, a, splits, splits), w.baseline.alltoallv(a, b, splits, splits)

    def transfers() -> None:
        for i in range(times):
            (there if i % 2 == 0 else back)()

    return transfers


_TOPK = 2
"""Experts per token in the ``moe_topk`` case."""


def _moe_topk(w: World, nbytes: int, reorder: bool) -> Case:
    """``unicoll.moe.dispatch`` + ``combine`` of this rank's tokens (identity experts), beside the
    same steps by hand with the four operators (see the module's docstring). ``reorder`` is unused:
    both sides always do the whole job."""
    import torch

    import unicoll as uc

    rows, hidden = w.shape(nbytes)
    experts, world, k = w.config.experts, w.world, _TOPK

    def inputs(rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        rng = np.random.default_rng([w.config.seed, rank, nbytes, OPS.index("moe_topk")])
        ids = rng.random((rows, world * experts)).argsort(axis=1)[:, :k] if world * experts >= k else None
        ids = rng.integers(0, world * experts, (rows, k)) if ids is None else ids  # one expert: both slots on it
        weights = rng.choice([0.5, 1.0, 2.0], (rows, k)) if w.dtype.is_floating_point else None
        return rng.integers(0, 8, (rows, hidden)).astype(np.float32), ids, weights

    tokens, ids_np, weights_np = inputs(w.rank)
    x = torch.from_numpy(tokens).to(w.device, w.dtype)
    ids = torch.from_numpy(ids_np).to(w.device)
    weights = None if weights_np is None else torch.from_numpy(weights_np).to(w.device, w.dtype)

    last: list[Any] = [None]

    def unicoll() -> Any:
        received, _, handle = uc.moe.dispatch(x, ids, weights, experts_per_rank=experts)
        last[0] = handle
        return uc.moe.combine(received, handle)

    def sent() -> tuple[int, int]:
        return last[0].bytes_sent, last[0].bytes_one_row_per_slot

    def by_hand() -> Any:
        slots = ids.reshape(-1)
        order = torch.argsort(slots, stable=True)  # the k copies of every token, sorted by expert
        local_count = torch.bincount(slots, minlength=world * experts)
        global_count = uc.exchange_counts(local_count)
        received = uc.global_scatter(x.index_select(0, order // k), local_count, global_count)
        received.split(global_count.reshape(world, experts).sum(0).tolist())  # the split per expert
        back = uc.global_gather(received, local_count, global_count)
        unsorted = torch.empty_like(back)
        unsorted[order] = back
        unsorted = unsorted.reshape(rows, k, hidden)
        return (unsorted if weights is None else unsorted * weights[..., None]).sum(1).to(w.dtype)

    def expected() -> np.ndarray:
        every = [inputs(r) for r in range(world)]
        received, _ = uc.reference.moe_dispatch([t for t, _, _ in every], [i for _, i, _ in every], experts)
        weighted = None if weights_np is None else [wt for _, _, wt in every]
        combined = uc.reference.moe_combine(received, [i for _, i, _ in every], experts, weighted)[w.rank]
        return torch.from_numpy(combined).to(w.dtype).contiguous().view(torch.uint8).numpy()

    transfer = _even_transfers(w, rows * k, hidden, 2)  # dispatch's rows there, combine's back
    nbytes = x.numel() * w.itemsize
    return Case("moe_topk", nbytes, x.numel(), unicoll, by_hand, expected, transfer=transfer, sent=sent)


CASES: dict[str, Callable[[World, int, bool], Case]] = {  # (world, nbytes, reorder) -> case
    "alltoall_single": _alltoall_single,
    "all_gather": _all_gather,
    "global_scatter": partial(_moe_case, "global_scatter"),
    "global_gather": partial(_moe_case, "global_gather"),
    "all_reduce": _all_reduce,
    "reduce_scatter": _reduce_scatter,
    "broadcast": _broadcast,
    "moe_topk": _moe_topk,
}


def check(w: World, case: Case) -> bool:
    """Whether unicoll's result matches the reference; the baseline must match too (else the
    comparison would be meaningless, and that is a bug here)."""
    expected = case.expected()
    results = []
    for call, want in ((case.unicoll, expected), (case.raw, (case.raw_expected or case.expected)())):
        if case.out is not None:
            case.out.zero_()
        if case.reset is not None:
            case.reset()
        results.append(_same_bits(call(), want))
    if not results[1]:
        raise AssertionError(
            f"unicoll bench: the raw baseline of {case.op} at {case.nbytes} B is wrong on rank {w.rank}"
        )
    return results[0]
