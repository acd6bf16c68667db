"""The per-request offload manager and what it composes: host pool, copier, copy streams,
store I/O workers.

Stores live in :mod:`kvstage.storage`, page keys in :mod:`kvstage.hashing`, copies in
:mod:`kvstage.kernels`; this package composes them and alone knows a request's lifecycle.

Modules: ``manager`` (:class:`OffloadManager`: lifecycle decisions), ``copier`` (moves pages,
reports :class:`CopyResult`), ``copy_stream``, ``host_pool``, ``key_chain`` (a request's keys in
chain order), ``store_io`` (the one page writer, the one prefix reader, worker threads), ``store_index``
(what a store holds, answered without a store round trip),
``backup`` (finished gathers into store writes, their accounting), ``prior_wait`` (a write
put again while its chain's prior page, another process's, is not stored yet), ``prefetcher`` (lookups,
reads into host pages), ``load_path`` (prefix match, prefetch and load
handles), ``request`` (what is read from a request), ``collaborators`` (typed Protocols),
``keyed_copies`` (stores and loads of pages whose keys the engine names), ``metrics``,
``prometheus`` (those counters as Prometheus metrics; imported on its own, not here),
``testing`` (engine stand-ins), ``components`` (a hybrid model's pools and stores per
component), ``hybrid`` (their store and load beside the full pages), ``restorable`` (restorable
lengths), ``hybrid_calls`` and ``inspection`` (the manager's snapshot call and its inspectors).
"""

from kvstage.offload.collaborators import CopyStreamLike, KVPoolLike, PageHasherLike, StoreWorkersLike
from kvstage.offload.components import ComponentPools, component_stores
from kvstage.offload.copier import Copier, CopyResult
from kvstage.offload.copy_stream import CopyStream, ManualCopyStream
from kvstage.offload.host_pool import HostPool
from kvstage.offload.hybrid import HybridLoadHandle
from kvstage.offload.key_chain import PriorFailedError
from kvstage.offload.keyed_copies import KeyedCopies, KeyedResult
from kvstage.offload.load_path import PREFETCH_POLICIES, LoadHandle, PrefetchHandle, PrefixMatch
from kvstage.offload.manager import OffloadManager
from kvstage.offload.metrics import OffloadMetrics
from kvstage.offload.request import OffloadRequest, kv_length
from kvstage.offload.store_index import StoreIndex
from kvstage.offload.store_io import StoreWorkers, write_pages

__all__ = [
    "PREFETCH_POLICIES",
    "ComponentPools",
    "Copier",
    "CopyResult",
    "CopyStream",
    "CopyStreamLike",
    "KVPoolLike",
    "PageHasherLike",
    "StoreWorkersLike",
    "HostPool",
    "HybridLoadHandle",
    "KeyedCopies",
    "KeyedResult",
    "LoadHandle",
    "ManualCopyStream",
    "OffloadManager",
    "OffloadMetrics",
    "OffloadRequest",
    "PrefetchHandle",
    "PrefixMatch",
    "PriorFailedError",
    "StoreIndex",
    "StoreWorkers",
    "component_stores",
    "kv_length",
    "write_pages",
]
