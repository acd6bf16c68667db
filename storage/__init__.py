"""Stores that hold KV pages by key under a layout fingerprint.

Knows keys, bytes and layout fingerprints; nothing of requests or kernels.

Public API:
    StorageBackend, PutStatus, PutStatuses, StorageStats: the interface every store implements
        (``put``, ``get``, ``exists``, ``clear``, ``take_events``).
    StoreEvent: a page stored, evicted or removed, as ``take_events`` reports it.
    LayoutFingerprint: the key space (model, dtype, layout, page size, rank or stage).
    MemoryStore: in-process pages (the default); FileStore: one crash-safe file a page
        (KeySpace: what ``FileStore.key_spaces()`` lists; StoreDirectoryError: a directory it
        cannot make, list or write, refused at open);
    MooncakeStore: the Mooncake distributed store (optional ``mooncake`` extra; imported when
        a store is built).
    open_storage, STORAGE_SCHEMES: build a store from a URL (``memory``, ``file:DIR``,
        ``mooncake://HOST:PORT?...``).

Modules: ``backend``, ``events``, ``fingerprint``, ``sizes`` (the size syntax of every URL), ``registry``, ``memory_store``,
``chain_index``, ``file_store`` (with ``page_file``: the page-file format; ``room``: room accounting; ``key_spaces``: the
key spaces of a directory; ``chain_writes``: a put's write order; ``io_threads``: a store's I/O threads),
``mooncake`` (``config``, ``status``, ``store``).
"""

from kvstage.storage.backend import MissingPriorError, PutStatus, PutStatuses, StorageBackend, StorageStats
from kvstage.storage.events import StoreEvent
from kvstage.storage.file_store import FileStore, KeySpace, StoreDirectoryError
from kvstage.storage.fingerprint import LayoutFingerprint
from kvstage.storage.memory_store import AdoptedPagesError, MemoryStore
from kvstage.storage.mooncake.config import MooncakeConfig
from kvstage.storage.mooncake.store import MooncakeStore
from kvstage.storage.registry import STORAGE_SCHEMES, open_storage

__all__ = [
    "AdoptedPagesError",
    "STORAGE_SCHEMES",
    "FileStore",
    "KeySpace",
    "LayoutFingerprint",
    "MemoryStore",
    "MissingPriorError",
    "MooncakeConfig",
    "MooncakeStore",
    "PutStatus",
    "PutStatuses",
    "StorageBackend",
    "StorageStats",
    "StoreDirectoryError",
    "StoreEvent",
    "open_storage",
]
