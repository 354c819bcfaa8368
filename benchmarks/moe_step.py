"""The MoE step beside the raw transport: ``moe.dispatch`` + ``moe.combine`` and
``global_scatter`` + ``global_gather`` against two even all-to-alls of the same bytes.

    python benchmarks/moe_step.py [--backend gloo --backend mpi] [--size 64K ...] [--topk 2 ...]
                                  [--old PATH] [--iters N] [--profile]

For each backend, one world of 2 ranks (one thread each) runs every (size, top-k) case: a size
is the bytes of the dispatched rows per rank (tokens x k rows of ``--hidden`` float32), the
tokens routed to random distinct experts (4 per rank) with random weights, a new routing every
step (a few are cycled). Each step is timed beside the raw transfer of its bytes, interleaved
(barrier, unicoll, barrier, raw): two even ``all_to_all_single`` (gloo) or ``Alltoall`` (mpi)
into buffers made once. Printed per case: the median step of the slowest rank, the raw pair,
their ratio, the floor (the raw pair plus the step's local work written by hand with torch into
buffers made once, timed alone in the same rotation, over the raw pair: with no idle core to
hide it behind the transfers, no step reaches a lower ratio), and the peak resident memory the
step loop adds on a rank, warm-up included (``VmHWM`` after the loop less ``VmRSS`` before it,
the peak reset through ``/proc/self/clear_refs``), so memory a backend keeps between steps
counts.

``--old PATH`` runs the same cases on another checkout first (a git worktree of an older
commit, with ``unicoll/backends`` linked to its ``backends/``), in the same run, so the two
columns compare. ``--profile`` prints each rank's cProfile of the largest case instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

EXPERTS_PER_RANK = 4


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _read_status(field: str) -> int:
    """A ``/proc/self/status`` figure in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise LookupError(field)


def _reset_peak() -> int:
    """Reset the peak resident set (``VmHWM``) to the current one; return the current one."""
    Path("/proc/self/clear_refs").write_text("5")
    return _read_status("VmRSS")


def _raw_pair(backend: str):
    """Two even all-to-alls of ``a``'s rows, there and back: ``Alltoall`` on mpi, else
    ``all_to_all_single``."""
    if backend == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD.Dup()

        def pair(a, b) -> None:
            an, bn = a.numpy(), b.numpy()
            comm.Alltoall(an, bn)
            comm.Alltoall(bn, an)

        return pair
    import torch.distributed as dist

    def pair(a, b) -> None:
        dist.all_to_all_single(b, a)
        dist.all_to_all_single(a, b)

    return pair


def _timed(step, raw, iters: int, warmup: int, local=None) -> tuple[float, float, int, float]:
    """Median seconds of ``step``, ``raw`` and ``local`` (interleaved, each after a barrier; 0
    without ``local``) and the peak resident memory from the first warm-up call on (less what was
    resident before), each the slowest rank's."""
    import numpy as np

    import unicoll as uc

    base = _reset_peak()
    for _ in range(warmup):
        step(), raw()
    times: list[list[float]] = [[], [], []]
    for _ in range(iters):
        for kept, fn in zip(times, (step, raw, local)):
            if fn is None:
                continue
            uc.barrier()
            start = time.perf_counter()
            fn()
            kept.append(time.perf_counter() - start)
    peak = _read_status("VmHWM") - base
    figures = [statistics.median(t) if t else 0.0 for t in times] + [peak]
    slowest = uc.all_gather(None, np.array(figures, dtype=np.float64).reshape(1, 4)).max(0)
    return float(slowest[0]), float(slowest[1]), int(slowest[3]), float(slowest[2])


def _local_work(x, routings, k: int):
    """The work a step must do beside its two transfers, written by hand with torch into buffers
    made once: sort the slots by expert (numpy's radix sort of 16-bit ids, the fastest here),
    gather x's rows into that order, and weigh and sum each token's k rows back (here straight
    from the gathered rows, which no transfer moved)."""
    import numpy as np
    import torch

    tokens = x.shape[0]
    sent, out, rows = torch.empty(tokens * k, x.shape[1]), torch.empty_like(x), torch.empty_like(x)
    turn = [0]

    def work() -> None:
        ids, weights, _, _ = routings[turn[0] % 3]
        turn[0] += 1
        order = torch.from_numpy(np.argsort(ids.numpy().reshape(-1).astype(np.int16), kind="stable"))
        torch.index_select(x, 0, order // k, out=sent)
        slot_row = torch.empty_like(order)
        slot_row[order] = torch.arange(order.numel())
        slot_row = slot_row.view(tokens, k)
        for j in range(k):
            torch.index_select(sent, 0, slot_row[:, j], out=rows if j else out)
            if j == 0:
                out.mul_(weights[:, :1])
            else:
                out.addcmul_(rows, weights[:, j : j + 1])

    work()  # the buffers' pages faulted in before the peak memory is reset
    return work


def _case(config: dict, size: int, k: int, raw_pair) -> dict | None:
    """One (size, top-k) case on this rank: checked, then timed (or profiled)."""
    import numpy as np
    import torch

    import unicoll as uc

    rank, world, hidden = uc.get_rank(), uc.get_world_size(), config["hidden"]
    experts = world * EXPERTS_PER_RANK
    tokens = max(1, size // (4 * hidden * k))
    rng = np.random.default_rng([rank, size, k])
    x = torch.from_numpy(rng.standard_normal((tokens, hidden), dtype=np.float32))
    routings = []
    for _ in range(3):
        ids = torch.from_numpy(rng.random((tokens, experts)).argsort(axis=1)[:, :k].copy())
        weights = torch.from_numpy(rng.random((tokens, k), dtype=np.float32))
        local = torch.bincount(ids.reshape(-1), minlength=experts)
        routings.append((ids, weights, local, uc.exchange_counts(local)))
    sent = x.repeat_interleave(k, 0)  # global_scatter's input: as many rows as dispatch sends
    a = torch.zeros(tokens * k - tokens * k % world, hidden)
    b = torch.empty_like(a)
    turn = [0]

    def dispatch_combine():
        ids, weights, _, _ = routings[turn[0] % 3]
        turn[0] += 1
        rows, _, handle = uc.moe.dispatch(x, ids, weights, experts_per_rank=EXPERTS_PER_RANK)
        return uc.moe.combine(rows, handle)

    def scatter_gather():
        _, _, local, glob = routings[turn[0] % 3]
        turn[0] += 1
        return uc.global_gather(uc.global_scatter(sent, local, glob), local, glob)

    out = dispatch_combine()  # identity experts: each token comes back weighted by its weights' sum
    turn[0] = 0
    correct = bool(torch.allclose(out, x * routings[0][1].sum(1, keepdim=True), rtol=1e-5, atol=1e-5))
    correct &= bool(torch.equal(scatter_gather(), sent))
    turn[0] = 0
    if config["profile"]:
        import cProfile
        import io
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        for _ in range(config["iters"]):
            dispatch_combine()
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
        print(f"--- rank {rank}: {config['iters']} x dispatch+combine, {size} B, top-{k}\n{text.getvalue()}")
        return None
    iters, warmup = (config["iters"], 2) if size >= 1 << 23 else (3 * config["iters"], 5)
    local = _local_work(x, routings, k)
    step_s, raw_s, step_peak, local_s = _timed(dispatch_combine, lambda: raw_pair(a, b), iters, warmup, local)
    gsgg_s, raw2_s, gsgg_peak, _ = _timed(scatter_gather, lambda: raw_pair(a, b), iters, warmup)
    return dict(size=size, k=k, tokens=tokens, step_ms=step_s * 1e3, raw_ms=raw_s * 1e3, step_peak=step_peak,
                local_ms=local_s * 1e3, gsgg_ms=gsgg_s * 1e3, raw2_ms=raw2_s * 1e3, gsgg_peak=gsgg_peak,
                correct=correct)  # fmt: skip


def _worker(config: dict) -> None:
    import torch

    import unicoll as uc

    torch.set_num_threads(1)
    uc.init(config["backend"])
    raw_pair = _raw_pair(config["backend"])
    cases = [(size, k) for k in config["topk"] for size in config["sizes"]]
    results = [_case(config, size, k, raw_pair) for size, k in (cases[-1:] if config["profile"] else cases)]
    if uc.get_rank() == 0 and not config["profile"]:
        Path(config["out"]).write_text(json.dumps(results))
    uc.finalize()


def _run_world(backend: str, code: str, config: dict) -> list[dict]:
    """Run the cases on a world of 2 ranks importing unicoll from ``code``; rank 0's results."""
    from unicoll.launch import local, mpi

    with tempfile.TemporaryDirectory() as tmp:
        config = {**config, "backend": backend, "out": os.path.join(tmp, "out.json")}
        env = {"PYTHONPATH": code, "OMP_NUM_THREADS": "1"}
        start = mpi.run if backend == "mpi" else local.run
        code_ = start(2, [os.path.abspath(__file__), "--worker", json.dumps(config)], env=env)
        if code_ != 0:
            raise SystemExit(f"the {backend} world on {code} failed with exit code {code_}")
        return [] if config["profile"] else json.loads(Path(config["out"]).read_text())


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", action="append", choices=("gloo", "mpi"))
    parser.add_argument("--size", action="append", type=parse_size, help="dispatched bytes per rank")
    parser.add_argument("--topk", action="append", type=int)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--iters", type=int, default=8, help="timed steps at 8 MiB and above (3x below)")
    parser.add_argument("--old", help="another checkout to run first, side by side")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(json.loads(args.worker))
    config = dict(sizes=args.size or [64 << 10, 1 << 20, 8 << 20, 64 << 20], topk=args.topk or [2, 8],
                  hidden=args.hidden, iters=args.iters, profile=args.profile)  # fmt: skip
    new = str(Path(__file__).resolve().parents[1])
    codes = ([("old", args.old)] if args.old else []) + [("new", new)]
    print("# 2 ranks x 1 thread; dispatched rows per rank = tokens x k x hidden float32; median step, slowest rank;")
    print("# raw = two even all-to-alls of the same bytes, interleaved; peak = resident memory the loop adds (MiB)")
    print("# floor = (raw + the step's local work by hand: sort, gather, weighted sum) / raw: the best ratio with")
    print("#         nothing overlapped, since no core is idle")
    print(f"# {'backend':<5} {'code':<4} {'size':>6} {'k':>2} {'tokens':>6} | {'dispatch+combine':>16} {'raw':>7} "
          f"{'ratio':>5} {'floor':>5} {'peak':>5} | {'scatter+gather':>14} {'raw':>7} {'ratio':>5} {'peak':>5} "
          "ok")  # fmt: skip
    for backend in args.backend or ["gloo", "mpi"]:
        for label, code in codes:
            for r in _run_world(backend, code, config):
                size = f"{r['size'] >> 20}M" if r["size"] >= 1 << 20 else f"{r['size'] >> 10}K"
                print(
                    f"  {backend:<5} {label:<4} {size:>6} {r['k']:>2} {r['tokens']:>6} | {r['step_ms']:13.2f} ms "
                    f"{r['raw_ms']:7.2f} {r['step_ms'] / r['raw_ms']:5.2f} {1 + r['local_ms'] / r['raw_ms']:5.2f} "
                    f"{_mib(r['step_peak']):>5} | "
                    f"{r['gsgg_ms']:11.2f} ms {r['raw2_ms']:7.2f} {r['gsgg_ms'] / r['raw2_ms']:5.2f} "
                    f"{_mib(r['gsgg_peak']):>5} {'yes' if r['correct'] else 'NO'}",
                    flush=True,
                )


if __name__ == "__main__":
    sys.exit(main())
