"""Each token sent once per rank against one row per slot: bytes and step times, side by side.

    python benchmarks/moe_once.py [--backend gloo --backend mpi] [--world 2 --world 4]
                                  [--topk 2 --topk 8] [--experts 4 --experts 8]
                                  [--tokens 4096] [--hidden 1024] [--iters 5] [--static | --compiled]

For each backend and world size, one world (one thread per rank) runs every (top-k, experts per
rank) case on ``--tokens`` tokens of ``--hidden`` float32 per rank, routed to random distinct
experts with random weights, a new routing every step (three are cycled). Interleaved, each
after a barrier: ``moe.dispatch`` + ``moe.combine`` with one row per slot (``UNICOLL_MOE_ONCE=0``,
the form before) and with each token once per rank (the default), each alone and with its
backward pass; and the same forward step by hand on the raw transport (torch.distributed's
``all_to_all_single`` on gloo, mpi4py's ``Alltoallv`` on mpi: the counts' exchange, the sort,
the gather, the rows there and back, the weighted sum), one row per slot. Printed per case:
the bytes of rows the ranks' dispatches sent each other (both forms, summed over the ranks),
and the median step of the slowest rank in milliseconds. ``--static``: the static-shape mode
(``moe.dispatch_static`` + ``moe.combine_static``) at a capacity factor of 1.25 (no slot of
these routings is dropped), against the same step by hand. ``--compiled``: that step compiled
(``fullgraph``, static shapes, aot_eager), its whole blocks (plain) against each token once per
rank in fixed shapes (``max_tokens_per_rank=--tokens``: unicoll.once_blocks), whose bytes come
from the arguments (the form is what a GPU backend sends).
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
from pathlib import Path

from raw_transport import counted_by_hand, raw_transport  # beside this script


def _hand_step(x, ids, weights, experts: int, world: int, alltoallv):
    """The forward step by hand, one row per slot: counts exchanged, rows sorted by expert and
    sent, sent back unchanged (identity experts), unsorted and weighed."""
    import torch

    tokens, k = ids.shape
    order, _, send_splits, recv_splits = counted_by_hand(ids, world, experts, alltoallv)
    received = alltoallv(x.index_select(0, order // k), send_splits, recv_splits)
    back = alltoallv(received, recv_splits, send_splits)
    unsorted = torch.empty_like(back)
    unsorted[order] = back
    return (unsorted.reshape(tokens, k, -1) * weights[..., None]).sum(1)


def _case(config: dict, k: int, experts: int, alltoallv) -> dict:
    import numpy as np
    import torch

    import unicoll as uc
    from unicoll import once_blocks

    rank, world = uc.get_rank(), uc.get_world_size()
    tokens, hidden = config["tokens"], config["hidden"]
    rng = np.random.default_rng([rank, k, experts])
    x = torch.from_numpy(rng.standard_normal((tokens, hidden), dtype=np.float32))
    routings = []
    for _ in range(3):
        ids = torch.from_numpy(rng.random((tokens, world * experts)).argsort(axis=1)[:, :k].copy())
        routings.append((ids, torch.from_numpy(rng.random((tokens, k), dtype=np.float32))))
    turn, sent = [0], {}
    capacity = math.ceil(1.25 * tokens * k / (world * experts)) if config["static"] or config["compiled"] else 0
    gradient = torch.from_numpy(rng.standard_normal((tokens, hidden), dtype=np.float32))

    compiled = {}
    if config["compiled"]:
        bounds = {"0": None, "1": tokens}

        def static_step(xs, ids, ws, bound):
            rows, _, handle = uc.moe.dispatch_static(xs, ids, ws, experts_per_rank=experts, capacity=capacity,
                                                     max_tokens_per_rank=bound)  # fmt: skip
            return uc.moe.combine_static(rows * 2.0, handle)

        torch._dynamo.reset()  # each case compiles afresh: its closure's sizes differ from the last case's
        compiled = {once: torch.compile(static_step, fullgraph=True, dynamic=False, backend="aot_eager")
                    for once in bounds}  # fmt: skip
        row, per_rank = hidden * 4, once_blocks.rows_per_rank(tokens, experts, capacity)
        for once, bound in bounds.items():
            used = once_blocks.chosen(bound, world, experts, capacity, x, k)
            whole = (world - 1) * experts * capacity * row
            sent[once] = ((world - 1) * per_rank * (row + once_blocks.META_BYTES * k) if used else whole, whole)

    def step(once: str, backward: bool):
        def run():
            ids, weights = routings[turn[0] % 3]
            turn[0] += 1
            os.environ["UNICOLL_MOE_ONCE"] = once
            xs, ws = (x.requires_grad_(), weights.requires_grad_()) if backward else (x, weights)
            if compiled:
                out = compiled[once](xs, ids, ws, bounds[once])
            elif capacity:
                rows, _, handle = uc.moe.dispatch_static(xs, ids, ws, experts_per_rank=experts, capacity=capacity)
                out = uc.moe.combine_static(rows * 2.0, handle)
                sent[once] = (handle.bytes_sent, handle.bytes_one_row_per_slot)
            else:
                rows, _, handle = uc.moe.dispatch(xs, ids, ws, experts_per_rank=experts)
                out = uc.moe.combine(rows * 2.0, handle)
                sent[once] = (handle.bytes_sent, handle.bytes_one_row_per_slot)
            if backward:
                (out * gradient).sum().backward()
                xs.grad = ws.grad = None
                xs.requires_grad_(False), ws.requires_grad_(False)
            return out

        return run

    def by_hand():
        ids, weights = routings[turn[0] % 3]
        turn[0] += 1
        return _hand_step(x, ids, weights, experts, world, alltoallv)

    ids, weights = routings[0]
    expected = (x[:, None, :] * weights[:, :, None]).sum(1) * 2.0
    correct = True
    for check in (step("0", False), step("1", False), lambda: by_hand() * 2.0):
        turn[0] = 0
        correct &= bool(torch.allclose(check(), expected, rtol=1e-4, atol=1e-4))
    calls = {
        "plain": step("0", False),
        "once": step("1", False),
        "plain+bwd": step("0", True),
        "once+bwd": step("1", True),
        "by hand": by_hand,
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(config["iters"] + 2):
        for name, fn in calls.items():
            turn[0] = i
            uc.barrier()
            start = time.perf_counter()
            fn()
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    medians = np.array([statistics.median(t) for t in times.values()], dtype=np.float64)
    byte_counts = np.array([*sent["0"], *sent["1"]], dtype=np.float64)
    slowest = uc.all_gather(None, medians.reshape(1, -1)).max(0)
    summed = uc.all_gather(None, byte_counts.reshape(1, -1)).sum(0)
    return dict(k=k, experts=experts, ms={n: float(t) * 1e3 for n, t in zip(calls, slowest)},
                plain_bytes=int(summed[0]), once_bytes=int(summed[2]), slot_bytes=int(summed[3]),
                correct=correct)  # fmt: skip


def _worker(config: dict) -> None:
    import torch

    import unicoll as uc

    torch.set_num_threads(1)
    uc.init(config["backend"])
    alltoallv, _ = raw_transport(config["backend"])
    results = [_case(config, k, e, alltoallv) for k in config["topk"] for e in config["experts"]]
    if uc.get_rank() == 0:
        Path(config["out"]).write_text(json.dumps(results))
    uc.finalize()


def _run_world(backend: str, world: int, config: dict) -> list[dict]:
    from unicoll.launch import local, mpi

    with tempfile.TemporaryDirectory() as tmp:
        config = {**config, "backend": backend, "out": os.path.join(tmp, "out.json")}
        start = mpi.run if backend == "mpi" else local.run
        code = start(world, [os.path.abspath(__file__), "--worker", json.dumps(config)], env={"OMP_NUM_THREADS": "1"})
        if code != 0:
            raise SystemExit(f"the {backend} world of {world} failed with exit code {code}")
        return json.loads(Path(config["out"]).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", action="append", choices=("gloo", "mpi"))
    parser.add_argument("--world", action="append", type=int)
    parser.add_argument("--topk", action="append", type=int)
    parser.add_argument("--experts", action="append", type=int, help="experts per rank")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--static", action="store_true", help="the static-shape mode")
    parser.add_argument("--compiled", action="store_true", help="the static-shape mode compiled, whole blocks "
                        "against max_tokens_per_rank=--tokens")  # fmt: skip
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(json.loads(args.worker))
    config = dict(topk=args.topk or [2, 8], experts=args.experts or [4, 8], tokens=args.tokens,
                  hidden=args.hidden, iters=args.iters, static=args.static, compiled=args.compiled)  # fmt: skip
    mode = "the static-shape mode, capacity factor 1.25" if args.static else "the dynamic mode"
    if args.compiled:
        mode = "the static-shape mode compiled (aot_eager), capacity factor 1.25; plain: whole blocks"
    print(f"# {mode}: {args.tokens} tokens x {args.hidden} float32 per rank, one thread per rank; bytes: rows (and the")
    print("# once form's metadata) the ranks' dispatches sent each other, summed; times: median step, slowest rank")
    print(f"# {'backend':<7} {'W':>2} {'k':>2} {'E':>2} | {'plain MiB':>9} {'once MiB':>8} {'once/plain':>10} | "
          f"{'plain':>7} {'once':>7} {'o/p':>5} | {'plain+bwd':>9} {'once+bwd':>9} {'o/p':>5} | {'by hand':>7} "
          f"{'once/hand':>9} ok")  # fmt: skip
    for backend in args.backend or ["gloo", "mpi"]:
        for world in args.world or [2, 4]:
            for r in _run_world(backend, world, config):
                ms, mib = r["ms"], 2**20
                print(
                    f"  {backend:<7} {world:>2} {r['k']:>2} {r['experts']:>2} | {r['plain_bytes'] / mib:9.1f} "
                    f"{r['once_bytes'] / mib:8.1f} {r['once_bytes'] / max(r['plain_bytes'], 1):10.3f} | "
                    f"{ms['plain']:7.1f} {ms['once']:7.1f} {ms['once'] / ms['plain']:5.2f} | "
                    f"{ms['plain+bwd']:9.1f} {ms['once+bwd']:9.1f} {ms['once+bwd'] / ms['plain+bwd']:5.2f} | "
                    f"{ms['by hand']:7.1f} {ms['once'] / ms['by hand']:9.2f} {'yes' if r['correct'] else 'NO'}",
                    flush=True,
                )


if __name__ == "__main__":
    sys.exit(main())
