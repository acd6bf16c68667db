"""sglang 0.5.23's own HiCacheController and HybridCacheController, with KVStageStorage loaded
as their ``dynamic`` L3 backend (``interface_v1``): write-through to the store on sglang's
backup thread, then a prefetch on its prefetch threads, the scheduler's part played by the
test (take the hit, allocate host slots, hand the operation to the I/O thread)."""

from __future__ import annotations

from array import array

import pytest
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
from sglang.srt.mem_cache.radix_cache import RadixKey

from kvstage.hashing import PageHasher
from kvstage.integrations.sglang import KVStageStorage

from sglang_rig import (
    DSA_PAGE_SIZE,
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    PAGE_SIZE,
    canonical_of,
    dsa_device_pool,
    dsa_host_pool_group,
    hicache_controller,
    host_pool,
    mha_device_pool,
    mla_device_pool,
    one_rank_gloo_world,
    prefetch,
    random_canonical,
    same_bytes,
    set_host,
    token_slots,
    watch_opened_stores,
    write_through,
)

KINDS = [("mha", layout) for layout in MHA_LAYOUTS] + [("mla", layout) for layout in MLA_LAYOUTS]
TIMEOUT = 30


@pytest.fixture(scope="module", autouse=True)
def one_rank_world(tmp_path_factory):
    """A one-process gloo world (a file rendezvous: no socket) and this rank's place in it."""
    with one_rank_gloo_world(tmp_path_factory.mktemp("gloo")) as world:
        yield world


def controller(kind: str, layout: str, url: str, hybrid: bool):
    device = mha_device_pool() if kind == "mha" else mla_device_pool()
    host = host_pool(device, layout)
    pool = host
    cls = HiCacheController
    if hybrid:
        pool = HostPoolGroup([PoolEntry(PoolName.KV, host, device, lambda layer: layer, is_primary_index_anchor=True)])
        cls = HybridCacheController
    cc = hicache_controller(device, pool, url, cls=cls)
    assert isinstance(cc.storage_backend, KVStageStorage)
    assert cc.page_set_func.__name__ == "_page_set_zero_copy"  # sglang chose the v1 calls
    return cc, host


def stop(cc) -> None:
    cc.detach_storage_backend()


@pytest.mark.parametrize("hybrid", [False, True], ids=["HiCacheController", "HybridCacheController"])
@pytest.mark.parametrize("kind,layout", KINDS)
def test_write_through_then_prefetch_through_sglangs_controller_moves_every_byte(kind, layout, hybrid):
    cc, host = controller(kind, layout, "memory", hybrid)
    try:
        set_host(host, random_canonical(host, seed=1))
        key = RadixKey(array("q", range(100, 100 + 5 * PAGE_SIZE)), extra_key="lora-7", cache_salt="tenant-a")
        written = write_through(cc, host, key)
        source = token_slots(host, canonical_of(host), written)
        host.kv_buffer.zero_()
        tokens, read = prefetch(cc, key)
        assert tokens == len(key.token_ids)
        assert same_bytes(token_slots(host, canonical_of(host), read), source)
        kvstage_keys = PageHasher(page_size=PAGE_SIZE).prefill_keys(
            list(key.token_ids), extra_key="lora-7", cache_salt="tenant-a"
        )
        assert cc.storage_backend.store.exists(kvstage_keys) == [True] * 5
    finally:
        stop(cc)


@pytest.mark.parametrize(
    "kind,written,read",
    [
        ("mha", "page_first", "layer_first"),
        ("mha", "page_head", "page_first_direct"),
        ("mla", "page_first_direct", "page_first"),
    ],
)
def test_the_next_turn_prefetches_through_another_host_layout_from_a_shared_file_store(tmp_path, kind, written, read):
    url = f"file:{tmp_path}"
    writer, writer_host = controller(kind, written, url, hybrid=False)
    try:
        set_host(writer_host, random_canonical(writer_host, seed=2))
        first_turn = RadixKey(array("q", range(7, 7 + 3 * PAGE_SIZE)))
        slots = write_through(writer, writer_host, first_turn)
        source = token_slots(writer_host, canonical_of(writer_host), slots)
    finally:
        stop(writer)
    reader, reader_host = controller(kind, read, url, hybrid=True)
    try:
        next_turn = RadixKey(array("q", list(first_turn.token_ids) + [1, 2, 3, 4, 5]))  # one page more, unseen
        tokens, got = prefetch(reader, next_turn)
        assert tokens == 3 * PAGE_SIZE
        assert same_bytes(token_slots(reader_host, canonical_of(reader_host), got), source)
    finally:
        stop(reader)


def test_flush_clears_what_the_controller_stored(tmp_path):
    cc, host = controller("mha", "page_first", f"file:{tmp_path}", hybrid=False)
    try:
        set_host(host, random_canonical(host, seed=3))
        key = RadixKey(array("q", range(2 * PAGE_SIZE)))
        write_through(cc, host, key)
        cc.storage_backend.clear()
        tokens, _ = prefetch(cc, key)
        assert tokens == 0
    finally:
        stop(cc)


def test_deepseek_v32s_dsa_pool_set_gets_a_key_space_per_pool_when_sglangs_hybrid_controller_registers_it(
    monkeypatch,
):
    """sglang's DSA stack (its _DsaStrategy): the MLA latent's host pool as the anchor and the
    indexer's host pool beside it. Once both are registered, the store the anchor's registration
    opened (the plain model's key space) is closed and one store per pool is opened in the
    hybrid layout's key spaces (the pages themselves: test_sglang_hybrid_v2.py)."""
    opened, closed = watch_opened_stores(monkeypatch)
    device = dsa_device_pool()
    group = dsa_host_pool_group(device)
    cc = hicache_controller(device, group, "memory", cls=HybridCacheController, page_size=DSA_PAGE_SIZE)
    try:
        backend = cc.storage_backend
        assert len(opened) == 3 and closed == opened[:1]
        assert backend.hybrid.stores == {"kv": opened[1], "indexer": opened[2]} and backend.store is opened[1]
    finally:
        stop(cc)
    assert len(closed) == 3 and {id(store) for store in closed} == {id(store) for store in opened}
