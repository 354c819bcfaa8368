"""Train a tiny Mixtral (Hugging Face transformers, randomly initialised: nothing is downloaded)
expert-parallel on N processes with one call, checked against the same model trained on one.

    pip install 'unicoll[hf]'
    unicoll run -n 2 examples/expert_parallel_hf.py
    unicoll run --mpi -n 2 examples/expert_parallel_hf.py --static

``unicoll.nn.expert_parallel(model)`` keeps rank r's share of every MoE block's
experts and routes their tokens through ``uc.moe.dispatch`` / ``uc.moe.combine`` (``--static``:
the static-shape mode); the router, attention and embeddings stay replicated. Each rank trains
on its own batch with its loss divided by the number of ranks (so the ranks' losses add up to
the loss of the union of the batches), sums the replicated gradients over the ranks
(``unicoll.nn.all_reduce_gradients``; combine's backward already summed the experts'), and
steps AdamW. The reference, on every process, is the same model before the call, trained on
the union of the batches. Every step's logits and every parameter must agree to
``--tolerance`` (float64: rounding only). Exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

import unicoll as uc


def tiny_mixtral(experts: int) -> torch.nn.Module:
    """A two-layer Mixtral of ``experts`` experts, top-2, float64, transformers' eager experts."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)  # every rank starts from the same weights
    config = MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=experts, num_experts_per_tok=2, max_position_embeddings=64,
        experts_implementation="eager",
    )  # fmt: skip
    return MixtralForCausalLM(config).double()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--experts-per-rank", type=int, default=2)
    parser.add_argument("--static", action="store_true", help="the static-shape mode")
    parser.add_argument("--tolerance", type=float, default=1e-10)
    args = parser.parse_args()

    import unicoll.nn as unn

    uc.init()
    rank, world = uc.get_rank(), uc.get_world_size()
    model = tiny_mixtral(args.experts_per_rank * world)
    reference = copy.deepcopy(model)
    unn.expert_parallel(model, static=args.static, capacity_factor=world * 2.0)  # no slot dropped
    local = args.experts_per_rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    whole = dict(reference.named_parameters())
    generator = torch.Generator().manual_seed(1)  # every rank draws every rank's batch
    worst = 0.0
    for _ in range(args.steps):
        batches = [torch.randint(0, 128, (2, 16), generator=generator) for _ in range(world)]
        optimizer.zero_grad()
        out = model(batches[rank], labels=batches[rank])
        (out.loss / world).backward()
        unn.all_reduce_gradients(unn.replicated_parameters(model))
        optimizer.step()
        reference_optimizer.zero_grad()
        union = reference(torch.cat(batches), labels=torch.cat(batches))
        union.loss.backward()
        reference_optimizer.step()
        worst = max(worst, (out.logits - union.logits[2 * rank : 2 * rank + 2]).abs().max().item())
    for name, p in model.named_parameters():
        ref = whole[name.replace("experts.experts.", "experts.")]
        shard = slice(rank * local, (rank + 1) * local) if p.shape != ref.shape else slice(None)
        worst = max(worst, (p - ref[shard]).abs().max().item())
    agreed = worst <= args.tolerance
    mode = "static" if args.static else "dynamic"
    if rank == 0:
        verdict = "every step's logits and every parameter match" if agreed else "MISMATCH"
        print(f"backend {uc.get_backend()}: Mixtral, {world} ranks x {local} experts ({mode} mode), {args.steps} "
              f"AdamW steps: {verdict} the single process (largest difference {worst:.1e})")  # fmt: skip
    uc.finalize()
    return 0 if agreed else 1


if __name__ == "__main__":
    sys.exit(main())
