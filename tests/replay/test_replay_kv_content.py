"""The KV content of a page is a function of (page key, position) only, and cheap to check."""

from __future__ import annotations

import pytest
import torch

from kvstage.replay.kv_content import KVContent, word_dtype
from kvstage.replay.models import resolve_model


@pytest.mark.parametrize("row_bytes, word", [(256, torch.int64), (12, torch.int32), (6, torch.int16), (3, torch.uint8)])
def test_word_is_the_widest_integer_that_divides_a_row(row_bytes, word):
    assert word_dtype(row_bytes) is word


def pages_of(content, keys):
    """Every layer and part of pages under ``keys``: words ``[P, num_layers, kv_parts, page_size, W]`` on CPU."""
    model, masks = content.model, content.masks(keys)
    planes = [
        [content.page_words_for_layer(masks, layer, part).cpu() for part in range(model.kv_parts)]
        for layer in range(model.num_layers)
    ]
    return (
        torch.stack([torch.stack(parts) for parts in planes])
        .view(model.num_layers, model.kv_parts, len(keys), content.page_size, -1)
        .permute(2, 0, 1, 3, 4)
    )


@pytest.mark.parametrize(
    "model",
    [
        resolve_model("small"),
        resolve_model("deepseek-v3", layers=2),
        resolve_model(None, layers=1, heads=3, head_dim=5, dtype="bfloat16"),
    ],
    ids=["small", "mla", "odd-row"],
)
def test_pages_depend_on_key_and_position_only(model, device):
    ps = 8
    content = KVContent(model, ps, seed=5, device=device)
    pages = pages_of(content, ["aa", "bb", "aa"])
    assert pages.shape == (3, model.num_layers, model.kv_parts, ps, content.words_per_row)
    assert content.words_per_row * content.word_bytes == model.num_heads * model.head_dim * model.dtype.itemsize
    assert torch.equal(pages[0], pages[2])
    assert torch.equal(pages[0], pages_of(KVContent(model, ps, seed=5), ["aa"])[0])
    assert not torch.equal(pages[0], pages_of(KVContent(model, ps, seed=6), ["aa"])[0])
    # Another key differs in every word; another position differs too.
    assert bool((pages[0] != pages[1]).all())
    assert not torch.equal(pages[0][:, :, 0], pages[0][:, :, 1])


def test_token_rows_are_rows_of_the_pages(device):
    model = resolve_model("small")
    ps = 4
    content = KVContent(model, ps, seed=0, device=device)
    keys = ["k0", "k1"]
    masks = content.masks(keys)
    offsets = torch.tensor([3, 0], device=device)
    for layer in range(model.num_layers):
        for part in range(model.kv_parts):
            whole = content.page_words_for_layer(masks, layer, part).cpu().view(2, ps, -1)
            single = content.token_rows(masks, offsets, layer, part).cpu()
            assert torch.equal(single[0], whole[0, 3]) and torch.equal(single[1], whole[1, 0])
