"""A small top-2 Mixture-of-Experts layer on N processes, checked against the same layer on one.

Run it on 2 (or more) CPU processes:

    unicoll run -n 2 examples/moe_dispatch.py
    unicoll run -n 3 examples/moe_dispatch.py --tokens 512 --experts-per-rank 4 --hidden 64 --capacity 40
    torchrun --nproc-per-node 2 examples/moe_dispatch.py     # torchrun works too

and on GPUs (one per rank), through torch.distributed's NCCL or CuPy's NCCL bindings:

    unicoll run -n 2 examples/moe_dispatch.py --backend torch-nccl
    unicoll run -n 2 examples/moe_dispatch.py --backend cupy-nccl    # torch tensors cross via DLPack

Every rank builds the same seeded weights (a router and one matrix per expert, W*E experts in
all; rank r owns experts r*E .. r*E+E-1) and its own tokens. The router picks the top-k
experts of each token and their gate probabilities; uc.moe.dispatch sends each token to its k
experts (one call: the sort by expert, the count exchange and the all-to-all), each expert
multiplies its block of rows by its matrix, and uc.moe.combine sends the results back and sums
each token's k outputs weighted by its gates. --capacity caps the rows each rank sends to
each expert (the lowest token indices kept).

The result and the gradients of a backward pass (to the tokens, the router through the gates,
and every expert's matrix) are compared with a dense computation on this process alone:
y_ref[t] = sum_j gate[t, j] * (x[t] @ W[expert[t, j]]) over the kept slots. Exits non-zero on
a mismatch.
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
    parser.add_argument("--topk", type=int, default=2, help="experts per token (k)")
    parser.add_argument("--capacity", type=int, default=None, help="most rows each rank sends to each expert")
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
    if args.tokens < 0 or min(args.experts_per_rank, args.hidden, args.iters, args.topk) < 1:
        parser.error("--tokens must be >= 0; --experts-per-rank, --topk, --hidden and --iters >= 1")
    if args.capacity is not None and args.capacity < 0:
        parser.error("--capacity must be >= 0")
    return args


def route(x: torch.Tensor, router: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: each token's k gate probabilities and global expert ids."""
    probs = torch.softmax(x @ router, dim=-1)
    return torch.topk(probs, min(k, probs.shape[-1]), dim=-1)


def moe_distributed(x, router, local_weights, k, capacity):
    """The MoE layer with expert parallelism: this rank's tokens through every rank's experts."""
    gates, experts = route(x, router, k)
    rows, rows_per_expert, handle = uc.moe.dispatch(
        x, experts, gates, experts_per_rank=len(local_weights), capacity=capacity
    )
    # rows: for each local expert, its rows from rank 0, 1, ... in one block of rows_per_expert[e] rows.
    # Every expert runs on its block, even an empty one: skipping an expert that received no rows
    # would leave this rank's backward without combine's and dispatch's collectives, which its
    # peers then wait for (docs/semantics.md, "Gradients").
    processed = torch.cat([block @ w for block, w in zip(rows.split(rows_per_expert), local_weights)])
    return uc.moe.combine(processed, handle)


def kept_slots(experts: torch.Tensor, n_experts: int, capacity: int | None) -> torch.Tensor:
    """Which slots capacity keeps: per expert, the first `capacity` slots in token order."""
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    one_hot = torch.nn.functional.one_hot(experts.reshape(-1), n_experts)
    place = (one_hot.cumsum(0) * one_hot).sum(1) - 1  # the slot's place among its expert's slots
    return (place < capacity).reshape(experts.shape)


def moe_dense(x, router, weights, k, capacity):
    """The same layer on one process, holding every expert: the reference."""
    gates, experts = route(x, router, k)
    gates = gates * kept_slots(experts, len(weights), capacity)
    outputs = torch.einsum("th,tjhk->tjk", x, weights[experts])  # every slot's expert output
    return (gates[..., None] * outputs).sum(1)


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
    rank, world, E, H, k = uc.get_rank(), uc.get_world_size(), args.experts_per_rank, args.hidden, args.topk

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
    x, router_d = tokens.clone().requires_grad_(), router.clone().requires_grad_()
    local_weights = weights[rank * E : (rank + 1) * E].clone().requires_grad_()
    y = moe_distributed(x, router_d, local_weights, k, args.capacity)
    y.pow(2).sum().backward()

    # Reference on this process alone, with every expert.
    x_ref, router_ref = tokens.clone().requires_grad_(), router.clone().requires_grad_()
    weights_ref = weights.clone().requires_grad_()
    y_ref = moe_dense(x_ref, router_ref, weights_ref, k, args.capacity)
    y_ref.pow(2).sum().backward()

    check("output", y, y_ref, rank)
    check("x.grad", x.grad, x_ref.grad, rank)
    check("router grad (through the gates)", router_d.grad, router_ref.grad, rank)
    # weights_ref.grad holds only this rank's tokens' share for every expert; an expert's full
    # gradient sums every rank's share. reduce_scatter sums block c (E experts) over the ranks
    # into rank c: each rank receives the full gradients of its own experts.
    full = uc.reduce_scatter(None, weights_ref.grad)
    check("expert weight grads", local_weights.grad, full, rank)

    # Time the communication of one layer: dispatch (counts exchange included) + combine.
    with torch.no_grad():
        _, experts = route(tokens, router, k)
        kept = kept_slots(experts, world * E, args.capacity).sum(1, keepdim=True).to(dtype)
        times = []
        for _ in range(args.iters + 2):
            uc.barrier()
            start = time.perf_counter()
            rows, _, handle = uc.moe.dispatch(tokens, experts, experts_per_rank=E, capacity=args.capacity)
            back = uc.moe.combine(rows, handle)
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        check("combine(dispatch(x)) == x * kept slots", back, tokens * kept, rank)
    medians = uc.all_gather(None, torch.tensor([statistics.median(times[2:])], device=device))  # 2 warm-ups
    counts = uc.all_gather(None, torch.tensor([handle.rows_per_expert], device=device))

    if rank == 0:
        print(
            f"backend {uc.get_backend()}: {world} ranks x {E} experts, top-{k}, {args.tokens} tokens/rank, "
            f"hidden {H}, {args.dtype}" + ("" if args.capacity is None else f", capacity {args.capacity}")
        )
        print(f"rows per expert (all experts): {counts.reshape(-1).tolist()}")
        print("verified against a single-process dense reference:")
        print("  forward output, x.grad, the router's gradient (through the gates),")
        print("  and every expert's weight gradient (summed over ranks)")
        print("  combine(dispatch(x)) == x * (kept slots per token)")
        print(f"moe.dispatch + moe.combine: median {medians.max():.3f} ms over {args.iters} iterations (slowest rank)")
    uc.finalize()


if __name__ == "__main__":
    main()
