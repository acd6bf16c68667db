"""sglang's real device and host pools on CPU, and a storage config, for the adapter tests."""

from __future__ import annotations

import contextlib

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
PAGE_SIZE = 4
LAYERS = 3


def mha_device_pool(
    size: int = 128, dtype=torch.bfloat16, head_num: int = 2, head_dim: int = 8, layer_num: int = LAYERS, **kwargs
) -> MHATokenToKVPool:
    return MHATokenToKVPool(
        size=size,
        page_size=PAGE_SIZE,
        dtype=dtype,
        head_num=head_num,
        head_dim=head_dim,
        layer_num=layer_num,
        device="cpu",
        enable_memory_saver=False,
        **kwargs,
    )


def mla_device_pool(size: int = 128, dtype=torch.bfloat16, layer_num: int = LAYERS) -> MLATokenToKVPool:
    return MLATokenToKVPool(
        size=size,
        page_size=PAGE_SIZE,
        dtype=dtype,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        layer_num=layer_num,
        device="cpu",
        enable_memory_saver=False,
    )


# DeepSeek V3.2's DSA pool: sglang requires 64-token pages (its indexer's physical page).
DSA_PAGE_SIZE = 64


def dsa_device_pool(size: int = 256, dtype=torch.bfloat16):
    """sglang's ``DSATokenToKVPool`` (an ``MLATokenToKVPool`` subclass: the latent plus the
    indexer's fp8 keys and scales per layer), 64-token pages."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    return DSATokenToKVPool(
        size=size,
        page_size=DSA_PAGE_SIZE,
        kv_lora_rank=16,
        dtype=dtype,
        qk_rope_head_dim=8,
        layer_num=LAYERS,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=24,
    )


def dsa_host_pool_group(device_pool, layout: str = "page_first"):
    """sglang's host pool set of a DSA device pool, as its ``_DsaStrategy`` builds it from
    ``host_pool_decls()``: the MLA latent's host pool (the anchor, under ``kv``) and the
    indexer's ``DSAIndexerPoolHost`` (under ``indexer``), pin_memory off."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry

    kv_decl, indexer_decl = device_pool.host_pool_decls()
    assert (kv_decl.pool_name, indexer_decl.pool_name) == (PoolName.KV, PoolName.INDEXER)
    info = device_pool.get_device_pool_infos()[0].buffer_info
    kv_host = MLATokenToKVPoolHost(
        info,
        2.0,
        0,
        device_pool.page_size,
        layout,
        pin_memory=False,
        device_capacity_tokens=device_pool.size,
        start_layer=device_pool.start_layer,
        end_layer=device_pool.end_layer,
        target_layer_num=device_pool.layer_num,
        override_kv_cache_dim=device_pool.kv_cache_dim,
    )
    indexer_host = DSAIndexerPoolHost(indexer_decl, kv_host, pin_memory=False)
    return HostPoolGroup(
        [
            PoolEntry(PoolName.KV, kv_host, device_pool, lambda layer: layer, is_primary_index_anchor=True),
            PoolEntry(PoolName.INDEXER, indexer_host, device_pool, lambda layer: layer),
        ]
    )


def host_pool(device_pool, layout: str, ratio: float = 2.0, drafts: tuple = ()):
    """sglang's host pool for ``device_pool`` (pin_memory off: a CPU torch cannot register memory);
    ``drafts``: one-layer draft device pools packed as its tail layers, as sglang packs an MTP
    draft (``draft_buffer_infos``)."""
    info = device_pool.get_device_pool_infos()[0].buffer_info
    common = dict(
        pin_memory=False,
        device_capacity_tokens=device_pool.size,
        start_layer=device_pool.start_layer,
        end_layer=device_pool.end_layer,
        draft_buffer_infos=tuple(draft.get_device_pool_infos()[0].buffer_info for draft in drafts),
    )
    if isinstance(device_pool, MLATokenToKVPool):
        return MLATokenToKVPoolHost(
            info,
            ratio,
            0,
            PAGE_SIZE,
            layout,
            target_layer_num=device_pool.layer_num,
            override_kv_cache_dim=device_pool.kv_cache_dim,
            **common,
        )
    return MHATokenToKVPoolHost(info, ratio, 0, PAGE_SIZE, layout, **common)


def storage_config(url: str, *, mla: bool = False, tp_rank: int = 0, tp_size: int = 1, **extra) -> HiCacheStorageConfig:
    """The config sglang's controller builds, with the dynamic backend's extra config."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="org/tiny-model",
        extra_config={
            "backend_name": "kvstage",
            "module_path": "kvstage.integrations.sglang",
            "class_name": "KVStageStorage",
            "interface_v1": 1,
            "url": url,
            **extra,
        },
    )


def kvstage_backend(url: str, host, **config):
    """A KVStageStorage built by sglang's storage factory and registered as its controller does."""
    mla = hasattr(host, "kv_cache_dim")
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(url, mla=mla, **config), host)
    backend.register_mem_pool_host(host)
    return backend


def write_through(cc, host, key: RadixKey, slots: torch.Tensor | None = None, timeout: float = 30) -> torch.Tensor:
    """Store the pages of ``key`` from ``host`` slots (fresh ones when ``slots`` is None) on
    sglang's backup thread, as its cache's write-through does; waits for the ack, checks every
    position of ``key`` was stored (a bigram key's last token only pairs with the one before
    it), and returns the slots."""
    if slots is None:
        slots = host.alloc(len(key))
    cc.write_storage(slots, key.token_ids, hash_value=get_storage_hash_str(key, page_size=host.page_size))
    assert cc.ack_backup_queue.get(timeout=timeout).completed_tokens == len(key)
    return slots


def prefetch(cc, key: RadixKey, rid: str = "next-turn", timeout: float = 30) -> tuple[int, torch.Tensor]:
    """sglang's prefetch of ``key`` as its scheduler drives it: the hit query, host slots for the
    hit, the I/O thread's reads; waits for the last ack. Returns (tokens prefetched, the slots).
    A ``HybridCacheController`` takes a ``CacheRequestHandle`` where the other takes the rid."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    cc.prefetch(CacheRequestHandle(rid, 0) if isinstance(cc, HybridCacheController) else rid, key)
    operation = cc.prefetch_hit_queue.get(timeout=timeout)
    operation.host_indices = cc.alloc_prefetch_host_buffers(operation, operation.storage_hit_count)
    cc.prefetch_buffer.put(operation)
    completed = 0
    while True:
        ack = cc.ack_prefetch_queue.get(timeout=timeout)
        if ack.completed_req:
            return completed, operation.host_indices
        completed = ack.completed_tokens


def page_tokens(host, starts: list[int]) -> torch.Tensor:
    """Host slot indices of the pages starting at ``starts`` (``page_size`` slots each)."""
    return torch.cat([torch.arange(start, start + host.page_size) for start in starts])


# Where token t of layer l (K or V part k, head h) lives in each host layout: the dims sglang's
# init_kv_buffer allocates (pool_host/mha.py, pool_host/mla.py), written from the whole-buffer
# side, independently of the adapter's per-page views. canonical: MHA [2, L, S, H, D], MLA [L, S, D].
def host_buffer_of(layout: str, canonical: torch.Tensor, mla: bool) -> torch.Tensor:
    if mla:
        L, S, D = canonical.shape
        P = S // PAGE_SIZE
        return {
            "layer_first": lambda: canonical.unsqueeze(2),
            "page_first": lambda: canonical.permute(1, 0, 2).unsqueeze(2),
            "page_first_direct": lambda: canonical.view(L, P, PAGE_SIZE, D).permute(1, 0, 2, 3).unsqueeze(3),
        }[layout]()
    _, L, S, H, D = canonical.shape
    P = S // PAGE_SIZE
    return {
        "layer_first": lambda: canonical,
        "page_first": lambda: canonical.permute(0, 2, 1, 3, 4),
        "page_first_direct": lambda: canonical.view(2, L, P, PAGE_SIZE, H, D).permute(0, 2, 1, 3, 4, 5),
        "page_head": lambda: canonical.view(2, L, P, PAGE_SIZE, H, D).permute(0, 2, 4, 3, 1, 5),
    }[layout]()


def canonical_shape(host) -> tuple[int, ...]:
    if hasattr(host, "kv_cache_dim"):
        return (host.layer_num, host.size, host.kv_cache_dim)
    return (2, host.layer_num, host.size, host.head_num, host.head_dim)


def random_canonical(host, seed: int) -> torch.Tensor:
    """Random bit patterns (any dtype) in the canonical order of ``host``."""
    generator = torch.Generator().manual_seed(seed)
    shape = canonical_shape(host)
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * host.dtype.itemsize), dtype=torch.uint8, generator=generator)
    return raw.view(host.dtype)


def set_host(host, canonical: torch.Tensor) -> None:
    host.kv_buffer.copy_(host_buffer_of(host.layout, canonical, hasattr(host, "kv_cache_dim")))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def canonical_of(host) -> torch.Tensor:
    """The host pool's content in canonical order (the inverse of ``host_buffer_of``, found by
    laying out element positions)."""
    shape = canonical_shape(host)
    positions = torch.arange(torch.Size(shape).numel()).view(shape)
    where = host_buffer_of(host.layout, positions, hasattr(host, "kv_cache_dim")).reshape(-1)
    flat = torch.empty(len(where), dtype=host.dtype)
    flat[where] = host.kv_buffer.reshape(-1)
    return flat.view(shape)


def token_slots(host, canonical: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The canonical content of host slots ``indices`` (token axis selected)."""
    return canonical.index_select(1 if hasattr(host, "kv_cache_dim") else 2, indices)


def extra_config(url: str, **extra) -> dict:
    return {
        **extra,
        "backend_name": "kvstage",
        "module_path": "kvstage.integrations.sglang",
        "class_name": "KVStageStorage",
        "interface_v1": 1,
        "url": url,
    }


def watch_opened_stores(monkeypatch) -> tuple[list, list]:
    """Record every store the sglang adapter opens (``ExtraConfig.open_store``) and every one closed:
    the two lists, filled as it happens."""
    from kvstage.integrations.sglang.key_space import ExtraConfig

    opened, closed = [], []
    real_open = ExtraConfig.open_store

    def open_and_watch(self, fingerprint):
        store = real_open(self, fingerprint)
        real_close = store.close
        store.close = lambda: (closed.append(store), real_close())[-1]
        opened.append(store)
        return store

    monkeypatch.setattr(ExtraConfig, "open_store", open_and_watch)
    return opened, closed


def hicache_controller(device_pool, pool, url: str, *, cls=None, page_size: int = PAGE_SIZE, extra: dict | None = None):
    """sglang's ``HiCacheController`` (or ``cls``, e.g. ``HybridCacheController``) over ``pool`` (a
    host pool of ``device_pool``, or a ``HostPoolGroup``) with KVStageStorage on ``url``, on the
    default process group (one rank); ``extra``: more keys of the extra config."""
    import threading

    import torch.distributed as dist
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    allocator = PagedTokenToKVPoolAllocator(
        device_pool.size, page_size, device_pool.dtype, "cpu", device_pool, need_sort=False
    )
    return (HiCacheController if cls is None else cls)(
        allocator,
        pool,
        page_size,
        dist.group.WORLD,
        threading.Event(),
        io_backend="direct",
        storage_backend="dynamic",
        model_name="org/tiny-model",
        storage_backend_extra_config=extra_config(url, **(extra or {})),
    )


@contextlib.contextmanager
def one_rank_gloo_world(directory):
    """A one-process gloo world (a file rendezvous in ``directory``: no socket), this rank's
    place in it stated to sglang; yields the world group and destroys it after."""
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(
        tp_rank=0, pp_rank=0, attn_tp_rank=0, attn_dp_rank=0, attn_cp_rank=0, attn_dcp_rank=0
    )
    dist.init_process_group("gloo", init_method=f"file://{directory / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
