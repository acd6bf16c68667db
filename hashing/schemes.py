"""The page hash schemes, chosen by name.

A scheme is a hash function plus the rule that a page's key is the lowercase hex of its raw
digest. Both schemes hash the same bytes for a page (see :mod:`kvstage.hashing.chain`): the
previous page's raw digest, if any, then the page's token ids as unsigned 32-bit
little-endian integers.

``sglang-v1``
    SHA-256 (``hashlib.sha256``), 32-byte digest, 64-character keys. Byte for byte the keys
    sglang's hierarchical cache (HiCache, key scheme "v1") writes to its L3 store, so a decode
    side using it shares pages with a prefill side. A cryptographic hash: keys cannot be made to
    collide on purpose, which is what makes ``cache_salt`` a real isolation boundary between
    tenants. The default.

``xxh3-128``
    XXH3-128 (``xxhash.xxh3_128``, seed 0), 16-byte digest, 32-character keys; the raw digest
    is xxhash's canonical (big-endian) form, i.e. ``xxh3_128(data).digest()``, and the key its
    hex. Several times faster than SHA-256 (see ``bench/bench_hashing.py``), but NOT a
    cryptographic hash: anyone who can choose token ids can force two different prefixes onto
    one key. Use it where all requests are trusted (one tenant, or isolation not relying on
    keys); multi-tenant deployments that rely on ``cache_salt`` for isolation should keep
    ``sglang-v1``. Its keys never match sglang's, so both sides must be configured with it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import xxhash

from kvstage.errors import ArgumentTypeError, InvalidArgumentError

SCHEMES = ("sglang-v1", "xxh3-128")
DEFAULT_SCHEME = "sglang-v1"


def _chain_hash_objects(new_hash: Callable) -> Callable:
    """A chain loop for a ``hashlib``-style constructor (``new_hash(data).digest()``)."""

    def chain(data: bytes, page_bytes: int, prior: bytes) -> list[bytes]:
        # The one Python loop: a hash object per page cannot be avoided. Each step hashes
        # prior digest + the page's bytes in one call; the walrus carries the digest forward.
        end = len(data) - len(data) % page_bytes
        return [prior := new_hash(prior + data[o : o + page_bytes]).digest() for o in range(0, end, page_bytes)]

    return chain


def _chain_digest_function(digest: Callable) -> Callable:
    """A chain loop for a one-call digest function (``digest(data) -> bytes``)."""

    def chain(data: bytes, page_bytes: int, prior: bytes) -> list[bytes]:
        end = len(data) - len(data) % page_bytes
        return [prior := digest(prior + data[o : o + page_bytes]) for o in range(0, end, page_bytes)]

    return chain


def _sha256_digest(data) -> bytes:
    return hashlib.sha256(data).digest()


@dataclass(frozen=True)
class HashScheme:
    """One page hash scheme.

    Attributes:
        name: the name it is chosen by (one of :data:`SCHEMES`).
        digest_size: bytes in a raw digest (keys are twice as many hex characters).
        digest: ``digest(data) -> bytes``, the raw digest of a bytes-like object in one call.
        chain: ``chain(data, page_bytes, prior) -> list[bytes]``: the raw digests of the full
            pages of ``data`` (``page_bytes`` bytes each; a partial tail is ignored), page i
            hashed as ``digest(prior_i + page_i)`` with ``prior_0 = prior`` (``b""``: none) and
            ``prior_i`` the digest of page i-1.
        cryptographic: whether collisions cannot be forced (so ``cache_salt`` isolates tenants).
    """

    name: str
    digest_size: int
    digest: Callable[[object], bytes]
    chain: Callable[[bytes, int, bytes], list]
    cryptographic: bool

    @property
    def key_length(self) -> int:
        """Characters in a key (lowercase hex of the raw digest)."""
        return 2 * self.digest_size


_REGISTRY = {
    "sglang-v1": HashScheme(
        "sglang-v1", 32, _sha256_digest, _chain_hash_objects(hashlib.sha256), cryptographic=True
    ),
    # xxh3_128_digest(data) is the one-call form of xxhash.xxh3_128(data).digest() (seed 0);
    # it skips a Python hash object per page, which is most of the cost at this speed.
    "xxh3-128": HashScheme(
        "xxh3-128", 16, xxhash.xxh3_128_digest, _chain_digest_function(xxhash.xxh3_128_digest), cryptographic=False
    ),
}
assert tuple(_REGISTRY) == SCHEMES


def get_scheme(scheme: str | HashScheme = DEFAULT_SCHEME) -> HashScheme:
    """The :class:`HashScheme` named ``scheme`` (a :class:`HashScheme` passes through).

    Raises:
        ArgumentTypeError: ``scheme`` is not a str.
        InvalidArgumentError: no scheme has that name.
    """
    if isinstance(scheme, HashScheme):
        return scheme
    if not isinstance(scheme, str):
        raise ArgumentTypeError(f"scheme: must be a scheme name (str), got {type(scheme).__name__}")
    try:
        return _REGISTRY[scheme]
    except KeyError:
        raise InvalidArgumentError(f"scheme: must be one of {', '.join(SCHEMES)}; got {scheme!r}") from None
