"""Train a small top-2 MoE transformer block on N processes, checked against the same block
trained densely on one.

    unicoll run -n 2 examples/train_moe.py              # gloo
    unicoll run --mpi -n 2 examples/train_moe.py        # MPI: the same code
    unicoll run -n 4 examples/train_moe.py --steps 50 --experts-per-rank 1
    unicoll run -n 2 examples/train_moe.py --backend torch-nccl   # CUDA, one GPU per rank

The block is pre-norm self-attention and a mixture of experts, each with a residual:
``h = x + attention(norm1(x))``, ``y = h + moe(norm2(h))``. Each token goes to the two
experts its router scores highest, weighted by their renormalized softmax scores; each expert
is a two-layer GELU MLP.

- Data parallel: the norms, the attention and the router are replicated. Rank 0's initial
  values reach every rank by ``uc.broadcast``, and after each backward pass their gradients
  are summed over the ranks by one ``uc.all_reduce`` of a flat buffer.
- Expert parallel: rank r holds experts r*E .. r*E+E-1 (its own random initial values).
  Tokens reach their experts by ``uc.exchange_counts`` and ``uc.global_scatter`` and come back
  by ``uc.global_gather``; each expert's gradient is complete on its rank with no further call.

Each rank trains on its own batch, with the loss ``sum of squared errors / all tokens of all
ranks``, so that the ranks' losses add up to the loss of the whole batch. The reference, on
every process, is the same block with every expert local and no communication, started from the
distributed block's initial weights (the experts gathered by ``uc.all_gather``) and trained by
Adam on every rank's batch at once. Every step's loss (summed over the ranks with the
gradients) and, at the end, every parameter must agree with the reference to
``--tolerance``; float64 makes the two differ by rounding only. Exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

import unicoll as uc


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend",
        default=None,
        help="gloo, mpi, torch-nccl or cupy-nccl (default: $UNICOLL_BACKEND, else auto); the NCCL ones run on CUDA",
    )
    parser.add_argument("--steps", type=int, default=30, help="Adam steps")
    parser.add_argument("--experts-per-rank", type=int, default=2, help="experts each rank holds (E)")
    parser.add_argument("--hidden", type=int, default=16, help="model width")
    parser.add_argument("--heads", type=int, default=2, help="attention heads (they divide --hidden)")
    parser.add_argument("--sequences", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--length", type=int, default=8, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam's learning rate")
    parser.add_argument("--tolerance", type=float, default=1e-10, help="largest difference allowed")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if min(args.steps, args.experts_per_rank, args.heads, args.sequences, args.length) < 1:
        parser.error("--steps, --experts-per-rank, --heads, --sequences and --length must be >= 1")
    if args.hidden < 1 or args.hidden % args.heads:
        parser.error("--hidden must be a positive multiple of --heads")
    return args


class Block(torch.nn.Module):
    """The replicated part of the block (norms, attention, router) and ``experts`` experts,
    their weights stacked: ``w_in[e]`` is (hidden, 2 * hidden), ``w_out[e]`` (2 * hidden, hidden)."""

    def __init__(self, hidden: int, heads: int, experts: int, total_experts: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(hidden, dtype=torch.float64)
        self.norm2 = torch.nn.LayerNorm(hidden, dtype=torch.float64)
        # no bias: a key's bias shifts every score of a query alike, so its gradient is zero up to
        # rounding, which Adam would scale up to full steps of noise
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False, dtype=torch.float64)
        self.proj = torch.nn.Linear(hidden, hidden, dtype=torch.float64)
        self.router = torch.nn.Linear(hidden, total_experts, bias=False, dtype=torch.float64)
        self.w_in = torch.nn.Parameter(torch.randn(experts, hidden, 2 * hidden, dtype=torch.float64) / hidden**0.5)
        self.w_out = torch.nn.Parameter(torch.randn(experts, 2 * hidden, hidden, dtype=torch.float64) / hidden**0.5)

    def replicated(self) -> list[torch.nn.Parameter]:
        """Every parameter but the experts'."""
        return [p for name, p in self.named_parameters() if not name.startswith("w_")]

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """Causal multi-head self-attention over (sequences, length, hidden)."""
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(mixed.transpose(1, 2).reshape(b, t, h))

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-2: each token's two experts (tokens, 2) and their weights, which sum to 1."""
        scores, experts = torch.softmax(self.router(tokens), dim=-1).topk(2, dim=-1)
        return experts, scores / scores.sum(-1, keepdim=True)

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return F.gelu(rows @ self.w_in[e]) @ self.w_out[e]

    def forward(self, x: torch.Tensor, moe: Callable[[Block, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        h = x + self.attention(self.norm1(x))
        tokens = self.norm2(h).reshape(-1, h.shape[-1])
        return h + moe(self, tokens).view_as(h)


def moe_dense(block: Block, tokens: torch.Tensor) -> torch.Tensor:
    """Every expert on this process: the reference."""
    experts, weights = block.route(tokens)
    out = torch.zeros_like(tokens)
    for e in range(block.w_in.shape[0]):
        token, slot = (experts == e).nonzero(as_tuple=True)
        out = out.index_add(0, token, block.expert(e, tokens[token]) * weights[token, slot, None])
    return out


def moe_parallel(block: Block, tokens: torch.Tensor) -> torch.Tensor:
    """This rank's tokens through every rank's experts: each (token, choice) pair is a row sent
    to the rank of its expert, in the order i = rank * E + expert."""
    world, local = uc.get_world_size(), block.w_in.shape[0]
    experts, weights = block.route(tokens)
    destination = experts.reshape(-1)  # pair p = 2 * token + choice
    order = torch.argsort(destination, stable=True)
    local_count = torch.bincount(destination, minlength=world * local)
    global_count = uc.exchange_counts(local_count)
    received = uc.global_scatter(tokens[order // 2], local_count, global_count)
    sizes = global_count.reshape(world, local).sum(0).tolist()  # expert-major: one segment per local expert
    processed = torch.cat([block.expert(e, rows) for e, rows in enumerate(received.split(sizes))])
    returned = uc.global_gather(processed, local_count, global_count)
    pairs = torch.empty_like(returned).index_copy(0, order, returned).view(-1, 2, tokens.shape[1])
    return (pairs * weights[..., None]).sum(1)


def batch(args: argparse.Namespace, rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s inputs and targets at ``step``, the same on every process that asks."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    shape = (args.sequences, args.length, args.hidden)
    x, target = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(2))
    return x.to(device), target.to(device)


def fail(rank: int, message: str) -> None:
    print(f"rank {rank}: MISMATCH: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def main() -> None:
    args = parse_args()
    uc.init(args.backend)
    rank, world, E = uc.get_rank(), uc.get_world_size(), args.experts_per_rank
    cuda = uc.get_backend() in ("torch-nccl", "cupy-nccl")  # they move CUDA tensors, one GPU per rank
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    # The distributed block: random initial values per rank, then rank 0's replicated ones everywhere.
    torch.manual_seed(args.seed + 1 + rank)
    block = Block(args.hidden, args.heads, E, world * E).to(device)
    with torch.no_grad():
        for p in block.replicated():
            uc.broadcast(p, src=0)

    # The reference: the same initial values, every expert (gathered from their ranks) local.
    dense = Block(args.hidden, args.heads, world * E, world * E).to(device)
    with torch.no_grad():
        for p, q in zip(block.replicated(), dense.replicated()):
            q.copy_(p)
        dense.w_in.copy_(uc.all_gather(None, block.w_in))
        dense.w_out.copy_(uc.all_gather(None, block.w_out))

    optimizer = torch.optim.Adam(block.parameters(), lr=args.lr)
    dense_optimizer = torch.optim.Adam(dense.parameters(), lr=args.lr)
    tokens_everywhere = world * args.sequences * args.length
    worst_loss = 0.0
    for step in range(args.steps):
        x, target = batch(args, rank, step, device)
        loss = (block(x, moe_parallel) - target).pow(2).sum() / tokens_everywhere
        optimizer.zero_grad()
        loss.backward()
        # Data parallel: the replicated gradients, summed over the ranks in one all_reduce of one
        # flat buffer (as DDP buckets them), with the loss riding along.
        replicated = block.replicated()
        flat = torch.cat([p.grad.reshape(-1) for p in replicated] + [loss.detach().reshape(1)])
        uc.all_reduce(flat)
        for p, summed in zip(replicated, flat[:-1].split([p.numel() for p in replicated])):
            p.grad.copy_(summed.view_as(p))
        total = flat[-1].item()
        optimizer.step()

        every = [batch(args, r, step, device) for r in range(world)]
        xs, targets = torch.cat([b[0] for b in every]), torch.cat([b[1] for b in every])
        dense_loss = (dense(xs, moe_dense) - targets).pow(2).sum() / tokens_everywhere
        dense_optimizer.zero_grad()
        dense_loss.backward()
        dense_optimizer.step()
        worst_loss = max(worst_loss, abs(total - dense_loss.item()))
        if not abs(total - dense_loss.item()) <= args.tolerance:
            fail(rank, f"step {step}: loss {total!r} on {world} ranks, {dense_loss.item()!r} dense")
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}: loss {total:.12f} (dense {dense_loss.item():.12f})", flush=True)

    mine = slice(rank * E, (rank + 1) * E)
    pairs = [(name, p, q) for (name, p), q in zip(block.named_parameters(), dense.parameters())]
    worst_parameter = 0.0
    for name, p, q in pairs:
        expected = q[mine] if name.startswith("w_") else q
        difference = (p - expected).abs().max().item()
        worst_parameter = max(worst_parameter, difference)
        if not difference <= args.tolerance:
            fail(rank, f"parameter {name}: differs from the dense model's by {difference:.3g}")
    worst = uc.all_reduce(torch.tensor([worst_loss, worst_parameter], dtype=torch.float64, device=device), op="max")
    if rank == 0:
        print(
            f"backend {uc.get_backend()}: {world} ranks x {E} experts, {args.steps} Adam steps: every loss and "
            f"every parameter match the dense model (largest difference: loss {worst[0]:.2g}, "
            f"parameters {worst[1]:.2g}; tolerance {args.tolerance:g})"
        )
    uc.finalize()


if __name__ == "__main__":
    main()
