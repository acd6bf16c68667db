"""sglang 0.5.23's HybridCacheController with KVStageStorage serving its v2 calls for the pool
sets of sglang's Mamba, Swa, MambaSwa and Dsa stack strategies (hybrid_pool_assembler's
``_STRATEGIES``): one controller writes a request's pages through (KV by the v1 calls, the
other pools by ``batch_set_v2``), a fresh controller over fresh host pools and another store
client prefetches them (``batch_exists_v2``, then v1 and ``batch_get_v2`` reads), and every
byte of every pool arrives as written. The scheduler's part (host slots for a hit, the
PoolTransfers its UnifiedRadixCache components build) is played by the test."""

from __future__ import annotations

from array import array

import pytest
import torch
import torch.distributed as dist
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

from kvstage.errors import InvalidArgumentError
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
    watch_opened_stores,
)

TIMEOUT = 30
WINDOW = 9  # tokens: kvstage keeps ceil(8/4) = 2 pages, sglang reads ceil(9/4) = 3


@pytest.fixture(scope="module", autouse=True)
def one_rank_world(tmp_path_factory):
    get_parallel().override_permanently(
        tp_rank=0, pp_rank=0, attn_tp_rank=0, attn_dp_rank=0, attn_cp_rank=0, attn_dcp_rank=0
    )
    init = tmp_path_factory.mktemp("gloo") / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def random_bytes_(tensor: torch.Tensor, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    raw = tensor.view(torch.uint8) if tensor.dtype != torch.uint8 else tensor
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def mamba_host(layers: int = 2, slots: int = 8) -> MambaPoolHost:
    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, 2, 3, 4, dtype=torch.float32),
        conv=(
            torch.zeros(layers, slots, 5, 3, dtype=torch.bfloat16),
            torch.zeros(layers, slots, 7, dtype=torch.bfloat16),
        ),
    )
    return MambaPoolHost(info, 1.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first")


def mamba_slot(host: MambaPoolHost, slot: int) -> list[torch.Tensor]:
    return [host.temporal_buffer[slot].clone(), *(buffer[slot].clone() for buffer in host.conv_buffer)]


class Rig:
    """One controller over a strategy's host pool set (fresh pools) and KVStageStorage on ``url``."""

    def __init__(self, strategy: str, url: str, seed: int | None = None) -> None:
        self.strategy = strategy
        if strategy == "dsa":
            device = dsa_device_pool()
            group = dsa_host_pool_group(device)
            self.kv, self.indexer = group.entry_map[PoolName.KV].host_pool, group.entry_map[PoolName.INDEXER].host_pool
            self.page_size = DSA_PAGE_SIZE
        else:
            device = mha_device_pool()
            self.kv = host_pool(device, "page_first")
            entries = [PoolEntry(PoolName.KV, self.kv, device, lambda layer: layer, is_primary_index_anchor=True)]
            if "swa" in strategy:
                swa_device = mha_device_pool(head_num=1)
                self.swa = host_pool(swa_device, "layer_first")
                entries.append(PoolEntry(PoolName.SWA, self.swa, swa_device, lambda layer: layer))
            if "mamba" in strategy:
                self.mamba = mamba_host()
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
            held["indexer"] = self.indexer.index_k_with_scale_buffer[pages].clone()
        self.cc.write_storage(slots, key.token_ids, hash_value=hashes, prefix_keys=[], extra_pools=extra)
        ack = self.cc.ack_backup_queue.get(timeout=TIMEOUT)
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
        self.cc.prefetch(CacheRequestHandle("next-turn", 0), key.token_ids, prefix_keys=[], extra_pools=extra)
        operation = self.cc.prefetch_hit_queue.get(timeout=TIMEOUT)
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
            ack = self.cc.ack_prefetch_queue.get(timeout=TIMEOUT)
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
            got["indexer"] = self.indexer.index_k_with_scale_buffer[pages].clone()
        return restorable, completed, got


STRATEGIES = ["mamba", "swa", "mamba_swa", "dsa"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_pool_written_by_one_controller_is_prefetched_byte_exact_by_a_fresh_one(tmp_path, strategy):
    url = f"file:{tmp_path}"
    pages = 2 if strategy == "dsa" else 5
    writer = Rig(strategy, url, seed=11)
    try:
        key = RadixKey(array("q", range(50, 50 + pages * writer.page_size)))
        held = writer.write_through(key)
    finally:
        writer.stop()
    reader = Rig(strategy, url)
    try:
        restorable, tokens, got = reader.prefetch(key)
        assert tokens == len(key.token_ids)
        # the node's end alone has a Mamba snapshot, and the 3 SWA pages sglang reads (its last 3)
        assert restorable == ([1, 2] if strategy == "dsa" else [pages])
        assert set(got) == set(held)
        for name in held:
            if name == "mamba":
                assert all(same_bytes(a, b) for a, b in zip(got[name], held[name], strict=True))
            else:
                assert same_bytes(got[name], held[name]), name
    finally:
        reader.stop()


def test_a_length_without_its_mamba_snapshot_is_not_restorable(tmp_path):
    """The writer's node ends at 5 pages; a request of 4 pages finds KV but no snapshot at 4."""
    url = f"file:{tmp_path}"
    writer = Rig("mamba", url, seed=3)
    try:
        writer.write_through(RadixKey(array("q", range(5 * PAGE_SIZE))))
        result = writer.cc.storage_backend.batch_exists_v2(
            writer.hashes(RadixKey(array("q", range(4 * PAGE_SIZE)))),
            [PoolTransfer(PoolName.MAMBA, keys=["x"], hit_policy=PoolHitPolicy.TRAILING_PAGES)],
        )
        assert (result.kv_hit_pages, result.restorable_prefix_pages) == (0, [])
        assert result.extra_pool_hit_pages == {"kv": 4}
    finally:
        writer.stop()


def test_swa_lengths_follow_kvstages_window_and_the_pages_sglang_reads(tmp_path):
    """Pages 2..4 of 5 hold SWA entries. kvstage's window for W=9, P=4 is ceil(8/4) = 2 pages, so
    lengths 4 and 5 pages are restorable where sglang reads the 2 trailing pages; where it reads
    3 (ceil(9/4), what its SWA component asks), length 4 would need page 1: only 5 is."""
    rig = Rig("swa", f"file:{tmp_path}", seed=4)
    try:
        key = RadixKey(array("q", range(5 * PAGE_SIZE)))
        rig.write_through(key)
        hashes = rig.hashes(key)
        backend = rig.cc.storage_backend
        for trailing, expected in ((2, [4, 5]), (3, [5])):
            swa = PoolTransfer(PoolName.SWA, keys=hashes[-trailing:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
            result = backend.batch_exists_v2(hashes, [swa])
            assert (result.restorable_prefix_pages, result.kv_hit_pages) == (expected, expected[-1])
            assert result.extra_pool_hit_pages == {"kv": 5, "swa": 5}
    finally:
        rig.stop()


def test_each_pool_has_its_own_key_space_covering_the_whole_layout(tmp_path):
    rig = Rig("mamba_swa", f"file:{tmp_path}")
    try:
        backend = rig.cc.storage_backend
        stores = backend.hybrid.stores
        assert sorted(stores) == ["kv", "mamba", "swa"]
        assert backend.store is stores["kv"]
        prefixes = {name: store.prefix for name, store in stores.items()}
        assert all(f"@{name}-" in prefix for name, prefix in prefixes.items())
        assert len(set(prefixes.values())) == 3
        assert f"W{WINDOW}" in stores["swa"].fingerprint.page_format
    finally:
        rig.stop()
    other = Rig("mamba", f"file:{tmp_path}")  # another layout: no key space in common
    try:
        assert other.cc.storage_backend.hybrid.stores["kv"].prefix != prefixes["kv"]
    finally:
        other.stop()


def test_an_swa_pool_without_the_window_is_refused_at_registration(monkeypatch):
    opened, closed = watch_opened_stores(monkeypatch)
    device = mha_device_pool()
    kv = host_pool(device, "page_first")
    swa_device = mha_device_pool(head_num=1)
    group = HostPoolGroup(
        [
            PoolEntry(PoolName.KV, kv, device, lambda layer: layer, is_primary_index_anchor=True),
            PoolEntry(PoolName.SWA, host_pool(swa_device, "page_first"), swa_device, lambda layer: layer),
        ]
    )
    with pytest.raises(InvalidArgumentError, match=r"extra_config.sliding_window: required with an 'swa' host pool"):
        hicache_controller(device, group, "memory", cls=HybridCacheController)
    assert closed == opened


def test_a_draft_pool_is_refused_at_registration_naming_its_name_kind_and_class(monkeypatch):
    opened, closed = watch_opened_stores(monkeypatch)
    device = mha_device_pool()
    kv = host_pool(device, "page_first")
    draft_device = mha_device_pool()
    group = HostPoolGroup(
        [
            PoolEntry(PoolName.KV, kv, device, lambda layer: layer, is_primary_index_anchor=True),
            PoolEntry(PoolName.DRAFT, host_pool(draft_device, "page_first"), draft_device, lambda layer: layer),
        ]
    )
    with pytest.raises(
        InvalidArgumentError, match=r"host pool 'draft': a draft model KV pool \(MHATokenToKVPoolHost\)"
    ):
        hicache_controller(device, group, "memory", cls=HybridCacheController)
    assert len(opened) == 1 and closed == opened


def test_a_v2_call_for_an_unregistered_pool_or_bad_slots_raises_before_anything_is_written(tmp_path):
    rig = Rig("mamba", f"file:{tmp_path}", seed=5)
    try:
        backend = rig.cc.storage_backend
        with pytest.raises(InvalidArgumentError, match=r"pool 'swa' is not registered"):
            backend.batch_set_v2([PoolTransfer(PoolName.SWA, torch.arange(4), keys=["a"])])
        with pytest.raises(InvalidArgumentError, match=r"2 slots for 1 keys of pool 'mamba'"):
            backend.batch_set_v2(
                [PoolTransfer(PoolName.MAMBA, torch.arange(2), keys=["a"], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
            )
        with pytest.raises(InvalidArgumentError, match=r"hit policy"):
            backend.batch_exists_v2(["a"], [PoolTransfer(PoolName.MAMBA, keys=["a"])])
        assert backend.hybrid.stores["mamba"].exists(["a"]) == [False]
    finally:
        rig.stop()
