"""A naive per-token reference of the page key schemes, written from the spec, for the hashing tests.

It shares no code with ``kvstage.hashing``: tokens are packed one ``to_bytes`` at a time and every
hash object is fed piece by piece, so agreement with the vectorised code is not circular.
"""

from __future__ import annotations

import hashlib

import pytest
import xxhash

NEW_HASH = {"sglang-v1": hashlib.sha256, "xxh3-128": xxhash.xxh3_128}


def naive_seed(extra_key, cache_salt, scheme="sglang-v1") -> bytes:
    if extra_key is None and cache_salt is None:
        return b""
    h = NEW_HASH[scheme]()
    h.update(b"sglang-cache-namespace-v1")
    for part in (extra_key, cache_salt):
        if part is None:
            h.update(b"\x00")
        else:
            data = part.encode("utf-8")
            h.update(b"\x01")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
    return h.digest()


def naive_keys(tokens, page_size, prior: bytes = b"", scheme="sglang-v1") -> list[str]:
    """A page whose ids all fit u32 hashes them as u32; a page with a wider id hashes 0xff, then
    every id as u64 (sglang 0.5.23's native page hash)."""
    keys = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = [int(token) for token in tokens[start : start + page_size]]
        wide = any(token > 2**32 - 1 for token in page)
        h = NEW_HASH[scheme]()
        h.update(prior)
        if wide:
            h.update(b"\xff")
        for token in page:
            h.update(token.to_bytes(8 if wide else 4, "little"))
        prior = h.digest()
        keys.append(h.hexdigest())
    return keys


class Naive:
    seed = staticmethod(naive_seed)
    keys = staticmethod(naive_keys)

    @staticmethod
    def prefill(tokens, page_size, extra_key=None, cache_salt=None, scheme="sglang-v1") -> list[str]:
        return naive_keys(tokens, page_size, naive_seed(extra_key, cache_salt, scheme), scheme)


@pytest.fixture(scope="session")
def naive() -> type[Naive]:
    """The naive reference: ``naive.seed``, ``naive.keys``, ``naive.prefill``."""
    return Naive
