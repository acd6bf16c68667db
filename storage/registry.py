"""Storage URLs: :func:`open_storage` and the table of schemes it knows.

The table is explicit (scheme -> module and factory name); a factory's module is imported
when a URL of its scheme is opened, so the optional Mooncake package is loaded only then.
"""

from __future__ import annotations

import importlib

from kvstage.errors import InvalidArgumentError
from kvstage.storage.backend import StorageBackend
from kvstage.storage.fingerprint import LayoutFingerprint

__all__ = ["STORAGE_SCHEMES", "open_storage"]

# URL scheme -> (module, factory); factory(rest_of_url, fingerprint) -> StorageBackend.
STORAGE_SCHEMES: dict[str, tuple[str, str]] = {
    "memory": ("kvstage.storage.memory_store", "open_memory_store"),
    "file": ("kvstage.storage.file_store", "open_file_store"),
    "mooncake": ("kvstage.storage.mooncake.store", "open_mooncake_store"),
}


def open_storage(url: str, fingerprint: LayoutFingerprint) -> StorageBackend:
    """Build a storage backend from a URL.

    Forms: ``memory`` or ``memory:CAPACITY``; ``file:DIR`` or
    ``file:DIR?capacity_bytes=CAPACITY&io_threads=N``; ``mooncake://HOST:PORT?...`` (needs the
    ``mooncake`` extra; see :func:`kvstage.storage.mooncake.config.parse_mooncake_url`). Every
    size in a URL is bytes or a number with a unit (:mod:`kvstage.storage.sizes`: ``8GB`` is
    8 * 1000**3 bytes, ``8GiB`` 8 * 1024**3).

    Raises:
        InvalidArgumentError: the URL's scheme is unknown (the message lists the known ones), its
            options are bad, or a ``memory`` / ``file`` capacity holds no page; the message names
            ``storage``, the config key engines take the URL from.
        BackendUnavailableError: the scheme's optional package is not installed.
        StorageError: the store cannot be set up (e.g. the Mooncake master is unreachable).
    """
    if not isinstance(url, str):
        raise InvalidArgumentError(f"storage: must be a storage URL string, got {type(url).__name__}")
    scheme, _, rest = url.partition(":")
    if url.startswith("mooncake://"):
        scheme, rest = "mooncake", url
    entry = STORAGE_SCHEMES.get(scheme)
    if entry is None:
        raise InvalidArgumentError(
            f"storage: unknown storage scheme {scheme!r} in {url!r}; known: {sorted(STORAGE_SCHEMES)}"
        )
    module, factory = entry
    return getattr(importlib.import_module(module), factory)(rest, fingerprint)
