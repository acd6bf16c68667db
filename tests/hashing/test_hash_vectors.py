"""Known-answer tests: sglang's own vectors (sglang-v1, u32 ids and sglang's native page hash with
ids up to 2**63-1) and the committed xxh3-128 vectors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstage.hashing import PageHasher, compute_prefix_hash, namespace_seed, page_keys, prefill_page_keys

from hash_chains import chain_scheme
from support import SHARED, missing_mark

SGLANG_VECTORS = SHARED / "reference" / "sglang_v1_vectors.json"
# Made with sglang 0.5.23's own native page hash (ids up to 2**63-1): "tokens", "page_size",
# "extra_key", "cache_salt", "seed" (hex or null) and "keys" per case, no "name".
SGLANG_NATIVE_VECTORS = SHARED / "reference" / "sglang_native_vectors.json"
XXH3_VECTORS = Path(__file__).with_name("xxh3_128_vectors.json")


def native_case_id(index: int, case: dict) -> str:
    return f"{index:02d}-{case['kind']}-page{case['page_size']}"


def load_cases(path: Path, case_id=lambda index, case: case["name"]) -> list:
    """The cases of a vector file as pytest params with readable ids; one skipped param if absent
    (failed under CI)."""
    if not path.is_file():
        return [pytest.param(None, marks=missing_mark(str(path)), id="absent")]
    data = json.loads(path.read_text())
    cases = data["cases"] if isinstance(data, dict) else data
    return [pytest.param(case, id=case_id(index, case)) for index, case in enumerate(cases)]


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


# ---- sglang's native page hash: ids up to 2**63-1 -------------------------------------------


def native_inputs(tokens: list[int], device: torch.device) -> dict:
    """The same ids in every container that holds ids up to 2**63-1."""
    return {
        "list": tokens,
        "tuple": tuple(tokens),
        "numpy-int64": np.array(tokens, dtype=np.int64),
        "numpy-uint64": np.array(tokens, dtype=np.uint64),
        "torch-int64": torch.tensor(tokens, dtype=torch.int64, device=device),
    }


@pytest.mark.parametrize("chain", ["compiled", "pure-python"])
@pytest.mark.parametrize("case", load_cases(SGLANG_NATIVE_VECTORS, native_case_id))
def test_sglang_v1_matches_sglangs_native_page_hash(case, chain, device):
    """Prefill from the seed, and decode segments split at every page boundary, give sglang's keys."""
    scheme = chain_scheme("sglang-v1", chain)
    extra_key, cache_salt, page_size, expected = case["extra_key"], case["cache_salt"], case["page_size"], case["keys"]
    assert namespace_seed(extra_key, cache_salt, scheme) == case["seed"]
    req = Request(extra_key, cache_salt)
    num_pages = len(case["tokens"]) // page_size
    assert len(expected) == num_pages
    for kind, tokens in native_inputs(case["tokens"], device).items():
        got = prefill_page_keys(tokens, page_size, extra_key=extra_key, cache_salt=cache_salt, scheme=scheme)
        assert got == expected, kind
        assert PageHasher(scheme, page_size).continue_keys(tokens, case["seed"]) == expected, kind
        # Decode: two segments cut at each page boundary (an empty first segment leaves the chain
        # unstarted, so the second starts from the seed), then one segment per page.
        for cut in range(num_pages + 1):
            first = compute_prefix_hash(req, tokens[: cut * page_size], "", page_size=page_size, scheme=scheme)
            rest = compute_prefix_hash(
                req, tokens[cut * page_size :], first[-1] if first else "", page_size=page_size, scheme=scheme
            )
            assert first + rest == expected, (kind, cut)
        keys, prior = [], ""
        for page in range(num_pages):
            keys += compute_prefix_hash(
                req, tokens[page * page_size : (page + 1) * page_size], prior, page_size=page_size, scheme=scheme
            )
            prior = keys[-1]
        assert keys == expected, kind


@pytest.mark.parametrize("case", load_cases(SGLANG_NATIVE_VECTORS, native_case_id))
def test_naive_reference_matches_sglangs_native_vectors(case, naive):
    """Guards the naive reference's wide-page rule, which the property tests compare against."""
    seed = naive.seed(case["extra_key"], case["cache_salt"])
    assert (seed.hex() if seed else None) == case["seed"]
    assert naive.keys(case["tokens"], case["page_size"], seed) == case["keys"]


@pytest.mark.parametrize("chain", ["compiled", "pure-python"])
def test_wide_pages_written_out_by_hand(chain):
    """A page with an id above 2**32-1 hashes prior + 0xff + every id as u64 LE; a page whose ids
    fit u32 (2**32-1 included) hashes them as u32 LE, also after a wide page. Both schemes."""
    import xxhash

    ids = [7, 2**32, 2**32 - 1, 0, 2**63 - 1, 1]
    narrow = lambda *page: b"".join(v.to_bytes(4, "little") for v in page)  # noqa: E731
    wide = lambda *page: b"\xff" + b"".join(v.to_bytes(8, "little") for v in page)  # noqa: E731
    for name, digest in (
        ("sglang-v1", lambda data: hashlib.sha256(data).digest()),
        ("xxh3-128", xxhash.xxh3_128_digest),
    ):
        scheme = chain_scheme(name, chain)
        first = digest(wide(7, 2**32))
        second = digest(first + narrow(2**32 - 1, 0))
        third = digest(second + wide(2**63 - 1, 1))
        assert page_keys(ids, 2, scheme=scheme) == [first.hex(), second.hex(), third.hex()]
        assert page_keys(ids[2:], 2, prior_hash=first.hex(), scheme=scheme) == [second.hex(), third.hex()]
        # A page of 2**32 ids: 1 + 8 * 2 bytes, never the 4 * 2 of a u32 page.
        assert page_keys([2**32, 2**32], 2, scheme=scheme) == [
            digest(b"\xff" + (2**32).to_bytes(8, "little") * 2).hex()
        ]
