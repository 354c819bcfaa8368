"""``unicoll bench --moe-modes``: one MoE step (dispatch, identity experts, combine) in
unicoll.moe's two modes beside the same step written by hand on the raw transport.

Each rank routes ``--tokens`` tokens of ``--hidden`` float32 to k experts of W * E (random
distinct experts, random weights, a new routing every step from a few cycled), for k in 2 and 8
and capacity factors 1.0, 1.25 and 2.0: the capacity C is ``ceil(factor * tokens * k / (W * E))``
rows per (source rank, expert), the same in the three steps, which therefore drop the same slots
and return the same result (checked once per case):

- **static**: ``moe.dispatch_static`` + ``moe.combine_static`` (blocks of C rows; on a host
  backend only their valid rows travel, after a fixed-size count exchange, and on a device
  backend the whole blocks, padding included);
- **dynamic**: ``moe.dispatch(..., capacity=C)`` + ``moe.combine``;
- **by hand**: what a user writes on the raw transport (torch.distributed, or mpi4py on ``mpi``)
  with the permutation computed every step: sort the slots by expert, cut each expert's slots
  at C, exchange the counts, send the rows, reorder them expert-major (where experts would run)
  and back, send them back, weigh and sum each token's slots.

The three run interleaved, each after a barrier; a figure is the median step of the slowest
rank. Printed per case: the three times, their ratios, the bytes each rank sends per step (rows
there and back and the counts) and the fraction of the static mode's rows that are padding.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..launch import local as launcher
from ..launch import mpi as mpirun

TOPK = (2, 8)
FACTORS = (1.0, 1.25, 2.0)
ROUTINGS = 3


def run(args: argparse.Namespace) -> int:
    """Run the grid on ``args.nprocs`` ranks and print the table."""
    config = dict(backend=args.backend, tokens=args.tokens, hidden=args.hidden or 1024, experts=args.experts,
                  iters=args.iters, warmup=args.warmup, seed=args.seed)  # fmt: skip
    start = mpirun.run if (args.backend or os.environ.get("UNICOLL_BACKEND")) == "mpi" else launcher.run
    with tempfile.TemporaryDirectory(prefix="unicoll-bench-modes-") as tmp:
        result = os.path.join(tmp, "modes.json")
        code = start(args.nprocs, ["-m", __name__, json.dumps(config), result])
        if code != 0:
            return code
        rows = json.loads(Path(result).read_text())
    print(format_table(config, rows))
    if args.json is not None:
        args.json.write_text(json.dumps(dict(config=config, rows=rows), indent=1) + "\n")
    return 0 if all(row["correct"] for row in rows) else 1


def format_table(config: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The grid as a table (times in ms, bytes in MiB per rank and step)."""
    backend, world = (rows[0]["backend"], rows[0]["world"]) if rows else ("?", "?")
    head = (
        f"# unicoll bench --moe-modes: backend {backend}, {world} ranks, {config['tokens']} tokens x "
        f"{config['hidden']} float32 per rank, {config['experts']} experts per rank; median step of the slowest rank; "
        "MiB sent per rank and step (rows there and back, counts); padding = share of the static mode's rows that "
        "hold no token\n"
        f"# {'k':>2} {'factor':>6} {'C':>6} | {'static':>9} {'dynamic':>9} {'by hand':>9} | {'st/dyn':>6} "
        f"{'dyn/hand':>8} {'st/hand':>7} | {'MiB st':>7} {'MiB dyn':>7} {'padding':>7} ok"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"  {r['k']:>2} {r['factor']:>6.2f} {r['capacity']:>6} | {r['static_ms']:9.2f} {r['dynamic_ms']:9.2f} "
            f"{r['hand_ms']:9.2f} | {r['static_ms'] / r['dynamic_ms']:6.2f} {r['dynamic_ms'] / r['hand_ms']:8.2f} "
            f"{r['static_ms'] / r['hand_ms']:7.2f} | {r['static_mib']:7.1f} {r['dynamic_mib']:7.1f} "
            f"{100 * r['padding']:6.1f}% {'yes' if r['correct'] else 'NO'}"
        )
    return "\n".join(lines)


# -- on every rank ---------------------------------------------------------------------------


def _routings(config: dict[str, Any], rank: int, world: int, k: int) -> list[tuple[Any, Any]]:
    """A few (topk_idx, topk_weights) of this rank: k distinct random experts per token."""
    import numpy as np
    import torch

    rng = np.random.default_rng([config["seed"], rank, k])
    experts = world * config["experts"]
    out = []
    for _ in range(ROUTINGS):
        ids = rng.random((config["tokens"], experts)).argsort(axis=1)[:, :k]
        out.append((torch.from_numpy(ids.copy()), torch.from_numpy(rng.random((config["tokens"], k), np.float32))))
    return out


def _by_hand(baseline: Any, world: int, experts: int, capacity: int) -> Callable[..., Any]:
    """The MoE step on the raw transport, as a user writes it (see the module's docstring)."""
    import torch

    def step(x: Any, ids: Any, weights: Any) -> Any:
        tokens, k = ids.shape
        slots = ids.reshape(-1)
        order = torch.argsort(slots, stable=True)
        counts = torch.bincount(slots, minlength=world * experts)
        starts = counts.cumsum(0) - counts
        kept = order[torch.arange(order.numel()) - starts[slots[order]] < capacity]  # the first C of each expert
        sent_counts = counts.clamp(max=capacity)
        got_counts = torch.empty_like(sent_counts)
        baseline.alltoallv(got_counts, sent_counts, [experts] * world, [experts] * world)()
        send = sent_counts.view(world, experts).sum(1).tolist()
        recv = got_counts.view(world, experts).sum(1).tolist()
        received = x.new_empty((sum(recv), x.shape[1]))
        baseline.alltoallv(received, x.index_select(0, kept // k), recv, send)()
        grid = got_counts.view(world, experts)  # [c, e]: rows from rank c for expert e, rank-major
        first = (grid.reshape(-1).cumsum(0) - grid.reshape(-1)).view(world, experts)
        lengths = grid.t().reshape(-1)
        to_experts = torch.repeat_interleave(first.t().reshape(-1) - (lengths.cumsum(0) - lengths), lengths)
        to_experts += torch.arange(to_experts.numel())
        outputs = received.index_select(0, to_experts)  # expert-major: the experts (identity) run here
        back_rows = torch.empty_like(outputs)
        back_rows[to_experts] = outputs
        back = x.new_empty((kept.numel(), x.shape[1]))
        baseline.alltoallv(back, back_rows, send, recv)()
        out = torch.zeros_like(x)
        return out.index_add_(0, kept // k, back * weights.reshape(-1)[kept, None])

    return step


def _median_slowest(baseline: Any, samples: list[float]) -> float:
    """The median of this rank's samples, the slowest rank's."""
    return baseline.slowest([statistics.median(samples)])[0]


def _case(config: dict[str, Any], baseline: Any, k: int, factor: float) -> dict[str, Any]:
    """One (k, capacity factor) case on this rank: checked once, then timed."""
    import numpy as np
    import torch
    from array_api_compat import array_namespace

    import unicoll as uc
    from unicoll.runtime import state
    from unicoll.static_layout import static_layout

    rank, world, experts = uc.get_rank(), uc.get_world_size(), config["experts"]
    tokens, hidden = config["tokens"], config["hidden"]
    capacity = math.ceil(factor * tokens * k / (world * experts))
    x = torch.from_numpy(np.random.default_rng([config["seed"], rank]).random((tokens, hidden), np.float32))
    routings = _routings(config, rank, world, k)
    hand = _by_hand(baseline, world, experts, capacity)
    turn = [0]

    def static(i: int) -> Any:
        ids, w = routings[i]
        rows, _, handle = uc.moe.dispatch_static(x, ids, w, experts_per_rank=experts, capacity=capacity)
        return uc.moe.combine_static(rows, handle)

    def dynamic(i: int) -> Any:
        ids, w = routings[i]
        rows, _, handle = uc.moe.dispatch(x, ids, w, experts_per_rank=experts, capacity=capacity)
        return uc.moe.combine(rows, handle)

    def by_hand(i: int) -> Any:
        ids, w = routings[i]
        return hand(x, ids, w)

    results = [f(0) for f in (static, dynamic, by_hand)]
    correct = all(torch.allclose(results[0], r, rtol=1e-5, atol=1e-5) for r in results[1:])
    steps = (static, dynamic, by_hand)
    times: list[list[float]] = [[], [], []]
    for i in range(config["warmup"] + config["iters"]):
        for kept, step in zip(times, steps):
            baseline.barrier()
            began = time.perf_counter()
            step(turn[0] % ROUTINGS)
            if i >= config["warmup"]:
                kept.append(time.perf_counter() - began)
        turn[0] += 1
    ids, _ = routings[0]
    layout = static_layout(array_namespace(ids), ids, world * experts, capacity)
    row_bytes, count_bytes = hidden * 4, world * experts * 8
    sent_rows = int(layout.sent.sum())
    static_rows = sent_rows if state("bench").backend.host_memory else world * experts * capacity
    static_mib = (2 * static_rows * row_bytes + 2 * count_bytes) / 2**20
    dynamic_mib = (2 * sent_rows * row_bytes + count_bytes) / 2**20
    padding = 1 - sent_rows / (world * experts * capacity)
    static_ms, dynamic_ms, hand_ms = (1e3 * _median_slowest(baseline, t) for t in times)
    everywhere = baseline.slowest([0.0 if correct else 1.0])[0] == 0
    return dict(backend=uc.get_backend(), world=world, k=k, factor=factor, capacity=capacity, static_ms=static_ms,
                dynamic_ms=dynamic_ms, hand_ms=hand_ms, static_mib=static_mib, dynamic_mib=dynamic_mib,
                padding=baseline.slowest([padding])[0], correct=everywhere)  # fmt: skip


def _worker(encoded: str, result_path: str) -> None:
    """``python -m unicoll.cli.bench_modes CONFIG RESULT``: every case on this rank; rank 0 writes the rows."""
    import torch

    import unicoll as uc

    from .bench_baselines import for_backend

    config = json.loads(encoded)
    uc.init(config["backend"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // uc.get_world_size()))
    baseline = for_backend(uc.get_backend())
    rows = [_case(config, baseline, k, factor) for k in TOPK for factor in FACTORS]
    if uc.get_rank() == 0:
        Path(result_path).write_text(json.dumps(rows))
    uc.finalize()


if __name__ == "__main__":
    _worker(*sys.argv[1:])
