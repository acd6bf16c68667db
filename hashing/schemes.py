"""The page hash schemes, chosen by name.

A scheme is a hash function plus the rule that a page's key is the lowercase hex of its raw
digest. Both schemes hash the same bytes for a page (see :mod:`kvstage.hashing.chain`): the
previous page's raw digest, if any, then the page's token ids as unsigned 32-bit little-endian
integers, or, for a page holding an id above ``2**32-1`` (ids go up to ``2**63-1``), the byte
``0xff`` then the ids as unsigned 64-bit little-endian integers (sglang 0.5.23's native page
hash, ``mem_cache/cpp_utils/hash_binding.cpp``).

``sglang-v1``
    SHA-256 (``hashlib.sha256``), 32-byte digest, 64-character keys. Byte for byte the keys
    sglang's hierarchical cache (HiCache, key scheme "v1"; with ids above ``2**32-1``, sglang
    0.5.23's native page hash) writes to its L3 store, so a decode side using it shares pages
    with a prefill side. A cryptographic hash: keys cannot be made to
    collide on purpose, which is what makes ``cache_salt`` a real isolation boundary between
    tenants. The default.

``xxh3-128``
    XXH3-128 (``xxhash.xxh3_128``, seed 0), 16-byte digest, 32-character keys; the raw digest
    is xxhash's canonical (big-endian) form, i.e. ``xxh3_128(data).digest()``, and the key its
    hex. kvstage's own rule for wide ids: the same bytes as ``sglang-v1`` (``0xff`` + u64
    little-endian ids for a page holding an id above ``2**32-1``), fed to XXH3-128; sglang has
    no such scheme. Several times faster than ``sglang-v1`` (about 3x at page 64 with both chains
    compiled; see ``bench/bench_hashing.py``). NOT a cryptographic hash: anyone who can choose
    token ids can force two different prefixes onto one key. Use it where all requests are
    trusted (one tenant, or isolation not relying on keys); multi-tenant deployments that rely
    on ``cache_salt`` for isolation should keep ``sglang-v1``. Its keys never match sglang's, so
    both sides must be configured with it.

Compiled chains: each scheme's chain runs in C, from token ids to keys in one call
(``kvstage.hashing._sha256_chain`` on OpenSSL's libcrypto, ``kvstage.hashing._xxh3_chain`` on
the xxHash header; one source, ``hashing/_page_chain.c``), when that optional extension was
built at install time; else in Python (:attr:`HashScheme.chain`), where a hash call per page
costs several times the hashing itself. Both give the same keys. ``KVSTAGE_PURE_PYTHON_HASH=1``
(any value but empty, ``0``, ``false``, ``no`` or ``off``), read at import, forces Python for
both. :attr:`HashScheme.implementation` (and ``kvstage info``) says which runs.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import struct
import sys
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Callable

import xxhash

from kvstage.errors import ArgumentTypeError, InvalidArgumentError

SCHEMES = ("sglang-v1", "xxh3-128")
DEFAULT_SCHEME = "sglang-v1"


def _full_pages(data, page_bytes: int):
    """The full pages of ``data`` (a bytes-like object) as ``bytes`` objects, split in C."""
    view = memoryview(data).cast("B")
    if page_bytes > len(view):
        return iter(())  # no full page (and no struct format of that size)
    end = len(view) - len(view) % page_bytes
    return struct.iter_unpack(f"{page_bytes}s", view[:end])


def _chain_hash_objects(new_hash: Callable) -> Callable:
    """A chain loop for a ``hashlib``-style constructor (``new_hash(data).digest()``)."""
    # Copying a hash object made once skips the digest lookup a constructor call pays: with
    # OpenSSL 3.0 that is ~5% of the whole chain at page 64. Per page, making and finalising a
    # hashlib object (~0.9 us here) costs several times hashing the page itself (~0.25 us with
    # SHA-NI), which is why a Python chain stays far below the one-call ceiling.
    fresh = new_hash().copy

    def chain(data: bytes, page_bytes: int, prior: bytes) -> list[bytes]:
        # The one Python loop: a hash object per page cannot be avoided. Each step hashes
        # prior digest + the page's bytes; nothing in it runs per token.
        digests = []
        append = digests.append
        for (page,) in _full_pages(data, page_bytes):
            h = fresh()
            h.update(prior + page)
            prior = h.digest()
            append(prior)
        return digests

    return chain


def _chain_digest_function(digest: Callable) -> Callable:
    """A chain loop for a one-call digest function (``digest(data) -> bytes``)."""

    def chain(data: bytes, page_bytes: int, prior: bytes) -> list[bytes]:
        return [prior := digest(prior + page) for (page,) in _full_pages(data, page_bytes)]

    return chain


def _sha256_digest(data) -> bytes:
    return hashlib.sha256(data).digest()


PURE_PYTHON_ENV = "KVSTAGE_PURE_PYTHON_HASH"


def _pure_python_forced() -> bool:
    return os.environ.get(PURE_PYTHON_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _load_compiled(module_name: str) -> tuple[ModuleType | None, str]:
    """``(kvstage.hashing.<module_name> or None, why it is not used)``."""
    if _pure_python_forced():
        return None, f"{PURE_PYTHON_ENV} is set"
    if sys.byteorder != "little":  # the C chains write u32 little-endian with native stores
        return None, "the compiled chains run on little-endian hosts only"
    try:
        module = importlib.import_module(f"kvstage.hashing.{module_name}")
    except ImportError as exc:  # the optional extension was not built (no compiler or headers)
        return None, f"kvstage.hashing.{module_name} not built: {exc}"
    return module, ""


@dataclass(frozen=True)
class HashScheme:
    """One page hash scheme.

    Attributes:
        name: the name it is chosen by (one of :data:`SCHEMES`).
        digest_size: bytes in a raw digest (keys are twice as many hex characters).
        digest: ``digest(data) -> bytes``, the raw digest of a bytes-like object in one call.
        chain: ``chain(data, page_bytes, prior) -> list[bytes]``, in Python: the raw digests of
            the full pages of ``data`` (``page_bytes`` bytes each; a partial tail is ignored),
            page i hashed as ``digest(prior_i + page_i)`` with ``prior_0 = prior`` (``b""``:
            none) and ``prior_i`` the digest of page i-1.
        cryptographic: whether collisions cannot be forced (so ``cache_salt`` isolates tenants).
        compiled: the scheme's C extension module (``page_chain(tokens, page_size, prior, hex)``
            there, from token ids to keys; see ``hashing/_page_chain.c``), or None: then the
            Python ``chain`` runs.
        why_pure_python: why ``compiled`` is None (empty when it is not).
    """

    name: str
    digest_size: int
    digest: Callable[[object], bytes]
    chain: Callable[[bytes, int, bytes], list]
    cryptographic: bool
    compiled: ModuleType | None = None
    why_pure_python: str = ""

    @property
    def key_length(self) -> int:
        """Characters in a key (lowercase hex of the raw digest)."""
        return 2 * self.digest_size

    @property
    def implementation(self) -> str:
        """How the chain runs: ``"compiled (<library and version>)"`` or ``"pure Python"``."""
        return f"compiled ({self.compiled.LIBRARY})" if self.compiled is not None else "pure Python"

    def keys(self, data, page_bytes: int, prior: bytes) -> list[str]:
        """The lowercase hex of :attr:`chain`'s digests (the Python chain, whatever is compiled)."""
        return list(map(bytes.hex, self.chain(data, page_bytes, prior)))

    def keys_of_pages(self, pages, prior: bytes) -> list[str]:
        """The lowercase hex keys of a chain over pages of different lengths, in Python.

        Args:
            pages: an iterable of bytes-like objects, each what one page hashes after its prior
                (:func:`kvstage.hashing.tokens.wide_pages`: u32 pages and ``0xff`` + u64 pages).
            prior: the raw prior digest of the first page (``b""``: none).

        Returns:
            One key per page: page i's is the hex of ``digest(prior_i + pages[i])``, ``prior_0 =
            prior`` and ``prior_i`` the digest of page i-1.
        """
        digest = self.digest
        keys = []
        for page in pages:
            prior = digest(prior + page)
            keys.append(prior.hex())
        return keys

    def pure_python(self) -> HashScheme:
        """This scheme with its Python chain only (``compiled`` None): the reference, and what
        runs without the extension."""
        return replace(self, compiled=None, why_pure_python="pure Python requested")


_sha256_module, _sha256_why = _load_compiled("_sha256_chain")
_xxh3_module, _xxh3_why = _load_compiled("_xxh3_chain")

_REGISTRY = {
    "sglang-v1": HashScheme(
        "sglang-v1",
        32,
        _sha256_digest,
        _chain_hash_objects(hashlib.sha256),
        cryptographic=True,
        compiled=_sha256_module,
        why_pure_python=_sha256_why,
    ),
    # xxh3_128_digest(data) is the one-call form of xxhash.xxh3_128(data).digest() (seed 0);
    # it skips a Python hash object per page, which is most of the cost at this speed.
    "xxh3-128": HashScheme(
        "xxh3-128",
        16,
        xxhash.xxh3_128_digest,
        _chain_digest_function(xxhash.xxh3_128_digest),
        cryptographic=False,
        compiled=_xxh3_module,
        why_pure_python=_xxh3_why,
    ),
}
assert tuple(_REGISTRY) == SCHEMES


def describe_chains() -> str:
    """How each scheme's chain runs here, one line (for ``kvstage info``).

    For example ``"sglang-v1 compiled (OpenSSL 3.0.19 ...); xxh3-128 compiled (xxHash 0.8.1)"``;
    a pure-Python chain says why (``pure Python (KVSTAGE_PURE_PYTHON_HASH is set)``).
    """
    parts = []
    for scheme in _REGISTRY.values():
        why = f" ({scheme.why_pure_python})" if scheme.compiled is None else ""
        parts.append(f"{scheme.name} {scheme.implementation}{why}")
    return "; ".join(parts)


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
