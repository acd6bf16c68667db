"""Six tiny random-weight hybrid transformers models (no download; 4 layers, hidden 64), the
shapes of ../shared/reference/hybrid-and-events.md: sliding windows (GptOss, Gemma3), linear
attention (Qwen3Next), Mamba beside attention (Jamba) and in the same layer (FalconH1), an MLA
latent with DSA indexer keys (DeepseekV32, which needs as many KV heads as query heads and
``num_experts_per_tok`` <= its experts)."""

from __future__ import annotations

import torch

COMMON = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
WINDOW = 8

CONFIGS = {
    "qwen3_next": (
        "Qwen3NextConfig",
        {
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
    ),
    "gpt_oss": (
        "GptOssConfig",
        {
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "sliding_window": WINDOW,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": WINDOW},
    ),
    "jamba": (
        "JambaConfig",
        {
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "mamba_d_state": 8,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
        },
    ),
    "falcon_h1": (
        "FalconH1Config",
        {
            "mamba_d_ssm": 64,
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_n_groups": 1,
            "mamba_d_state": 8,
            "mamba_expand": 1,
            "mamba_chunk_size": 8,
        },
    ),
    "deepseek_v32": (
        "DeepseekV32Config",
        {
            "num_key_value_heads": 4,
            "kv_lora_rank": 16,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "index_topk": 8,
            "index_head_dim": 16,
            "index_n_heads": 2,
        },
    ),
}
ARCHS = tuple(CONFIGS)


def config_of(arch: str):
    """The small config of ``arch`` (one of :data:`ARCHS`)."""
    import transformers

    name, extra = CONFIGS[arch]
    return getattr(transformers, name)(**{**COMMON, **extra})


def build_model(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """``arch``'s causal LM with seeded random weights, in eval mode."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config_of(arch))
    return model.to(dtype).eval()
