"""A small Mixture-of-Experts layer on N processes, checked against the same layer on one.

Run it on 2 (or more) CPU processes:

    unicoll run -n 2 examples/moe_dispatch.py
    unicoll run -n 3 examples/moe_dispatch.py --tokens 512 --experts-per-rank 4 --hidden 64
    torchrun --nproc-per-node 2 examples/moe_dispatch.py     # torchrun works too

and on GPUs (one per rank), through torch.distributed's NCCL or CuPy's NCCL bindings:

    unicoll run -n 2 examples/moe_dispatch.py --backend torch-nccl
    unicoll run -n 2 examples/moe_dispatch.py --backend cupy-nccl    # torch tensors cross via DLPack

Every rank builds the same seeded weights (a router and one matrix per expert, W*E experts in
all; rank r owns experts r*E .. r*E+E-1) and its own tokens. A top-1 router picks an expert
per token; the tokens are sorted by expert, the counts exchanged (uc.exchange_counts), the
tokens dispatched (uc.global_scatter), multiplied by their expert's matrix, sent back
(uc.global_gather), put back in token order and scaled by the router's gate probability.

The result and the gradients of a backward pass are compared with a dense computation on
this process alone: y_ref[t] = gate[t] * (x[t] @ W[expert[t]]). Exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import unicoll as uc

GPU_BACKENDS = ("torch-nccl", "cupy-nccl")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend",
        default=None,
        help="gloo, torch-nccl or cupy-nccl (default: $UNICOLL_BACKEND, else auto); the NCCL ones run on CUDA",
    )
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    parser.add_argument("--experts-per-rank", type=int, default=2, help="experts each rank holds (E)")
    parser.add_argument("--hidden", type=int, default=32, help="model width")
    parser.add_argument(
        "--dtype",
        choices=["float64", "float32"],
        default="float64",
        help="float64 makes the comparison exact up to rounding; float32 uses looser tolerances",
    )
    parser.add_argument("--iters", type=int, default=20, help="timed repetitions of the exchange")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.tokens < 0 or min(args.experts_per_rank, args.hidden, args.iters) < 1:
        parser.error("--tokens must be >= 0; --experts-per-rank, --hidden and --iters >= 1")
    return args


def route(x: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 routing: each token's expert index and its gate probability."""
    gate, expert = torch.softmax(x @ router, dim=-1).max(dim=-1)
    return gate, expert


def moe_distributed(x, router, local_weights, world, n_local):
    """The MoE layer with expert parallelism: this rank's tokens through every rank's experts."""
    gate, expert = route(x, router)
    order = torch.argsort(expert, stable=True)  # tokens sorted by i = rank*E + e
    local_count = torch.bincount(expert, minlength=world * n_local)
    global_count = uc.exchange_counts(local_count)
    received = uc.global_scatter(x[order], local_count, global_count)
    # Expert-major: for each local expert, the rows from rank 0, 1, ... in one segment.
    sizes = global_count.reshape(world, n_local).sum(0).tolist()
    processed = torch.cat([seg @ w for seg, w in zip(received.split(sizes), local_weights)])
    combined = uc.global_gather(processed, local_count, global_count)
    return combined[order.argsort()] * gate[:, None]  # back to token order, scaled


def moe_dense(x, router, weights):
    """The same layer on one process, holding every expert: the reference."""
    gate, expert = route(x, router)
    return gate[:, None] * torch.einsum("th,thk->tk", x, weights[expert])


def check(what: str, actual: torch.Tensor, expected: torch.Tensor, rank: int) -> None:
    """assert_close (its default tolerances for float64; float32 sums in another order drift more)."""
    loose = dict(rtol=1e-4, atol=1e-4) if actual.dtype == torch.float32 else {}
    try:
        torch.testing.assert_close(actual, expected, **loose)
    except AssertionError as err:
        print(f"rank {rank}: MISMATCH in {what}:\n{err}", file=sys.stderr, flush=True)
        sys.exit(1)


def main() -> None:
    args = parse_args()
    uc.init(args.backend)
    rank, world, E, H = uc.get_rank(), uc.get_world_size(), args.experts_per_rank, args.hidden

    # gloo moves CPU tensors; torch-nccl (auto's pick where CUDA is present) and cupy-nccl move
    # CUDA tensors, one GPU per rank on this machine (cupy-nccl takes them through DLPack).
    cuda = uc.get_backend() in GPU_BACKENDS
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    weights_gen = torch.Generator().manual_seed(args.seed)  # same on every rank
    router = torch.randn(H, world * E, generator=weights_gen, dtype=dtype).to(device)
    weights = (torch.randn(world * E, H, H, generator=weights_gen, dtype=dtype) / H**0.5).to(device)
    tokens_gen = torch.Generator().manual_seed(args.seed + 1 + rank)  # different per rank
    tokens = torch.randn(args.tokens, H, generator=tokens_gen, dtype=dtype).to(device)

    # Distributed forward and backward: this rank holds only its own E experts.
    x = tokens.clone().requires_grad_()
    local_weights = weights[rank * E : (rank + 1) * E].clone().requires_grad_()
    y = moe_distributed(x, router, local_weights, world, E)
    y.pow(2).sum().backward()

    # Reference on this process alone, with every expert.
    x_ref = tokens.clone().requires_grad_()
    weights_ref = weights.clone().requires_grad_()
    y_ref = moe_dense(x_ref, router, weights_ref)
    y_ref.pow(2).sum().backward()

    check("output", y, y_ref, rank)
    check("x.grad", x.grad, x_ref.grad, rank)
    # weights_ref.grad holds only this rank's tokens' share for every expert; an expert's full
    # gradient sums every rank's share. reduce_scatter sums block c (E experts) over the ranks
    # into rank c: each rank receives the full gradients of its own experts.
    full = uc.reduce_scatter(None, weights_ref.grad)
    check("expert weight grads", local_weights.grad, full, rank)

    # Time the communication of one layer: counts exchange + dispatch + combine.
    with torch.no_grad():
        _, expert = route(tokens, router)
        order = torch.argsort(expert, stable=True)
        sorted_tokens = tokens[order]
        local_count = torch.bincount(expert, minlength=world * E)
        times = []
        for _ in range(args.iters + 2):
            uc.barrier()
            start = time.perf_counter()
            global_count = uc.exchange_counts(local_count)
            received = uc.global_scatter(sorted_tokens, local_count, global_count)
            back = uc.global_gather(received, local_count, global_count)
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        check("global_gather(global_scatter(x)) == x", back, sorted_tokens, rank)
    medians = uc.all_gather(None, torch.tensor([statistics.median(times[2:])], device=device))  # 2 warm-ups
    counts = uc.all_gather(None, torch.bincount(expert, minlength=world * E)[None])

    if rank == 0:
        print(
            f"backend {uc.get_backend()}: {world} ranks x {E} experts, {args.tokens} tokens/rank, "
            f"hidden {H}, {args.dtype}"
        )
        print(f"tokens per expert (all ranks): {counts.sum(0).tolist()}")
        print("verified against a single-process dense reference:")
        print("  forward output, x.grad, and every expert's weight gradient (summed over ranks)")
        print("  global_gather(global_scatter(x)) == x")
        print(
            f"exchange (counts + global_scatter + global_gather): median {medians.max():.3f} ms "
            f"over {args.iters} iterations (slowest rank)"
        )
    uc.finalize()


if __name__ == "__main__":
    main()
