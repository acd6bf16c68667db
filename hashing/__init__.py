"""Namespace-seeded page hash chains (storage keys) for paged KV.

A page's key is the hex hash of the previous page's raw digest followed by the page's token ids;
the first page's prior is the namespace seed of ``(extra_key, cache_salt)``. Token ids may be
``0 <= id <= 2**63-1``: a page whose ids all fit u32 hashes them as u32 little-endian; a page
holding an id above ``2**32-1`` hashes the byte ``0xff``, then every id of the page as u64
little-endian. The encoding is chosen page by page and the chain runs across both; an id below 0
or above ``2**63-1`` raises :class:`kvstage.errors.InvalidArgumentError`. Source: sglang 0.5.23's
native page hash (``mem_cache/cpp_utils/hash_binding.cpp``) and HiCache's key scheme "v1"; facts
in ``shared/reference/sglang-storage-keys.md``.

Scheme ``sglang-v1`` (SHA-256, the default) matches sglang's keys byte for byte; ``xxh3-128``
(the same bytes fed to XXH3-128) is several times faster but not cryptographic.

Modules: ``tokens`` (ids -> bytes), ``schemes`` (hash functions by name), ``namespace`` (the
seed), ``chain`` (keys, the decode form, :class:`PageHasher`), ``bigram`` (EAGLE's token-pair
keys, :class:`BigramPageHasher`).
"""

from kvstage.hashing.bigram import BigramPageHasher, bigram_pages, pair_ids
from kvstage.hashing.chain import PageHasher, compute_prefix_hash, full_pages, page_keys, prefill_page_keys
from kvstage.hashing.namespace import namespace_seed
from kvstage.hashing.schemes import DEFAULT_SCHEME, SCHEMES, HashScheme, get_scheme
from kvstage.hashing.tokens import token_buffer, token_bytes

__all__ = [
    "BigramPageHasher",
    "DEFAULT_SCHEME",
    "SCHEMES",
    "HashScheme",
    "PageHasher",
    "compute_prefix_hash",
    "full_pages",
    "bigram_pages",
    "get_scheme",
    "namespace_seed",
    "page_keys",
    "pair_ids",
    "prefill_page_keys",
    "token_buffer",
    "token_bytes",
]
