"""Tiny random-weight transformers models for the transformers adapter's tests, and the second
process those tests start (``python transformers_models.py STORE OUT``).

The second process builds the same models (same seeds), opens a :class:`KVStageSession` on the
first process's ``file:`` store and, for each model, runs the two turns the test compares:

1. ``load`` of the prompt's stored prefix, the user's own ``model.generate`` on it, ``store``;
2. ``session.generate`` of a follow-up turn whose prompt is turn 1's sequence.

It saves what each step loaded, its tokens and logits (``torch.save`` to OUT).
"""

from __future__ import annotations

import sys

import torch

VOCAB = 1000
PAGE_SIZE = 8
PROMPT_TOKENS = 37  # 4 whole pages and 5 tokens: a lookup loads 32
NEW_TOKENS = 8  # the cache then holds 37 + 7 = 44 tokens: 5 whole pages stored
ARCHS = ("llama", "deepseek_v3")
GENERATE = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}


def build_model(arch: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A small model with seeded random weights (no download), eager attention, in eval mode:
    Llama (MHA/GQA: 2 layers, 4 query / 2 KV heads, head_dim 16) or DeepseekV3 (MLA: 2 layers,
    one dense and one MoE, kv_lora_rank 32, qk_rope_head_dim 16)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

    if arch == "llama":
        config = LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=VOCAB,
            max_position_embeddings=256,
            attn_implementation="eager",
        )
        cls = LlamaForCausalLM
    elif arch == "deepseek_v3":
        config = DeepseekV3Config(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            vocab_size=VOCAB,
            max_position_embeddings=256,
            attn_implementation="eager",
        )
        cls = DeepseekV3ForCausalLM
    else:
        raise ValueError(f"arch: one of {ARCHS}, got {arch!r}")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = cls(config)
    return model.to(dtype).eval()


def prompt_ids() -> torch.Tensor:
    """The prompt, ``[1, PROMPT_TOKENS]``."""
    return torch.randint(0, VOCAB, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1))


def store_url(directory: str, arch: str) -> str:
    return f"file:{directory}/{arch}"


def session_of(model: torch.nn.Module, directory: str, arch: str, **kwargs):
    from kvstage.integrations.transformers import KVStageSession

    return KVStageSession(
        model,
        store_url(directory, arch),
        model_id=f"tiny-{arch}",
        page_size=PAGE_SIZE,
        max_tokens=256,
        extra_key="lora-7",
        cache_salt="tenant-a",
        **kwargs,
    )


def second_process(directory: str) -> dict:
    """Turns 1 and 2 of each model on the store the first process filled (see the module doc)."""
    results = {}
    for arch in ARCHS:
        model = build_model(arch)
        with session_of(model, directory, arch) as session:
            ids = prompt_ids()
            cache = session.load(ids)
            loaded = cache.get_seq_length()
            out = model.generate(ids, cache=cache, **GENERATE)
            stored = session.store(out.sequences, cache)
            follow_up = session.generate(out.sequences, **GENERATE)
            metrics = session.metrics
            results[arch] = {
                "loaded": loaded,
                "stored": stored,
                "sequences": out.sequences,
                "logits": torch.stack(out.logits),
                "follow_up_sequences": follow_up.sequences,
                "follow_up_logits": torch.stack(follow_up.logits),
                "pages_loaded": metrics.pages_loaded,
                "pages_deduplicated": metrics.pages_deduplicated,
            }
    return results


if __name__ == "__main__":
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest on a busy machine, and bitwise the same
    torch.save(second_process(sys.argv[1]), sys.argv[2])
