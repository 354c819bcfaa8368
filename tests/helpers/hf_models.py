"""Tiny, randomly initialised Hugging Face MoE models for the expert-parallel tests (no
weights are downloaded): float64, transformers' eager experts code, the same parameters on
every rank (one seed)."""

from __future__ import annotations

import importlib

import torch

MODELS = ("mixtral", "qwen2_moe", "deepseek_v3", "qwen3_moe", "olmoe")
"""Mixtral (experts only), Qwen2-MoE (a sigmoid-gated shared expert beside them), DeepSeek-V3
(a dense first layer, a shared expert, a group-limited router), Qwen3-MoE and OLMoE."""

VOCAB = 64


def import_models() -> None:
    """Import transformers' modules of :data:`MODELS` (what the suite's forkserver loads once:
    helpers/warm_server.py)."""
    for name in MODELS:
        importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def tiny(name: str, experts: int = 4, topk: int = 2) -> torch.nn.Module:
    """A two-layer model ``name`` (:data:`MODELS`) of ``experts`` experts, top-``topk``."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=topk, max_position_embeddings=64, experts_implementation="eager")  # fmt: skip
    if name == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        model = MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_local_experts=experts, **common))
    elif name == "deepseek_v3":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        config = DeepseekV3Config(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=experts,
                                  n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                                  q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                  v_head_dim=8, **{**common, "num_key_value_heads": 4})  # fmt: skip
        model = DeepseekV3ForCausalLM(config)
    elif name == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24, num_experts=experts,
                                                   **common))  # fmt: skip
    elif name == "olmoe":
        from transformers import OlmoeConfig, OlmoeForCausalLM

        model = OlmoeForCausalLM(OlmoeConfig(intermediate_size=48, num_experts=experts, **common))
    else:
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        config = Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                num_experts=experts, **common)  # fmt: skip
        model = Qwen2MoeForCausalLM(config)
    return model.double()
