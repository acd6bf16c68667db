"""``KVStageOffloadingSpec``: kvstage as vLLM 0.33.0's offloading backend, GPU blocks to a store.

vLLM's ``OffloadingConnector`` loads a spec by name (``vllm/v1/kv_offload/factory.py``)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "KVStageOffloadingSpec",
            "spec_module_path": "kvstage.integrations.vllm", "storage": "file:/var/cache/kv"}}'

and asks it for a scheduler-side manager (:class:`KVStageOffloadingManager`: decides, answers
lookups from a :class:`kvstage.offload.StoreIndex`, announces stored and lost blocks) and, in each worker, a
worker (:class:`KVStageWorker`: moves vLLM's canonical block tensors to and from the store with
:class:`kvstage.offload.KeyedCopies`). A page is one block of one worker across the KV group's
layers; its key is the block's ``OffloadKey`` in hex. A hybrid model (several groups: full
attention, sliding window, Mamba in align mode) keeps each group in a key space of its own
(:mod:`kvstage.integrations.vllm.groups`); vLLM's connector scheduler decides which chunks of each
group to store and load, and needs :class:`KVStageConnector` to name the groups' kinds.

Extra config: ``storage`` (a kvstage storage URL, required), ``num_host_pages`` (the worker's
host pool, default 256), ``model_id`` (default: the model path vLLM runs; set it where engines
serve one model from different paths), ``miss_ttl_s`` and ``hit_ttl_s`` (see
:class:`kvstage.offload.StoreIndex`; default 1 and 10 seconds). Other keys, besides those vLLM
reads itself, are named in a WARNING.
"""

from __future__ import annotations

import logging

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingSpec, OffloadingWorker

from kvstage.errors import is_int, require
from kvstage.integrations.vllm.groups import KV_CACHE_CONFIG, GroupStores, group_fingerprints, group_layout
from kvstage.integrations.vllm.keys import block_fingerprint
from kvstage.integrations.vllm.manager import KVStageOffloadingManager
from kvstage.integrations.vllm.worker import KVStageWorker
from kvstage.storage.shared import open_shared_storage, release_shared_storage

__all__ = ["KVStageOffloadingSpec"]

logger = logging.getLogger(__name__)

_KVSTAGE_KEYS = frozenset({"storage", "num_host_pages", "model_id", "miss_ttl_s", "hit_ttl_s"})
# Keys vLLM 0.33.0 itself reads from kv_connector_extra_config for any spec (kv_offload/factory.py,
# kv_offload/base.py, offloading/config.py).
_VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "canonical_layout",
        "self_describing_kv_events",
        "offload_prompt_only",
    }
)
_warned: set[tuple[str, ...]] = set()


class KVStageOffloadingSpec(OffloadingSpec):
    """vLLM's ``OffloadingSpec`` over a kvstage store (see the module doc for the config).

    Raises:
        InvalidArgumentError: a missing ``storage`` or a bad extra config value (named); several
            KV groups without :class:`KVStageConnector` (naming ``kv_connector``), or a group of a
            kind kvstage does not store (naming ``kv_cache_groups[i]`` and its kind, see
            :func:`kvstage.integrations.vllm.groups.group_layout`); chunks of more than one block
            (naming ``block_size`` or ``blocks_per_chunk``, as written).
    """

    def __init__(self, config) -> None:
        super().__init__(config)
        extra = self.extra_config
        require(
            "storage" in extra,
            "storage",
            "required: a kvstage storage URL (file:DIR, mooncake://..., memory[:BYTES]); vLLM's scheduler and workers may run "
            "in different processes, and a memory store is its process's only",
        )
        self.storage_url = extra["storage"]
        require(
            isinstance(self.storage_url, str),
            "storage",
            lambda: f"must be a storage URL string, got {self.storage_url!r}",
        )
        unknown = sorted(set(extra) - _KVSTAGE_KEYS - _VLLM_KEYS)
        if unknown and tuple(unknown) not in _warned:  # most likely a misspelled kvstage key: its default applies
            _warned.add(tuple(unknown))  # once a process, not once per connector role
            logger.warning(
                "kvstage: KVStageOffloadingSpec ignores kv_connector_extra_config keys %s; it reads %s",
                unknown,
                sorted(_KVSTAGE_KEYS),
            )
        self.num_host_pages = extra.get("num_host_pages", 256)
        require(
            is_int(self.num_host_pages) and self.num_host_pages >= 1,
            "num_host_pages",
            lambda: f"must be an int >= 1, got {self.num_host_pages!r}",
        )
        self.miss_ttl_s = extra.get("miss_ttl_s", 1.0)
        self.hit_ttl_s = extra.get("hit_ttl_s", 10.0)
        if len(config.groups) == 1:
            self.fingerprint = block_fingerprint(config, model_id=extra.get("model_id"))
            self.group_fingerprints = None
            self.layout, self.group_components, self.unchained_groups = None, None, frozenset()
        else:
            kv_cache_config = KV_CACHE_CONFIG.get()
            require(
                kv_cache_config is not None,
                "kv_connector",
                lambda: (
                    f"this model offloads {len(config.groups)} KV cache groups (a hybrid model): KVStageOffloadingSpec "
                    "needs each group's kind, which vLLM hands only to the connector: give kv_connector "
                    "'KVStageConnector' with kv_connector_module_path 'kvstage.integrations.vllm'"
                ),
            )
            self.fingerprint = None
            # one key space per group, each of its own page size (refuses a group kind kvstage does not store)
            self.group_fingerprints = group_fingerprints(config, kv_cache_config, model_id=extra.get("model_id"))
            # the groups as kvstage components (ModelLayout): group id -> component name
            self.layout, self.group_components = group_layout(kv_cache_config, tuple(self.group_fingerprints))
            # a sliding-window or state page's predecessor is rightly absent: such pages start no chain
            self.unchained_groups = frozenset(
                group_id
                for group_id, name in self.group_components.items()
                if self.layout.component(name).kind != "full"
            )
        self.report_load_errors = False  # KVStageConnector sets it: failed loads go to vLLM's scheduler
        self.load_errors_by_request = False  # KVStageConnector sets it for several KV cache groups
        self.load_failure_policy = "fail"  # KVStageConnector sets vLLM's kv_load_failure_policy (for warnings)
        self.reports_stores = False  # KVStageConnector sets it: workers report their stores to the scheduler
        self._manager: KVStageOffloadingManager | None = None
        self._worker: KVStageWorker | None = None

    def get_manager(self) -> OffloadingManager:
        """The scheduler-side manager (one per spec)."""
        if self._manager is None:
            storage = self._open_storage()
            try:
                self._manager = KVStageOffloadingManager(
                    storage,
                    miss_ttl_s=self.miss_ttl_s,
                    hit_ttl_s=self.hit_ttl_s,
                    events=self.kv_events_config.enable_kv_cache_events,
                    unchained_groups=self.unchained_groups,
                    chunk_tokens={group.group_id: group.tokens_per_block for group in self.config.groups},
                )
            except BaseException:
                release_shared_storage(storage)  # the manager owns the store only once built
                raise
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """This worker's mover over ``kv_caches`` (one per spec)."""
        if self._worker is None:
            storage = self._open_storage()
            try:
                self._worker = KVStageWorker(
                    kv_caches,
                    storage,
                    num_host_pages=self.num_host_pages,
                    report_load_errors=self.report_load_errors,
                    load_errors_by_request=self.load_errors_by_request,
                    load_failure_policy=self.load_failure_policy,
                    reports_stores=self.reports_stores,
                    group_ids=None if self.group_fingerprints is None else tuple(self.group_fingerprints),
                )
            except BaseException:
                release_shared_storage(storage)  # the worker owns the store only once built
                raise
        return self._worker

    def _open_storage(self):
        """The store (one group), or a :class:`GroupStores` of each group's (a hybrid model)."""
        if self.group_fingerprints is None:
            return open_shared_storage(self.storage_url, self.fingerprint)
        stores = {}
        try:
            for group_id, fingerprint in self.group_fingerprints.items():
                stores[group_id] = open_shared_storage(self.storage_url, fingerprint)
        except BaseException:
            for store in stores.values():
                release_shared_storage(store)
            raise
        return GroupStores(stores)
