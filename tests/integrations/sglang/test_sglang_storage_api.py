"""KVStageStorage's other duties under sglang 0.5.23: chain links from prefix_keys, the legacy
flat-page calls, clear, get_stats, the three sglang threads at once, sglang's namespaced keys,
and clear errors for what kvstage's key space cannot describe."""

from __future__ import annotations

import dataclasses
import threading
from array import array

import pytest
import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolName
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvstage.errors import InvalidArgumentError, StorageError
from kvstage.hashing import PageHasher
from kvstage.integrations.sglang import KVStageStorage
from kvstage.integrations.sglang.storage import CHUNK_PAGES

from sglang_rig import (
    LAYERS,
    PAGE_SIZE,
    canonical_of,
    canonical_shape,
    dsa_device_pool,
    dsa_host_pool_group,
    host_pool,
    kvstage_backend,
    mha_device_pool,
    mla_device_pool,
    random_canonical,
    same_bytes,
    set_host,
    storage_config,
)


def slots(starts) -> torch.Tensor:
    return torch.cat([torch.arange(start, start + PAGE_SIZE) for start in starts])


def key(n: int) -> str:
    return f"{n:064x}"


def mha_host(layout="page_first"):
    return host_pool(mha_device_pool(), layout)


# -- chains -------------------------------------------------------------------------------------


@pytest.mark.parametrize("store", ["memory", "file"])
def test_a_child_written_before_its_parent_is_stored_and_read_back(tmp_path, store):
    host = mha_host()
    set_host(host, random_canonical(host, seed=1))
    backend = kvstage_backend("memory" if store == "memory" else f"file:{tmp_path / 'store'}", host)
    child = HiCacheStorageExtraInfo(prefix_keys=[key(1)])  # key(1) not stored yet
    assert backend.batch_set_v1([key(2), key(3)], slots([8, 12]), child) == [True, True]
    assert backend.batch_set_v1([key(1)], slots([4])) == [True]
    assert backend.batch_exists([key(1), key(2), key(3)]) == 3
    assert backend.batch_get_v1([key(2), key(3)], slots([40, 44])) == [True, True]
    assert same_bytes(host.get_data_page(40), host.get_data_page(8))


def test_prefix_keys_link_a_run_to_its_stored_parent_so_eviction_takes_the_chain_tail_first():
    host = mha_host()
    set_host(host, random_canonical(host, seed=2))
    page_bytes = None
    backend = kvstage_backend("memory", host)
    page_bytes = backend.store.page_bytes
    backend.close()
    backend = kvstage_backend(f"memory:{2 * page_bytes}", host)  # room for two pages
    assert backend.batch_set_v1([key(1)], slots([0])) == [True]  # the parent, used first
    assert backend.batch_set_v1([key(2)], slots([4]), HiCacheStorageExtraInfo(prefix_keys=[key(1)])) == [True]
    assert backend.batch_set_v1([key(9)], slots([8])) == [True]  # a third page evicts one
    # Linked, the parent is no candidate while its child is stored: the child (the tail) goes,
    # though the parent was used longer ago.
    assert backend.exists(key(1)) and not backend.exists(key(2))


def _put_raises_from_the_second_call(backend):
    """The backend's store, its put raising OSError(EIO) from its second call on."""
    store = backend.store
    real_put, calls = store.put, []

    def put(keys, pages, prior_key=None):
        calls.append(list(keys))
        if len(calls) > 1:
            raise OSError(5, "Input/output error: the disk went away")
        return real_put(keys, pages, prior_key=prior_key)

    store.put = put
    return calls


def test_a_store_put_that_raises_fails_its_pages_with_a_warning_and_never_reaches_sglang(caplog):
    host = mha_host()
    set_host(host, random_canonical(host, seed=3))
    backend = kvstage_backend("memory", host)
    calls = _put_raises_from_the_second_call(backend)
    keys = [key(n) for n in range(1, 11)]
    with caplog.at_level("WARNING", logger="kvstage.integrations.sglang.storage"):
        assert backend.batch_set_v1(keys[:8], slots(range(0, 32, 4))) == [True] * 8
        assert backend.batch_set_v1(keys[8:], slots(range(32, 40, 4))) == [False] * 2
    assert len(calls) == 2
    assert backend.batch_exists(keys) == 8
    assert "2 of 2 pages not stored" in caplog.text and "the disk went away" in caplog.text
    caplog.clear()
    with caplog.at_level(
        "WARNING", logger="kvstage.integrations.sglang.storage"
    ):  # the legacy call: one flat page each
        assert backend.batch_set([key(20)], [host.get_data_page(0, flat=True)]) is False
    assert "1 of 1 pages not stored" in caplog.text and "the disk went away" in caplog.text
    assert backend.batch_exists([key(20)]) == 0


@pytest.mark.parametrize("strided", [True, False])
def test_a_call_moves_its_pages_in_one_store_call_where_the_store_takes_views_else_in_chunks(strided):
    # A store with strided_pages takes the host page views as they are (no staging to bound),
    # so a call's ten pages go in one put and one get (the memory store then moves adjacent
    # host pages in one copy); a store that needs contiguous pages gets CHUNK_PAGES at a time.
    host = mha_host()
    set_host(host, random_canonical(host, seed=5))
    backend = kvstage_backend("memory", host)
    store = backend.store
    if not strided:
        store.strided_pages = False  # as a contiguous-only store (Mooncake): staged
    puts, gets = [], []
    real_put, real_get = store.put, store.get
    store.put = lambda keys, pages, prior_key=None: (
        puts.append(len(keys)),
        real_put(keys, pages, prior_key=prior_key),
    )[1]
    store.get = lambda keys, into: (gets.append(len(keys)), real_get(keys, into))[1]
    keys = [key(n) for n in range(1, 11)]
    assert backend.batch_set_v1(keys, slots(range(0, 40, 4))) == [True] * 10
    assert backend.batch_get_v1(keys, slots(range(40, 80, 4))) == [True] * 10
    assert puts == gets == ([10] if strided else [CHUNK_PAGES, 10 - CHUNK_PAGES])
    assert all(same_bytes(host.get_data_page(40 + 4 * n), host.get_data_page(4 * n)) for n in range(10))


def test_batch_set_v1_with_prefix_keys_asks_the_store_no_exists_whether_the_parent_is_stored_or_not():
    host = mha_host()
    set_host(host, random_canonical(host, seed=4))
    backend = kvstage_backend("memory", host)
    store, asked = backend.store, []
    real_exists = store.exists
    store.exists = lambda keys: (asked.append(list(keys)), real_exists(keys))[-1]
    orphan = HiCacheStorageExtraInfo(prefix_keys=[key(1)])  # key(1) is not stored
    assert backend.batch_set_v1([key(2), key(3)], slots([8, 12]), orphan) == [True, True]
    assert backend.batch_set_v1([key(1)], slots([4])) == [True]
    assert backend.batch_set_v1([key(4)], slots([16]), HiCacheStorageExtraInfo(prefix_keys=[key(1)])) == [True]
    assert asked == []
    store.exists = real_exists
    assert backend.batch_exists([key(n) for n in range(1, 5)]) == 4


# -- legacy flat pages --------------------------------------------------------------------------


@pytest.mark.parametrize("written,read", [("page_first", "layer_first"), ("page_head", "page_first_direct")])
def test_legacy_set_and_get_of_flat_pages_cross_host_layouts(written, read):
    url = "memory"
    writer_host, reader_host = mha_host(written), mha_host(read)
    set_host(writer_host, random_canonical(writer_host, seed=3))
    writer = kvstage_backend(url, writer_host)
    assert writer.set(key(1), writer_host.get_data_page(4, flat=True))
    assert writer.batch_set(
        [key(2), key(3)], [writer_host.get_data_page(8, flat=True), writer_host.get_data_page(0, flat=True)]
    )
    assert writer.exists(key(2)) and not writer.exists(key(4))
    reader = KVStageStorage.__new__(KVStageStorage)
    reader.__dict__.update(writer.__dict__)  # same store, read through another host layout:
    # A second reader of the same store: its per-thread state is private, made fresh here.
    reader.mem_pool_host, reader._local = reader_host, threading.local()
    target = reader_host.get_dummy_flat_data_page()
    assert reader.get(key(1), target) is target
    reader_host.set_from_flat_data_page(12, target)
    got = reader.batch_get(
        [key(3), key(4)], [reader_host.get_dummy_flat_data_page(), reader_host.get_dummy_flat_data_page()]
    )
    assert got[1] is None
    reader_host.set_from_flat_data_page(16, got[0])

    source = torch.zeros(canonical_shape(writer_host), dtype=writer_host.dtype)
    writer_canonical = canonical_of(writer_host)
    expected = torch.zeros_like(source)
    expected[:, :, 12:16] = writer_canonical[:, :, 4:8]
    expected[:, :, 16:20] = writer_canonical[:, :, 0:4]
    assert same_bytes(canonical_of(reader_host)[:, :, 12:20], expected[:, :, 12:20])


# -- clear, stats, threads ----------------------------------------------------------------------


@pytest.mark.parametrize("store", ["memory", "file"])
def test_clear_empties_what_sglang_flush_expects(tmp_path, store):
    host = mha_host()
    set_host(host, random_canonical(host, seed=4))
    url = "memory" if store == "memory" else f"file:{tmp_path}"
    backend = kvstage_backend(url, host)
    assert backend.batch_set_v1([key(1), key(2)], slots([0, 4])) == [True, True]
    backend.clear()
    assert backend.batch_exists([key(1), key(2)]) == 0
    assert backend.batch_get_v1([key(1)], slots([8])) == [False]
    assert backend.batch_set_v1([key(1)], slots([0])) == [True]  # usable after a flush
    assert backend.batch_exists([key(1)]) == 1


def test_get_stats_reports_each_v1_call_since_the_last_get_stats():
    host = mha_host()
    set_host(host, random_canonical(host, seed=5))
    backend = kvstage_backend("memory", host)
    backend.batch_set_v1([key(1), key(2), key(3)], slots([0, 4, 8]))
    backend.batch_get_v1([key(1), key(2)], slots([12, 16]))
    stats = backend.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [2]
    assert len(stats.backup_bandwidth) == 1 and stats.backup_bandwidth[0] > 0
    assert backend.get_stats().backup_pgs == []


def test_sglang_three_storage_threads_at_once_move_every_page_intact(tmp_path):
    host = mha_host("page_first")
    source = random_canonical(host, seed=6)
    set_host(host, source)
    backend = kvstage_backend(f"file:{tmp_path}", host)
    pages = host.size // PAGE_SIZE
    half = pages // 2
    written = [False] * half
    errors: list[BaseException] = []

    def backup():  # sglang's backup thread: pages of the first half of the pool
        for i in range(half):
            written[i] = backend.batch_set_v1([key(1000 + i)], slots([i * PAGE_SIZE])) == [True]

    def lookup():  # sglang's prefetch thread
        for _ in range(200):
            hit = backend.batch_exists([key(1000 + i) for i in range(half)])
            assert 0 <= hit <= half

    def prefetch():  # sglang's prefetch I/O thread: reads into the second half
        for i in range(half):
            while not backend.batch_exists([key(1000 + i)]):
                pass
            assert backend.batch_get_v1([key(1000 + i)], slots([(half + i) * PAGE_SIZE])) == [True]

    def run(fn):
        try:
            fn()
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in (backup, lookup, prefetch)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and all(written)
    got = canonical_of(host)
    assert same_bytes(got[:, :, half * PAGE_SIZE : 2 * half * PAGE_SIZE], source[:, :, : half * PAGE_SIZE])


# -- keys -----------------------------------------------------------------------------------------


def test_sglang_namespaced_storage_keys_are_kvstages_sglang_v1_keys():
    host = mha_host()
    set_host(host, random_canonical(host, seed=7))
    backend = kvstage_backend("memory", host)
    tokens = list(range(5, 5 + 3 * PAGE_SIZE))
    for extra_key, cache_salt in [(None, None), ("lora-7", "tenant-a"), ("", None), ("Zürich", "𝄞")]:
        radix_key = RadixKey(array("q", tokens), extra_key=extra_key, cache_salt=cache_salt)
        sglang_keys = get_storage_hash_str(radix_key, page_size=PAGE_SIZE)
        assert backend.batch_set_v1(sglang_keys, slots([0, 4, 8])) == [True] * 3
        kvstage_keys = PageHasher(page_size=PAGE_SIZE).prefill_keys(tokens, extra_key=extra_key, cache_salt=cache_salt)
        assert kvstage_keys == sglang_keys
        assert backend.store.exists(kvstage_keys) == [True] * 3


# -- what kvstage refuses, before anything is opened or written ----------------------------------


def test_an_extra_config_passed_as_kwargs_instead_of_in_the_storage_config_is_named():
    # A user building KVStageStorage by hand put the JSON in the second argument and was told
    # that no url was given.
    extra = storage_config("memory").extra_config
    bare = dataclasses.replace(storage_config("memory"), extra_config=None)
    with pytest.raises(
        InvalidArgumentError, match=r"^storage_config.extra_config: .*HiCacheStorageConfig\(extra_config="
    ):
        KVStageStorage(bare, extra)


def test_extra_config_errors_name_the_key():
    with pytest.raises(InvalidArgumentError, match="extra_config.url"):
        KVStageStorage(dataclasses.replace(storage_config("memory"), extra_config={"backend_name": "kvstage"}))
    with pytest.raises(InvalidArgumentError, match="unknown keys \\['urll'\\]"):
        KVStageStorage(storage_config("memory", urll="x"))
    with pytest.raises(InvalidArgumentError, match="kv_cache_dtype"):
        KVStageStorage(storage_config("memory", kv_cache_dtype="fp8"))
    # sglang's own keys of the same JSON are not kvstage's to refuse
    KVStageStorage(
        storage_config("memory", prefetch_threshold=256, hicache_storage_pass_prefix_keys=True, tp_lcm_size=None)
    )


def test_context_parallel_and_split_heads_are_refused_with_the_field_named():
    with pytest.raises(InvalidArgumentError, match="attn_cp_size"):
        KVStageStorage(dataclasses.replace(storage_config("memory"), attn_cp_size=2, attn_cp_rank=1))
    # split heads are kvstage's head groups (test_sglang_tp_split.py); a tp_lcm_size no TP size divides is refused
    with pytest.raises(InvalidArgumentError, match="storage_config.tp_lcm_size"):
        KVStageStorage(dataclasses.replace(storage_config("memory", tp_size=2), should_split_heads=True, tp_lcm_size=3))


def test_v_head_size_unlike_k_head_size_is_refused_at_registration():
    device = mha_device_pool(v_head_dim=4)
    host = host_pool(device, "layer_first")
    backend = KVStageStorage(storage_config("memory"))
    with pytest.raises(InvalidArgumentError, match="V head size 4 differs from K head size 8"):
        backend.register_mem_pool_host(host)
    assert backend.store is None


def mamba_host() -> MambaPoolHost:
    """sglang's Mamba state host pool (a hybrid linear-attention model's SSM and conv states)."""
    info = MambaStateBufferInfo(temporal=torch.zeros(LAYERS, 9, 2, 4), conv=(torch.zeros(LAYERS, 9, 4, 3),))
    return MambaPoolHost(info, 2.0, 0, device_capacity=8, pin_memory=False, layout="page_first")


def test_host_pools_kvstage_does_not_store_are_refused_at_v2_registration_naming_their_kind():
    """sglang's HybridCacheController registers every pool of the set through
    register_mem_host_pool_v2. kvstage stores 'kv' (the anchor), 'swa', 'indexer' and 'mamba'
    (test_sglang_hybrid_v2.py); any other pool, or a known name on a pool of another class, is
    refused there, before sglang could ask for its pages."""
    host = mha_host()
    backend = kvstage_backend("memory", host)
    backend.register_mem_host_pool_v2(host, PoolName.KV)  # the anchor again, under "kv": stored
    group = dsa_host_pool_group(dsa_device_pool())
    for pool, name, rule in [
        (mha_host(), PoolName.DRAFT, r"host pool 'draft': a draft model KV pool \(MHATokenToKVPoolHost\)"),
        (mha_host(), PoolName.DRAFT_SWA, r"host pool 'draft_swa': a SWA \(draft model\) pool \(MHATokenToKVPoolHost\)"),
        (mha_host(), PoolName.AUXILIARY_SWA, r"host pool 'auxiliary_swa': a SWA pool \(MHATokenToKVPoolHost\)"),
        (mha_host(), PoolName.DEEPSEEK_V4_C4, r"host pool 'deepseek_v4_c4': a DeepSeek V4 pool"),
        (mamba_host(), PoolName.SWA, r"host pool 'swa': a SWA pool \(MambaPoolHost\)"),
        (mha_host(), PoolName.MAMBA, r"host pool 'mamba': a Mamba pool \(MHATokenToKVPoolHost\)"),
        (
            group.get_pool(PoolName.INDEXER),
            PoolName.DRAFT_INDEXER,
            r"host pool 'draft_indexer': a sparse-attention indexer \(draft model\) pool \(DSAIndexerPoolHost\)",
        ),
        (
            mha_host(),
            PoolName.KV,
            r"host pool 'kv' \(MHATokenToKVPoolHost\) is not the pool registered by register_mem_pool_host",
        ),
    ]:
        with pytest.raises(InvalidArgumentError, match=rule):
            backend.register_mem_host_pool_v2(pool, name)


def test_a_v2_registration_kvstage_refuses_closes_the_store_the_anchor_opened(monkeypatch):
    from kvstage.integrations.sglang.key_space import ExtraConfig

    opened = []
    real_open = ExtraConfig.open_store
    monkeypatch.setattr(
        ExtraConfig, "open_store", lambda self, fingerprint: opened.append(real_open(self, fingerprint)) or opened[-1]
    )
    host = mha_host()
    backend = kvstage_backend("memory", host)
    with pytest.raises(InvalidArgumentError, match="'draft'"):
        backend.register_mem_host_pool_v2(mha_host(), PoolName.DRAFT)
    assert backend.store is None and len(opened) == 1
    with pytest.raises(StorageError, match="no host pool registered"):
        backend.batch_exists([key(1)])


def test_a_host_pool_of_another_kind_is_refused_as_the_anchor_naming_it():
    for pool, rule in [
        (mamba_host(), r"mem_pool_host: a Mamba host pool \(MambaPoolHost\)"),
        (
            dsa_host_pool_group(dsa_device_pool()).get_pool(PoolName.INDEXER),
            r"mem_pool_host: a DSA indexer .*\(DSAIndexerPoolHost\)",
        ),
    ]:
        backend = KVStageStorage(storage_config("memory"))
        with pytest.raises(InvalidArgumentError, match=rule):
            backend.register_mem_pool_host(pool)
        assert backend.store is None


def test_fp8_stored_as_uint8_needs_its_kind_and_the_kind_is_in_the_key_space():
    host = host_pool(mha_device_pool(dtype=torch.float8_e4m3fn), "page_first")
    assert host.dtype in (torch.uint8, torch.float8_e4m3fn)
    if host.dtype == torch.uint8:
        with pytest.raises(InvalidArgumentError, match="kv_cache_dtype"):
            KVStageStorage(storage_config("memory")).register_mem_pool_host(host)
    e4m3 = KVStageStorage(storage_config("memory", kv_cache_dtype="fp8_e4m3"))
    e4m3.register_mem_pool_host(host)
    e5m2 = KVStageStorage(storage_config("memory", kv_cache_dtype="fp8_e5m2"))
    e5m2.register_mem_pool_host(host)
    assert "float8_e4m3fn" in e4m3.store.prefix and "float8_e5m2" in e5m2.store.prefix


def test_calls_before_a_host_pool_is_registered_raise_and_bad_host_indices_write_nothing():
    backend = KVStageStorage(storage_config("memory"))
    with pytest.raises(StorageError, match="register_mem_pool_host"):
        backend.batch_exists([key(1)])
    host = mha_host()
    backend.register_mem_pool_host(host)
    with pytest.raises(InvalidArgumentError, match="host_indices\\[4\\]: 6 is not a page start"):
        backend.batch_set_v1([key(1), key(2)], torch.cat([torch.arange(0, 4), torch.arange(6, 10)]))
    with pytest.raises(InvalidArgumentError, match="8 slots for 3 keys"):
        backend.batch_set_v1([key(1), key(2), key(3)], slots([0, 4]))
    assert backend.batch_exists([key(1)]) == 0


def test_a_pipeline_stage_keys_its_own_layers():
    device = mha_device_pool(start_layer=3, end_layer=6)
    backend = kvstage_backend("memory", host_pool(device, "page_first"))
    assert "@L3-5xKV2xH2xD8@" in backend.store.prefix


def test_sglang_factory_builds_it_from_the_dynamic_backend_config():
    host = mha_host()
    backend = StorageBackendFactory.create_backend("dynamic", storage_config("memory", model_id="my-model"), host)
    assert isinstance(backend, KVStageStorage)
    backend.register_mem_pool_host(host)
    assert backend.store.prefix.startswith("my-model@bfloat16@L0-2xKV2xH2xD8@P4@tp0of1@")
    mla = kvstage_backend("memory", host_pool(mla_device_pool(), "page_first"), tp_rank=1, tp_size=2)
    assert mla.store.prefix.endswith("@tp-any@") and not mla.store.fingerprint.writes_pages


def test_a_store_that_answers_exists_for_fewer_keys_than_asked_raises_rather_than_a_short_lookup(monkeypatch):
    backend = kvstage_backend("memory", mha_host())
    monkeypatch.setattr(backend.store, "exists", lambda keys: [True] * (len(keys) - 1))
    with pytest.raises(StorageError, match=r"exists\(\) answered 2 keys of 3"):
        backend.batch_exists([key(1), key(2), key(3)])
