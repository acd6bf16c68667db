"""Host pool sets of sglang 0.5.23's hybrid stack strategies (Mamba, Swa, MambaSwa, Dsa) under a
HybridCacheController with KVStageStorage, random bytes in every pool, and the scheduler's part
of a write-through and a prefetch (the PoolTransfers its UnifiedRadixCache components build)."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_storage_hash_str

from kvstage.integrations.sglang import KVStageStorage

from sglang_rig import (
    DSA_PAGE_SIZE,
    PAGE_SIZE,
    canonical_of,
    dsa_device_pool,
    dsa_host_pool_group,
    hicache_controller,
    host_pool,
    mha_device_pool,
    random_canonical,
    same_bytes,
    set_host,
    token_slots,
)

STRATEGIES = ["mamba", "swa", "mamba_swa", "dsa"]

TIMEOUT = 30
WINDOW = 9  # tokens: kvstage keeps ceil(8/4) = 2 pages, sglang reads ceil(9/4) = 3


def random_bytes_(tensor: torch.Tensor, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    raw = tensor.view(torch.uint8) if tensor.dtype != torch.uint8 else tensor
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def mamba_host(layers: int = 2, slots: int = 8, layout: str = "page_first") -> MambaPoolHost:
    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, 2, 3, 4, dtype=torch.float32),
        conv=(
            torch.zeros(layers, slots, 5, 3, dtype=torch.bfloat16),
            torch.zeros(layers, slots, 7, dtype=torch.bfloat16),
        ),
    )
    return MambaPoolHost(info, 1.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout=layout)


def mamba_slot(host: MambaPoolHost, slot: int) -> list[torch.Tensor]:
    return [host.temporal_buffer[slot].clone(), *(buffer[slot].clone() for buffer in host.conv_buffer)]


def indexer_pages(host, pages: list[int]) -> torch.Tensor:
    """The DSA indexer host pool's ``pages``, ``[page, layer, bytes]`` whatever its layout."""
    buffer = host.index_k_with_scale_buffer
    if host.layout == "layer_first":  # [layer, page, bytes]
        return buffer[:, pages].transpose(0, 1).clone()
    return buffer[pages, :, 0].clone()  # [page, layer, 1, bytes]


class Rig:
    """One controller over a strategy's host pool set (fresh pools) and KVStageStorage on ``url``."""

    def __init__(
        self, strategy: str, url: str, seed: int | None = None, timeout: float = 30, layout: str = "page_first"
    ) -> None:
        """``layout``: the KV, SWA and indexer host pools' (``page_first`` and ``layer_first``
        swap the SWA pool's, to mix them); Mamba's is ``page_first_direct`` with
        ``page_first_direct``, else ``page_first``."""
        self.timeout = timeout
        self.strategy = strategy
        if strategy == "dsa":
            device = dsa_device_pool()
            group = dsa_host_pool_group(device, layout)
            self.kv, self.indexer = group.entry_map[PoolName.KV].host_pool, group.entry_map[PoolName.INDEXER].host_pool
            self.page_size = DSA_PAGE_SIZE
        else:
            device = mha_device_pool()
            self.kv = host_pool(device, layout)
            entries = [PoolEntry(PoolName.KV, self.kv, device, lambda layer: layer, is_primary_index_anchor=True)]
            if "swa" in strategy:
                swa_device = mha_device_pool(head_num=1)
                swap = {"page_first": "layer_first", "layer_first": "page_first"}
                self.swa = host_pool(swa_device, swap.get(layout, layout))
                entries.append(PoolEntry(PoolName.SWA, self.swa, swa_device, lambda layer: layer))
            if "mamba" in strategy:
                self.mamba = mamba_host(layout="page_first_direct" if layout == "page_first_direct" else "page_first")
                entries.append(PoolEntry(PoolName.MAMBA, self.mamba, device, lambda layer: layer))
            group = HostPoolGroup(entries)
            self.page_size = PAGE_SIZE
        extra = {"sliding_window": WINDOW} if "swa" in strategy else {}
        self.cc = hicache_controller(
            device, group, url, cls=HybridCacheController, page_size=self.page_size, extra=extra
        )
        assert isinstance(self.cc.storage_backend, KVStageStorage)
        if seed is not None:
            set_host(self.kv, random_canonical(self.kv, seed))
            for name in ("swa",):
                if hasattr(self, name):
                    set_host(self.swa, random_canonical(self.swa, seed + 1))
            if hasattr(self, "mamba"):
                for index, buffer in enumerate([self.mamba.temporal_buffer, *self.mamba.conv_buffer]):
                    random_bytes_(buffer, seed + 2 + index)
            if hasattr(self, "indexer"):
                random_bytes_(self.indexer.index_k_with_scale_buffer, seed + 9)

    def stop(self) -> None:
        self.cc.detach_storage_backend()

    def hashes(self, key: RadixKey) -> list[str]:
        return get_storage_hash_str(key, page_size=self.page_size)

    def write_through(self, key: RadixKey) -> dict:
        """Back up ``key`` as UnifiedRadixCache does for one node: KV pages, plus the pools'
        transfers (Mamba: the node's state under its last page; SWA: its trailing window pages;
        indexer: every page, on the KV slots). Returns what each pool held there."""
        hashes = self.hashes(key)
        slots = self.kv.alloc(len(key.token_ids))
        held = {"kv": token_slots(self.kv, canonical_of(self.kv), slots)}
        extra = []
        if hasattr(self, "swa"):
            tail = hashes[-3:]
            swa_slots = self.swa.alloc(len(tail) * self.page_size)
            extra.append(PoolTransfer(PoolName.SWA, swa_slots, keys=tail, hit_policy=PoolHitPolicy.TRAILING_PAGES))
            held["swa"] = token_slots(self.swa, canonical_of(self.swa), swa_slots)
        if hasattr(self, "mamba"):
            slot = self.mamba.alloc(1)
            extra.append(PoolTransfer(PoolName.MAMBA, slot, keys=[hashes[-1]], hit_policy=PoolHitPolicy.TRAILING_PAGES))
            held["mamba"] = mamba_slot(self.mamba, int(slot[0]))
        if hasattr(self, "indexer"):
            extra.append(PoolTransfer(PoolName.INDEXER, indices_from_pool=PoolName.KV))
            pages = (slots[:: self.page_size] // self.page_size).tolist()
            held["indexer"] = indexer_pages(self.indexer, pages)
        self.cc.write_storage(slots, key.token_ids, hash_value=hashes, prefix_keys=[], extra_pools=extra)
        ack = self.cc.ack_backup_queue.get(timeout=self.timeout)
        assert ack.completed_tokens == len(key.token_ids)
        return held

    def prefetch(self, key: RadixKey, window_pages: int = 3):
        """The scheduler's prefetch of ``key`` with the pools' load transfers; returns (the hit
        query's restorable pages, tokens prefetched, what each pool holds in the slots read)."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        hashes = self.hashes(key)
        extra = []
        if hasattr(self, "swa"):
            extra.append(
                PoolTransfer(PoolName.SWA, keys=hashes[-window_pages:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
            )
        if hasattr(self, "mamba"):
            extra.append(PoolTransfer(PoolName.MAMBA, keys=[hashes[-1]], hit_policy=PoolHitPolicy.TRAILING_PAGES))
        if hasattr(self, "indexer"):
            extra.append(PoolTransfer(PoolName.INDEXER, indices_from_pool=PoolName.KV))
        self.cc.prefetch(CacheRequestHandle("next-turn", 0), key, prefix_keys=[], extra_pools=extra)
        operation = self.cc.prefetch_hit_queue.get(timeout=self.timeout)
        restorable = list(operation.pool_storage_result.restorable_prefix_pages or [])
        hit_pages = operation.storage_hit_count // self.page_size
        operation.host_indices = self.cc.alloc_prefetch_host_buffers(operation, operation.storage_hit_count)
        for transfer in extra:  # the scheduler's host slots for the pools with their own
            if transfer.name == PoolName.SWA:
                transfer.host_indices = self.swa.alloc(min(window_pages, hit_pages) * self.page_size)
            elif transfer.name == PoolName.MAMBA:
                transfer.host_indices = self.mamba.alloc(1)
        self.cc.prefetch_buffer.put(operation)
        completed, pool_hits = 0, {}
        while True:
            ack = self.cc.ack_prefetch_queue.get(timeout=self.timeout)
            if ack.completed_req:
                break
            if ack.completed_tokens is not None:
                completed = ack.completed_tokens
            pool_hits.update(ack.pool_hits or {})
        self.pool_hits = pool_hits
        got = {"kv": token_slots(self.kv, canonical_of(self.kv), operation.host_indices)}
        for transfer in extra:
            if transfer.name == PoolName.SWA:
                got["swa"] = token_slots(self.swa, canonical_of(self.swa), transfer.host_indices)
            elif transfer.name == PoolName.MAMBA:
                got["mamba"] = mamba_slot(self.mamba, int(transfer.host_indices[0]))
        if hasattr(self, "indexer"):
            pages = (operation.host_indices[:: self.page_size] // self.page_size).tolist()
            got["indexer"] = indexer_pages(self.indexer, pages)
        return restorable, completed, got


def assert_same_pools(got: dict, held: dict) -> None:
    """Every pool's bytes in ``got`` (a prefetch's) equal those ``held`` (the writer's)."""
    assert set(got) == set(held)
    for name in held:
        if name == "mamba":
            assert all(same_bytes(a, b) for a, b in zip(got[name], held[name], strict=True)), name
        else:
            assert same_bytes(got[name], held[name]), name
