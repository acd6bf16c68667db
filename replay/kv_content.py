"""The KV bytes the replay writes: a deterministic function of (page key, position in page).

No model runs, so the replay makes up KV content, under one rule: the bytes of token ``t`` of a
page (every layer and part) depend only on the page's key and ``t``. Any page loaded back from
storage into device slots can then be checked against what it must hold, and two pages under one
key (a prefix shared by two requests) hold the same bytes, as real KV would.

Scheme (cheap: one XOR per machine word): a seeded random *base page* of words
``[num_layers, kv_parts, page_size, W]`` (W words a token row of one layer and part) gives the
position dependence, and a 64-bit *mask* derived from the key (``xxh3_64(key)`` with the seed)
gives the key dependence::

    content(key)[l, k, t, w] = base[l, k, t, w] XOR mask(key)   (mask truncated to the word)

A page under a different key differs in every word; a token at a wrong position differs from
the base of its position. The word is the widest of int64/int32/int16/uint8 that divides a
token row's bytes, so the KV dtype itself is never interpreted (bf16 NaN patterns are fine: the
copies move bytes).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import xxhash

from kvstage.replay.models import ModelShape

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def word_dtype(row_bytes: int) -> torch.dtype:
    """The widest integer dtype whose size divides ``row_bytes``."""
    for size, dtype in _WORDS:
        if row_bytes % size == 0:
            return dtype
    raise AssertionError("unreachable: 1 divides every size")


class KVContent:
    """Makes the expected KV words of pages and tokens.

    Args:
        model: the KV layout.
        page_size: tokens per page.
        seed: seeds the base page (a ``torch.Generator`` on CPU) and the key masks.
        device: where :meth:`page_words_for_layer` and :meth:`token_rows` build tensors
            (the KV pool's device).
        salt: changes the base page only (a hybrid model's sliding-window layers: other
            bytes, the same masks).

    Attributes:
        word: the integer dtype words are made of; ``words_per_row`` of them a token row
            (one layer and part: ``num_heads * head_dim`` elements).
    """

    def __init__(
        self, model: ModelShape, page_size: int, seed: int = 0, device: torch.device | str = "cpu", salt: int = 0
    ) -> None:
        self.model = model
        self.page_size = page_size
        self.seed = int(seed)
        row_bytes = model.num_heads * model.head_dim * model.dtype.itemsize
        self.word = word_dtype(row_bytes)
        self.word_bytes = torch.empty((), dtype=self.word).element_size()
        self.words_per_row = row_bytes // self.word_bytes
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + 17 + 7919 * salt)
        shape = (model.num_layers, model.kv_parts, page_size, self.words_per_row)
        raw = torch.randint(0, 256, (int(np.prod(shape)) * self.word_bytes,), dtype=torch.uint8, generator=generator)
        self.device = torch.device(device)
        self.base = raw.view(self.word).view(shape).to(self.device)

    # -- masks ------------------------------------------------------------------------------

    def mask(self, key: str) -> int:
        """The key's mask as a signed 64-bit int (truncated to the word when applied)."""
        value = xxhash.xxh3_64_intdigest(key.encode(), seed=self.seed)
        value = value - (1 << 64) if value >= 1 << 63 else value
        if self.word_bytes < 8:  # keep it in the word's range so the XOR is exact
            bits = 8 * self.word_bytes
            value &= (1 << bits) - 1
            if self.word is not torch.uint8 and value >= 1 << (bits - 1):
                value -= 1 << bits
        return value

    def masks(self, keys: Sequence[str]) -> torch.Tensor:
        """Masks of ``keys`` as a 1-D tensor of the word dtype on :attr:`device`."""
        return torch.tensor([self.mask(key) for key in keys], dtype=self.word).to(self.device)

    # -- content ----------------------------------------------------------------------------

    def page_words_for_layer(self, masks: torch.Tensor, layer: int, part: int) -> torch.Tensor:
        """Words of one layer and part of pages with these masks: ``[P * page_size, W]``."""
        base = self.base[layer, part]  # [page_size, W]
        return (base.unsqueeze(0) ^ masks.view(-1, 1, 1)).reshape(-1, self.words_per_row)

    def token_rows(self, masks: torch.Tensor, offsets: torch.Tensor, layer: int, part: int) -> torch.Tensor:
        """Words of single tokens: token i at position ``offsets[i]`` of a page with ``masks[i]``: ``[R, W]``."""
        return self.base[layer, part].index_select(0, offsets) ^ masks.view(-1, 1)


class StateContent:
    """The expected bytes of a state snapshot: the state after ``L`` tokens is a function of the key
    of the page ending at ``L`` (which fixes every token before it and the namespace)::

        snapshot(key) = base XOR tile(mask(key))   (bytes; the mask's 8 little-endian bytes repeated)

    Args:
        entry_bytes: bytes of one snapshot (``RequestState.entry_bytes``), every layer's tensors
            in the component's byte order.
        seed: seeds the base (the masks are :meth:`KVContent.mask`'s, from ``masks_from``).
        masks_from: the :class:`KVContent` whose :meth:`KVContent.mask` keys the snapshots.
        device: where :meth:`snapshot` builds its tensor.
    """

    def __init__(self, entry_bytes: int, seed: int, masks_from: KVContent, device: torch.device | str = "cpu") -> None:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + 29)
        self.device = torch.device(device)
        self.base = torch.randint(0, 256, (entry_bytes,), dtype=torch.uint8, generator=generator).to(self.device)
        self.masks_from = masks_from

    def snapshot(self, key: str) -> torch.Tensor:
        """``[entry_bytes]`` uint8: the snapshot stored under ``key``."""
        mask = self.masks_from.mask(key) & ((1 << (8 * self.masks_from.word_bytes)) - 1)
        word = torch.tensor(list(mask.to_bytes(8, "little")), dtype=torch.uint8, device=self.device)
        reps = -(-self.base.numel() // 8)
        return self.base ^ word.repeat(reps)[: self.base.numel()]
