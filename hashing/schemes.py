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
    hex. Far faster per byte than SHA-256, and about 3x faster than ``sglang-v1``'s pure-Python
    chain at page 64; but its chain is a Python loop, so against the compiled ``sglang-v1``
    chain (below) it is about as fast at page 64 (see ``bench/bench_hashing.py``). NOT a
    cryptographic hash: anyone who can choose token
    ids can force two different prefixes onto one key. Use it where all requests are trusted (one tenant, or isolation not relying on
    keys); multi-tenant deployments that rely on ``cache_salt`` for isolation should keep
    ``sglang-v1``. Its keys never match sglang's, so both sides must be configured with it.

Compiled chain: ``sglang-v1``'s per-page loop runs in C (``kvstage.hashing._chain``, on
OpenSSL's libcrypto, GIL released) when that optional extension was built at install time; else
in Python, where a hashlib object per page costs several times the hashing itself. Both give the
same digests. ``KVSTAGE_PURE_PYTHON_HASH=1`` (any value but empty or ``0``), read at import,
forces the Python loop. :attr:`HashScheme.implementation` (and ``kvstage info``) says which runs.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from typing import Callable

import xxhash

from kvstage.errors import ArgumentTypeError, InvalidArgumentError

SCHEMES = ("sglang-v1", "xxh3-128")
DEFAULT_SCHEME = "sglang-v1"


def _full_pages(data, page_bytes: int):
    """The full pages of ``data`` (a bytes-like object) as ``bytes`` objects, split in C."""
    view = memoryview(data).cast("B")
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


def _hex_keys(chain: Callable) -> Callable:
    """``keys(data, page_bytes, prior) -> list[str]``: the hex of every digest of ``chain``."""

    def keys(data, page_bytes: int, prior: bytes) -> list[str]:
        return list(map(bytes.hex, chain(data, page_bytes, prior)))

    return keys


PURE_PYTHON_ENV = "KVSTAGE_PURE_PYTHON_HASH"


def _pure_python_forced() -> bool:
    return os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0")


def _load_compiled_sha256_chain() -> tuple[Callable | None, str]:
    """``(kvstage.hashing._chain.sha256_chain or None, why it is not used)``."""
    if _pure_python_forced():
        return None, f"{PURE_PYTHON_ENV} is set"
    try:
        from kvstage.hashing._chain import sha256_chain
    except ImportError as exc:  # the optional extension was not built (no compiler or OpenSSL headers)
        return None, f"kvstage.hashing._chain not built: {exc}"
    return sha256_chain, ""


def _compiled_chains(sha256_chain: Callable) -> tuple[Callable, Callable]:
    """``(chain, keys)`` over the C loop ``sha256_chain(data, page_bytes, prior, hex)``."""

    def chain(data, page_bytes: int, prior: bytes) -> list[bytes]:
        digests = sha256_chain(data, page_bytes, prior)
        return [digests[i : i + 32] for i in range(0, len(digests), 32)]

    def keys(data, page_bytes: int, prior: bytes) -> list[str]:
        # The C function writes the hex strings itself: ~0.1 us a page, where bytes.hex per
        # page, or one .hex() then slicing, costs ~0.2-0.3 us a page in Python.
        return sha256_chain(data, page_bytes, prior, True)

    return chain, keys


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
        keys: ``keys(data, page_bytes, prior) -> list[str]``: the lowercase hex of ``chain``'s
            digests (default: ``bytes.hex`` of each; a compiled chain writes them itself).
        accelerated: whether ``chain`` and ``keys`` run in compiled code (see the module doc).
    """

    name: str
    digest_size: int
    digest: Callable[[object], bytes]
    chain: Callable[[bytes, int, bytes], list]
    cryptographic: bool
    keys: Callable[[bytes, int, bytes], list] | None = None
    accelerated: bool = False

    def __post_init__(self) -> None:
        if self.keys is None:
            object.__setattr__(self, "keys", _hex_keys(self.chain))

    @property
    def key_length(self) -> int:
        """Characters in a key (lowercase hex of the raw digest)."""
        return 2 * self.digest_size

    @property
    def implementation(self) -> str:
        """How the chain runs: ``"compiled (OpenSSL)"`` or ``"pure Python"``."""
        return "compiled (OpenSSL)" if self.accelerated else "pure Python"


_compiled_sha256_chain, _why_pure_python = _load_compiled_sha256_chain()
if _compiled_sha256_chain is not None:
    _sglang_chain, _sglang_keys = _compiled_chains(_compiled_sha256_chain)
else:
    _sglang_chain, _sglang_keys = _chain_hash_objects(hashlib.sha256), None

_REGISTRY = {
    "sglang-v1": HashScheme(
        "sglang-v1",
        32,
        _sha256_digest,
        _sglang_chain,
        cryptographic=True,
        keys=_sglang_keys,
        accelerated=_compiled_sha256_chain is not None,
    ),
    # xxh3_128_digest(data) is the one-call form of xxhash.xxh3_128(data).digest() (seed 0);
    # it skips a Python hash object per page, which is most of the cost at this speed.
    "xxh3-128": HashScheme(
        "xxh3-128", 16, xxhash.xxh3_128_digest, _chain_digest_function(xxhash.xxh3_128_digest), cryptographic=False
    ),
}
assert tuple(_REGISTRY) == SCHEMES


def describe_chains() -> str:
    """One line saying how ``sglang-v1``'s chain runs here (for ``kvstage info``).

    ``"sglang-v1 chain: compiled (OpenSSL)"``, or ``"sglang-v1 chain: pure Python (<why>)"``
    where the extension was not built or ``KVSTAGE_PURE_PYTHON_HASH`` forced the Python loop.
    """
    scheme = _REGISTRY["sglang-v1"]
    if scheme.accelerated:
        return f"sglang-v1 chain: {scheme.implementation}"
    return f"sglang-v1 chain: {scheme.implementation} ({_why_pure_python})"


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
