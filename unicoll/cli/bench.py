"""``unicoll bench``: nccl-tests-style timings of unicoll's operators beside the raw transport.

:func:`run` (the command) starts N ranks with :func:`unicoll.launch.local.run` (on ``mpi``, as an
MPI job with :func:`unicoll.launch.mpi.run`), each running
``python -m unicoll.cli.bench sweep CONFIG RESULT PROGRESS``. For every operator and message size
each rank builds one :class:`_Case` (the same buffers for unicoll's call and the raw call of
the transport, :mod:`unicoll.cli.bench_baselines`), checks both results against
:mod:`unicoll.reference` once, then times them interleaved: every iteration runs both, in
alternating order, each after a barrier, so drift affects both alike. A rank's figure is the
median of its samples (blocks of back-to-back calls); the table shows the slowest rank's. A
second, one-rank world (``python -m unicoll.cli.bench single CONFIG RESULT``) measures the front
end on its own: a tiny unicoll call with the backend's transfer primitives stubbed out, and the
whole call beside the raw transfer it issues; and a single-process memory copy of each size,
the bound that a transport within one machine is read against. docs/performance.md explains
the figures.

Sizes are bytes per rank as nccl-tests counts them: the send (= receive) buffer of
alltoall_single, all_reduce and broadcast, the *output* buffer of all_gather (each rank
contributes size / N), the *input* buffer of reduce_scatter (each rank receives size / N), and
the tokens a rank dispatches (global_scatter's input, global_gather's output) for the MoE
operators. Data are rows of ``hidden`` elements of random bits (of small integers for the
summing operators, all_reduce and reduce_scatter with ``op="sum"``); the results are compared
bit for bit. all_reduce and broadcast work in place: the correctness check restores their input
first.

``moe_topk`` is ``unicoll.moe``: one ``dispatch`` (top-2, with weights for floating dtypes)
and one ``combine`` of this rank's tokens (the size: their bytes before the top-2 copies), and
its baseline is not the raw transport but the same steps written by hand with unicoll's
operators, as a user would without ``unicoll.moe``: sort the k copies of each token by expert,
count, ``exchange_counts``, ``global_scatter``, read the counts to split per expert,
``global_gather``, unsort, weigh and sum over the k slots. Its data are small integers (and
weights 0.5, 1 or 2), so both results are exact and compared bit for bit too.

For the MoE operators a third call is timed in the same rotation: the bare even all-to-alls of
the rows they move (``global_scatter``/``global_gather``: one of the size; ``moe_topk``: two,
of tokens x 2 rows, there and back), and the table's ``uc/xfer`` column is unicoll's time over
theirs: how close to the transport the step runs on this machine.

The backends on torch.distributed (``gloo``, ``torch-nccl``) are compared with
torch.distributed itself, ``mpi`` with bare mpi4py. Nothing heavy is imported until a rank
starts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ..launch import local as launcher
from ..launch import mpi as mpirun
from ..launch.process import write_atomically

OPS: tuple[str, ...] = (
    "alltoall_single",
    "all_gather",
    "global_scatter",
    "global_gather",
    "all_reduce",
    "reduce_scatter",
    "broadcast",
    "moe_topk",
)
DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_BLOCK_BYTES, _MAX_BLOCK = 1 << 20, 16
"""A timed block is ``_BLOCK_BYTES // size`` calls, between 1 and ``_MAX_BLOCK``."""
_FRONTEND_BYTES = 256
"""Payload of the front-end measurement: small enough that the transfer costs next to nothing."""
_FRONTEND_PER_ITER = 100
"""Calls of the front-end measurement per ``--iters``: 2000 at the default 20, with a tenth as
many warm-up calls; a quick run (``--iters 1``) times 100."""
_OVERHEAD_SAMPLES = 5
"""The whole call on N ranks at the front-end payload: this many times ``--iters`` samples of
``_MAX_BLOCK`` calls, so that a difference of a few microseconds shows through the noise."""


@dataclass(frozen=True)
class Config:
    """What to measure; the command line's options, passed to every rank as JSON."""

    backend: str | None
    ops: tuple[str, ...]
    min_bytes: int
    max_bytes: int
    dtype: str
    experts: int
    hidden: int
    iters: int
    warmup: int
    seed: int

    def sizes(self) -> list[int]:
        """The message sizes of the sweep: ``min_bytes`` doubling up to ``max_bytes``."""
        sizes, size = [], self.min_bytes
        while size <= self.max_bytes:
            sizes.append(size)
            size *= 2
        return sizes


# -- the command -----------------------------------------------------------------------------


def parse_bytes(text: str) -> int:
    """``"4096"``, ``"1K"``, ``"64M"``, ``"1G"`` (binary units, optional ``B``/``iB``) -> bytes."""
    spec = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = spec[-1:] if spec[-1:] in _UNITS else ""
    number = spec[: len(spec) - len(unit)]
    if not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(f"expected a size such as 4096, 1K or 64M, got {text!r}")
    return int(number) * _UNITS[unit]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``unicoll bench`` to ``parser``."""

    def at_least(low: int) -> Callable[[str], int]:
        def parse(text: str) -> int:
            if not text.isdigit() or int(text) < low:
                raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
            return int(text)

        return parse

    parser.add_argument("-n", "--nprocs", type=at_least(1), required=True, help="number of ranks")
    parser.add_argument("--backend", help="unicoll backend (default: $UNICOLL_BACKEND, else auto)")
    parser.add_argument("--op", action="append", choices=OPS, help="operator to measure (repeatable; default: all)")
    parser.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("1K"), help="smallest size (1K)")
    parser.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("64M"), help="largest size (64M)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="element type (float32)")
    parser.add_argument("--experts", type=at_least(1), default=4, help="experts per rank, MoE operators (4)")
    parser.add_argument("--hidden", type=at_least(1), help="elements per row, at most (256; --moe-modes: 1024)")
    parser.add_argument("--iters", type=at_least(1), default=20, help="timed iterations per size (20)")
    parser.add_argument("--warmup", type=at_least(0), default=5, help="untimed iterations per size (5)")
    parser.add_argument("--seed", type=at_least(0), default=0, help="seed of the data and the counts (0)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="draw busbw against size (needs matplotlib)")
    parser.add_argument(
        "--moe-modes", action="store_true",
        help="instead of the sweep: one MoE step in the static and dynamic modes and by hand (unicoll.cli.bench_modes)",
    )  # fmt: skip
    parser.add_argument("--tokens", type=at_least(1), default=4096, help="tokens per rank, --moe-modes (4096)")


def run(args: argparse.Namespace) -> int:
    """``unicoll bench``: run the sweep and the front-end measurement, print, write, plot (or,
    with ``--moe-modes``, :func:`unicoll.cli.bench_modes.run`)."""
    if args.moe_modes:
        from . import bench_modes

        return bench_modes.run(args)
    if args.min_bytes > args.max_bytes:
        print(f"unicoll bench: --min-bytes {args.min_bytes} is above --max-bytes {args.max_bytes}", file=sys.stderr)
        return 2
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("unicoll bench: --plot needs matplotlib: pip install 'unicoll[bench]'", file=sys.stderr)
            return 2
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        problem = None if path is None else _unwritable(path)
        if problem is not None:
            print(
                f"unicoll bench: {flag}: expected a file it can write, got {str(path)!r} ({problem})", file=sys.stderr
            )
            return 2
    config = Config(
        backend=args.backend,
        ops=tuple(dict.fromkeys(args.op or OPS)),
        min_bytes=args.min_bytes,
        max_bytes=args.max_bytes,
        dtype=args.dtype,
        experts=args.experts,
        hidden=args.hidden or 256,
        iters=args.iters,
        warmup=args.warmup,
        seed=args.seed,
    )
    encoded = json.dumps(asdict(config))
    start = mpirun.run if (config.backend or os.environ.get("UNICOLL_BACKEND")) == "mpi" else launcher.run
    with tempfile.TemporaryDirectory(prefix="unicoll-bench-") as tmp:
        sweep, single, progress = (os.path.join(tmp, name) for name in ("sweep.json", "single.json", "progress"))
        total = len(config.ops) * len(config.sizes())
        with _progress_bar(progress, total):
            code = start(args.nprocs, ["-m", __name__, "sweep", encoded, sweep, progress])
        if code == 0:
            code = start(1, ["-m", __name__, "single", encoded, single])
        if code != 0:
            return code
        result = json.loads(Path(sweep).read_text())
        result.update(json.loads(Path(single).read_text()))
    from . import bench_report

    print(bench_report.format_table(result))
    print(bench_report.format_copy(result))
    print(bench_report.format_frontend(result))
    print(bench_report.format_overhead(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot is not None:
        bench_report.plot(result, args.plot)
    return 0 if all(row["correct"] for row in result["rows"]) else 1


def _unwritable(path: Path) -> str | None:
    """Why ``path`` cannot be written, found before the sweep instead of after it (by opening
    it for appending, which leaves an existing file as it is; a file made here is removed
    again), or None when it can."""
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    if not existed:
        path.unlink()
    return None


@contextmanager
def _progress_bar(path: str, total: int) -> Iterator[None]:
    """Show a tqdm bar on stderr (if tqdm is installed and stderr is a terminal) that follows
    the ``done op size`` line rank 0 keeps in ``path``, while the block runs."""
    stop = threading.Event()
    thread = threading.Thread(target=_follow_progress, args=(path, total, stop), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _follow_progress(path: str, total: int, stop: threading.Event) -> None:
    try:
        from tqdm import tqdm
    except ImportError:
        return
    with tqdm(total=total, desc="unicoll bench", unit="size", file=sys.stderr, disable=None) as bar:
        while True:
            stopping = stop.wait(0.2)
            try:
                done, op, size = Path(path).read_text().split()
            except (OSError, ValueError):
                done = None
            if done is not None:
                bar.set_postfix_str(f"{op} {size} B", refresh=False)
                bar.update(int(done) - bar.n)
            if stopping:
                return


# -- on every rank ---------------------------------------------------------------------------


@dataclass
class _Case:
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


class _World:
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


def _alltoall_single(w: _World, nbytes: int, reorder: bool) -> _Case:
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

    return _Case(
        "alltoall_single", x.numel() * w.itemsize, x.numel(), lambda: uc.alltoall_single(out, x), raw, expected, out
    )


def _all_gather(w: _World, nbytes: int, reorder: bool) -> _Case:
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

    return _Case("all_gather", out.numel() * w.itemsize, out.numel(), lambda: uc.all_gather(out, x), raw, expected, out)


def _all_reduce(w: _World, nbytes: int, reorder: bool) -> _Case:
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

    return _Case(
        "all_reduce", x.numel() * w.itemsize, x.numel(), lambda: uc.all_reduce(x), raw, expected,
        reset=lambda: x.copy_(pristine),
    )  # fmt: skip


def _reduce_scatter(w: _World, nbytes: int, reorder: bool) -> _Case:
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

    return _Case(
        "reduce_scatter", x.numel() * w.itemsize, x.numel(), lambda: uc.reduce_scatter(out, x), raw, expected, out
    )


def _broadcast(w: _World, nbytes: int, reorder: bool) -> _Case:
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

    return _Case(
        "broadcast", x.numel() * w.itemsize, x.numel(), lambda: uc.broadcast(x, 0), raw, expected,
        reset=lambda: x.copy_(w.tensor(mine)),
    )  # fmt: skip


def _expert_major_order(global_count: np.ndarray, world: int) -> np.ndarray:
    """The reorder a user writes by hand: rows arrive rank-major (source rank, then expert);
    sort them stably by (expert, source rank)."""
    counts = global_count.reshape(world, -1)
    experts = np.arange(counts.shape[1])
    keys = np.repeat((experts[None, :] * world + np.arange(world)[:, None]).ravel(), counts.ravel())
    return np.argsort(keys, kind="stable")


def _moe_case(op: str, w: _World, nbytes: int, reorder: bool) -> _Case:
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
    order = _expert_major_order(gc, w.world)
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
    return _Case(
        op, count * w.itemsize, count, lambda: call(x, lc, gc), raw, expected, None, None if reorder else transferred,
        transfer=_even_transfers(w, rows, hidden, 1),
    )  # fmt: skip


def _even_transfers(w: _World, rows: int, hidden: int, times: int) -> Callable[[], None]:
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


def _moe_topk(w: _World, nbytes: int, reorder: bool) -> _Case:
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
    return _Case("moe_topk", nbytes, x.numel(), unicoll, by_hand, expected, transfer=transfer, sent=sent)


_CASES: dict[str, Callable[[_World, int, bool], _Case]] = {  # (world, nbytes, reorder) -> case
    "alltoall_single": _alltoall_single,
    "all_gather": _all_gather,
    "global_scatter": partial(_moe_case, "global_scatter"),
    "global_gather": partial(_moe_case, "global_gather"),
    "all_reduce": _all_reduce,
    "reduce_scatter": _reduce_scatter,
    "broadcast": _broadcast,
    "moe_topk": _moe_topk,
}


def _check(w: _World, case: _Case) -> bool:
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


def _time(
    w: _World, calls: Sequence[Callable[[], Any]], iters: int, warmup: int, block: int, barrier: Callable[[], None]
) -> list[float]:
    """This rank's median time per call in µs of each of ``calls`` (unicoll's call, the raw
    call, ...), in their order.

    Each of the ``iters`` samples is a block of ``block`` back-to-back calls after a barrier
    (so the barrier's exit skew is paid once per block, as in nccl-tests); the calls alternate
    block by block, in reversed order every other iteration.
    """
    for _ in range(warmup):
        for call in calls:
            call()
    samples: list[list[float]] = [[] for _ in calls]
    order = list(enumerate(calls))
    for i in range(iters):
        for index, call in order if i % 2 == 0 else order[::-1]:
            barrier()
            w.sync()
            start = time.perf_counter_ns()
            for _ in range(block):
                call()
            w.sync()
            samples[index].append((time.perf_counter_ns() - start) / block)
    return [statistics.median(times) / 1e3 for times in samples]


def _bandwidths(op: str, nbytes: int, us: float, world: int) -> tuple[float, float]:
    """algbw and busbw in GB/s. nccl-tests (doc/PERFORMANCE.md): algbw = S / t with S the size
    column (for all_gather the whole output, sendcount * N elements; for reduce_scatter the whole
    input); busbw = algbw * 2(N-1)/N for AllReduce, algbw for Broadcast, and algbw * (N-1)/N for
    AllGather, ReduceScatter and AlltoAll, which we also use for the MoE operators (all-to-alls)."""
    algbw = nbytes / (us * 1e3)
    factor = {"all_reduce": 2 * (world - 1) / world, "broadcast": 1.0}.get(op, (world - 1) / world)
    return algbw, algbw * factor


def _sweep(config: Config, result_path: str, progress_path: str) -> None:
    w = _World(config)
    rows, steps, done = [], [(op, size) for op in config.ops for size in config.sizes()], 0
    for op, size in steps:
        case = _CASES[op](w, size, w.baseline.moe_reorder)
        correct = _check(w, case)
        block = min(_MAX_BLOCK, max(1, _BLOCK_BYTES // size))
        calls = [case.unicoll, case.raw] + ([] if case.transfer is None else [case.transfer])
        uc_us, raw_us, *transfer_us = _time(w, calls, config.iters, config.warmup, block, w.baseline.barrier)
        uc_us, raw_us, wrong, *transfer_us = w.baseline.slowest([uc_us, raw_us, 0.0 if correct else 1.0, *transfer_us])
        sent, slots = (0, 0) if case.sent is None else case.sent()
        sent, slots = w.baseline.slowest([float(sent), float(slots)])
        algbw, busbw = _bandwidths(op, case.nbytes, uc_us, w.world)
        raw_algbw, raw_busbw = _bandwidths(op, case.nbytes, raw_us, w.world)
        rows.append(
            {
                "op": op,
                "size_bytes": case.nbytes,
                "count": case.count,
                "dtype": config.dtype,
                "time_us": uc_us,
                "algbw_gbps": algbw,
                "busbw_gbps": busbw,
                "correct": wrong == 0.0,
                "raw_time_us": raw_us,
                "raw_algbw_gbps": raw_algbw,
                "raw_busbw_gbps": raw_busbw,
                "ratio": uc_us / raw_us,
                "transfer_time_us": transfer_us[0] if transfer_us else None,
                "transfer_ratio": uc_us / transfer_us[0] if transfer_us else None,
                "bytes_sent": int(sent) if case.sent else None,
                "bytes_one_row_per_slot": int(slots) if case.sent else None,
                "sent_ratio": sent / slots if case.sent and slots else None,
                "calls_per_sample": block,
            }
        )
        done += 1
        if w.rank == 0:
            write_atomically(progress_path, f"{done} {op} {case.nbytes}")
    overhead = _overhead(w)
    if w.rank == 0:
        result = {**_environment(w), "config": asdict(config), "rows": rows, "overhead": overhead}
        write_atomically(result_path, json.dumps(result))


def _overhead(w: _World) -> dict[str, Any]:
    """Per operator, on every rank of the sweep: the whole call at the front-end payload beside
    the raw call with the same arguments (the sweep's baseline: for the MoE operators on
    torch.distributed the transfer and the reorder by hand), the slowest rank's medians; what
    unicoll costs on top of the transport on this machine. The raw call is timed twice, in the
    same rotation: ``raw_again_ratio``, one against the other, is how far apart two identical
    calls measure here, the resolution of ``ratio``."""
    figures, samples = {}, _OVERHEAD_SAMPLES * w.config.iters
    for op in w.config.ops:
        case = _CASES[op](w, _FRONTEND_BYTES, w.baseline.moe_reorder)
        times = _time(w, [case.unicoll, case.raw, case.raw], samples, w.config.warmup, _MAX_BLOCK, w.baseline.barrier)
        uc_us, raw_us, again_us = w.baseline.slowest(times)
        figures[op] = {
            "unicoll_us": uc_us,
            "raw_us": raw_us,
            "difference_us": uc_us - raw_us,
            "ratio": uc_us / raw_us,
            "raw_again_ratio": again_us / raw_us,
        }
    blocks = {"samples": samples, "calls_per_sample": _MAX_BLOCK}
    return {"bytes": _FRONTEND_BYTES, "ranks": w.world, **blocks, "ops": figures}


def _single(config: Config, result_path: str) -> None:
    """On a world of one: the front end (:func:`_frontend`) and the memory copy (:func:`_copy`)."""
    w = _World(config)
    write_atomically(result_path, json.dumps({"frontend": _frontend(w), "copy": _copy(config)}))


def _copy(config: Config) -> list[dict[str, float]]:
    """A single-process memory copy (``numpy.copyto``, one thread) of each size of the sweep,
    timed as the sweep times a call: the median of blocks of back-to-back copies."""
    rows = []
    for size in config.sizes():
        src, dst = np.ones(size, dtype=np.uint8), np.zeros(size, dtype=np.uint8)
        block = min(_MAX_BLOCK, max(1, _BLOCK_BYTES // size))
        for _ in range(config.warmup + 1):
            np.copyto(dst, src)
        samples = []
        for _ in range(config.iters):
            start = time.perf_counter_ns()
            for _ in range(block):
                np.copyto(dst, src)
            samples.append((time.perf_counter_ns() - start) / block)
        ns = statistics.median(samples)
        rows.append({"size_bytes": size, "time_us": ns / 1e3, "gbps": size / ns})
    return rows


def _frontend(w: _World) -> dict[str, Any]:
    """Per operator: the front end alone (``frontend_us``: the call with the backend's transfer
    primitives stubbed out, less an empty call), and the whole call beside the raw transfer it
    issues (``unicoll_us``, ``raw_us`` and their ``difference_us``). For the MoE operators also
    ``frontend_fresh_counts_us``: the front end when every call brings new counts, so that
    neither the validator's memory nor a plan made for earlier counts can help."""
    from unicoll.runtime import transport_stubbed

    figures, calls = {}, _FRONTEND_PER_ITER * w.config.iters
    for op in w.config.ops:
        case = _CASES[op](w, _FRONTEND_BYTES, False)
        uc_us, raw_us = _time(w, [case.unicoll, case.raw], calls, calls // 10, 1, _none)
        with transport_stubbed():
            stubbed_us, empty_us = _time(w, [case.unicoll, _none], calls, calls // 10, 1, _none)
        figures[op] = {
            "frontend_us": stubbed_us - empty_us,
            "unicoll_us": uc_us,
            "raw_us": raw_us,
            "difference_us": uc_us - raw_us,
        }
        if op in ("global_scatter", "global_gather"):
            fresh = _with_fresh_counts(op, w, calls)
            with transport_stubbed():
                fresh_us, _ = _time(w, [fresh, _none], calls, 0, 1, _none)
            figures[op]["frontend_fresh_counts_us"] = fresh_us - empty_us
    return {"bytes": _FRONTEND_BYTES, "iters": calls, "ops": figures}


def _none() -> None:
    return None


def _with_fresh_counts(op: str, w: _World, calls: int) -> Callable[[], Any]:
    """A one-rank ``op`` call whose counts differ from every recent call's (as in training,
    where the router's counts change every step), so nothing derived from them is reused in
    ``calls`` calls.
    Rows of one element, at least 4 experts (one expert leaves one way to count 64 rows)."""
    import unicoll as uc

    rows = 64  # rows of one element: enough ways to split them that no counts come back soon
    x = w.tensor(w.bits(0, op, rows * w.itemsize, rows, 1))
    rng, slots = np.random.default_rng(w.config.seed), max(4, w.config.experts)  # one expert: one way
    distinct = {tuple(rng.multinomial(rows, np.full(slots, 1 / slots))) for _ in range(4 * calls)}
    pool = itertools.cycle([np.array(c, dtype=np.int64) for c in distinct])  # one rank: global = local
    call = getattr(uc, op)

    def fresh() -> Any:
        counts = next(pool)
        return call(x, counts, counts)

    return fresh


def _environment(w: _World) -> dict[str, Any]:
    import torch

    import unicoll as uc

    return {
        "unicoll": uc.__version__,
        "torch": torch.__version__,
        "backend": uc.get_backend(),
        "baseline": w.baseline.name,
        "world_size": w.world,
        "device": str(w.device),
        "cpus": os.cpu_count(),
        "threads_per_rank": torch.get_num_threads(),
    }


def _worker(argv: Sequence[str]) -> None:
    """``python -m unicoll.cli.bench sweep CONFIG RESULT PROGRESS`` or ``... single CONFIG RESULT``."""
    mode, encoded, *paths = argv
    fields = json.loads(encoded)
    config = Config(**{**fields, "ops": tuple(fields["ops"])})
    if mode == "sweep":
        _sweep(config, *paths)
    else:
        _single(config, *paths)


if __name__ == "__main__":
    _worker(sys.argv[1:])
