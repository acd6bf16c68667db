"""Namespace-seeded page hash chains (storage keys) for paged KV.

A page's key is the hex hash of the previous page's raw digest followed by the page's token ids
(u32 little-endian); the first page's prior is the namespace seed of ``(extra_key, cache_salt)``.
Scheme ``sglang-v1`` (SHA-256, the default) matches sglang HiCache's prefill keys byte for byte;
``xxh3-128`` is several times faster but not cryptographic.

Modules: ``tokens`` (ids -> bytes), ``schemes`` (hash functions by name), ``namespace`` (the
seed), ``chain`` (keys, the decode form, :class:`PageHasher`).
"""

from kvstage.hashing.chain import PageHasher, compute_prefix_hash, full_pages, page_keys, prefill_page_keys
from kvstage.hashing.namespace import namespace_seed
from kvstage.hashing.schemes import DEFAULT_SCHEME, SCHEMES, HashScheme, get_scheme
from kvstage.hashing.tokens import token_bytes

__all__ = [
    "DEFAULT_SCHEME",
    "SCHEMES",
    "HashScheme",
    "PageHasher",
    "compute_prefix_hash",
    "full_pages",
    "get_scheme",
    "namespace_seed",
    "page_keys",
    "prefill_page_keys",
    "token_bytes",
]
