"""kvstage's EAGLE bigram page keys against sglang 0.5.23's own: ``get_storage_hash_str`` of a
bigram ``RadixKey`` (its native page hash with ``is_bigram``), with namespace seeds, wide ids
and chains continued segment by segment as a decode side continues the prefill side's."""

from __future__ import annotations

import random
from array import array

import pytest
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_hash_str, get_storage_hash_str

from kvstage.hashing import BigramPageHasher, PageHasher

U32_MAX = 2**32 - 1


def sglang_bigram_keys(tokens, page_size, extra_key=None, cache_salt=None) -> list[str]:
    key = RadixKey(array("q", tokens), extra_key, is_bigram=True, cache_salt=cache_salt).page_aligned(page_size)
    return get_storage_hash_str(key, page_size=page_size)


CASES = [
    ("plain", list(range(100, 118)), 4, None, None),
    ("one page and its boundary", [7, 8, 9, 10, 11], 4, None, None),
    ("no whole page", [7, 8, 9, 10], 4, None, None),
    ("lora", list(range(5, 30)), 4, "lora-7", None),
    ("salt", list(range(5, 30)), 8, None, "tenant-a"),
    ("both", list(range(5, 30)), 3, "lora-7", "tenant-a"),
    ("empty extra_key", list(range(5, 30)), 4, "", None),  # RadixKey turns cache_salt "" into None
    ("u32 max", [U32_MAX] * 13, 4, None, None),
    ("wide boundary id", [1, 2, 3, 4, 2**40, 6, 7, 8, 9], 4, None, None),
    ("wide inside", [1, 2**63 - 1, 3, 4, 5, 6, 7, 8, 9, 10], 2, "x", None),
    ("page size 1", [3, 1, 4, 1, 5, 9, 2, 6], 1, None, "s"),
]


@pytest.mark.parametrize("name,tokens,page_size,extra_key,cache_salt", CASES, ids=[c[0] for c in CASES])
def test_bigram_prefill_keys_equal_sglangs(name, tokens, page_size, extra_key, cache_salt):
    want = sglang_bigram_keys(tokens, page_size, extra_key, cache_salt)
    hasher = BigramPageHasher(page_size=page_size)
    got = hasher.prefill_keys(tokens, extra_key=extra_key, cache_salt=cache_salt)
    assert got == want
    assert len(got) == (len(tokens) - 1) // page_size == hasher.full_pages(len(tokens))[0]
    for container in (array("q", tokens), tuple(tokens)):
        assert hasher.prefill_keys(container, extra_key=extra_key, cache_salt=cache_salt) == want


def test_bigram_keys_differ_from_plain_keys():
    tokens = list(range(40, 61))
    assert sglang_bigram_keys(tokens, 4) != get_storage_hash_str(RadixKey(array("q", tokens[:20])), page_size=4)
    assert BigramPageHasher(page_size=4).prefill_keys(tokens) != PageHasher(page_size=4).prefill_keys(tokens)


def test_bigram_chain_continued_segment_by_segment_equals_sglangs_whole_chain():
    rng = random.Random(5)
    page_size = 4
    tokens = [rng.randrange(0, 2**17) for _ in range(61)]
    want = sglang_bigram_keys(tokens, page_size, "lora-7", "tenant-a")
    hasher = BigramPageHasher(page_size=page_size)
    keys = hasher.prefill_keys(tokens[:9], extra_key="lora-7", cache_salt="tenant-a")  # 2 pages
    for start, end in ((8, 21), (20, 33), (32, 61)):  # each segment reads one id past its pages
        keys += hasher.continue_keys(tokens[start:end], keys[-1])
    assert keys == want
    # sglang's own continuation: a bigram RadixKey slice hashed from the previous key
    tail = RadixKey(array("q", tokens), "lora-7", is_bigram=True, cache_salt="tenant-a")[8:60]
    assert get_hash_str(tail, want[1], page_size=page_size) == want[2:]
