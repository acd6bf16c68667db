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
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
from sglang.srt.mem_cache.radix_cache import RadixKey

from kvstage.errors import InvalidArgumentError

from sglang_hybrid_rig import STRATEGIES, WINDOW, Rig, assert_same_pools, mamba_slot
from sglang_rig import (
    PAGE_SIZE,
    canonical_of,
    dsa_device_pool,
    dsa_host_pool_group,
    hicache_controller,
    host_pool,
    mha_device_pool,
    one_rank_gloo_world,
    same_bytes,
    token_slots,
    watch_opened_stores,
)


@pytest.fixture(scope="module", autouse=True)
def one_rank_world(tmp_path_factory):
    with one_rank_gloo_world(tmp_path_factory.mktemp("gloo")) as world:
        yield world


# sglang_rig's canonical views of page_first_direct assume its 4-token pages, not DSA's 64
LAYOUT_PAIRS = [("page_first", "layer_first"), ("page_first_direct", "page_first")]
CASES = [(s, w, r) for s in STRATEGIES for w, r in LAYOUT_PAIRS if s != "dsa" or "page_first_direct" not in (w, r)]
CASES.append(("dsa", "layer_first", "page_first"))


@pytest.mark.parametrize("strategy,written,read", CASES)
def test_every_pool_written_by_one_controller_is_prefetched_byte_exact_by_a_fresh_one(
    tmp_path, strategy, written, read
):
    """The reader's host pools have other layouts than the writer's: entries are in kvstage's order."""
    url = f"file:{tmp_path}"
    pages = 2 if strategy == "dsa" else 5
    writer = Rig(strategy, url, seed=11, layout=written)
    try:
        key = RadixKey(array("q", range(50, 50 + pages * writer.page_size)), extra_key="lora-7", cache_salt="t")
        held = writer.write_through(key)
    finally:
        writer.stop()
    reader = Rig(strategy, url, layout=read)
    try:
        restorable, tokens, got = reader.prefetch(key)
        assert tokens == len(key.token_ids)
        # the node's end alone has a Mamba snapshot, and the 3 SWA pages sglang reads (its last 3)
        assert restorable == ([1, 2] if strategy == "dsa" else [pages])
        assert_same_pools(got, held)
        # what sglang counted per sidecar pool read (count_pool_hits of its batch_get_v2; the
        # indexer's reads clamp the KV batches' completed tokens instead, checked above)
        expected_hits = {"mamba": {"mamba": 1}, "swa": {"swa": 3}, "mamba_swa": {"mamba": 1, "swa": 3}, "dsa": {}}
        assert {name: hits for name, hits in reader.pool_hits.items() if hits} == expected_hits[strategy]
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


def test_a_hybrid_pool_beside_tp_lcm_size_head_groups_is_refused_at_registration(monkeypatch):
    """Head groups key the KV pool per head group, a hybrid pool set per rank: not both at once."""
    opened, closed = watch_opened_stores(monkeypatch)
    device = mha_device_pool()
    swa_device = mha_device_pool(head_num=1)
    group = HostPoolGroup(
        [
            PoolEntry(
                PoolName.KV, host_pool(device, "page_first"), device, lambda layer: layer, is_primary_index_anchor=True
            ),
            PoolEntry(PoolName.SWA, host_pool(swa_device, "page_first"), swa_device, lambda layer: layer),
        ]
    )
    with pytest.raises(InvalidArgumentError, match=r"host pool 'swa': storage_config.tp_lcm_size"):
        hicache_controller(
            device, group, "memory", cls=HybridCacheController, extra={"tp_lcm_size": 2, "sliding_window": WINDOW}
        )
    assert len(opened) == 1 and closed == opened


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


def test_a_miss_leaves_the_pools_host_slots_untouched_and_a_late_pool_is_refused(tmp_path):
    rig = Rig("mamba_swa", f"file:{tmp_path}", seed=6)
    try:
        backend = rig.cc.storage_backend
        before = mamba_slot(rig.mamba, 3)
        swa_before = rig.swa.kv_buffer.clone()
        results = backend.batch_get_v2(
            [
                PoolTransfer(
                    PoolName.MAMBA, torch.tensor([3]), keys=["nowhere"], hit_policy=PoolHitPolicy.TRAILING_PAGES
                ),
                PoolTransfer(PoolName.SWA, torch.arange(8), keys=["a", "b"], hit_policy=PoolHitPolicy.TRAILING_PAGES),
            ]
        )
        assert results == {"mamba": [False], "swa": [False, False]}
        assert all(same_bytes(a, b) for a, b in zip(mamba_slot(rig.mamba, 3), before, strict=True))
        assert same_bytes(rig.swa.kv_buffer, swa_before)
        with pytest.raises(
            InvalidArgumentError, match=r"host pool 'indexer': registered after the pool set was complete"
        ):
            backend.register_mem_host_pool_v2(
                dsa_host_pool_group(dsa_device_pool()).get_pool(PoolName.INDEXER), PoolName.INDEXER
            )
        assert backend.store is None and backend.hybrid is None  # closed: the set cannot be stored whole
    finally:
        rig.stop()


def test_a_mamba_snapshot_round_trips_through_the_v2_calls_alone(tmp_path):
    """batch_set_v2 / batch_get_v2 of one Mamba slot: every layer's conv and temporal tensors."""
    writer = Rig("mamba", f"file:{tmp_path}", seed=8)
    reader = Rig("mamba", f"file:{tmp_path}")
    try:
        transfer = dict(keys=["h3"], hit_policy=PoolHitPolicy.TRAILING_PAGES)
        source = mamba_slot(writer.mamba, 5)
        assert any(bool(tensor.view(torch.uint8).any()) for tensor in source)
        assert writer.cc.storage_backend.batch_set_v2(
            [PoolTransfer(PoolName.MAMBA, torch.tensor([5]), **transfer)]
        ) == {"mamba": [True]}
        got = reader.cc.storage_backend.batch_get_v2([PoolTransfer(PoolName.MAMBA, torch.tensor([2]), **transfer)])
        assert got == {"mamba": [True]}
        assert all(same_bytes(a, b) for a, b in zip(mamba_slot(reader.mamba, 2), source, strict=True))
    finally:
        writer.stop()
        reader.stop()


def test_swa_pages_round_trip_through_the_v2_calls_across_staging_chunks(tmp_path):
    """11 SWA pages in one call (more than the 8 a call stages at once), read into other slots of
    another layout by a fresh backend."""
    writer = Rig("swa", f"file:{tmp_path}", seed=12)
    reader = Rig("swa", f"file:{tmp_path}", layout="layer_first")
    try:
        keys = [f"page-{index}" for index in range(11)]
        written = writer.swa.alloc(len(keys) * PAGE_SIZE)
        transfer = dict(keys=keys, hit_policy=PoolHitPolicy.TRAILING_PAGES)
        stored = writer.cc.storage_backend.batch_set_v2([PoolTransfer(PoolName.SWA, written, **transfer)])
        assert stored == {"swa": [True] * 11}
        read = reader.swa.alloc(len(keys) * PAGE_SIZE)[PAGE_SIZE:]  # not the writer's slots
        read = torch.cat([read, reader.swa.alloc(PAGE_SIZE)])
        got = reader.cc.storage_backend.batch_get_v2([PoolTransfer(PoolName.SWA, read, **transfer)])
        assert got == {"swa": [True] * 11}
        assert same_bytes(
            token_slots(reader.swa, canonical_of(reader.swa), read),
            token_slots(writer.swa, canonical_of(writer.swa), written),
        )
    finally:
        writer.stop()
        reader.stop()


def test_an_indexer_page_missing_cuts_the_restorable_prefix_before_it(tmp_path):
    """DSA (ALL_PAGES): KV pages 0..2 stored, indexer pages 0 and 2 only: only 1 page restores."""
    rig = Rig("dsa", f"file:{tmp_path}", seed=13)
    try:
        backend, size = rig.cc.storage_backend, rig.page_size
        keys = ["d0", "d1", "d2"]
        slots = rig.kv.alloc(3 * size)
        assert backend.batch_set_v1(keys, slots) == [True] * 3
        for index in (0, 2):
            page = slots[index * size : (index + 1) * size]
            assert backend.batch_set_v2([PoolTransfer(PoolName.INDEXER, page, keys=[keys[index]])]) == {
                "indexer": [True]
            }
        result = backend.batch_exists_v2(keys, [PoolTransfer(PoolName.INDEXER, indices_from_pool=PoolName.KV)])
        assert (result.kv_hit_pages, result.restorable_prefix_pages) == (1, [1])
        assert result.extra_pool_hit_pages == {"kv": 3, "indexer": 1}
    finally:
        rig.stop()
