"""Tokens follow block ids and request indices; model presets have the published KV shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.replay.models import PRESETS, resolve_model
from kvstage.replay.tokens import VOCAB_SIZE, TokenSource
from kvstage.replay.trace import TraceRequest


def request(index, input_length, hash_ids, output_length=5):
    return TraceRequest(index, 0.0, input_length, output_length, tuple(hash_ids))


def test_block_tokens_are_a_function_of_the_block_id_alone():
    a, b = TokenSource(seed=3), TokenSource(seed=3)
    assert np.array_equal(a.block(17), b.block(17))
    assert not np.array_equal(a.block(17), a.block(18))
    assert not np.array_equal(a.block(17), TokenSource(seed=4).block(17))
    tokens = a.block(17)
    assert tokens.shape == (512,) and tokens.dtype == np.int64
    assert 0 <= tokens.min() and tokens.max() < VOCAB_SIZE


def test_prompt_is_the_blocks_cut_at_input_length_and_shares_leading_blocks():
    source = TokenSource(seed=0)
    first = source.prompt(request(0, 1100, [0, 1, 2]))
    second = source.prompt(request(1, 700, [0, 5]))
    assert first.shape == (1100,) and second.shape == (700,)
    assert np.array_equal(first[:512], second[:512])  # block 0 shared
    assert not np.array_equal(first[512:700], second[512:700])
    assert np.array_equal(first[1024:], source.block(2)[:76])


def test_output_tokens_are_a_function_of_the_request_index():
    source = TokenSource(seed=0)
    out = source.output(request(7, 10, [1], output_length=9))
    assert out.shape == (9,)
    assert np.array_equal(out, TokenSource(seed=0).output(request(7, 900, [4, 5], output_length=9)))
    assert not np.array_equal(out, source.output(request(8, 10, [1], output_length=9)))


def test_presets_have_the_published_kv_shapes():
    llama = PRESETS["llama3-8b"]
    assert (llama.num_layers, llama.kv_parts, llama.num_heads, llama.head_dim, llama.dtype) == (
        32,
        2,
        8,
        128,
        torch.bfloat16,
    )
    assert llama.token_bytes == 128 * 1024
    deepseek = PRESETS["deepseek-v3"]
    assert (deepseek.num_layers, deepseek.kv_parts, deepseek.num_heads, deepseek.head_dim) == (61, 1, 1, 576)
    assert deepseek.token_bytes == 61 * 576 * 2
    assert PRESETS["small"].page_bytes(64) == 64 * 1024


def test_explicit_fields_override_the_preset():
    model = resolve_model("llama3-8b", layers=4, dtype="float16")
    assert (model.num_layers, model.num_heads, model.head_dim, model.dtype) == (4, 8, 128, torch.float16)
    assert model.name == "llama3-8b+custom"
    custom = resolve_model(None, layers=3, heads=1, head_dim=16)
    assert (custom.name, custom.num_layers, custom.kv_parts, custom.num_heads, custom.head_dim) == (
        "custom",
        3,
        2,
        1,
        16,
    )
    assert resolve_model("deepseek-v3", layers=2).kv_parts == 1


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"preset": "gpt-5"}, "--model"),
        ({"layers": 0}, "--layers"),
        ({"heads": -1}, "--heads"),
        ({"head_dim": 0}, "--head-dim"),
        ({"dtype": "int3"}, "--dtype"),
    ],
)
def test_bad_model_options_name_the_option(kwargs, option):
    with pytest.raises(InvalidArgumentError, match=f"^{option}:"):
        resolve_model(**kwargs)
