"""EAGLE bigram page keys: the storage keys sglang writes when its radix tree keys token pairs.

With an EAGLE draft model (``--speculative-algorithm EAGLE``/``EAGLE3``, and NEXTN, which sglang
runs as EAGLE) sglang's tree keys the KV of position ``j`` by the bigram ``(t[j], t[j+1])``
(``RadixKey(is_bigram=True)``, sglang 0.5.23 ``mem_cache/radix_cache.py``), and its storage
chain hashes those pairs (``mem_cache/cpp_utils/hash_binding.cpp``, ``is_bigram``):

* page ``i`` holds the bigrams of positions ``[i*P, (i+1)*P)``, so it reads the ``P + 1`` token
  ids ``t[i*P] .. t[(i+1)*P]`` (its last id is the next page's first); ``n`` token ids make
  ``(n - 1) // P`` full pages;
* its bytes are the pairs' ids in order, ``t[j], t[j+1]`` for each position ``j`` of the page:
  u32 little-endian while all ``P + 1`` ids fit u32, else the byte ``0xff`` then the pairs' ids
  as u64 little-endian;
* the chain, prior digest and namespace seed (``extra_key``, ``cache_salt``) are the plain
  scheme's (:mod:`kvstage.hashing.chain`).

So a bigram page's key is the plain key, at page size ``2 * P``, of the pair-expanded ids
``t[0], t[1], t[1], t[2], ...``: this module expands the ids and runs the plain chain (either
scheme; only ``sglang-v1`` equals sglang's keys).
"""

from __future__ import annotations

import numpy as np

from kvstage.hashing.chain import PageHasher, _check_page_size, _keys, _prior_bytes
from kvstage.hashing.namespace import namespace_seed_bytes
from kvstage.hashing.tokens import TOKEN_BYTES, token_ids


def bigram_pages(num_tokens: int, page_size: int) -> int:
    """Full bigram pages in ``num_tokens`` token ids: ``(num_tokens - 1) // page_size`` (0 for none)."""
    return max(num_tokens - 1, 0) // _check_page_size(page_size)


def pair_ids(tokens, page_size: int) -> np.ndarray:
    """The pair-expanded ids of the full bigram pages of ``tokens``.

    Args:
        tokens: token ids as :func:`kvstage.hashing.tokens.token_ids` takes them
            (``0 <= id <= 2**63-1``).
        page_size: bigrams per page (>= 1).

    Returns:
        A 1-D ``uint32`` array (every id fits u32) or ``uint64`` array of ``2 * page_size * pages``
        ids: ``t[j], t[j+1]`` for each bigram position ``j`` of the full pages.

    Raises:
        ArgumentTypeError / InvalidArgumentError: as ``token_ids`` (the message names the
            position in ``tokens``), or ``page_size`` not an int >= 1.
    """
    data, id_bytes = token_ids(tokens)
    values = np.frombuffer(data, dtype="<u4" if id_bytes == TOKEN_BYTES else "<u8")
    count = bigram_pages(len(values), page_size) * page_size
    pairs = np.empty(2 * count, dtype=values.dtype)
    pairs[0::2] = values[:count]
    pairs[1::2] = values[1 : count + 1]
    return pairs


class BigramPageHasher(PageHasher):
    """EAGLE bigram page keys for one (scheme, page size), with :class:`~kvstage.hashing.PageHasher`'s
    methods (its scheme, seed and key length are the plain ones); ``tokens`` are raw token ids
    and a page reads one id past its end, ``page_size`` counts bigrams.

    Args:
        scheme: ``"sglang-v1"`` (default; equals sglang's EAGLE keys) or ``"xxh3-128"``.
        page_size: bigrams (KV positions) per page, the engine's page size (>= 1).

    Raises:
        ArgumentTypeError / InvalidArgumentError: unknown scheme, or ``page_size`` not an int >= 1.
    """

    bigram = True

    def prefill_keys(self, tokens, extra_key: str | None = None, cache_salt: str | None = None) -> list[str]:
        """The keys of the full bigram pages of ``tokens`` (from position 0) from the namespace
        seed: ``(len(tokens) - 1) // page_size`` keys, sglang's ``get_storage_hash_str`` of a
        bigram ``RadixKey``."""
        seed = namespace_seed_bytes(extra_key, cache_salt, self._scheme)
        return _keys(pair_ids(tokens, self._page_size), 2 * self._page_size, seed, self._scheme)

    def continue_keys(self, tokens, prior_hash: str | None) -> list[str]:
        """The keys of the full bigram pages of ``tokens`` (starting at a page boundary; the
        last page reads the id after it) continuing the chain from ``prior_hash`` (None or
        ``""``: no prior, not even a seed)."""
        prior = _prior_bytes(prior_hash, self._scheme)
        return _keys(pair_ids(tokens, self._page_size), 2 * self._page_size, prior, self._scheme)

    def full_pages(self, num_tokens: int) -> tuple[int, int]:
        """``(pages, bigrams left over)`` for ``num_tokens`` token ids (``num_tokens - 1`` bigrams)."""
        pages = bigram_pages(num_tokens, self._page_size)
        return pages, max(num_tokens - 1, 0) - pages * self._page_size

    def __repr__(self) -> str:
        return f"BigramPageHasher(scheme={self.scheme!r}, page_size={self._page_size})"
