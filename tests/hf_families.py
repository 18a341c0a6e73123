"""Tiny configs (hidden size 16, 2 layers, 4 heads / 2 key-value heads, random weights, nothing downloaded) of the
transformers causal-LM families that ship a tensor-parallel plan, as people fine-tune them: tied embeddings where the
family ships them tied. Used by test_hf_families.py (the family matrix) and its docs table."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

COMMON: dict[str, Any] = dict(
    vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # name: (config class, model class, config arguments beyond COMMON)
    "Llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    "Llama (tied)": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "Mistral": ("MistralConfig", "MistralForCausalLM", {"head_dim": 4}),
    "Qwen2 (tied)": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 4}),
    "Gemma2 (tied)": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 4}),
    "Gemma3 (tied)": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 4}),
    "Phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "OLMo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "GPT-NeoX": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"num_key_value_heads": None}),
    "Starcoder2 (tied)": ("Starcoder2Config", "Starcoder2ForCausalLM", {"tie_word_embeddings": True}),
    "Mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "Qwen3-MoE": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"head_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
                                                              "moe_intermediate_size": 8}),
    "DeepSeek-V2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {  # latent attention, a dense layer, then MoE
        "num_key_value_heads": 4, "q_lora_rank": 8, "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
        "v_head_dim": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
        "first_k_dense_replace": 1, "n_shared_experts": 1}),
}

MOE = ["Mixtral", "Qwen3-MoE", "DeepSeek-V2"]
"""The families whose experts transformers packs into 3-D weights (per-expert tensors on disk)."""

_LATENT = {"q_lora_rank": 8, "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4}
EXPERT_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # the MoE families trained with their experts over ep (test_hf_experts.py): 4 experts, top-2
    **{name: FAMILIES[name] for name in MOE},
    "Qwen2-MoE": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {  # a gated shared expert beside the routed ones
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8}),
    "OLMoE": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
    "DeepSeek-V3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {  # grouped routing, a dense first layer
        "num_key_value_heads": 4, **_LATENT, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
        "first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 2, "topk_group": 1}),
    "GPT-OSS": ("GptOssConfig", "GptOssForCausalLM", {  # expert biases, attention sinks, sliding windows
        "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 4, "sliding_window": 4}),
    "GLM-4-MoE": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "moe_intermediate_size": 8, "head_dim": 4, "n_group": 1, "topk_group": 1}),
    "ERNIE-4.5-MoE": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", {
        "moe_num_experts": 4, "moe_k": 2, "moe_num_shared_experts": 1, "moe_intermediate_size": 8,
        "moe_layer_start_index": 1, "head_dim": 4}),
}  # fmt: skip


def tiny_causal_lm(family: str, **overrides: Any) -> nn.Module:
    import transformers

    config_class, model_class, extra = {**EXPERT_FAMILIES, **FAMILIES}[family]
    arguments = {**COMMON, **extra, **overrides}
    arguments = {k: v for k, v in arguments.items() if v is not None}
    config = getattr(transformers, config_class)(**arguments)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():  # norms start away from their init, so a gradient summed wrongly over tp shows
        for name, param in model.named_parameters():
            if "norm" in name or "layernorm" in name:
                param.add_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    return model


EXPERTS_OVER_TP = {
    "model.layers.*.mlp.experts": "moe_tp_experts",
    "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "model.layers.*.mlp.experts.down_proj": "rowwise",
}
"""The tp entries for packed experts that transformers 5.5-5.24 ship in the MoE families' own plans (5.25 and later
leave the experts to the ep plan: whole on every tp rank under tp alone)."""


def with_experts_over_tp(model: nn.Module) -> nn.Module:
    """``model`` with its packed experts split over tp by its plan, as the releases of :data:`EXPERTS_OVER_TP`
    ship it, where this release's plan leaves them whole."""
    if "moe_tp_experts" not in model.tp_plan.values():
        model.tp_plan = {**model.tp_plan, **EXPERTS_OVER_TP}
    return model
