"""Tiny random-weight Hugging Face MoE models of every family AutoEP converts (built from configs: no downloads)."""
from __future__ import annotations

import torch

COMMON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)
_DEEPSEEK = dict(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
                 num_experts_per_tok=2, first_k_dense_replace=1, num_key_value_heads=4, kv_lora_rank=16,
                 qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_group=4, topk_group=2)

# family -> (config class, model class, config kwargs beyond COMMON); each exercises its router's semantics:
# softmax + always renormalised (Mixtral), softmax with a sigmoid-gated shared expert (Qwen2-MoE), softmax +
# norm_topk_prob (Qwen3-MoE), group-limited greedy + a dense first layer + a shared expert (DeepSeek-V2),
# sigmoid + grouped top-2-sum + routed scaling (DeepSeek-V3), softmax with 8 experts (OLMoE).
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                       num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                       norm_topk_prob=True, head_dim=8)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(_DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.0)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(_DEEPSEEK, q_lora_rank=16, routed_scaling_factor=2.5, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(eos_token_id=1, pad_token_id=0, intermediate_size=16, num_experts=8, num_experts_per_tok=2)),
}


def build(family: str, seed: int = 0):
    import transformers

    config_name, model_name, kwargs = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**COMMON, **kwargs})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    if family == "deepseek_v3":  # zeros at init: give the correction bias values, so it is exercised
        with torch.no_grad():
            for layer in model.model.layers:
                bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
                if bias is not None:
                    bias.copy_(torch.linspace(-0.1, 0.1, bias.numel()))
    return model.train()


def batch(step: int, rank: int, micro: int = 2, seq: int = 8):
    """(input_ids, attention_mask, labels) of one rank's micro-batch; rank 1's first row is left-padded, so the
    attention mask reaches the auxiliary loss."""
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(2, COMMON["vocab_size"], (micro, seq), generator=g)
    mask = torch.ones_like(ids)
    if rank % 2:
        mask[0, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels
