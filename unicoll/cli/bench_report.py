"""What ``unicoll bench`` shows: the nccl-tests-style table, the front-end figures, the plot.

Every function takes the result dictionary that ``unicoll bench --json`` writes: the run's
environment and config (``baseline`` names the raw transport), ``rows`` (one per operator and
size), ``copy`` (a one-process memory copy of each size) and ``frontend``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_COLUMNS = (
    # (header, unit, width, row key, format)
    ("size", "(B)", 11, "size_bytes", "d"),
    ("count", "(elements)", 12, "count", "d"),
    ("type", "", 8, "dtype", "s"),
    ("op", "", 15, "op", "s"),
    ("time", "(us)", 10, "time_us", ".1f"),
    ("algbw", "(GB/s)", 7, "algbw_gbps", ".3f"),
    ("busbw", "(GB/s)", 7, "busbw_gbps", ".3f"),
    ("correct", "", 7, "correct", "s"),
    ("raw time", "(us)", 10, "raw_time_us", ".1f"),
    ("raw busbw", "(GB/s)", 9, "raw_busbw_gbps", ".3f"),
    ("ratio", "uc/raw", 6, "ratio", ".3f"),
    ("transfer", "uc/xfer", 8, "transfer_ratio", ".3f"),
    ("sent", "/slots", 7, "sent_ratio", ".3f"),
)


def format_table(result: dict[str, Any]) -> str:
    """The sweep as nccl-tests prints it: a ``#`` header, then one line per operator and size."""
    config = result["config"]
    lines = [
        f"# unicoll {result['unicoll']} bench: backend {result['backend']}, {result['world_size']} ranks on "
        f"{result['device']} ({result['cpus']} CPUs, torch threads per rank: {result['threads_per_rank']}), "
        f"torch {result['torch']}",
        f"# {config['iters']} timed iterations after {config['warmup']} warm-up, unicoll and raw interleaved; "
        f"time = median, slowest rank; experts per rank (MoE operators): {config['experts']}",
        f"# raw = {_raw_description(result['baseline'])}",
        "# transfer (MoE operators) = unicoll's time over that of the bare even all-to-alls of the rows they move "
        "(moe_topk: two, of tokens x 2 rows), timed in the same run: how close to the transport the step runs",
        "# sent (moe_topk) = the bytes a rank's dispatch sent the other ranks over one row per slot's, the rank "
        "that sends most: below 1 where each token went once per rank",
        "#",
        "#" + "  ".join(f"{name:>{width}}" for name, _, width, _, _ in _COLUMNS)[1:],
        "#" + "  ".join(f"{unit:>{width}}" for _, unit, width, _, _ in _COLUMNS)[1:],
    ]
    for row in result["rows"]:
        cells = []
        for _, _, width, key, spec in _COLUMNS:
            value = row.get(key)
            if value is None:
                text = "-"
            else:
                text = ("yes" if value else "NO") if isinstance(value, bool) else format(value, spec)
            cells.append(f"{text:>{width}}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def _raw_description(baseline: str) -> str:
    topk = "; for moe_topk: the same top-2 dispatch and combine written by hand with unicoll's four operators"
    if baseline == "mpi4py":
        return "bare mpi4py Alltoallv/Allgather of the same bytes (for the MoE operators: without the reorder)" + topk
    return f"{baseline} on the same buffers (for the MoE operators: the transfer and the reorder, by hand)" + topk


def format_copy(result: dict[str, Any]) -> str:
    """The single-process memory copy of each size, and each operator's busbw as a share of it."""
    ops = list(dict.fromkeys(row["op"] for row in result["rows"]))
    busbw = {(row["op"], row["size_bytes"]): row["busbw_gbps"] for row in result["rows"]}
    lines = [
        "# memory copy: one process, numpy.copyto of size bytes (one thread), median; busbw / copy per operator",
        f"# {'':>4}  {'size (B)':>11}  {'time (us)':>10}  {'copy (GB/s)':>11}" + "".join(f"  {op:>15}" for op in ops),
    ]
    for copy in result["copy"]:
        shares = [busbw.get((op, copy["size_bytes"])) for op in ops]
        lines.append(
            f"  copy  {copy['size_bytes']:>11d}  {copy['time_us']:10.1f}  {copy['gbps']:11.3f}"
            + "".join(f"  {'-' if b is None else format(b / copy['gbps'], '.3f'):>15}" for b in shares)
        )
    return "\n".join(lines)


def format_frontend(result: dict[str, Any]) -> str:
    """The front end's cost per operator (transport stubbed out), and the whole call beside
    the raw transfer, both on one rank."""
    frontend = result["frontend"]
    lines = [
        f"# one rank, {frontend['bytes']} B, median of {frontend['iters']} calls: front end = validation, "
        "dispatch, conversion and wrapping (transport stubbed out), with the same arguments every call and, "
        "for the MoE operators, with new counts every call; call = the whole call, beside the raw transfer",
        f"# {'op':>15}  {'front end (us)':>14}  {'new counts (us)':>15}  {'call (us)':>9}  {'raw (us)':>9}  "
        f"{'difference (us)':>15}",
    ]
    for op, f in frontend["ops"].items():
        fresh = f.get("frontend_fresh_counts_us")
        lines.append(
            f"  {op:>15}  {f['frontend_us']:14.2f}  {'-' if fresh is None else format(fresh, '.2f'):>15}  "
            f"{f['unicoll_us']:9.2f}  {f['raw_us']:9.2f}  {f['difference_us']:15.2f}"
        )
    return "\n".join(lines)


def format_overhead(result: dict[str, Any]) -> str:
    """The whole call beside the raw call with the same arguments, on the sweep's ranks: what
    unicoll adds to the transport on this machine; and the raw call against itself, timed in
    the same rotation: a ratio that close to 1 is within what this machine can tell apart."""
    overhead = result["overhead"]
    lines = [
        f"# {overhead['ranks']} ranks, {overhead['bytes']} B, median of {overhead['samples']} samples of "
        f"{overhead['calls_per_sample']} calls, slowest rank: call = the whole unicoll call, raw = the raw call "
        "with the same arguments (as in the sweep), raw/raw = the raw call timed twice, one against the other",
        f"# {'op':>15}  {'call (us)':>9}  {'raw (us)':>9}  {'difference (us)':>15}  {'ratio':>6}  {'raw/raw':>7}",
    ]
    for op, f in overhead["ops"].items():
        lines.append(
            f"  {op:>15}  {f['unicoll_us']:9.2f}  {f['raw_us']:9.2f}  {f['difference_us']:15.2f}  {f['ratio']:6.3f}"
            f"  {f['raw_again_ratio']:7.3f}"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Draw busbw against size (log-2 axis), unicoll and raw, one panel per operator, to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(row["op"] for row in result["rows"]))
    fig, axes = plt.subplots(1, len(ops), figsize=(4.5 * len(ops), 3.8), squeeze=False)
    for ax, op in zip(axes[0], ops):
        rows = [row for row in result["rows"] if row["op"] == op]
        sizes = [row["size_bytes"] for row in rows]
        ax.plot(sizes, [row["busbw_gbps"] for row in rows], "o-", label="unicoll")
        ax.plot(sizes, [row["raw_busbw_gbps"] for row in rows], "s--", label=f"raw {result['baseline']}")
        ax.set_xscale("log", base=2)
        ax.set_title(op)
        ax.set_xlabel("size per rank (B)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"unicoll bench: {result['backend']}, {result['world_size']} ranks, {result['config']['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
