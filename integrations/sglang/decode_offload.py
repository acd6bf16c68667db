"""``KVStageDecodeOffloadManager``: kvstage's offload manager in the place of sglang's decode-side
``DecodeKVCacheOffloadManager`` (sglang 0.5.23,
``sglang/srt/disaggregation/decode_kvcache_offload_manager.py``).

sglang's decode scheduler (prefill/decode disaggregation with
``--disaggregation-decode-enable-offload-kvcache``) builds it as
``DecodeKVCacheOffloadManager(req_to_token_pool=, token_to_kv_pool_allocator=, tp_group=,
tree_cache=)`` and calls, on its scheduler thread: ``offload_kv_cache(req)`` each step for each
running request and once at finish (``False`` there: sglang calls
``finalize_release_on_finish(req)``), ``check_offload_progress()`` each step,
``drain_before_retraction()``, ``has_inflight_device_transfer()``, ``len(ongoing_offload)`` and
``release_host_resources()`` at shutdown. This class offers the same surface and drives
:class:`kvstage.offload.OffloadManager` with ``store_prompt=False``: the prefill side stored the
prompt's whole pages, and the decode pages' keys continue that chain (sglang-v1 keys, equal to
sglang's own).

Releases in TP lockstep: every TP rank must free a finished request's device slots in the same
scheduler step, or the ranks schedule different batches. kvstage releases a request when its
own rank's copies end (an MLA rank > 0 copies nothing), so each rank queues its finished
requests in finish order (the same on every rank) and, each step, the ranks agree by an
all-reduce (MIN over ``tp_group``) on how many of the queue's head are released everywhere;
exactly those are handed back to sglang.

Retraction: sglang's decode side frees a retracted request's slots itself (``retract_all``)
and holds the same ``Req`` for re-bootstrap; the next :meth:`check_offload_progress` sees its
slots gone and ends its lifecycle with :meth:`kvstage.offload.OffloadManager.retract`
(``keep_offloaded=True``: when it runs again its pages continue after those stored). The
manager and this class then hold it weakly only, so a request sglang drops while held is
collected with sglang's last reference.

Switching sglang to it without editing sglang's source: :func:`sglang_plugin`, an sglang plugin
enabled by ``KVSTAGE_SGLANG_DECODE_OFFLOAD=1``.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import torch

from kvstage.errors import InvalidArgumentError
from kvstage.hashing import PageHasher
from kvstage.integrations.sglang.bigram_requests import BigramRequest, PairUnitHasher
from kvstage.integrations.sglang.decode_hybrid import dsa_pools, swa_pools
from kvstage.integrations.sglang.draft_layers import DRAFT_PLAN_HOOK_TARGET, packed_drafts_of, record_packed_drafts
from kvstage.integrations.sglang.key_space import ExtraConfig
from kvstage.integrations.sglang.pool_kinds import decode_device_pool_kind, pool_kind, require_stored_device_pool
from kvstage.integrations.sglang.storage_options import pop_sliding_window
from kvstage.kernels import KVPool
from kvstage.offload import HostPool, OffloadManager
from kvstage.offload.components import ComponentPools
from kvstage.offload.manager_arguments import check_events_of_model

__all__ = ["ENABLE_ENV", "KVStageDecodeOffloadManager", "sglang_plugin"]


def _sglang_settings() -> tuple[int, int, dict, str | None, float, float, bool]:
    """(page_size, offload_stride, storage extra config, served model name, hicache_size GB,
    hicache_ratio, bigram keys), read from sglang's published config as its own decode manager
    reads them; bigram keys where its tree is an EAGLE one (``CacheInitParams.is_eagle``:
    ``SpeculativeAlgorithm.is_eagle()`` of ``--speculative-algorithm``)."""
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_memory, get_schedule, get_serving, get_spec
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    page_size = get_schedule().page_size
    env_stride = envs.SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE.get()
    stride = page_size if env_stride is None or env_stride <= 0 else max(page_size, env_stride // page_size * page_size)
    memory = get_memory()
    raw = memory.hicache_storage_backend_extra_config
    try:
        extra = json.loads(raw) if raw else {}
    except json.JSONDecodeError as error:
        raise InvalidArgumentError(f"--hicache-storage-backend-extra-config: not JSON ({error})") from None
    bigram = SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm).is_eagle()
    return page_size, stride, extra, get_serving().served_model_name, memory.hicache_size, memory.hicache_ratio, bigram


def _pool_parts(kv_cache: Any, drafts: tuple[Any, ...]) -> tuple[Any, tuple[list[torch.Tensor], ...]]:
    """(``KVPool.mla`` or ``KVPool.mha``, its per-layer buffer lists): the target pool's layers,
    then each packed draft pool's (sglang's host page order), each pool checked alike."""
    pools = (kv_cache, *drafts)
    names = ["token_to_kv_pool_allocator"] + [f"packed draft pool {i}" for i in range(len(drafts))]
    # Exact classes: a subclass may hold more than kvstage stores (DSA: the indexer's keys).
    mla = [require_stored_device_pool(pool, name) for pool, name in zip(pools, names)]
    if any(kind != mla[0] for kind in mla):
        raise InvalidArgumentError(f"packed draft pools: must be of the target pool's kind ({pool_kind(kv_cache)})")
    if mla[0]:
        return KVPool.mla, ([buffer for pool in pools for buffer in pool.kv_buffer],)
    for pool, name in zip(pools, names):
        if pool.v_head_dim != pool.head_dim:
            raise InvalidArgumentError(
                f"{name}: V head size {pool.v_head_dim} differs from K head size {pool.head_dim}"
            )
    return KVPool.mha, ([b for pool in pools for b in pool.k_buffer], [b for pool in pools for b in pool.v_buffer])


def _open_stores(config: ExtraConfig, fingerprint: Any, layout: Any, page_size: int, shard: dict) -> dict[str, Any]:
    """The stores by component name: ``{"kv": store}`` for a plain pool, else one per component of
    ``layout`` in the prefill side's key spaces (``layout.fingerprints``); none left open on error."""
    if layout is None:
        return {"kv": config.open_store(fingerprint)}
    stores: dict[str, Any] = {}
    try:
        for name, component_fingerprint in layout.fingerprints(config.model_id, page_size=page_size, **shard).items():
            stores[name] = config.open_store(component_fingerprint)
    except BaseException:
        for store in stores.values():
            store.close()
        raise
    return stores


class KVStageDecodeOffloadManager:
    """sglang's decode-side KV offload manager, on kvstage.

    Args:
        req_to_token_pool: sglang's ``ReqToTokenPool``; a request's device slots are
            ``req_to_token[req.kv.req_pool_idx]``.
        token_to_kv_pool_allocator: sglang's allocator; its ``get_kvcache()`` is the device pool
            (``MHATokenToKVPool``: ``k_buffer``/``v_buffer`` per layer; ``MLATokenToKVPool``:
            ``kv_buffer``; DeepSeek V3.2's ``DSATokenToKVPool``: the latent and the indexer's
            pages, stored as the prefill side's ``kv`` and ``indexer`` components,
            :mod:`~kvstage.integrations.sglang.decode_hybrid`), wrapped in place.
        tp_group: the TP process group (gloo on CPU) over which releases are agreed.
        tree_cache: sglang's tree cache; a released request's slots go back through it as
            sglang's own manager returns them.

    Settings, from sglang's config: the page size; the stride
    (``SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE``, a multiple of the page size, default one page);
    ``--hicache-storage-backend-extra-config``, read as the prefill side's
    :class:`~kvstage.integrations.sglang.KVStageStorage` reads it
    (:class:`~kvstage.integrations.sglang.key_space.ExtraConfig`): ``url`` (any
    :func:`kvstage.storage.open_storage` URL, the same store the prefill side writes), optional
    ``model_id`` (default: the served model name) and ``kv_cache_dtype`` (``"fp8_e4m3"`` /
    ``"fp8_e5m2"``, required when sglang holds fp8 KV as ``uint8``; the device pool is then
    wrapped as that dtype, so its pages share the prefill side's key space); host pages: ``--hicache-size`` GB, else
    ``--hicache-ratio`` times the device pool. ``kv_events_endpoint`` (optional
    ``kv_events_replay_endpoint``, ``kv_events_topic``) turns on KV events in sglang's format,
    bound by TP rank 0: the decode pages the manager stores, with their token ids, and the
    store's evictions and removals (:class:`~kvstage.events.KVEventAnnouncer`; a run whose
    parent this stream never announced, such as the prefill side's prompt pages, is counted as
    unanchored rather than announced); the publisher is :attr:`kv_event_publisher`.
    Speculative decoding: with an EAGLE-family ``--speculative-algorithm`` (sglang's tree keys
    token pairs) pages are keyed as EAGLE bigrams (:mod:`~kvstage.integrations.sglang.bigram_requests`,
    :attr:`bigram_keys`); the MTP draft pools sglang packs after the target's layers
    (:mod:`~kvstage.integrations.sglang.draft_layers`) are stored with them, in the prefill
    side's host-page layout.

    Raises:
        InvalidArgumentError: the extra config as
            :meth:`~kvstage.integrations.sglang.key_space.ExtraConfig.parse` and
            :meth:`~kvstage.integrations.sglang.key_space.ExtraConfig.kv_dtype` refuse it (no
            ``url``, an unknown key, fp8 as ``uint8`` without ``kv_cache_dtype`` or
            ``kv_cache_dtype`` on a pool that is not fp8) or, for a bad URL,
            :meth:`~kvstage.integrations.sglang.key_space.ExtraConfig.open_store`; a device pool other than
            exactly sglang's ``MHATokenToKVPool``, ``MLATokenToKVPool`` or ``DSATokenToKVPool``
            (named by kind and class: SWA, Mamba, FP4 pools...), or an MHA pool whose V head size
            differs from its K head size; a packed draft pool of another kind than the target's;
            KV events with bigram keys; a DSA pool with bigram keys or draft pools.
    """

    def __init__(self, req_to_token_pool: Any, token_to_kv_pool_allocator: Any, tp_group: Any, tree_cache: Any) -> None:
        page_size, stride, extra, served_model, hicache_size, hicache_ratio, bigram = _sglang_settings()
        window = pop_sliding_window(extra)  # an SWA pool's window, as KVStageStorage takes it out
        config = ExtraConfig.parse(extra, served_model)
        if bigram and config.kv_events_endpoint is not None:
            raise InvalidArgumentError(
                "kv_events_endpoint: KV events of EAGLE bigram pages are not supported by the decode drop-in"
            )
        self.bigram_keys = bigram
        kv_cache = token_to_kv_pool_allocator.get_kvcache()
        layout = components = None
        kind = decode_device_pool_kind(kv_cache, "token_to_kv_pool_allocator")
        if kind in ("dsa", "swa"):
            if bigram or packed_drafts_of(kv_cache):
                raise InvalidArgumentError(
                    f"token_to_kv_pool_allocator: a {kind.upper()} pool with EAGLE bigram keys or MTP draft pools is "
                    "not supported by the decode drop-in yet"
                )
        if kind == "dsa":
            dtype = config.kv_dtype(kv_cache.kv_buffer[0].dtype, "device pool")
            kv_pool, layout, extra_pools = dsa_pools(kv_cache, dtype)
            components = ComponentPools(layout, extra_pools)
        elif kind == "swa":
            kv_pool, layout, extra_pools, slots_of = swa_pools(kv_cache, config, window, self._slot_indices)
            # sglang frees window slots behind a running request: kvstage gathers only the pages
            # holding the window - 1 positions the next token needs (any eviction timing keeps them)
            components = ComponentPools(layout, extra_pools, slots_of, window_kept={"swa": window - 1})
        else:
            wrap, parts = _pool_parts(kv_cache, packed_drafts_of(kv_cache))
            # fp8 held as uint8: the same bytes viewed as the fp8 kind, so the pool's layout is the
            # prefill side's (a view, no copy).
            dtype = config.kv_dtype(parts[0][0].dtype, "device pool")
            kv_pool = wrap(*([buffer.view(dtype) for buffer in part] for part in parts))
        check_events_of_model(config.kv_events_endpoint, components, "kv_events_endpoint")  # before a store opens
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.tree_cache = tree_cache
        self.tp_group = tp_group
        self.tp_world_size = torch.distributed.get_world_size(group=tp_group)
        self.page_size = page_size
        self.offload_stride = stride
        shard = dict(
            tp_rank=torch.distributed.get_rank(group=tp_group),
            tp_size=self.tp_world_size,
            first_layer=getattr(kv_cache, "start_layer", 0),
        )
        fingerprint = config.fingerprint(kv_pool.layout, "device pool", page_size=page_size, **shard)
        page_bytes = fingerprint.page_bytes
        num_pages = (
            int(hicache_size * 1e9) // page_bytes if hicache_size else int(hicache_ratio * kv_cache.size) // page_size
        )
        self._released_here: set[int] = set()  # id(req) of finishing requests kvstage released on this rank
        self._finishing: list[Any] = []  # finished requests, in finish order (equal on every rank)
        # Running requests handed to the manager, held weakly: sglang may retract one (free its
        # slots, hold the Req) and drop it later without calling this class again.
        self._running: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._retracting: set[int] = set()  # id(req) being retracted: its release is not sglang's hand-back
        self.stores = _open_stores(config, fingerprint, layout, page_size, shard)
        self.storage = self.stores["kv"]
        publisher = None
        try:
            publisher = self.kv_event_publisher = config.kv_event_publisher(torch.distributed.get_rank(group=tp_group))
            self.host_pool = HostPool.like(kv_pool, num_pages=max(num_pages, 1), page_size=page_size)
            self.manager = OffloadManager(
                kv_pool,
                self.host_pool,
                self.stores if components is not None else self.storage,
                PairUnitHasher(page_size=page_size) if bigram else PageHasher(page_size=page_size),
                self._slot_indices,
                offload_stride=stride,
                store_prompt=False,
                release=self._on_release,
                kv_events=publisher,
                components=components,
            )
        except BaseException:
            if publisher is not None:
                publisher.close()
            for store in self.stores.values():  # sglang never calls release_host_resources on a failed manager
                store.close()
            raise

    # -- what sglang's scheduler calls ------------------------------------------------------

    @property
    def ongoing_offload(self) -> dict[int, Any]:
        """Finished requests not handed back to sglang yet, by ``id(req)`` (sglang counts them)."""
        return {id(req): req for req in self._finishing}

    def offload_kv_cache(self, req: Any) -> bool:
        """A running request: launch its new whole strides of decode KV (True when a copy was
        launched). A finished one: offload its last whole pages and queue its release (always
        True: sglang gets it back from :meth:`check_offload_progress`)."""
        if req.kv.req_pool_idx is None or req.kv.req_pool_idx == -1:
            return False
        if self.bigram_keys and not req.output_ids:
            return False  # the prompt's last bigram pairs it with the first output token
        if req.finished():
            self._running.pop(id(req), None)
            self.manager.finish(self._seen(req))
            self._finishing.append(req)
            return True
        self._running[id(req)] = req
        return self.manager.offload(self._seen(req))

    def finalize_release_on_finish(self, req: Any) -> None:
        """``req`` ends without :meth:`offload_kv_cache` taking it (e.g. sglang's sampling-mask
        abort): nothing more of it is stored; it is released in lockstep like any other."""
        if req.kv.req_pool_idx is None or req.kv.req_pool_idx == -1 or any(queued is req for queued in self._finishing):
            return  # released to sglang already, or queued
        self._running.pop(id(req), None)
        self.manager.abort(self._seen(req))  # releases at once when nothing of it is in flight
        if not self.manager.is_tracked(self._seen(req)):
            self._released_here.add(id(req))
        self._finishing.append(req)

    def check_offload_progress(self) -> None:
        """Collect finished copies and store writes (never waits), end the lifecycle of each
        running request sglang retracted since the last step, then hand sglang the finished
        requests that every TP rank has released, in finish order."""
        self.manager.poll()
        self._retract_freed()
        ready = 0
        for req in self._finishing:
            if id(req) not in self._released_here:
                break
            ready += 1
        if self.tp_world_size > 1:
            agreed = torch.tensor([ready], dtype=torch.int64)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN, group=self.tp_group)
            ready = int(agreed.item())
        released, self._finishing = self._finishing[:ready], self._finishing[ready:]
        for req in released:
            self._released_here.discard(id(req))
            self._release_to_sglang(req)

    def has_inflight_device_transfer(self) -> bool:
        """Whether a copy of device slots (D2H gather) may still read the KV pool."""
        return self.manager.copies_in_flight > 0

    def drain_before_retraction(self) -> None:
        """Collect what finished; raise on every rank if any rank still copies device slots.

        Raises:
            RuntimeError: a D2H copy is pending on some TP rank (retraction would free the
                device KV it reads).
        """
        self.check_offload_progress()
        pending = torch.tensor([int(self.has_inflight_device_transfer())], dtype=torch.int64)
        if self.tp_world_size > 1:
            torch.distributed.all_reduce(pending, op=torch.distributed.ReduceOp.MAX, group=self.tp_group)
        if pending.item():
            raise RuntimeError(
                f"kvstage decode offload: device-to-host copies are still pending on some TP rank "
                f"(here: {self.manager.copies_in_flight}); refusing to retract"
            )

    def release_host_resources(self) -> None:
        """Shut down: wait for what is in flight, close the manager (its last events published),
        the KV event publisher and the store."""
        self.manager.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()
        for store in self.stores.values():
            store.close()

    # -- helpers ------------------------------------------------------------------------------

    def _retract_freed(self) -> None:
        """Running requests whose slots sglang freed without finishing them: its decode-side
        retraction (``retract_all``: slots and row freed, the same ``Req`` held for
        re-bootstrap). Each is retracted in the manager (``keep_offloaded``: when it runs again
        its pages continue after those stored, as sglang's own manager resumes), which then
        holds it weakly only, so a request sglang drops while held (an abort) is not kept
        alive. sglang drains device-to-host copies before it retracts, so nothing of it copies."""
        for key, req in list(self._running.items()):
            if req.kv.req_pool_idx is not None and req.kv.req_pool_idx != -1:
                continue
            del self._running[key]
            if not self.manager.is_tracked(self._seen(req)):
                continue
            self._retracting.add(key)
            self.manager.retract(self._seen(req), keep_offloaded=True)

    def _seen(self, req: Any) -> Any:
        """``req`` as the manager sees it: itself, or with bigram keys its pair-unit view."""
        return BigramRequest.of(req) if self.bigram_keys else req

    def _on_release(self, req: Any) -> None:
        """The manager's release: a finishing request may go back to sglang; a retracted one's
        slots are sglang's already."""
        req = req.req if isinstance(req, BigramRequest) else req
        if id(req) in self._retracting:
            self._retracting.discard(id(req))
            return
        self._released_here.add(id(req))

    def _slot_indices(self, req: Any) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]

    def _release_to_sglang(self, req: Any) -> None:
        """Give ``req``'s device slots back to sglang, as its own decode manager does at finish."""
        kv = req.kv
        if kv.req_pool_idx is None or kv.req_pool_idx == -1:
            return
        self.tree_cache.free_kv_row(kv, [(kv.cache_protected_len, kv.kv_allocated_len)])
        self.tree_cache.unlock(req.lock)
        req.lock = None
        self.req_to_token_pool.free(req)
        kv.mark_kv_released()


ENABLE_ENV = "KVSTAGE_SGLANG_DECODE_OFFLOAD"


def sglang_plugin() -> None:
    """sglang's general plugin (entry point group ``sglang.srt.plugins``, name
    ``kvstage_decode_offload``, declared in kvstage's ``pyproject.toml``): with
    ``KVSTAGE_SGLANG_DECODE_OFFLOAD=1`` in the environment, replaces sglang's
    ``DecodeKVCacheOffloadManager`` with :class:`KVStageDecodeOffloadManager` through sglang's
    ``HookRegistry`` (a class ``REPLACE``, applied to every module that imported the name).
    sglang runs plugins in every scheduler process (``load_plugins()`` in
    ``run_scheduler_process``), so setting the variable before ``sglang.launch_server`` switches
    every rank; without it the plugin does nothing."""
    import os

    if os.environ.get(ENABLE_ENV) != "1":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.disaggregation.decode_kvcache_offload_manager.DecodeKVCacheOffloadManager",
        KVStageDecodeOffloadManager,
        HookType.REPLACE,
    )
    HookRegistry.register(DRAFT_PLAN_HOOK_TARGET, record_packed_drafts, HookType.AFTER)
