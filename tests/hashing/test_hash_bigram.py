"""EAGLE bigram keys (kvstage.hashing.bigram) from first principles: each page hashes its pairs'
ids after the prior digest (u32, or 0xff + u64 where a page reads a wide id); the sglang venv's
test_sglang_bigram_keys.py compares them with sglang's own."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from kvstage.errors import InvalidArgumentError
from kvstage.hashing import BigramPageHasher, namespace_seed, pair_ids


def naive_bigram_keys(tokens, page_size, prior=b""):
    keys = []
    for start in range(0, (len(tokens) - 1) // page_size * page_size, page_size):
        ids = [v for j in range(start, start + page_size) for v in (tokens[j], tokens[j + 1])]
        if max(tokens[start : start + page_size + 1]) > 2**32 - 1:
            data = b"\xff" + struct.pack(f"<{len(ids)}Q", *ids)
        else:
            data = struct.pack(f"<{len(ids)}I", *ids)
        prior = hashlib.sha256(prior + data).digest()
        keys.append(prior.hex())
    return keys


@pytest.mark.parametrize("n", [0, 1, 4, 5, 8, 9, 23])
def test_pages_read_one_id_past_their_end(n):
    tokens = list(range(50, 50 + n))
    hasher = BigramPageHasher(page_size=4)
    assert hasher.prefill_keys(tokens) == naive_bigram_keys(tokens, 4)
    assert hasher.full_pages(n) == (max(n - 1, 0) // 4, max(n - 1, 0) % 4)


def test_a_wide_boundary_id_makes_both_pages_wide_and_the_seed_starts_the_chain():
    tokens = [1, 2, 3, 4, 2**40, 6, 7, 8, 9, 10]
    seed = bytes.fromhex(namespace_seed("lora", None))
    assert BigramPageHasher(page_size=4).prefill_keys(tokens, extra_key="lora") == naive_bigram_keys(tokens, 4, seed)
    assert pair_ids(tokens, 4).dtype == np.uint64 and pair_ids([1, 2, 3], 1).tolist() == [1, 2, 2, 3]


def test_continue_keys_split_at_page_boundaries_equal_the_whole_chain():
    tokens = [(i * 7919) % 50000 for i in range(41)]
    hasher = BigramPageHasher(page_size=4, scheme="xxh3-128")
    whole = hasher.prefill_keys(tokens)
    keys = hasher.prefill_keys(tokens[:13])
    keys += hasher.continue_keys(tokens[12:], keys[-1])
    assert keys == whole and len(whole) == 10 and hasher.key_length == 32


def test_a_bad_id_is_named_by_its_position_in_tokens():
    with pytest.raises(InvalidArgumentError, match=r"tokens\[2\]"):
        BigramPageHasher(page_size=2).prefill_keys([1, 2, -3, 4, 5])
