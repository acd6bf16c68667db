"""The KV content of a page is a function of (page key, position) only, and cheap to check."""

from __future__ import annotations

import pytest
import torch

from kvstage.replay.kv_content import KVContent, word_dtype
from kvstage.replay.models import resolve_model


@pytest.mark.parametrize("row_bytes, word", [(256, torch.int64), (12, torch.int32), (6, torch.int16), (3, torch.uint8)])
def test_word_is_the_widest_integer_that_divides_a_row(row_bytes, word):
    assert word_dtype(row_bytes) is word


@pytest.mark.parametrize(
    "model",
    [resolve_model("small"), resolve_model("deepseek-v3", layers=2), resolve_model(None, layers=1, heads=3, head_dim=5, dtype="bfloat16")],
    ids=["small", "mla", "odd-row"],
)
def test_pages_depend_on_key_and_position_only(model, device):
    ps = 8
    content = KVContent(model, ps, seed=5, device=device)
    pages = content.expected_pages(["aa", "bb", "aa"])
    assert pages.shape == (3, model.page_bytes(ps)) and pages.dtype == torch.uint8
    assert torch.equal(pages[0], pages[2])
    assert torch.equal(pages[0], KVContent(model, ps, seed=5).expected_pages(["aa"])[0])
    assert not torch.equal(pages[0], KVContent(model, ps, seed=6).expected_pages(["aa"])[0])
    # Another key differs in every word; another position differs too.
    words = pages.view(content.word).view(3, -1)
    assert bool((words[0] != words[1]).all())
    rows = words[0].view(model.num_layers, model.kv_parts, ps, -1)
    assert not torch.equal(rows[:, :, 0], rows[:, :, 1])


def test_layer_rows_and_token_rows_agree_with_the_page_layout(device):
    model = resolve_model("small")
    ps = 4
    content = KVContent(model, ps, seed=0, device=device)
    keys = ["k0", "k1"]
    masks = content.masks(keys)
    page = content.expected_pages(keys).view(content.word).view(2, model.num_layers, model.kv_parts, ps, -1)
    for layer in range(model.num_layers):
        for part in range(model.kv_parts):
            whole = content.page_words_for_layer(masks, layer, part).cpu()
            assert torch.equal(whole, page[:, layer, part].reshape(2 * ps, -1))
            offsets = torch.tensor([3, 0], device=device)
            single = content.token_rows(masks, offsets, layer, part).cpu()
            assert torch.equal(single[0], page[0, layer, part, 3]) and torch.equal(single[1], page[1, layer, part, 0])
