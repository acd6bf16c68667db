"""``integrations.transformers.model_layout``: six hybrid models' ModelLayouts, read from the cache a
prefill fills, against the sizes their configs imply (the models' own formulas)."""

from __future__ import annotations

import time

import pytest
import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.integrations.transformers import model_layout, model_layout_of_config
from kvstage.kv_layout import KVLayout
from kvstage.model_layout import FullAttention, ModelLayout, PageSidecar, RequestState, SlidingWindow, TensorSpec

import hybrid_models as hm


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def expected(arch: str, dtype: torch.dtype = torch.float32) -> ModelLayout:
    """What each model caches, from its config fields (not from a cache)."""
    c = hm.config_of(arch)
    kv = KVLayout(2, 2, c.num_key_value_heads, c.head_dim, dtype)
    if arch in ("gpt_oss", "gemma3"):
        return ModelLayout(4, (SlidingWindow((0, 2), kv, c.sliding_window), FullAttention((1, 3), kv)))
    if arch == "qwen3_next":
        key_dim, value_dim = (
            c.linear_key_head_dim * c.linear_num_key_heads,
            c.linear_value_head_dim * c.linear_num_value_heads,
        )
        conv = TensorSpec("conv", (2 * key_dim + value_dim, c.linear_conv_kernel_dim), dtype)
        recurrent = TensorSpec(
            "recurrent", (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim), dtype
        )
        return ModelLayout(
            4, (RequestState((0, 1, 2), (conv, recurrent)), FullAttention((3,), KVLayout(1, 2, 2, 16, dtype)))
        )
    if arch == "jamba":
        inner = c.mamba_expand * c.hidden_size
        state = (
            TensorSpec("conv", (inner, c.mamba_d_conv), dtype),
            TensorSpec("recurrent", (inner, c.mamba_d_state), dtype),
        )
        return ModelLayout(4, (RequestState((0, 2), state), FullAttention((1, 3), kv)))
    if arch == "falcon_h1":
        conv = TensorSpec("conv", (c.mamba_d_ssm + 2 * c.mamba_n_groups * c.mamba_d_state, c.mamba_d_conv), dtype)
        ssm = TensorSpec("recurrent", (c.mamba_n_heads, c.mamba_d_head, c.mamba_d_state), dtype)
        kv4 = KVLayout(4, 2, c.num_key_value_heads, c.head_dim, dtype)
        return ModelLayout(4, (FullAttention((0, 1, 2, 3), kv4), RequestState((0, 1, 2, 3), (conv, ssm))))
    assert arch == "deepseek_v32"
    latent = KVLayout(4, 1, 1, c.kv_lora_rank + c.qk_rope_head_dim, dtype)
    indexer = PageSidecar((0, 1, 2, 3), (TensorSpec("indexer_keys", (c.index_head_dim,), dtype),), name="indexer")
    return ModelLayout(4, (FullAttention((0, 1, 2, 3), latent), indexer))


@pytest.mark.parametrize("arch", hm.ARCHS)
def test_layout_read_from_the_cache_equals_the_configs(arch):
    started = time.perf_counter()
    layout = model_layout(hm.build_model(arch))
    assert layout == expected(arch), layout.describe()
    assert time.perf_counter() - started < 30  # tiny configs: a few seconds on a busy CPU


def test_dtype_comes_from_the_cache_and_makes_another_key_space():
    layout = model_layout(hm.build_model("gpt_oss", torch.bfloat16))
    assert layout == expected("gpt_oss", torch.bfloat16)
    ours = {fp.prefix() for fp in layout.fingerprints("gpt-oss", page_size=4).values()}
    theirs = {fp.prefix() for fp in expected("gpt_oss").fingerprints("gpt-oss", page_size=4).values()}
    assert not ours & theirs


def test_a_probe_shorter_than_the_window_is_checked_too():
    assert model_layout(hm.build_model("gemma3"), probe_tokens=3) == expected("gemma3")


def test_layout_of_a_config_builds_the_model():
    assert model_layout_of_config(hm.config_of("jamba")) == expected("jamba")


def test_a_plain_model_is_a_plain_layout():
    from transformers import LlamaConfig

    layout = model_layout_of_config(LlamaConfig(**hm.COMMON))
    assert layout.is_plain and layout == ModelLayout.full_attention(KVLayout(4, 2, 2, 16, torch.float32))


def test_refusals_name_the_layer_and_field():
    from transformers import Llama4TextConfig

    with pytest.raises(ArgumentTypeError, match=r"model: must be a transformers model"):
        model_layout(torch.nn.Linear(2, 2))
    with pytest.raises(ArgumentTypeError, match=r"config: must be a transformers PretrainedConfig"):
        model_layout_of_config({"hidden_size": 64})
    with pytest.raises(InvalidArgumentError, match=r"probe_tokens: must be a positive int"):
        model_layout(hm.build_model("gemma3"), probe_tokens=0)
    config = Llama4TextConfig(**{**hm.COMMON, "num_hidden_layers": 2}, attention_chunk_size=8, num_local_experts=2)
    config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(InvalidArgumentError, match=r"model.config.layer_types: layer 0 is a 'chunked_attention' layer"):
        model_layout_of_config(config)
