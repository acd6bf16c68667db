"""The copy-word rule, written once for both backends: the widest word a copy may move.

Both backends move bytes, not elements: every tensor is viewed as rows of *words*, the
widest power of two (up to 16 bytes) that divides a row and the start address of every
tensor the copy touches. fp16, bf16, fp32, fp8 and int8 then take one code path, and wide
accesses (16-byte vectors on a GPU, fewer per-element steps in ``index_copy_``) happen
wherever the row and the addresses allow them.
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["WORD_DTYPES", "as_words", "widest_word"]

# The dtype that holds one word of each size. complex128 is only a 16-byte container here:
# the copies move its values bit for bit and never compute with them.
WORD_DTYPES = {16: torch.complex128, 8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def widest_word(row_bytes: int, addresses: Iterable[int], max_word: int = 16) -> int:
    """The widest word in bytes (``max_word``, ..., 2 or 1; powers of two) dividing ``row_bytes`` and every address.

    Args:
        row_bytes: bytes of one row (one slot of one buffer), >= 1.
        addresses: start addresses (``data_ptr()``) or byte offsets of every tensor the copy touches.
        max_word: the widest word wanted, a power of two <= 16.
    """
    addresses = list(addresses)
    word = max_word
    while word > 1 and (row_bytes % word or any(a % word for a in addresses)):
        word //= 2
    return word


def as_words(t: torch.Tensor, row_bytes: int, word: int) -> torch.Tensor:
    """View contiguous ``t`` as ``[numel * itemsize / row_bytes, row_bytes / word]`` words (no copy).

    ``word`` must divide ``row_bytes`` and ``t``'s start address (see :func:`widest_word`).
    """
    flat = t.reshape(-1).view(torch.uint8)
    return flat.view(WORD_DTYPES[word]).view(-1, row_bytes // word)
