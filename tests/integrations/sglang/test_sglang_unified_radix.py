"""sglang 0.5.23's own ``UnifiedRadixCache`` on CPU with KVStageStorage as its L3 backend
(``hicache_storage_backend="dynamic"``), for each stack strategy of
``hybrid_pool_assembler._STRATEGIES`` kvstage stores (``_MambaStrategy``, ``_SwaStrategy``,
``_MambaSwaStrategy``, ``_DsaStrategy``, and the catch-all ``_PlainKvStrategy``):
``init_hicache`` builds the strategy's host pool set and ``HybridCacheController``, which opens
kvstage's store on every pool. Then a request's round trip: one server's cache inserts it, backs
the nodes up to host memory (write_through) and, on the ack, to the store
(``write_backup_storage``); a fresh server's cache and controller over fresh pools prefetch it
(``prefetch_from_storage``, ``check_prefetch_progress``) into its host tree, and every pool's
pages arrive with the bytes written: KV, the SWA window, the Mamba state, the DSA indexer.
The scheduler's part (device slots, the calls, the polls) is played by the test; see
unified_radix_rig for what stands in for CUDA on CPU. sglang's two other strategies build pools
kvstage does not store, refused at ``init_hicache`` before anything is stored:
``_MiniMaxSparseStrategy``'s index-key pool, ``_DeepSeekV4Strategy``'s anchor pool."""

from __future__ import annotations

from array import array

import pytest
import torch
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_storage_hash_str

from kvstage.errors import InvalidArgumentError
from kvstage.integrations.sglang import KVStageStorage

from sglang_rig import one_rank_gloo_world, same_bytes, watch_opened_stores
from unified_radix_rig import REFUSED, STRATEGIES, UnifiedRig, cpu_hicache

# what each strategy's cache stores beside the KV pages, and the pages of it a prefetch reads
# (5 pages; DSA's are 64 tokens, 2 of them): the SWA window's trailing ceil(9/4) = 3 pages,
# the Mamba state at the node's last page, the indexer's every page
SIDECARS = {
    "mamba": {"mamba": [4]},
    "swa": {"swa": [2, 3, 4]},
    "mamba_swa": {"swa": [2, 3, 4], "mamba": [4]},
    "dsa": {"indexer": [0, 1]},
    "plain_kv": {},
}


@pytest.fixture(scope="module", autouse=True)
def one_rank_world(tmp_path_factory):
    with one_rank_gloo_world(tmp_path_factory.mktemp("gloo")) as world:
        yield world


@pytest.fixture
def cpu(monkeypatch):
    with cpu_hicache(monkeypatch):
        yield


def merged(writes: list[dict]) -> dict[str, dict]:
    pools: dict[str, dict] = {}
    for write in writes:
        for name, pages in write.items():
            pools.setdefault(name, {}).update(pages)
    return pools


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_init_hicache_opens_kvstage_on_every_pool_of_the_strategys_host_pool_set(tmp_path, cpu, strategy):
    rig = UnifiedRig(strategy, f"file:{tmp_path}", seed=1)
    try:
        controller = rig.cache.cache_controller
        assert (
            type(hybrid_pool_assembler._select_strategy(rig.kv, set(rig.cache.components))).__name__
            == (STRATEGIES[strategy])
        )
        assert isinstance(controller, HybridCacheController)
        backend = controller.storage_backend
        assert isinstance(backend, KVStageStorage)
        pools = ["kv", *sorted(SIDECARS[strategy])]
        assert sorted(name.value for name in rig.cache.host_pool_group.entry_map) == sorted(pools)
        if strategy == "plain_kv":  # the KV pool alone: kvstage's one store, no hybrid pool set
            assert backend.hybrid is None and backend.store is not None
            return
        assert sorted(backend.hybrid.stores) == sorted(pools)
        assert backend.store is backend.hybrid.stores["kv"]
        assert all(backend.hybrid.pools[name] is rig.host_pool(name) for name in pools)
    finally:
        rig.stop()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_fresh_unified_radix_cache_prefetches_every_pool_another_one_wrote_back(tmp_path, cpu, strategy):
    url = f"file:{tmp_path / 'pages'}"
    writer = UnifiedRig(strategy, url, seed=3)
    try:
        pages = 2 if strategy == "dsa" else 5
        key = RadixKey(array("q", range(300, 300 + pages * writer.page_size)), extra_key="lora-1", cache_salt="s")
        slots = writer.insert_and_write_through(key)
        held = merged(writer.stored)
        hashes = get_storage_hash_str(key, page_size=writer.page_size)
    finally:
        writer.stop()
    assert len(hashes) == pages and list(held["kv"]) == hashes
    # what went to the store is what the device held (the KV and SWA layers' bytes)
    assert all(same_bytes(held["kv"][h], page) for h, page in zip(hashes, writer.device_pages(slots), strict=True))
    if "swa" in held:
        device = writer.device_pages(slots, swa=True)
        assert all(same_bytes(held["swa"][hashes[i]], device[i]) for i in SIDECARS[strategy]["swa"])
    reader = UnifiedRig(strategy, url, seed=4)  # other random device bytes: nothing shared but the store
    try:
        assert reader.prefetch(key) == len(key)
        assert len(reader.prefetched) == 1
        got = reader.prefetched[0]
    finally:
        reader.stop()
    expected = {"kv": list(range(pages)), **SIDECARS[strategy]}
    assert {name: list(pool) for name, pool in got.items()} == {
        name: [hashes[i] for i in indices] for name, indices in expected.items()
    }
    for name, pool in got.items():
        for page_key, page in pool.items():
            assert same_bytes(page, held[name][page_key]), (name, hashes.index(page_key))
            assert page.view(torch.uint8).any(), (name, page_key)  # random bytes, not an empty page


@pytest.mark.parametrize("strategy", list(REFUSED))
def test_init_hicache_of_a_strategy_kvstage_cannot_store_whole_is_refused_with_no_store_left_open(
    tmp_path, cpu, monkeypatch, strategy
):
    """MiniMax M3's sparse layers keep index keys in an ``MHATokenToKOnlyPoolHost`` under
    'indexer', DeepSeek V4 its compressed KV under a ``LogicalHostPool`` anchor: pools kvstage
    does not store, so the pages it could store would restore a broken model."""
    name, rule, stores = REFUSED[strategy]
    opened, closed = watch_opened_stores(monkeypatch)
    select, selected = hybrid_pool_assembler._select_strategy, []
    monkeypatch.setattr(
        hybrid_pool_assembler,
        "_select_strategy",
        lambda kvcache, components: selected.append(select(kvcache, components)) or selected[-1],
    )
    with pytest.raises(InvalidArgumentError, match=rule):
        UnifiedRig(strategy, f"file:{tmp_path}", seed=1)
    assert [type(strategy).__name__ for strategy in selected] == [name]
    assert len(opened) == stores and closed == opened  # the anchor's store, if opened, closed again
