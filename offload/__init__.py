"""The per-request offload manager, its host page pool and copy streams.

Stores live in :mod:`kvstage.storage`, page keys in :mod:`kvstage.hashing`, copies in
:mod:`kvstage.kernels`; this package composes them and alone knows a request's lifecycle.
"""

from kvstage.offload.copy_stream import CopyStream, ManualCopyStream
from kvstage.offload.host_pool import HostPool
from kvstage.offload.manager import OffloadManager, OffloadMetrics, OffloadRequest

__all__ = [
    "CopyStream",
    "HostPool",
    "ManualCopyStream",
    "OffloadManager",
    "OffloadMetrics",
    "OffloadRequest",
]
