"""The namespace seed: the prior of a chain's first page, from ``(extra_key, cache_salt)``.

Source: sglang's HiCache storage key scheme "v1" (facts in
``shared/reference/sglang-storage-keys.md``). The seed isolates LoRA adapters (``extra_key``)
and tenants (``cache_salt``): two requests share page keys only when both match.

Bytes hashed, in order:

1. the ASCII tag ``sglang-cache-namespace-v1``;
2. one part for ``extra_key``, then one part for ``cache_salt``, where an absent part (None) is
   the single byte ``0x00`` and a present part is ``0x01``, then the UTF-8 byte length as an
   unsigned 64-bit little-endian integer, then the UTF-8 bytes.

The presence byte and the length make the encoding unambiguous: ``""`` differs from None,
``("a", "bc")`` from ``("ab", "c")``, ``extra_key="X"`` from ``cache_salt="X"``.
With both None there is no seed and the first page has no prior, so un-namespaced keys stay
identical to the plain chain.

The seed is hashed with the chain's own scheme (SHA-256 for ``sglang-v1``, as sglang does;
XXH3-128 for ``xxh3-128``), so its raw digest has the length of every other prior.
"""

from __future__ import annotations

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.hashing.schemes import DEFAULT_SCHEME, HashScheme, get_scheme

NAMESPACE_TAG = b"sglang-cache-namespace-v1"


def _part(value: str | None, argument: str) -> bytes:
    if value is None:
        return b"\x00"
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{argument}: must be a str or None, got {type(value).__name__}")
    try:
        data = value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(f"{argument}: must be encodable as UTF-8 ({exc.reason} at {exc.start})") from None
    return b"\x01" + len(data).to_bytes(8, "little") + data


def namespace_bytes(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """The bytes the namespace seed is the hash of; None when both inputs are None.

    Raises:
        ArgumentTypeError: ``extra_key`` or ``cache_salt`` is neither a str nor None.
        InvalidArgumentError: a string cannot be encoded as UTF-8 (a lone surrogate).
    """
    extra = _part(extra_key, "extra_key")
    salt = _part(cache_salt, "cache_salt")
    if extra_key is None and cache_salt is None:
        return None
    return NAMESPACE_TAG + extra + salt


def namespace_seed_bytes(
    extra_key: str | None, cache_salt: str | None, scheme: str | HashScheme = DEFAULT_SCHEME
) -> bytes:
    """The raw namespace seed digest, or ``b""`` (no prior) when both inputs are None.

    Raises: as :func:`namespace_bytes`, and for an unknown ``scheme``.
    """
    hash_scheme = get_scheme(scheme)
    data = namespace_bytes(extra_key, cache_salt)
    return b"" if data is None else hash_scheme.digest(data)


def namespace_seed(
    extra_key: str | None, cache_salt: str | None, scheme: str | HashScheme = DEFAULT_SCHEME
) -> str | None:
    """The namespace seed as lowercase hex, or None when ``extra_key`` and ``cache_salt`` are both None.

    Args:
        extra_key: the model-variant key (e.g. a LoRA adapter id), or None.
        cache_salt: the per-tenant salt, or None.
        scheme: a name from :data:`kvstage.hashing.SCHEMES` (default ``sglang-v1``).

    Returns:
        64 hex characters for ``sglang-v1`` (SHA-256), 32 for ``xxh3-128``; None without a namespace.

    Raises:
        ArgumentTypeError: an input is neither a str nor None, or ``scheme`` is not a str.
        InvalidArgumentError: unknown ``scheme``, or a string that cannot be encoded as UTF-8.
    """
    seed = namespace_seed_bytes(extra_key, cache_salt, scheme)
    return seed.hex() if seed else None
