"""A naive per-token reference of the page key schemes, written from the spec, for tests.

It shares no code with ``kvstage.hashing``: tokens are packed one ``to_bytes`` at a time and every
hash object is fed piece by piece, so agreement with the vectorised code is not circular. The
hashing tests check it against sglang's own vectors (``tests/hashing/test_hash_vectors.py``);
the offload rig (``tests/offload_rig.py``) takes its expected keys from it.

Scheme (``../shared/reference/sglang-storage-keys.md``): the namespace seed hashes
``b"sglang-cache-namespace-v1"``, then per part (``extra_key``, ``cache_salt``) ``b"\\x00"`` for
None or ``b"\\x01"``, its UTF-8 length as u64 little-endian and its bytes; no namespace: no seed.
"""

from __future__ import annotations

import hashlib

import xxhash

NEW_HASH = {"sglang-v1": hashlib.sha256, "xxh3-128": xxhash.xxh3_128}


def naive_seed(extra_key: str | None, cache_salt: str | None, scheme: str = "sglang-v1") -> bytes:
    """The namespace seed's digest (``b""`` without a namespace)."""
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


def naive_keys(tokens, page_size: int, prior: bytes = b"", scheme: str = "sglang-v1") -> list[str]:
    """Hex keys of the whole pages of ``tokens`` after the digest ``prior``. A page whose ids all
    fit u32 hashes them as u32; a page with a wider id hashes 0xff, then every id as u64 (sglang
    0.5.23's native page hash)."""
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


def naive_prefill_keys(
    tokens, page_size: int, extra_key: str | None = None, cache_salt: str | None = None, scheme: str = "sglang-v1"
) -> list[str]:
    """The keys a prefill side stores for ``tokens`` in the namespace (``extra_key``, ``cache_salt``)."""
    return naive_keys(tokens, page_size, naive_seed(extra_key, cache_salt, scheme), scheme)


class Naive:
    """The reference as one object (the hashing tests' ``naive`` fixture)."""

    seed = staticmethod(naive_seed)
    keys = staticmethod(naive_keys)
    prefill = staticmethod(naive_prefill_keys)
