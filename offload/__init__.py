"""The per-request offload manager, host page pool, copy streams and storage backends.

Importing this package registers the built-in storage schemes ``memory``, ``file`` and
``mooncake`` in :data:`kvstage.offload.storage.STORAGE_SCHEMES` (see :func:`open_storage`);
``mooncake`` imports the optional Mooncake package only when a store is built.
"""

from kvstage.offload.copy_stream import CopyStream, ManualCopyStream
from kvstage.offload.file_store import FileStore
from kvstage.offload.host_pool import HostPool
from kvstage.offload.manager import OffloadManager, OffloadMetrics, OffloadRequest
from kvstage.offload.memory_store import MemoryStore
from kvstage.offload.mooncake_store import MooncakeConfig, MooncakeStore
from kvstage.offload.storage import (
    STORAGE_SCHEMES,
    LayoutFingerprint,
    PutStatus,
    StorageBackend,
    StorageStats,
    open_storage,
)

__all__ = [
    "STORAGE_SCHEMES",
    "CopyStream",
    "FileStore",
    "HostPool",
    "LayoutFingerprint",
    "ManualCopyStream",
    "MemoryStore",
    "MooncakeConfig",
    "MooncakeStore",
    "OffloadManager",
    "OffloadMetrics",
    "OffloadRequest",
    "PutStatus",
    "StorageBackend",
    "StorageStats",
    "open_storage",
]
