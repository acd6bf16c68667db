"""``KVStageOffloadingSpec``: kvstage as vLLM 0.33.0's offloading backend, GPU blocks to a store.

vLLM's ``OffloadingConnector`` loads a spec by name (``vllm/v1/kv_offload/factory.py``)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "KVStageOffloadingSpec",
            "spec_module_path": "kvstage.integrations.vllm", "storage": "file:/var/cache/kv"}}'

and asks it for a scheduler-side manager (:class:`KVStageOffloadingManager`: decides, answers
lookups from a :class:`kvstage.offload.StoreIndex`, reports store events) and, in each worker, a
worker (:class:`KVStageWorker`: moves vLLM's canonical block tensors to and from the store with
:class:`kvstage.offload.KeyedCopies`). A page is one block of one worker across the KV group's
layers; its key is the block's ``OffloadKey`` in hex.

Extra config: ``storage`` (a kvstage storage URL, default ``memory``), ``num_host_pages`` (the
worker's host pool, default 256), ``model_id`` (default: the model vLLM runs), ``miss_ttl_s``
and ``hit_ttl_s`` (see :class:`kvstage.offload.StoreIndex`; default 1 and 10 seconds).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)

from kvstage.errors import InvalidArgumentError, is_int, require
from kvstage.integrations.vllm.keys import block_fingerprint, offloading_events, page_keys
from kvstage.kernels import KVPool
from kvstage.offload import Copier, HostPool, KeyedCopies, StoreIndex, StoreWorkers
from kvstage.storage.shared import open_shared_storage, release_shared_storage

__all__ = ["KVStageLoadStoreSpec", "KVStageOffloadingManager", "KVStageOffloadingSpec", "KVStageWorker"]

_LOOKUP = {True: LookupResult.HIT, False: LookupResult.MISS, None: LookupResult.RETRY}


class KVStageLoadStoreSpec(LoadStoreSpec):
    """Where blocks live in kvstage: their page keys (hex ``OffloadKey``s), in block order."""

    def __init__(self, page_keys: list[str]) -> None:
        self.page_keys = page_keys

    def __repr__(self) -> str:
        return f"KVStageLoadStoreSpec({len(self.page_keys)} pages)"


class KVStageOffloadingSpec(OffloadingSpec):
    """vLLM's ``OffloadingSpec`` over a kvstage store (see the module doc for the config).

    Raises:
        InvalidArgumentError: a bad extra config value (named), more than one KV group.
    """

    def __init__(self, config) -> None:
        super().__init__(config)
        extra = self.extra_config
        self.storage_url = extra.get("storage", "memory")
        require(isinstance(self.storage_url, str), "storage", lambda: f"must be a storage URL string, got {self.storage_url!r}")
        self.num_host_pages = extra.get("num_host_pages", 256)
        require(is_int(self.num_host_pages) and self.num_host_pages >= 1, "num_host_pages", lambda: f"must be an int >= 1, got {self.num_host_pages!r}")
        self.miss_ttl_s = extra.get("miss_ttl_s", 1.0)
        self.hit_ttl_s = extra.get("hit_ttl_s", 10.0)
        self.fingerprint = block_fingerprint(config, model_id=extra.get("model_id"))
        self._manager: KVStageOffloadingManager | None = None
        self._worker: KVStageWorker | None = None

    def get_manager(self) -> OffloadingManager:
        """The scheduler-side manager (one per spec)."""
        if self._manager is None:
            self._manager = KVStageOffloadingManager(
                open_shared_storage(self.storage_url, self.fingerprint), miss_ttl_s=self.miss_ttl_s,
                hit_ttl_s=self.hit_ttl_s, events=self.kv_events_config.enable_kv_cache_events,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """This worker's mover over ``kv_caches`` (one per spec)."""
        if self._worker is None:
            self._worker = KVStageWorker(kv_caches, open_shared_storage(self.storage_url, self.fingerprint), num_host_pages=self.num_host_pages)
        return self._worker


class KVStageOffloadingManager(OffloadingManager):
    """Decides for vLLM's scheduler: what the store holds (cached, refreshed on a reader
    thread), which blocks to store, and the store's events as vLLM's.

    Args:
        storage: the store (shared with the workers of this process, if any).
        miss_ttl_s: seconds a "not held" answer is trusted.
        hit_ttl_s: seconds after which a held key is checked again in the background.
        events: collect vLLM events (vLLM publishes KV events).

    A store's eviction of a page is seen at once through the store's events when the workers
    share this process's store object (one process); otherwise within ``hit_ttl_s`` of the
    key's last check, and a load of an evicted page meanwhile fails (vLLM recomputes the block).
    """

    def __init__(self, storage: Any, *, miss_ttl_s: float = 1.0, hit_ttl_s: float | None = 10.0, events: bool = False) -> None:
        self.storage = storage
        self._workers = StoreWorkers()
        self.index = StoreIndex(storage, self._workers, miss_ttl_s=miss_ttl_s, hit_ttl_s=hit_ttl_s)
        self._events_enabled = events
        self._events: list[OffloadingEvent] = []
        self._storing: set[str] = set()  # page keys of stores in flight
        self._lock = threading.Lock()

    @property
    def lock(self) -> threading.Lock:
        """Held by vLLM's scheduler around every call (the reader thread never takes it)."""
        return self._lock

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        """HIT / MISS from the index; RETRY while the store is being asked."""
        return _LOOKUP[self.index.lookup(key.hex())]

    def prepare_load(self, keys: Collection[bytes], req_context: ReqContext) -> LoadStoreSpec:
        """The page keys to read (the store keeps no pins: a page evicted meanwhile fails the load)."""
        return KVStageLoadStoreSpec(page_keys(keys))

    def prepare_store(self, keys: Collection[bytes], req_context: ReqContext) -> PrepareStoreOutput | None:
        """Store the blocks the store does not hold and no store in flight is writing."""
        wanted = [key for key in keys if self.index.lookup(key.hex()) is not True and key.hex() not in self._storing]
        hex_keys = page_keys(wanted)
        self._storing.update(hex_keys)
        return PrepareStoreOutput(keys_to_store=wanted, store_spec=KVStageLoadStoreSpec(hex_keys), evicted_keys=[])

    def complete_store(self, keys: Collection[bytes], req_context: ReqContext, success: bool = True) -> None:
        """The workers finished writing ``keys``."""
        hex_keys = page_keys(keys)
        self._storing.difference_update(hex_keys)
        if success:
            self.index.add(hex_keys)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: Any) -> None:
        """Send queued lookups; keep the index current with the store's events."""
        self.index.poll()
        self._drain_store_events()

    def has_pending_work(self) -> bool:
        return self.index.refreshing

    def reset_cache(self) -> None:
        """Clear the store's key space (vLLM's connector cache reset, e.g. after a weight
        update) and forget every lookup answer. Blocks this thread for the clear: a rare,
        operator-driven call. Stores in other processes (``memory``) are not reached."""
        self.storage.clear()
        self.index.reset()
        self._storing.clear()
        self._drain_store_events()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The store's stored / evicted / removed pages since the last call, as vLLM events."""
        self._drain_store_events()
        events, self._events = self._events, []
        return events

    def _drain_store_events(self) -> None:
        store_events = self.storage.take_events()
        prefix = self.storage.prefix
        self.index.discard([event.key for event in store_events if event.kind != "stored" and event.key_space == prefix])
        if self._events_enabled and store_events:
            self._events.extend(offloading_events(store_events, key_space=prefix, medium=Medium.STORAGE, locality=None, ownership=None))

    def shutdown(self) -> None:
        self._workers.close()
        release_shared_storage(self.storage)


class KVStageWorker(OffloadingWorker):
    """Moves one worker's blocks between vLLM's canonical block tensors and the store.

    Args:
        kv_caches: vLLM's ``CanonicalKVCaches`` of one KV group: each layer's tensor
            ``(num_blocks, page_size_bytes)`` int8, contiguous, unpadded.
        storage: the store; its page is one block of every layer of the group.
        num_host_pages: host pages for blocks in flight.

    Raises:
        InvalidArgumentError: more than one group, a padded or strided layer tensor, layers of
            different page sizes, or a store of another page size; before anything is allocated.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, storage: Any, *, num_host_pages: int = 256) -> None:
        require(len(kv_caches.group_data_refs) == 1, "kv_caches", lambda: f"must hold one KV group, got {len(kv_caches.group_data_refs)}")
        layers = []
        for index, ref in enumerate(kv_caches.group_data_refs[0]):
            tensor = kv_caches.tensors[ref.tensor_idx].tensor
            require(
                tensor.dim() == 2 and tensor.is_contiguous() and tensor.shape[1] == ref.page_size_bytes,
                f"kv_caches.group_data_refs[0][{index}]",
                lambda: f"must be a contiguous (num_blocks, page bytes) tensor without padding, got shape {tuple(tensor.shape)} "
                f"strides {tensor.stride()} for a page of {ref.page_size_bytes} bytes",
            )
            layers.append(tensor.view(torch.uint8).view(tensor.shape[0], 1, tensor.shape[1]))
        self.kv_pool = KVPool.mla(layers)  # a block is a slot; a layer's page is its row
        host_pool = HostPool.like(self.kv_pool, num_pages=num_host_pages, page_size=1)
        self.copier = Copier(self.kv_pool, host_pool)
        self._workers = StoreWorkers()
        self.storage = storage
        try:
            self.keyed = KeyedCopies(self.copier, storage, self._workers)
        except InvalidArgumentError:
            self.close()
            raise
        self._refused: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: KVStageLoadStoreSpec) -> bool:
        """Copy the GPU blocks out and write them under the spec's keys (asynchronously)."""
        return self._submit(job_id, lambda slots: self.keyed.store(job_id, slots, dst_spec.page_keys), src_spec)

    def submit_load(self, job_id: int, src_spec: KVStageLoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False) -> bool:
        """Read the spec's keys and copy them into the GPU blocks (asynchronously)."""
        return self._submit(job_id, lambda slots: self.keyed.load(job_id, src_spec.page_keys, slots), dst_spec)

    def _submit(self, job_id: int, submit, gpu_spec: GPULoadStoreSpec) -> bool:
        slots = torch.from_numpy(gpu_spec.block_ids.astype("int64")).to(self.kv_pool.device)
        if not submit(slots):
            # No free host pages now: the job fails (vLLM drops the store, or recomputes).
            self._refused.append(TransferResult(job_id=job_id, success=False))
        return True

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call; never blocks."""
        results, self._refused = self._refused, []
        for result in self.keyed.poll():
            results.append(TransferResult(result.job, result.ok, transfer_size=result.bytes, transfer_time=result.seconds))
        return results

    def wait(self, job_ids: set[int]) -> None:
        """Block until the given jobs finished (their results stay for :meth:`get_finished`)."""
        self.keyed.wait(list(job_ids))

    def shutdown(self) -> None:
        self.close()

    def close(self) -> None:
        """Wait for copies, stop the threads, close the store. Idempotent."""
        if self.storage is None:
            return
        self.copier.close()
        self._workers.close()
        release_shared_storage(self.storage)
        self.storage = None
