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

The command is here; what every rank of the sweep runs is in :mod:`unicoll.cli.bench_cases`
(each operator's case: buffers, calls, expected results) and :mod:`unicoll.cli.bench_sweep`
(the timing and the sweep), the one-rank world in :mod:`unicoll.cli.bench_single`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from ..launch import local as launcher
from ..launch import mpi as mpirun
from .bench_config import DTYPES, OPS, Config

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


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


def _worker(argv: Sequence[str]) -> None:
    """``python -m unicoll.cli.bench sweep CONFIG RESULT PROGRESS`` or ``... single CONFIG RESULT``."""
    mode, encoded, *paths = argv
    fields = json.loads(encoded)
    config = Config(**{**fields, "ops": tuple(fields["ops"])})
    if mode == "sweep":
        from .bench_sweep import sweep

        sweep(config, *paths)
    else:
        from .bench_single import single

        single(config, *paths)


if __name__ == "__main__":
    _worker(sys.argv[1:])
