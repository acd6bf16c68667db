"""``KVStageStorage``: kvstage's stores as sglang's HiCache L3 storage backend.

sglang 0.5.23 loads it through its storage factory (``--hicache-storage-backend dynamic``, see
the README's "Use with sglang") as ``KVStageStorage(storage_config, kwargs)``, then calls
``register_mem_pool_host(host_pool)``, the first point where the KV layout is known: the store
(any :func:`kvstage.storage.open_storage` URL) is opened there, under the
:class:`~kvstage.storage.LayoutFingerprint` of the host pool and the storage config.

A hybrid model's other host pools (SWA, DSA indexer, Mamba), which sglang's
``HybridCacheController`` registers with ``register_mem_host_pool_v2`` and moves with the v2
calls, get one key space each in one :class:`~kvstage.model_layout.ModelLayout`
(:mod:`kvstage.integrations.sglang.hybrid_pools`, :mod:`kvstage.integrations.sglang.hybrid_store`).

A page is stored in kvstage's byte order, whatever the host layout
(:mod:`kvstage.integrations.sglang.host_layouts`), so a page written through one host layout
reads back right through another, and a store's checksum turns a corrupted page into a miss.
Keys are sglang's page hashes as given (with the default ``sglang-v1`` scheme they equal the
keys :class:`kvstage.hashing.PageHasher` computes).

KV events (``kv_events_endpoint`` in the extra config): what this backend stores, what its store
evicts or removes, and a ``clear``, published in sglang's format at sglang's L3 tier
(:data:`~kvstage.events.sglang_format.SGLANG_FORMAT`, medium ``"DISK"``), which sglang itself
never announces. sglang 0.5.23 hands this backend keys and host slots only
(``HiCacheStorageExtraInfo`` holds ``prefix_keys`` and an ``extra_info`` the controller leaves
empty; the token ids stay in its ``StorageOperation``), so each ``BlockStored`` carries the page
hashes (equal to sglang's own GPU / host event hashes), the parent and ``block_size``, with
``token_ids`` empty: a router that links blocks by sglang's hashes (llm-d) can place them; one
that hashes tokens itself (Dynamo) drops them. The parent is ``prefix_keys[-1]``, which sglang
passes only with ``"hicache_storage_pass_prefix_keys": true``: without it (``prefix_keys``
None, or the legacy ``batch_set``) a run's place in its chain is unknown and its pages are not
announced (counted in ``kv_events_unannounced``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any, Mapping, Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvstage.errors import InvalidArgumentError, StorageError
from kvstage.events import KVEventAnnouncer
from kvstage.integrations.sglang.host_layouts import flat_page_view, host_kv_layout, page_views
from kvstage.integrations.sglang.hybrid_pools import hybrid_layout
from kvstage.integrations.sglang.hybrid_store import HybridStores
from kvstage.integrations.sglang.key_space import ExtraConfig
from kvstage.integrations.sglang.pool_kinds import require_stored_host_pool, require_stored_v2_pool
from kvstage.integrations.sglang.storage_options import pop_sliding_window, require_head_groups
from kvstage.kv_layout import KVLayout
from kvstage.model_layout import FullAttention, ModelLayout
from kvstage.offload.store_io import leading_hits, write_pages
from kvstage.storage import MissingPriorError, StorageBackend
from kvstage.storage.head_groups import HeadGroups

__all__ = ["KVStageStorage", "CHUNK_PAGES"]

logger = logging.getLogger(__name__)

CHUNK_PAGES = 8  # pages a call moves per store call where pages are staged: bounds each thread's staging memory


class KVStageStorage(HiCacheStorage):
    """sglang's ``HiCacheStorage`` interface over a kvstage store.

    Args:
        storage_config: sglang's ``HiCacheStorageConfig``. Its ``extra_config`` (the JSON of
            ``--hicache-storage-backend-extra-config``) holds ``url`` (required: a storage URL,
            e.g. ``"file:/var/cache/kv"``, ``"memory:8589934592"``, ``"mooncake://host:port?..."``),
            optionally ``model_id`` (default: ``storage_config.model_name``),
            ``kv_cache_dtype`` (``"fp8_e4m3"`` or ``"fp8_e5m2"``: required when the host pool
            holds fp8 KV as ``uint8``), ``sliding_window`` (the model's window in tokens: required
            with an ``swa`` host pool) and ``kv_events_endpoint`` (KV events on, bound there by
            TP rank 0; with optional ``kv_events_replay_endpoint``, ``kv_events_topic``: see the
            module); sglang's own keys (``backend_name``, ``module_path``,
            ``class_name``, ``interface_v1``, the prefetch knobs,
            ``hicache_storage_pass_prefix_keys``) are ignored here. sglang's ``tp_lcm_size``
            (``storage_config.tp_lcm_size``; sglang takes it out of the extra config) opts in
            to pages split by KV head groups, shared by servers of every TP size dividing it
            (:mod:`kvstage.storage.head_groups`; MHA only).
        kwargs: what sglang's factory passes along (unused).

    Raises:
        InvalidArgumentError: no ``url``; an unknown key in ``extra_config``; no model id;
            ``sliding_window`` not a positive int; a
            storage config kvstage's key space cannot describe yet: attention context
            parallel (``attn_cp_size > 1``) or decode context parallel (``dcp_size > 1``), whose
            pages hold a shard of a page; ``tp_lcm_size`` not a multiple of ``tp_size``, with an
            MLA model, or with KV events.

    Thread-safety: sglang calls ``batch_set_v1`` (backup thread), ``batch_exists`` (prefetch
    thread) and ``batch_get_v1`` (prefetch I/O thread) at once; each call stages pages in its
    own thread's buffers and the store serializes only its index updates.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        if not storage_config.extra_config and isinstance(kwargs, Mapping) and "url" in kwargs:
            raise InvalidArgumentError(
                "storage_config.extra_config: empty, and the second argument holds a kvstage extra config "
                "(its 'url'); pass it in the storage config: HiCacheStorageConfig(extra_config={...})"
            )
        extra = dict(storage_config.extra_config or {})
        self.sliding_window = pop_sliding_window(extra)  # an swa pool's window (hybrid_pools.py)
        self.config = ExtraConfig.parse(extra, storage_config.model_name)
        for name, value in (
            ("attn_cp_size", storage_config.attn_cp_size),
            ("dcp_size", getattr(storage_config, "dcp_size", 1)),
        ):
            if value != 1:
                raise InvalidArgumentError(
                    f"storage_config.{name}: {value}; context-parallel shards of a page are not in kvstage's key space yet (must be 1)"
                )
        self.tp_lcm_size = getattr(storage_config, "tp_lcm_size", None) or (storage_config.extra_config or {}).get(
            "tp_lcm_size"
        )
        self.head_groups: HeadGroups | None = None  # set at registration with tp_lcm_size
        if self.tp_lcm_size is not None:
            require_head_groups(storage_config, self.tp_lcm_size, self.config)
        self.storage_config = storage_config
        self.store: StorageBackend | None = None
        self.mem_pool_host: Any = None
        self.kv_layout: KVLayout | None = None
        self.announcer: KVEventAnnouncer | None = None  # set with the store when KV events are on
        self.kv_events_unannounced = 0  # pages written without a known parent (no prefix_keys)
        self.v2_pools: dict[str, Any] = {}  # sglang pool name -> host pool (register_mem_host_pool_v2)
        self.hybrid: HybridStores | None = None  # a hybrid pool set's stores, once registered
        self.pool_set_fixed = False  # on_host_pools_registered ran: no pool joins later
        self._local = threading.local()
        self._metrics_lock = threading.Lock()
        self._metrics = StorageMetrics()

    # -- setup --------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the store for this host pool's layout (called once by sglang's controller).

        The fingerprint: ``model_id``; the pool's layers (``start_layer`` as the first layer,
        for pipeline stages), K/V or MLA latent, heads, head size and dtype; ``page_size``; the
        TP rank and size (MLA: rank-neutral; only TP rank 0 writes, as sglang's own
        ``is_storage_writer``).

        Raises:
            InvalidArgumentError: a host pool other than sglang's ``MHATokenToKVPoolHost`` or
                ``MLATokenToKVPoolHost`` (exactly: Mamba, DSA indexer, K-only, MXFP8 and other
                pools, subclasses too, named by kind), an unsupported layout (see
                :func:`~kvstage.integrations.sglang.host_layouts.host_kv_layout`); a ``uint8``
                pool without ``kv_cache_dtype``, or ``kv_cache_dtype`` on a pool that is not fp8;
                a bad URL (the message names ``extra_config.url``); a second registration.
            BackendUnavailableError, StorageError: as :func:`kvstage.storage.open_storage`.
        """
        if self.store is not None:
            raise InvalidArgumentError("mem_pool_host: a host pool is already registered")
        require_stored_host_pool(mem_pool_host)
        config = self.storage_config
        layout = host_kv_layout(mem_pool_host)
        if self.tp_lcm_size is not None:
            self.head_groups = HeadGroups.for_layout(
                layout,
                tp_lcm_size=self.tp_lcm_size,
                tp_rank=config.tp_rank,
                tp_size=config.tp_size,
                argument="storage_config.tp_lcm_size",
            )
        fingerprint = self.config.fingerprint(
            layout,
            "host pool",
            page_size=mem_pool_host.page_size,
            tp_rank=config.tp_rank,
            tp_size=config.tp_size,
            first_layer=getattr(mem_pool_host, "start_layer", 0),
            head_groups=self.head_groups,
        )
        super().register_mem_pool_host(mem_pool_host)
        self.kv_layout = replace(layout, dtype=fingerprint.layout.dtype)
        self._entry_shape = fingerprint.layout.page_shape(mem_pool_host.page_size)
        self._per_page = 1 if self.head_groups is None else self.head_groups.per_rank
        self._open_kv(self.config.open_store(fingerprint))

    def _open_kv(self, store: StorageBackend) -> None:
        """Serve the KV pages from ``store``, with KV events on it where they are on."""
        self.store = store
        try:
            publisher = self.config.kv_event_publisher(self.storage_config.tp_rank)
        except BaseException:
            self.store.close()
            self.store = None
            raise
        if publisher is not None:
            self.announcer = KVEventAnnouncer(
                publisher, self.store, block_size=self.mem_pool_host.page_size, owns_publisher=True
            )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """sglang's ``HybridCacheController`` registers each pool of its host pool group here
        (after :meth:`register_mem_pool_host`); :meth:`on_host_pools_registered` then opens one
        key space per pool (:mod:`kvstage.integrations.sglang.hybrid_pools`). Stored: the anchor
        again under ``"kv"``, ``"swa"``, ``"indexer"``, ``"mamba"`` (see
        :func:`~kvstage.integrations.sglang.pool_kinds.require_stored_v2_pool`).

        Raises:
            InvalidArgumentError: any other pool, named by its pool name, kind and class; a pool
                registered after the set's key spaces were opened (a layout cannot grow), or
                beside ``tp_lcm_size`` head groups; the
                stores opened so far are closed first (this backend then serves nothing: the
                model's pages cannot be stored whole).
        """
        try:
            name = require_stored_v2_pool(host_pool, host_pool_name, self.mem_pool_host)
            if self.pool_set_fixed and name != "kv":
                raise InvalidArgumentError(
                    f"host pool {name!r}: registered after the pool set was complete (on_host_pools_registered, "
                    f"pools {sorted({'kv', *self.v2_pools})}); kvstage fixes a model's layout and key spaces there"
                )
            if self.head_groups is not None and name != "kv":
                raise InvalidArgumentError(
                    f"host pool {name!r}: storage_config.tp_lcm_size (heads split across TP sizes) is for "
                    "plain MHA pools; a hybrid pool set keeps per-rank key spaces (leave tp_lcm_size unset)"
                )
        except InvalidArgumentError:
            self.close()
            self.store = self.announcer = self.hybrid = None
            raise
        self.v2_pools[name] = host_pool
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def on_host_pools_registered(self) -> None:
        """With pools beside the KV pool: the KV store is reopened in the hybrid layout's ``kv``
        key space and a store is opened for each other pool (one layout, fingerprinted whole).

        Raises:
            InvalidArgumentError: as :func:`~kvstage.integrations.sglang.hybrid_pools.hybrid_layout`
                (e.g. an ``swa`` pool without ``extra_config.sliding_window``); nothing stays open.
            BackendUnavailableError, StorageError: as :func:`kvstage.storage.open_storage`.
        """
        self.pool_set_fixed = True
        if self.hybrid is not None or not set(self.v2_pools) - {"kv"}:
            return
        try:
            pools = {"kv": self.mem_pool_host, **self.v2_pools}
            layout = hybrid_layout(pools, self.kv_layout.dtype, self.config, self.sliding_window)
            config = self.storage_config
            fingerprints = layout.fingerprints(
                self.config.model_id,
                page_size=self.mem_pool_host.page_size,
                tp_rank=config.tp_rank,
                tp_size=config.tp_size,
                first_layer=getattr(self.mem_pool_host, "start_layer", 0),
            )
            self.close()
            self.store = self.announcer = None
            stores: dict[str, StorageBackend] = {}
            try:
                for name, fingerprint in fingerprints.items():
                    stores[name] = self.config.open_store(fingerprint)
                self._open_kv(stores["kv"])
            except BaseException:
                for store in stores.values():
                    store.close()
                raise
        except BaseException:
            self.close()
            self.store = self.announcer = None
            raise
        self.hybrid = HybridStores(layout, stores, pools, self.mem_pool_host.page_size)

    # -- v2 interface (hybrid pool sets) ------------------------------------------------------

    def _stores_v2(self) -> HybridStores:
        if self.hybrid is None and set(self.v2_pools) - {"kv"}:
            with self._metrics_lock:  # a caller that never announced the end of its pool set
                self.on_host_pools_registered()
        if self.hybrid is not None:
            return self.hybrid
        layout = ModelLayout(
            self.kv_layout.num_layers, (FullAttention(range(self.kv_layout.num_layers), self.kv_layout, name="kv"),)
        )
        return HybridStores(layout, {"kv": self._store()}, {"kv": self.mem_pool_host}, self.mem_pool_host.page_size)

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: Any = None, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> Any:
        """sglang's hit query over the KV pool and ``pool_transfers``' pools: a
        ``PoolTransferResult`` of kvstage's restorable lengths
        (:meth:`~kvstage.integrations.sglang.hybrid_store.HybridStores.exists`).

        Raises:
            InvalidArgumentError: a pool not registered, or a hit policy that is not its kind's.
            StorageError: no host pool registered yet.
        """
        self._store()
        return self._stores_v2().exists(keys, pool_transfers)

    def batch_set_v2(self, transfers: Any, extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Store each transfer's host entries (sglang's hybrid backup); per pool name, True per key
        stored or already there. A ``kv`` transfer goes through :meth:`batch_set_v1`.

        Raises:
            InvalidArgumentError: a pool not registered, host slots that do not match the keys
                (before anything is written). StorageError: no host pool registered yet.
        """
        self._store()
        prefix_keys = extra_info.prefix_keys if extra_info is not None else None
        return self._stores_v2().set(
            transfers, prefix_keys, lambda keys, slots: self.batch_set_v1(keys, slots, extra_info)
        )

    def batch_get_v2(self, transfers: Any, extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Read each transfer's entries into its host slots (sglang's hybrid prefetch); per pool
        name, True per entry found intact and written. A ``kv`` transfer goes through
        :meth:`batch_get_v1`.

        Raises:
            As :meth:`batch_set_v2`, before anything is read.
        """
        self._store()
        return self._stores_v2().get(transfers, lambda keys, slots: self.batch_get_v1(keys, slots, extra_info))

    # -- v1 zero-copy interface (host indices) ------------------------------------------------

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store the pages at ``host_indices`` (``page_size`` host slots per key, the first of each
        page a multiple of ``page_size``) under ``keys``; True per key stored or already there.

        ``keys`` are one run of one chain; ``extra_info.prefix_keys`` (sglang's
        ``hicache_storage_pass_prefix_keys``) names the keys before it. The run is linked to
        ``prefix_keys[-1]`` only when that page is stored: a child written before its parent
        (or after it was evicted) is stored as a chain's start rather than refused, so no page
        sglang hands over is lost (its parent, written later, is then not linked to it for
        eviction). The store is not asked first: a put the store refuses with
        :class:`kvstage.storage.MissingPriorError` for that key is put again unlinked.

        Raises:
            InvalidArgumentError: ``host_indices`` is not a 1-D tensor of ``len(keys) * page_size``
                host slots whose pages start at multiples of ``page_size`` inside the host pool;
                raised before any page is written.
            StorageError: no host pool registered yet.
        """
        store, starts = self._pages_of(keys, host_indices)
        prefix_keys = extra_info.prefix_keys if extra_info is not None else None
        prior = prefix_keys[-1] if prefix_keys else None
        started = time.perf_counter()
        views = page_views(self.mem_pool_host, starts)
        results = self._write(store, keys, views, prior, announce=prefix_keys is not None)
        self._record("backup", sum(results), time.perf_counter() - started)
        return results

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Read the pages of ``keys`` into ``host_indices`` (as :meth:`batch_set_v1`); True per
        page found intact and written to the host pool. A missing or corrupt page is False and
        its host slots get no bytes of a wrong page.

        Raises:
            InvalidArgumentError, StorageError: as :meth:`batch_set_v1`, before any page is read.
        """
        store, starts = self._pages_of(keys, host_indices)
        started = time.perf_counter()
        results: list[bool] = []
        views = page_views(self.mem_pool_host, starts)  # once: each call views two pages itself
        step = self._chunk_pages(store, len(keys))
        for first in range(0, len(keys), step):
            results += self._get_into(store, keys[first : first + step], views[first : first + step])
        self._record("prefetch", sum(results), time.perf_counter() - started)
        if self.announcer is not None and not all(results):  # a corrupt page the store dropped
            self.announcer.poll()
        return results

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, the store holds (sglang's lookup).

        Raises:
            StorageError: no host pool registered yet, or the store answered for a different
                number of keys than asked (:func:`kvstage.offload.store_io.leading_hits`).
        """
        store = self._store()
        if self.head_groups is None:
            return leading_hits(store, keys)
        return leading_hits(store, self.head_groups.entry_keys(keys)) // self._per_page

    # -- the legacy interface (flat pages in the host layout's order) -------------------------

    def exists(self, key: str) -> bool:
        """Whether the store holds ``key``."""
        store = self._store()
        return all(store.exists([key] if self.head_groups is None else self.head_groups.entry_keys([key])))

    def set(
        self, key: str, value: Any | None = None, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> bool:
        """Store one flat page (``host_pool.get_data_page(index, flat=True)``) under ``key``."""
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store flat pages under ``keys`` (one chain run); True when every page is stored or was there.

        Raises:
            InvalidArgumentError: ``values`` is not one flat page per key (see
                :func:`~kvstage.integrations.sglang.host_layouts.flat_page_view`).
        """
        store = self._store()
        values = list(values or [])
        if len(values) != len(keys):
            raise InvalidArgumentError(f"values: {len(values)} pages for {len(keys)} keys")
        views = [flat_page_view(self.mem_pool_host, value, self.kv_layout) for value in values]
        return all(self._write(store, list(keys), views, None, announce=False))  # no parent known

    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None) -> torch.Tensor | None:
        """Read ``key`` into ``target_location`` (a flat page, e.g.
        ``host_pool.get_dummy_flat_data_page()``); it, or None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any | None = None, target_sizes: Any | None = None
    ) -> list[torch.Tensor | None]:
        """Read ``keys`` into the flat pages ``target_locations``; each target, or None on a miss."""
        store = self._store()
        targets = list(target_locations or [])
        if len(targets) != len(keys):
            raise InvalidArgumentError(f"target_locations: {len(targets)} pages for {len(keys)} keys")
        views = [flat_page_view(self.mem_pool_host, target, self.kv_layout) for target in targets]
        out: list[torch.Tensor | None] = []
        step = self._chunk_pages(store, len(keys))
        for first in range(0, len(keys), step):
            hits = self._get_into(store, list(keys[first : first + step]), views[first : first + step])
            out += [target if hit else None for target, hit in zip(targets[first : first + step], hits)]
        return out

    # -- lifecycle ----------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove every page of this key space (sglang's ``flush_cache``); with KV events on,
        each page removed is announced (``BlockRemoved``). A hybrid model's other key spaces
        (SWA, indexer, Mamba) are cleared too."""
        self._store().clear()
        for name, store in self.hybrid.stores.items() if self.hybrid is not None else ():
            if name != "kv":
                store.clear()
        if self.announcer is not None:
            self.announcer.poll()

    def get_stats(self) -> StorageMetrics:
        """sglang's ``StorageMetrics`` since the last call: pages and GB/s of each v1 backup
        (``batch_set_v1``) and prefetch (``batch_get_v1``) call."""
        with self._metrics_lock:
            metrics, self._metrics = self._metrics, StorageMetrics()
        return metrics

    def close(self) -> None:
        """Publish the store's last events and close the publisher (KV events on), then close
        the store. Idempotent."""
        if self.announcer is not None:
            self.announcer.close()
            self.announcer = None
        if self.hybrid is not None:
            self.hybrid.close()  # the KV store among them
        elif self.store is not None:
            self.store.close()

    # -- helpers ------------------------------------------------------------------------------

    def _store(self) -> StorageBackend:
        if self.store is None:
            raise StorageError(
                "KVStageStorage: no host pool registered yet (sglang calls register_mem_pool_host first)"
            )
        return self.store

    def _pages_of(self, keys: Sequence[str], host_indices: torch.Tensor) -> tuple[StorageBackend, list[int]]:
        """The store and the first host slot of each key's page, checked before anything moves."""
        store = self._store()
        page_size = self.mem_pool_host.page_size
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
            raise InvalidArgumentError("host_indices: must be a 1-D tensor of host slots")
        if host_indices.numel() != len(keys) * page_size:
            raise InvalidArgumentError(
                f"host_indices: {host_indices.numel()} slots for {len(keys)} keys of page_size {page_size}"
            )
        starts = host_indices[::page_size].tolist()
        for position, start in enumerate(starts):
            if start % page_size != 0 or not 0 <= start < self.mem_pool_host.size:
                raise InvalidArgumentError(
                    f"host_indices[{position * page_size}]: {start} is not a page start of the host pool "
                    f"(a multiple of page_size {page_size} below {self.mem_pool_host.size})"
                )
        return store, starts

    @staticmethod
    def _chunk_pages(store: StorageBackend, num_pages: int) -> int:
        """Pages (of ``num_pages``) a store call moves: all of them where the store takes page
        views as they are (:attr:`~kvstage.storage.StorageBackend.strided_pages`: no staging,
        and the memory store moves a run of adjacent host pages in one copy), else
        ``CHUNK_PAGES`` (this thread's staging holds that many)."""
        return max(num_pages, 1) if store.strided_pages else CHUNK_PAGES

    def _staging(self, num_pages: int) -> list[torch.Tensor]:
        """This thread's ``num_pages`` (<= CHUNK_PAGES store entries per page) buffers of store
        entries (pages, or head groups of pages) in kvstage's order."""
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            buffers = torch.empty((CHUNK_PAGES * self._per_page, *self._entry_shape), dtype=self.mem_pool_host.dtype)
            self._local.buffers = buffers
        return list(buffers[:num_pages])

    def _for_put(self, store: StorageBackend, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """The pages to hand ``store.put``: the views themselves where the store takes them
        (contiguous, or any view for a store with ``strided_pages``: one copy, by the store);
        others copied into this thread's staging first."""
        if store.strided_pages:
            return views
        staging = iter(self._staging(sum(not view.is_contiguous() for view in views)))
        pages = []
        for view in views:
            if view.is_contiguous():
                pages.append(view)
            else:
                page = next(staging).view(view.shape)
                page.copy_(view)
                pages.append(page)
        return pages

    def _write(
        self, store: StorageBackend, keys: list[str], views: list[torch.Tensor], prior: str | None, announce: bool
    ) -> list[bool]:
        """Store the page views under ``keys`` (one chain run after ``prior``; None: a chain's
        start; a run refused because ``prior`` is not stored is put again as a chain's start),
        in one store call (``CHUNK_PAGES`` at a time where pages are staged: :meth:`_chunk_pages`)
        through :func:`kvstage.offload.store_io.write_pages`,
        so a store that raises fails its pages rather than sglang's thread; True per page stored
        or already there. Failed pages are logged once per call at WARNING, with the cause.
        KV events on: the pages are announced when ``announce`` (the run's parent is known),
        else only the store's removals are (the pages count in ``kv_events_unannounced``).
        With head groups each page is this rank's entries, chained page by page and group by group."""
        results: list[bool] = []
        cause: BaseException | None = None
        if self.head_groups is not None:
            keys, views = (
                self.head_groups.entry_keys(keys),
                self.head_groups.entry_views(views, self.kv_layout.page_shape(self.mem_pool_host.page_size)),
            )
            prior = None if prior is None else self.head_groups.entry_keys([prior])[-1]
        step = self._chunk_pages(store, len(keys)) * self._per_page
        for first in range(0, len(keys), step):
            chunk = keys[first : first + step]
            pages = self._for_put(store, views[first : first + step])
            outcome = write_pages(store, chunk, pages, prior_key=prior)
            if prior is not None and isinstance(outcome.error, MissingPriorError) and outcome.error.prior_key == prior:
                outcome = write_pages(store, chunk, pages)  # the prior is not stored: this run starts a chain
            if self.announcer is not None and announce:  # no token ids from sglang (see the module)
                self.announcer.written(chunk, (), prior, (None, None), outcome.failed_keys)
            elif self.announcer is not None:
                self.kv_events_unannounced += len(chunk)
                self.announcer.poll()
            failed = set(outcome.failed_keys)
            results += [key not in failed for key in chunk]
            cause = cause or outcome.error
            prior = chunk[-1]
        if self.head_groups is not None:
            results = self.head_groups.page_hits(results)
        if not all(results):
            logger.warning(
                "KVStageStorage: %d of %d pages not stored: %s",
                results.count(False),
                len(results),
                repr(cause) if cause is not None else "the store refused them (no room)",
            )
        return results

    def _get_into(self, store: StorageBackend, keys: list[str], views: list[torch.Tensor]) -> list[bool]:
        """Read ``keys`` into the page views, directly where the store takes them, else through
        this thread's staging (copied on a hit only, so a miss writes nothing). With head groups,
        a page is a hit when all its entries are; a page with some missing has its found heads
        written (the right page's bytes) and reads False."""
        groups = self.head_groups
        if groups is not None:
            shape = self.kv_layout.page_shape(self.mem_pool_host.page_size)
            keys, views = groups.entry_keys(keys), groups.entry_views(views, shape)
        direct = [store.strided_pages or view.is_contiguous() for view in views]
        spare = iter(self._staging(sum(not d for d in direct)))
        into = [view if is_direct else next(spare) for view, is_direct in zip(views, direct)]
        hits = store.get(keys, into)
        for view, target, hit in zip(views, into, hits):
            if hit and target is not view:
                view.copy_(target.view(view.shape))
        return hits if groups is None else groups.page_hits(hits)

    def _record(self, direction: str, num_pages: int, seconds: float) -> None:
        gigabytes = num_pages * self._per_page * self.store.page_bytes / 1e9
        with self._metrics_lock:
            getattr(self._metrics, f"{direction}_pgs").append(num_pages)
            getattr(self._metrics, f"{direction}_bandwidth").append(gigabytes / seconds if seconds > 0 else 0.0)
