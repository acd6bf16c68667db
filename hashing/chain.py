"""Page hash chains: the storage key of every full page of a token list.

Construction (sglang HiCache key scheme "v1" and sglang 0.5.23's native page hash,
``mem_cache/cpp_utils/hash_binding.cpp``; facts in ``shared/reference/sglang-storage-keys.md``):
page i's key is the lowercase hex of ``H(prior_i + tokens_i)`` where ``prior_0`` is the raw bytes
of the prior hash the chain starts from (nothing when there is none), ``prior_i`` is the raw
digest of page i-1, and ``tokens_i`` encodes the ``page_size`` ids of page i:

* every id ``<= 2**32-1``: the ids as u32 little-endian (``4 * page_size`` bytes);
* any id above ``2**32-1``: the byte ``0xff``, then the ids as u64 little-endian
  (``1 + 8 * page_size`` bytes).

Ids must satisfy ``0 <= id <= 2**63-1``. The encoding is chosen page by page; the chain runs
across both. ``H`` is the scheme's hash (:mod:`kvstage.hashing.schemes`). A key therefore commits
to the whole prefix and to the namespace seed it started from.

Prefill hashes a prompt in one go from the namespace seed (:func:`prefill_page_keys`); decode
continues the same chain segment by segment from the previous segment's last key
(:func:`compute_prefix_hash` / :func:`page_keys`), never re-applying the seed. For any split of a
token list at page boundaries the concatenated segment keys equal the prefill keys.

Partial last page: only FULL pages are hashed. Tokens after the last full page (fewer than
``page_size``) get no key and are not part of any returned key; :func:`full_pages` says how many
pages were hashed and how many tokens were left over. Hash them later, once their page is full,
by passing them again (at the start of the next segment) with the last key as ``prior_hash``.
A partial page is never hashed as if it were full.
"""

from __future__ import annotations

import inspect
import re

from kvstage.errors import ArgumentTypeError, InvalidArgumentError, is_int
from kvstage.hashing.namespace import namespace_seed_bytes
from kvstage.hashing.schemes import DEFAULT_SCHEME, HashScheme, get_scheme
from kvstage.hashing.tokens import TOKEN_BYTES, compiled_source, out_of_range_error, token_ids, wide_pages

_HEX_DIGITS = re.compile(r"[0-9a-fA-F]*")


def _check_page_size(page_size: int) -> int:
    if not is_int(page_size):
        raise ArgumentTypeError(f"page_size: must be an int, got {type(page_size).__name__}")
    if page_size < 1:
        raise InvalidArgumentError(f"page_size: must be >= 1, got {page_size}")
    return page_size


def _prior_bytes(prior_hash: str | None, hash_scheme: HashScheme) -> bytes:
    """The raw bytes of a hex prior hash; ``b""`` for None or ``""`` (no prior)."""
    if prior_hash is None or prior_hash == "":
        return b""
    if not isinstance(prior_hash, str):
        raise ArgumentTypeError(f"prior_hash: must be a hex str or None, got {type(prior_hash).__name__}")
    if len(prior_hash) != hash_scheme.key_length:
        raise InvalidArgumentError(
            f"prior_hash: must be a {hash_scheme.key_length}-character {hash_scheme.name} key (or empty), "
            f"got {len(prior_hash)} characters"
        )
    # Not bytes.fromhex alone: it skips whitespace, so a padded key would pass as a shorter prior.
    if not _HEX_DIGITS.fullmatch(prior_hash):
        raise InvalidArgumentError(f"prior_hash: must be hexadecimal, got {prior_hash!r}")
    return bytes.fromhex(prior_hash)


def _keys(tokens, page_size: int, prior: bytes, hash_scheme: HashScheme) -> list[str]:
    """The full-page keys of ``tokens`` from ``prior``: the compiled chain where it reads them."""
    compiled = hash_scheme.compiled
    if compiled is not None:
        source = compiled_source(tokens)
        if source is not None:
            try:
                keys = compiled.page_chain(source, page_size, prior, True)
            except compiled.TokenOutOfRange as exc:
                position, value = exc.args
                raise out_of_range_error("tokens", position, value) from None
            if keys is not NotImplemented:
                return keys
    data, id_bytes = token_ids(tokens)
    if id_bytes == TOKEN_BYTES:  # every id fits u32: one uniform stream of pages
        return hash_scheme.keys(data, page_size * TOKEN_BYTES, prior)
    return hash_scheme.keys_of_pages(wide_pages(data, page_size), prior)


def full_pages(num_tokens: int, page_size: int) -> tuple[int, int]:
    """``(pages, leftover)``: how many full pages ``num_tokens`` tokens fill and how many tokens remain.

    ``pages`` is the number of keys :func:`page_keys` returns for that many tokens; the
    ``leftover`` tokens (``0 <= leftover < page_size``) are not hashed.

    Raises:
        ArgumentTypeError / InvalidArgumentError: ``page_size`` is not an int >= 1, or
            ``num_tokens`` is not an int >= 0.
    """
    _check_page_size(page_size)
    if not is_int(num_tokens):
        raise ArgumentTypeError(f"num_tokens: must be an int, got {type(num_tokens).__name__}")
    if num_tokens < 0:
        raise InvalidArgumentError(f"num_tokens: must be >= 0, got {num_tokens}")
    return divmod(num_tokens, page_size)


def page_keys(tokens, page_size: int, *, prior_hash: str | None = None, scheme: str = DEFAULT_SCHEME) -> list[str]:
    """The keys of the full pages of ``tokens``, chained from ``prior_hash``.

    Args:
        tokens: token ids (list/tuple/range of ints, 1-D numpy integer array, 1-D torch integer
            tensor on any device, ``array.array`` of an integer typecode such as sglang's
            ``array('q')``, or another 1-D buffer of integers such as a ``memoryview``; see
            :mod:`kvstage.hashing.tokens`), each ``0 <= id <= 2**63-1``; a page holding an id
            above ``2**32-1`` is hashed as ``0xff`` + u64 ids (see the module doc). Every form
            gives the same keys.
        page_size: tokens per page (>= 1).
        prior_hash: hex key the chain continues from (the previous page's key, or a namespace
            seed); None or ``""`` = no prior (the first page hashes its tokens only).
        scheme: ``"sglang-v1"`` (default) or ``"xxh3-128"``.

    Returns:
        ``len(tokens) // page_size`` lowercase hex keys (64 characters for sglang-v1, 32 for
        xxh3-128), in page order. Tokens of a partial last page are validated but not hashed.

    Raises:
        ArgumentTypeError: non-integer tokens (floats, bools, a buffer of a non-integer
            format), unsupported container (``bytes`` and ``bytearray`` included), non-int
            ``page_size``, non-str ``prior_hash`` or ``scheme``.
        InvalidArgumentError: a token id outside ``0 <= id <= 2**63-1`` (first bad position
            and value named), ``page_size < 1``, a ``prior_hash`` that is not a key of this
            scheme, an unknown scheme.
    """
    hash_scheme = get_scheme(scheme)
    _check_page_size(page_size)
    prior = _prior_bytes(prior_hash, hash_scheme)
    return _keys(tokens, page_size, prior, hash_scheme)


def prefill_page_keys(
    tokens,
    page_size: int,
    *,
    extra_key: str | None = None,
    cache_salt: str | None = None,
    scheme: str = DEFAULT_SCHEME,
) -> list[str]:
    """The keys of the full pages of a prompt, chained from the namespace seed of ``(extra_key, cache_salt)``.

    Equal to ``page_keys(tokens, page_size, prior_hash=namespace_seed(extra_key, cache_salt, scheme))``;
    with both None the first page has no prior. This is what a prefill side writes.

    Raises: as :func:`page_keys`, and :func:`kvstage.hashing.namespace_seed` for the namespace.
    """
    hash_scheme = get_scheme(scheme)
    _check_page_size(page_size)
    seed = namespace_seed_bytes(extra_key, cache_salt, hash_scheme)
    return _keys(tokens, page_size, seed, hash_scheme)


def request_namespace(req) -> tuple[str | None, str | None]:
    """``(req.extra_key, req.cache_salt)``, the request's namespace (each a str or None).

    A missing attribute is not read as None: a request that lost its ``cache_salt`` would
    share another tenant's pages.

    Raises:
        ArgumentTypeError: ``req`` has no such attribute (the message names it and the
            request's type), or holds neither a str nor None there.
    """
    values = []
    for name in ("extra_key", "cache_salt"):
        try:
            value = getattr(req, name)
        except AttributeError:
            if inspect.getattr_static(req, name, None) is not None:
                raise  # the attribute exists and its getter failed: the engine's error, not a missing field
            kind = type(req)
            raise ArgumentTypeError(
                f"req: a request must have attributes extra_key and cache_salt (each a str or None); "
                f"{kind.__module__}.{kind.__qualname__} has no attribute {name!r}"
            ) from None  # the AttributeError says less than this
        if value is not None and not isinstance(value, str):
            raise ArgumentTypeError(f"req.{name}: must be a str or None, got {type(value).__name__}")
        values.append(value)
    return values[0], values[1]


def compute_prefix_hash(
    req, tokens, prior_hash: str | None = "", *, page_size: int, scheme: str = DEFAULT_SCHEME
) -> list[str]:
    """The keys of the full pages of one segment of a request's tokens (the decode form).

    Args:
        req: the request; ``req.extra_key`` and ``req.cache_salt`` (str or None) name its namespace.
        tokens: the segment's token ids (as :func:`page_keys`), starting at a page boundary.
        prior_hash: ``""`` (or None): the segment is the request's first, so the chain starts
            from the namespace seed. Otherwise the key of the page just before the segment: the
            chain continues from it and the seed is NOT applied again (it is already in it).
        page_size: tokens per page (>= 1).
        scheme: ``"sglang-v1"`` (default) or ``"xxh3-128"``.

    Returns:
        The segment's full-page keys (a partial last page is not hashed; see the module doc).

    Raises:
        ArgumentTypeError: ``req`` lacks ``extra_key`` or ``cache_salt`` (the message names the
            attribute and ``req``'s type) or holds a non-str there; and as :func:`page_keys`.
        InvalidArgumentError: as :func:`page_keys`.
    """
    hash_scheme = get_scheme(scheme)
    _check_page_size(page_size)
    extra_key, cache_salt = request_namespace(req)
    if prior_hash is None or prior_hash == "":
        prior = namespace_seed_bytes(extra_key, cache_salt, hash_scheme)
    else:
        prior = _prior_bytes(prior_hash, hash_scheme)
    return _keys(tokens, page_size, prior, hash_scheme)


class PageHasher:
    """Page keys for one (scheme, page size): the object an engine holds.

    Args:
        scheme: ``"sglang-v1"`` (default; SHA-256, matches sglang's prefill keys) or
            ``"xxh3-128"`` (faster, not cryptographic; see :mod:`kvstage.hashing.schemes`).
        page_size: tokens per page (>= 1), the engine's KV page size.

    Raises:
        ArgumentTypeError / InvalidArgumentError: unknown scheme, or ``page_size`` not an int >= 1.
    """

    def __init__(self, scheme: str = DEFAULT_SCHEME, page_size: int = 64) -> None:
        self._scheme = get_scheme(scheme)
        self._page_size = _check_page_size(page_size)

    @property
    def scheme(self) -> str:
        """The scheme's name."""
        return self._scheme.name

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._page_size

    @property
    def key_length(self) -> int:
        """Hex characters in a key (64 for sglang-v1, 32 for xxh3-128)."""
        return self._scheme.key_length

    def seed(self, extra_key: str | None = None, cache_salt: str | None = None) -> str | None:
        """The namespace seed (hex) of ``(extra_key, cache_salt)``; None when both are None."""
        seed = namespace_seed_bytes(extra_key, cache_salt, self._scheme)
        return seed.hex() if seed else None

    def prefill_keys(self, tokens, extra_key: str | None = None, cache_salt: str | None = None) -> list[str]:
        """:func:`prefill_page_keys` with this hasher's scheme and page size."""
        seed = namespace_seed_bytes(extra_key, cache_salt, self._scheme)
        return _keys(tokens, self._page_size, seed, self._scheme)

    def continue_keys(self, tokens, prior_hash: str | None) -> list[str]:
        """:func:`page_keys` from ``prior_hash`` (None or ``""``: no prior, not even a seed)."""
        prior = _prior_bytes(prior_hash, self._scheme)
        return _keys(tokens, self._page_size, prior, self._scheme)

    def compute_prefix_hash(self, req, tokens, prior_hash: str | None = "") -> list[str]:
        """:func:`compute_prefix_hash` with this hasher's scheme and page size."""
        return compute_prefix_hash(req, tokens, prior_hash, page_size=self._page_size, scheme=self._scheme)

    def full_pages(self, num_tokens: int) -> tuple[int, int]:
        """``(pages, leftover)`` for ``num_tokens`` tokens at this page size (see :func:`full_pages`)."""
        return full_pages(num_tokens, self._page_size)

    def __repr__(self) -> str:
        return f"PageHasher(scheme={self.scheme!r}, page_size={self._page_size})"
