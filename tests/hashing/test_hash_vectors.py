"""Known-answer tests: sglang's own vectors (sglang-v1) and the committed xxh3-128 vectors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstage.hashing import PageHasher, compute_prefix_hash, namespace_seed, page_keys, prefill_page_keys
from support import SHARED

SGLANG_VECTORS = SHARED / "reference" / "sglang_v1_vectors.json"
XXH3_VECTORS = Path(__file__).with_name("xxh3_128_vectors.json")


def load_cases(path: Path) -> list:
    """The cases of a vector file as pytest params with readable ids; one skipped param if absent."""
    if not path.is_file():
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"{path} is absent"), id="absent")]
    data = json.loads(path.read_text())
    cases = data["cases"] if isinstance(data, dict) else data
    return [pytest.param(case, id=case["name"]) for case in cases]


class Request:
    def __init__(self, extra_key, cache_salt):
        self.extra_key = extra_key
        self.cache_salt = cache_salt


def as_inputs(tokens: list[int], device: torch.device) -> dict:
    """The same token ids in every accepted container."""
    return {
        "list": tokens,
        "tuple": tuple(tokens),
        "numpy-int64": np.array(tokens, dtype=np.int64),
        "numpy-uint32": np.array(tokens, dtype=np.uint32),
        "torch-int64": torch.tensor(tokens, dtype=torch.int64, device=device),
        "torch-int32": torch.tensor(tokens, dtype=torch.int32, device=device) if max(tokens) < 2**31 else None,
    }


def check_case(case: dict, scheme: str, device: torch.device) -> None:
    extra_key, cache_salt, page_size = case["extra_key"], case["cache_salt"], case["page_size"]
    expected = case["page_hashes"]
    assert namespace_seed(extra_key, cache_salt, scheme) == case["namespace_seed"]
    for kind, tokens in as_inputs(case["tokens"], device).items():
        if tokens is None:
            continue
        got = prefill_page_keys(tokens, page_size, extra_key=extra_key, cache_salt=cache_salt, scheme=scheme)
        assert got == expected, kind
    tokens = case["tokens"]
    assert page_keys(tokens, page_size, prior_hash=case["namespace_seed"], scheme=scheme) == expected
    assert compute_prefix_hash(Request(extra_key, cache_salt), tokens, page_size=page_size, scheme=scheme) == expected
    hasher = PageHasher(scheme, page_size)
    assert hasher.seed(extra_key, cache_salt) == case["namespace_seed"]
    assert hasher.prefill_keys(tokens, extra_key, cache_salt) == expected
    # Decode form: the first page from the seed, the rest continued from the first key.
    first = hasher.compute_prefix_hash(Request(extra_key, cache_salt), tokens[:page_size])
    rest = hasher.compute_prefix_hash(Request(extra_key, cache_salt), tokens[page_size:], prior_hash=first[-1])
    assert first + rest == expected


@pytest.mark.parametrize("case", load_cases(SGLANG_VECTORS))
def test_sglang_v1_matches_every_reference_vector(case, device):
    check_case(case, "sglang-v1", device)


@pytest.mark.parametrize("case", load_cases(XXH3_VECTORS))
def test_xxh3_128_matches_committed_vectors(case, device):
    check_case(case, "xxh3-128", device)


@pytest.mark.parametrize("case", load_cases(XXH3_VECTORS))
def test_committed_xxh3_vectors_agree_with_the_naive_reference(case, naive):
    """The committed xxh3-128 vectors were made by kvstage; a per-token reference recomputes them."""
    seed = naive.seed(case["extra_key"], case["cache_salt"], "xxh3-128")
    assert (seed.hex() if seed else None) == case["namespace_seed"]
    assert naive.keys(case["tokens"], case["page_size"], seed, "xxh3-128") == case["page_hashes"]


@pytest.mark.parametrize("case", load_cases(SGLANG_VECTORS))
def test_naive_reference_matches_sglang_vectors(case, naive):
    """Guards the naive reference itself, which the property tests compare against."""
    seed = naive.seed(case["extra_key"], case["cache_salt"])
    assert (seed.hex() if seed else None) == case["namespace_seed"]
    assert naive.keys(case["tokens"], case["page_size"], seed) == case["page_hashes"]


def test_xxh3_128_first_page_written_out_by_hand():
    """One key recomputed from first principles: xxh3_128 of the seed digest, then 2 u32 LE ids."""
    import xxhash

    seed = xxhash.xxh3_128(b"sglang-cache-namespace-v1" + b"\x01" + (6).to_bytes(8, "little") + b"lora-a" + b"\x00")
    assert namespace_seed("lora-a", None, "xxh3-128") == seed.hexdigest()
    page = seed.digest() + bytes([0x01, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF])
    expected = xxhash.xxh3_128(page).hexdigest()
    assert prefill_page_keys([1, 2**32 - 1, 5], 2, extra_key="lora-a", scheme="xxh3-128") == [expected]
    assert len(expected) == 32


def test_sglang_v1_first_page_written_out_by_hand():
    import hashlib

    assert page_keys([1, 2], 2) == [hashlib.sha256(b"\x01\x00\x00\x00\x02\x00\x00\x00").hexdigest()]
    assert namespace_seed(None, None) is None
