"""The ``unicoll`` command: ``unicoll run`` starts a local world, ``unicoll info`` reports,
``unicoll bench`` times the operators (see :mod:`unicoll.cli.bench`).

``unicoll run -n 4 train.py --lr 1e-3`` runs ``train.py`` as 4 ranks on this machine (see
:mod:`unicoll.launch.local`); ``unicoll run -n 4 -m package.module`` runs a module instead, and
``unicoll run --mpi -n 4 train.py`` starts the ranks as an MPI job (see :mod:`unicoll.launch.mpi`).
``unicoll info`` prints the backends available here. Nothing heavy is imported before a
subcommand needs it, so the command starts at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..launch import local as launcher
from ..launch import mpi as mpirun


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``unicoll`` command line (``argv`` defaults to ``sys.argv[1:]``); return its code."""
    args = _parser().parse_args(argv)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    """Build the argument parser with its ``run``, ``info`` and ``bench`` subcommands."""
    parser = argparse.ArgumentParser(
        prog="unicoll",
        description="Mixture-of-Experts collectives for numpy, torch and cupy arrays.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        help="run a Python script or module as N ranks on this machine",
        description="Run `python SCRIPT ARGS...` (or `python -m MODULE ARGS...`) as N ranks on "
        "this machine, with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and "
        "MASTER_PORT set. Output lines are prefixed with [rank K]; the first rank to fail "
        "stops the others and its exit code is returned. For a job of several machines, run it "
        "on each with --nnodes, --node-rank, --master-addr and --master-port, as with torchrun. "
        "With --mpi the ranks are an MPI job started by mpiexec (the mpi backend; rank and size "
        "come from MPI).",
    )
    run.add_argument("-n", "--nprocs", type=_positive_int, required=True, help="number of ranks (on this node)")
    run.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name")
    run.add_argument("--nnodes", type=_positive_int, help="number of nodes (machines) of the job (default: 1)")
    run.add_argument("--node-rank", type=int, help="this node's number, 0 to NNODES-1 (node 0 hosts rank 0)")
    run.add_argument(
        "--master-addr", help="rendezvous address: an address of node 0 that every node reaches (default: 127.0.0.1)"
    )
    run.add_argument("--master-port", type=int, help="rendezvous port (default on one node: a free one)")
    run.add_argument(
        "--mpi",
        action="store_true",
        help="start the ranks with mpiexec as an MPI job, with UNICOLL_BACKEND=mpi unless it is set",
    )
    run.add_argument("--mpiexec", metavar="PATH", help="the MPI launcher for --mpi (default: the one beside python)")
    run.add_argument("script", metavar="SCRIPT", help="the script (or module) every rank runs")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments passed to SCRIPT")
    run.set_defaults(handler=_run)

    info = commands.add_parser("info", help="show the backends available on this machine")
    info.set_defaults(handler=_info)

    from . import bench  # imports nothing heavy; torch loads in the ranks it starts

    timings = commands.add_parser(
        "bench",
        help="time the operators against raw torch.distributed, nccl-tests style",
        description="Start N ranks and time each operator at sizes doubling from --min-bytes to "
        "--max-bytes, beside the raw torch.distributed call that does the same work, then the "
        "front end's own cost on one rank. Prints a table like nccl-tests'.",
    )
    bench.add_arguments(timings)
    timings.set_defaults(handler=bench.run)
    return parser


def _run(args: argparse.Namespace) -> int:
    """``unicoll run``: start the world and return the code of its first failing rank, or 0
    (with ``--mpi``, the MPI launcher's exit code); 2, with the reason, for flags that cannot
    start a job."""
    argv = ["-m", args.script, *args.args] if args.module else [args.script, *args.args]
    if args.mpi:
        if any(flag is not None for flag in (args.master_addr, args.master_port, args.nnodes, args.node_rank)):
            print(
                "unicoll run: --master-addr/--master-port/--nnodes/--node-rank do not apply to --mpi "
                "(MPI connects the ranks; its launcher places them on nodes)",
                file=sys.stderr,
            )
            return 2
        try:
            mpiexec = mpirun.find_mpiexec(args.mpiexec)
        except FileNotFoundError as exc:  # --mpiexec names no executable, or no MPI launcher is installed
            print(exc, file=sys.stderr)
            return 2
        return mpirun.run(args.nprocs, argv, mpiexec=mpiexec)
    if args.mpiexec is not None:
        print("unicoll run: --mpiexec needs --mpi", file=sys.stderr)
        return 2
    nnodes = args.nnodes or 1
    if args.node_rank is None and nnodes > 1:
        print(
            f"unicoll run: --node-rank: expected this node's number from 0 to {nnodes - 1}, got none", file=sys.stderr
        )
        return 2
    try:
        return launcher.run(
            args.nprocs,
            argv,
            master_addr=args.master_addr or "127.0.0.1",
            master_port=args.master_port,
            nnodes=nnodes,
            node_rank=args.node_rank or 0,
        )
    except ValueError as exc:  # the rendezvous's flags, checked before any rank starts
        print(exc, file=sys.stderr)
        return 2


def _info(args: argparse.Namespace) -> int:
    """``unicoll info``: print what :func:`unicoll.registry.format_info` reports."""
    from ..registry import format_info

    print(format_info())
    return 0


def _positive_int(text: str) -> int:
    """Parse a command-line integer that must be at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)
