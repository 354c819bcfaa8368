"""A training step of a small Mixtral made expert-parallel by unicoll.nn, side by side with the
same model on one process and with the same block written by hand on the raw transport.

    python benchmarks/hf_expert_parallel.py [--backend gloo --backend mpi] [--tokens 512]
                                            [--experts 8] [--hidden 256] [--iters 5]

Per backend, one world of 2 ranks (one thread per rank) times, interleaved, each after a
barrier: (1) a training step (forward, backward, the replicated gradients summed, AdamW) of a
two-layer Mixtral (``--experts`` experts, top-2, float32, transformers' default experts code)
on ``--tokens`` tokens per rank, made expert-parallel by ``unicoll.nn.expert_parallel``, the
replicated gradients summed after the backward pass (``all_reduce_gradients``) and, in an
"overlap" column, while it runs (``GradientReducer``); (2) the
same step with each MoE block's experts wrapped by hand: the counts exchanged, the rows sorted
by expert and sent by the raw transport's uneven all-to-all (torch.distributed's
``all_to_all_single`` on gloo, mpi4py's ``Alltoallv`` on mpi), the local experts, the rows sent
back, weighed and summed (with autograd through the transfers), the replicated gradients summed
by one flat all-reduce of the raw transport; and, on rank 0 alone while rank 1 waits, (3) the
single-process model's step on both ranks' tokens. Printed: the median step of the slowest
rank in milliseconds and the ratios.
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

from raw_transport import counted_by_hand, raw_transport  # beside this script


def _by_hand_experts(experts, world: int, alltoallv):
    """A block's experts (this rank's slice, transformers' interface) wrapped by hand."""
    import torch

    local = experts.num_experts

    class Exchange(torch.autograd.Function):
        @staticmethod
        def forward(ctx, rows, send_splits, recv_splits):
            ctx.splits = send_splits, recv_splits
            return alltoallv(rows, send_splits, recv_splits)

        @staticmethod
        def backward(ctx, grad):
            send_splits, recv_splits = ctx.splits
            return alltoallv(grad, recv_splits, send_splits), None, None

    class ByHand(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = experts

        def forward(self, hidden, top_k_index, top_k_weights):
            tokens, k = top_k_index.shape
            order, heard, send_splits, recv_splits = counted_by_hand(top_k_index, world, local, alltoallv)
            rows = Exchange.apply(hidden.index_select(0, order // k), send_splits, recv_splits)
            # received rank-major: sort them expert-major for the experts, and back
            expert_of = torch.arange(local).repeat(world).repeat_interleave(heard.reshape(-1))
            by_expert = torch.argsort(expert_of, stable=True)
            ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype)
            y = torch.empty_like(rows)
            y[by_expert] = self.experts(rows[by_expert], expert_of[by_expert].reshape(-1, 1), ones)
            back = Exchange.apply(y, recv_splits, send_splits)
            unsorted = torch.empty_like(back)
            unsorted[order] = back
            return (unsorted.reshape(tokens, k, -1) * top_k_weights[..., None]).sum(1)

    return ByHand()


def _worker(config: dict) -> None:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    import unicoll as uc
    import unicoll.nn as unn

    torch.set_num_threads(1)
    uc.init(config["backend"])
    rank, world = uc.get_rank(), uc.get_world_size()
    alltoallv, all_reduce_ = raw_transport(config["backend"])
    hidden, experts = config["hidden"], config["experts"]

    def model():
        torch.manual_seed(0)
        cfg = MixtralConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=4, num_local_experts=experts,
                            num_experts_per_tok=2, max_position_embeddings=config["tokens"])  # fmt: skip
        return MixtralForCausalLM(cfg)

    ep = unn.expert_parallel(model())
    overlapped = unn.expert_parallel(model())
    reducer = unn.GradientReducer(unn.replicated_parameters(overlapped))
    hand = model()
    for block in [m for m in hand.modules() if hasattr(m, "experts")]:
        block.experts = _by_hand_experts(unn.sharded_experts(block.experts), world, alltoallv)
    hand_experts = {id(p) for m in hand.modules() if hasattr(m, "experts") for p in m.experts.parameters()}
    hand_replicas = [p for p in hand.parameters() if id(p) not in hand_experts]
    single = model()
    generator = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, 1024, (1, config["tokens"]), generator=generator)
    union = torch.cat([batch] * world)
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in
                  (("unicoll", ep), ("overlapped", overlapped), ("by hand", hand), ("single", single))}  # fmt: skip

    def step_ep():
        optimizers["unicoll"].zero_grad()
        (ep(batch, labels=batch).loss / world).backward()
        unn.all_reduce_gradients(unn.replicated_parameters(ep))
        optimizers["unicoll"].step()

    def step_overlapped():
        optimizers["overlapped"].zero_grad()
        (overlapped(batch, labels=batch).loss / world).backward()
        reducer.finish()
        optimizers["overlapped"].step()

    def step_hand():
        optimizers["by hand"].zero_grad()
        (hand(batch, labels=batch).loss / world).backward()
        grads = [p.grad for p in hand_replicas if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce_(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        optimizers["by hand"].step()

    def step_single():
        if rank == 0:
            optimizers["single"].zero_grad()
            single(union, labels=union).loss.backward()
            optimizers["single"].step()

    calls = {"unicoll": step_ep, "overlapped": step_overlapped, "by hand": step_hand, "single": step_single}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(config["iters"] + 1):
        for name, fn in calls.items():
            uc.barrier()
            start = time.perf_counter()
            fn()
            if i:
                times[name].append(time.perf_counter() - start)
    import numpy as np

    medians = np.array([statistics.median(t) for t in times.values()], dtype=np.float64)
    slowest = uc.all_gather(None, medians.reshape(1, -1)).max(0)
    if rank == 0:
        Path(config["out"]).write_text(json.dumps({n: float(t) * 1e3 for n, t in zip(calls, slowest)}))
    uc.finalize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", action="append", choices=("gloo", "mpi"))
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(json.loads(args.worker))
    from unicoll.launch import local, mpi

    print(f"# a training step of a 2-layer Mixtral ({args.experts} experts, top-2, hidden {args.hidden}, float32), "
          f"{args.tokens} tokens per rank, 2 ranks; median step of the slowest rank (ms); single: one process on "
          "both ranks' tokens")  # fmt: skip
    print(f"# {'backend':<7} | {'unicoll':>8} {'overlap':>8} {'by hand':>8} {'single':>8} | {'uc/hand':>7} "
          f"{'ov/hand':>7} {'uc/single':>9}")  # fmt: skip
    for backend in args.backend or ["gloo", "mpi"]:
        with tempfile.TemporaryDirectory() as tmp:
            config = dict(vars(args), backend=backend, out=os.path.join(tmp, "out.json"))
            config.pop("worker")
            start = mpi.run if backend == "mpi" else local.run
            code = start(2, [os.path.abspath(__file__), "--worker", json.dumps(config)], env={"OMP_NUM_THREADS": "1"})
            if code != 0:
                raise SystemExit(f"the {backend} world failed with exit code {code}")
            ms = json.loads(Path(config["out"]).read_text())
        print(f"  {backend:<7} | {ms['unicoll']:8.1f} {ms['overlapped']:8.1f} {ms['by hand']:8.1f} "
              f"{ms['single']:8.1f} | "
              f"{ms['unicoll'] / ms['by hand']:7.2f} {ms['overlapped'] / ms['by hand']:7.2f} "
              f"{ms['unicoll'] / ms['single']:9.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
