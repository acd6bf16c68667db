"""KVStageOffloadingSpec inside vLLM 0.33.0's OffloadingConnector, on CPU: vLLM's own Scheduler
and connector scheduler decide, vLLM's connector worker hands kvstage's worker real block
tensors (``register_kv_caches``), kvstage's copier and store threads move the bytes.

What must hold: a request's full prompt blocks are stored; after the GPU prefix cache is reset
and the KV cache zeroed, a second request with that prompt loads them from the store (no
recompute of those tokens) and its blocks hold exactly the first request's bytes; lookups never
block (an unknown key is a RETRY while the store is asked); the manager's take_events reports
what the store stored and evicted, and vLLM's connector publishes them as KV events.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM 0.33.0 is not installed (make .venv-vllm/.installed, then run with .venv-vllm/bin/python)",
)

import torch  # noqa: E402
from vllm.v1.kv_offload.base import Medium  # noqa: E402

from kvstage.errors import InvalidArgumentError, StorageError  # noqa: E402
from kvstage.integrations.vllm import KVStageOffloadingSpec  # noqa: E402

from vllm_rig import ConnectorRig, assert_blocks_hold, expected_block, run_to_prompt_end  # noqa: E402

BLOCK = ConnectorRig.BLOCK_SIZE
PROMPT = list(range(1, 4 * BLOCK + 6))  # 4 full blocks and 5 tokens


@pytest.fixture(params=["memory", "file"])
def rig(request, tmp_path):
    rig = ConnectorRig(tmp_path / "model", "memory" if request.param == "memory" else f"file:{tmp_path / 'kv'}")
    yield rig
    rig.close()


def test_a_second_request_loads_the_first_ones_blocks_from_the_store(rig):
    rig.add_request("a", PROMPT)
    first = rig.run_until_idle()
    assert first[0].num_scheduled_tokens == {}  # the lookup asked the store on a thread: RETRY
    assert sum(step.num_scheduled_tokens.get("a", 0) for step in first) == len(PROMPT) + 1  # all computed
    assert rig.manager.storage.stats.pages_stored == 4  # the 4 full prompt blocks
    assert not rig.scheduler.requests

    assert rig.scheduler.reset_prefix_cache()  # the GPU cache forgets them ...
    rig.backing.zero_()  # ... and holds nothing of them
    request = rig.add_request("b", PROMPT)
    second = rig.run_until_idle()
    scheduled = [step.num_scheduled_tokens.get("b", 0) for step in second]
    assert sum(scheduled) == len(PROMPT) - 4 * BLOCK + 1  # only the 5 tokens past the loaded blocks (+1 decode)
    assert rig.manager.storage.stats.pages_read == 4
    assert request.num_output_tokens == 2


def test_loaded_blocks_hold_exactly_the_stored_bytes(rig):
    rig.add_request("a", PROMPT, max_tokens=1)
    rig.run_until_idle()
    rig.scheduler.reset_prefix_cache()
    rig.backing.zero_()
    request = rig.add_request("b", PROMPT, max_tokens=50)  # still running when checked
    for _ in range(500):
        rig.step()
        if request.num_computed_tokens >= len(PROMPT):
            break
    blocks = rig.block_ids("b")
    for index in range(4):
        for layer, name in enumerate(rig.LAYERS):
            assert torch.equal(rig.kv[name][blocks[index]], expected_block(rig, PROMPT, index)[layer]), (index, name)


def test_take_events_reports_stored_and_evicted_blocks(tmp_path):
    # Room for 3 pages (one block of both layers each): a second prompt's 2 blocks evict one.
    page_bytes = (
        2 * ConnectorRig.BLOCK_SIZE * ConnectorRig.NUM_KV_HEADS * ConnectorRig.HEAD_SIZE * 2 * len(ConnectorRig.LAYERS)
    )
    rig = ConnectorRig(tmp_path / "model", f"memory:{3 * page_bytes}")
    try:
        rig.add_request("a", list(range(1, 2 * BLOCK + 3)))
        rig.run_until_idle()
        rig.add_request("c", list(range(100, 100 + 2 * BLOCK + 3)))
        rig.run_until_idle()
        taken = rig.offloading_events  # as vLLM's scheduler took them, step by step
        stored = [key for event in taken if not event.removed for key in event.keys]
        evicted = [key for event in taken if event.removed for key in event.keys]
        assert len(stored) == 4 and len(evicted) == 1 and evicted[0] in stored[:2]
        assert all(event.medium is Medium.STORAGE for event in taken)
        assert rig.manager.index.lookup(evicted[0].hex()) is False  # never offered for a load
        removed = [e for e in rig.kv_events if type(e).__name__ == "BlockRemoved" and e.medium == "STORAGE"]
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        assert [h for e in removed for h in e.block_hashes] == [
            maybe_convert_block_hash(evicted[0][:-4])
        ]  # vLLM published it
        # vLLM published every stored block too, under its GPU block's hash (events without
        # self_describing_kv_events; with it, over ZMQ: test_kv_events.py)
        published = [e for e in rig.kv_events if type(e).__name__ == "BlockStored"]
        storage = [h for e in published if e.medium == "STORAGE" for h in e.block_hashes]
        assert storage == [h for e in published if e.medium == "GPU" for h in e.block_hashes]
        assert storage == [maybe_convert_block_hash(key[:-4]) for key in stored]
    finally:
        rig.close()


def test_a_hybrid_model_without_kvstages_connector_raises_naming_the_connector_to_use():
    # vLLM's own OffloadingConnector hands the spec no group kinds (KVStageConnector does).
    from vllm_offloading_config import offloading_config

    config = offloading_config({"storage": "memory"})
    two_groups = type(config)(**{**config.__dict__, "groups": config.groups * 2})
    with pytest.raises(
        InvalidArgumentError, match="^kv_connector: this model offloads 2 KV cache groups.*KVStageConnector"
    ):
        KVStageOffloadingSpec(two_groups)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"storage": "memory", "num_host_pages": 0}, "^num_host_pages: must be an int >= 1, got 0"),
        ({"storage": 7}, "^storage: must be a storage URL string, got 7"),
        ({}, "^storage: required"),
    ],
)
def test_bad_extra_config_raises_naming_the_key(extra, message):
    from vllm_offloading_config import offloading_config

    with pytest.raises(InvalidArgumentError, match=message):
        KVStageOffloadingSpec(offloading_config(extra))


def test_a_padded_layer_row_is_stored_whole_and_a_store_of_its_unpadded_size_raises():
    # vLLM pads a hybrid model's Mamba rows to the attention page: the row is the page.
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    from kvstage.integrations.vllm import KVStageWorker
    from kvstage.storage import LayoutFingerprint, MemoryStore

    padded = CanonicalKVCaches(
        [CanonicalKVCacheTensor(torch.zeros(4, 512, dtype=torch.int8), 512)], [[CanonicalKVCacheRef(0, 384)]]
    )
    store = MemoryStore(LayoutFingerprint.opaque("m", page_bytes=384, page_format="t"))
    with pytest.raises(
        InvalidArgumentError,
        match=r"^storage: holds pages of 384 bytes, a block of the group's layers is 512 \(each layer's row",
    ):
        KVStageWorker(padded, store)
    KVStageWorker(padded, MemoryStore(LayoutFingerprint.opaque("m", page_bytes=512, page_format="t"))).close()


def test_a_connector_cache_reset_clears_the_store_and_reports_the_removals(tmp_path):
    rig = ConnectorRig(tmp_path / "model", f"file:{tmp_path / 'kv'}")
    try:
        rig.add_request("a", PROMPT)
        rig.run_until_idle()
        stored = [key for event in rig.offloading_events if not event.removed for key in event.keys]
        assert len(stored) == 4
        assert rig.scheduler.reset_prefix_cache(reset_connector=True)  # e.g. after a weight update
        rig.add_request("b", PROMPT)
        second = rig.run_until_idle()
        assert sum(step.num_scheduled_tokens.get("b", 0) for step in second) == len(PROMPT) + 1  # nothing loaded
        removed = [key for event in rig.offloading_events if event.removed for key in event.keys]
        assert sorted(removed) == sorted(stored)
        assert rig.manager.storage.stats.pages_read == 0
    finally:
        rig.close()


def test_a_second_request_loads_from_a_real_mooncake_master(tmp_path):
    from kvstage.storage.mooncake.store import master_binary, mooncake_available

    from mooncake_master import LocalMooncakeMaster

    if not (mooncake_available() and master_binary()):
        pytest.skip("the Mooncake store is not installed (make .venv/.mooncake)")
    with LocalMooncakeMaster(tmp_path / "master.log") as master:
        rig = ConnectorRig(tmp_path / "model", master.url())
        try:
            rig.add_request("a", PROMPT, max_tokens=1)
            rig.run_until_idle()
            rig.scheduler.reset_prefix_cache()
            rig.backing.zero_()
            request = rig.add_request("b", PROMPT, max_tokens=50)
            for _ in range(500):
                rig.step()
                if request.num_computed_tokens >= len(PROMPT):
                    break
            assert rig.manager.storage.stats.pages_read == 4
            blocks = rig.block_ids("b")
            for index in range(4):
                for layer, name in enumerate(rig.LAYERS):
                    assert torch.equal(rig.kv[name][blocks[index]], expected_block(rig, PROMPT, index)[layer])
        finally:
            rig.close()


@pytest.mark.parametrize("report_load_errors", [True, False])
def test_the_worker_reports_a_failed_load_as_vllms_connector_can_take_it(report_load_errors):
    # KVStageConnector: done, its blocks in take_block_ids_with_load_errors (vLLM recomputes them).
    # vLLM's own OffloadingConnector has no such path: the load is reported failed, never done
    # with blocks it did not write.
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec

    from kvstage.integrations.vllm import KVStageWorker
    from kvstage.integrations.vllm.manager import KVStageLoadStoreSpec
    from kvstage.storage import LayoutFingerprint, MemoryStore

    tensors = [torch.zeros(8, 64, dtype=torch.int8) for _ in range(2)]
    kv_caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, 64) for t in tensors], [[CanonicalKVCacheRef(i, 64) for i in range(2)]]
    )
    store = MemoryStore(LayoutFingerprint.opaque("m", page_bytes=128, page_format="test"))
    worker = KVStageWorker(kv_caches, store, num_host_pages=2, report_load_errors=report_load_errors)
    try:
        assert worker.submit_load(
            7, KVStageLoadStoreSpec(["aa", "bb", "cc"]), GPULoadStoreSpec([5, 6, 3], [3], [0])
        )  # 3 pages, 2 host pages
        worker.wait({7})
        [result] = worker.get_finished()
        assert result.job_id == 7 and result.success is report_load_errors
        assert worker.take_block_ids_with_load_errors() == ({5, 6, 3} if report_load_errors else set())
        assert worker.take_block_ids_with_load_errors() == set() and worker.loads_failed == 1
        assert all(not t.any() for t in tensors)  # nothing written
    finally:
        worker.close()


def test_unknown_extra_config_keys_are_warned_once_naming_them(caplog):
    import logging

    from vllm_offloading_config import offloading_config

    extra = {
        "storage": "memory",
        "spec_name": "KVStageOffloadingSpec",
        "offload_prompt_only": True,
        "num_host_page": 8,
        "hit_ttl": 3,
    }
    with caplog.at_level(logging.WARNING, logger="kvstage.integrations.vllm.spec"):
        KVStageOffloadingSpec(offloading_config(extra))
        KVStageOffloadingSpec(offloading_config(extra))  # vLLM builds a spec per connector role
    warnings = [record.getMessage() for record in caplog.records if record.name == "kvstage.integrations.vllm.spec"]
    assert len(warnings) == 1 and "['hit_ttl', 'num_host_page']" in warnings[0], warnings


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"block_size": 64}, r"^block_size: .*vLLM's block of 16 tokens.*got 64"),
        ({"blocks_per_chunk": 2}, r"^blocks_per_chunk: .*got 2"),
    ],
)
def test_chunks_of_several_blocks_raise_naming_what_the_user_wrote(extra, message, tmp_path):
    with pytest.raises(InvalidArgumentError, match=message):
        ConnectorRig(tmp_path / "model", "memory", extra_config=extra)


def test_the_managers_index_follows_the_stores_events_in_order():
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvstage.integrations.vllm import KVStageOffloadingManager
    from kvstage.storage import LayoutFingerprint, MemoryStore

    store = MemoryStore(LayoutFingerprint.opaque("m", page_bytes=16, page_format="test"), capacity_pages=1)
    manager = KVStageOffloadingManager(store)
    try:
        a, b = bytes(36), bytes(35) + b"\x01"
        page = torch.zeros(16, dtype=torch.uint8)
        assert manager.prepare_store([a, b], ReqContext("r")).keys_to_store == [a, b]  # a worker writes them:
        store.put([a.hex()], [page])
        store.put([b.hex()], [page])  # evicts a: events stored a, stored b, evicted a
        manager.complete_store([a, b], ReqContext("r"))  # a worker reported both done
        assert manager.lookup(b, ReqContext("r")) is LookupResult.HIT  # the store said stored
        assert manager.lookup(a, ReqContext("r")) is LookupResult.RETRY  # not held: the store is asked
        while manager.index.refreshing:  # the scheduler's steps until the store answered
            manager.index.wait()
            manager.on_schedule_end(None)
        assert manager.lookup(a, ReqContext("r")) is LookupResult.MISS
    finally:
        manager.shutdown()


def test_closing_the_worker_writes_the_stores_it_was_never_polled_for(tmp_path):
    # vLLM's worker may shut down right after submitting: the gathered blocks still reach the store.
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec

    from kvstage.integrations.vllm import KVStageWorker
    from kvstage.integrations.vllm.manager import KVStageLoadStoreSpec
    from kvstage.storage import LayoutFingerprint, open_storage

    tensors = [torch.arange(8 * 64, dtype=torch.int64).remainder(251).to(torch.int8).view(8, 64) + i for i in range(2)]
    kv_caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, 64) for t in tensors], [[CanonicalKVCacheRef(i, 64) for i in range(2)]]
    )
    fingerprint = LayoutFingerprint.opaque("m", page_bytes=128, page_format="test")
    worker = KVStageWorker(kv_caches, open_storage(f"file:{tmp_path}", fingerprint), num_host_pages=1)
    assert worker.submit_store(
        3, GPULoadStoreSpec([1, 4, 6], [3], [0]), KVStageLoadStoreSpec(["k1", "k4", "k6"])
    )  # 3 parts of 1 page
    worker.close()  # closes the store: a new one over the same directory reads what was written
    store = open_storage(f"file:{tmp_path}", fingerprint)
    assert store.exists(["k1", "k4", "k6"]) == [True, True, True]
    for key, block in (("k1", 1), ("k4", 4), ("k6", 6)):
        page = torch.empty(128, dtype=torch.uint8)
        assert store.get([key], [page]) == [True]
        assert torch.equal(page.view(torch.int8).view(2, 64), torch.stack([t[block] for t in tensors]))


def test_a_page_a_load_stopped_at_misses_and_the_pages_before_it_stay_hits():
    # KVStageConnector hands the manager the page each failed load stopped at (the workers'
    # take_unreadable_keys): that page misses for miss_ttl_s, a store of it meanwhile included;
    # the pages the load read stay hits, for the request vLLM looks up again and for others.
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvstage.integrations.vllm import KVStageOffloadingManager
    from kvstage.storage import LayoutFingerprint, MemoryStore

    store = MemoryStore(LayoutFingerprint.opaque("m", page_bytes=16, page_format="test"))
    manager = KVStageOffloadingManager(store, miss_ttl_s=60)
    try:
        keys = [index.to_bytes(36, "big") for index in range(3)]
        assert manager.prepare_store(keys, ReqContext("r")).keys_to_store == keys
        store.put([key.hex() for key in keys], [torch.zeros(16, dtype=torch.uint8)] * 3)
        manager.complete_store(keys, ReqContext("r"))
        manager.complete_load(keys, ReqContext("r"))  # read, or failed: the store keeps no pins
        manager.loads_failed([keys[1].hex()])
        lookups = [manager.lookup(key, ReqContext("r")) for key in keys]
        assert lookups == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]
        assert manager.prepare_store(keys, ReqContext("r")).keys_to_store == [keys[1]]  # vLLM computes it again
        manager.complete_store([keys[1]], ReqContext("r"))  # the store kept its unreadable page: "held"
        assert manager.lookup(keys[1], ReqContext("r")) is LookupResult.MISS
    finally:
        manager.shutdown()


def test_a_manager_or_worker_that_fails_to_build_lets_go_of_the_shared_store_and_shutdown_twice_is_harmless():
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    from kvstage.storage import shared

    from vllm_offloading_config import offloading_config

    # No public view of the shared stores open and their users.
    before = dict(shared._open)
    spec = KVStageOffloadingSpec(offloading_config({"storage": "memory", "miss_ttl_s": -1}))
    with pytest.raises(InvalidArgumentError, match="miss_ttl_s"):
        spec.get_manager()
    assert shared._open == before  # the store's user was let go (closed: it had no other)
    padded = torch.zeros(8, 80, dtype=torch.int8)[:, :64]
    kv_caches = CanonicalKVCaches([CanonicalKVCacheTensor(padded, 64)], [[CanonicalKVCacheRef(0, 64)]])
    with pytest.raises(InvalidArgumentError):
        spec.get_worker(kv_caches)
    assert shared._open == before

    good = KVStageOffloadingSpec(offloading_config({"storage": "memory"}))
    manager, other = good.get_manager(), KVStageOffloadingSpec(offloading_config({"storage": "memory"})).get_manager()
    assert manager.storage is other.storage
    manager.shutdown()
    manager.shutdown()  # a second shutdown must not count the other user off
    assert [entry[1] for entry in shared._open.values() if entry[0] is other.storage] == [1]
    other.shutdown()
    assert shared._open == before


def test_a_clear_that_raises_is_logged_and_lookups_resume(caplog):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvstage.integrations.vllm import KVStageOffloadingManager
    from kvstage.storage import LayoutFingerprint, MemoryStore

    store = MemoryStore(LayoutFingerprint.opaque("m", page_bytes=16, page_format="test"))

    def refuse():
        raise OSError("read-only file system")

    store.clear = refuse
    manager = KVStageOffloadingManager(store)
    try:
        manager.reset_cache()
        assert manager.lookup(bytes(36), ReqContext("r")) is LookupResult.MISS  # waiting for the clear
        with (
            caplog.at_level("ERROR", logger="kvstage.integrations.vllm.manager"),
            pytest.raises(OSError, match="read-only"),
        ):
            manager.on_reset_flushed()
        assert any(
            "read-only file system" in r.getMessage()
            for r in caplog.records
            if r.name == "kvstage.integrations.vllm.manager"
        )
        assert manager.lookup(bytes(36), ReqContext("r")) is LookupResult.RETRY  # asked of the store again
    finally:
        manager.shutdown()


def test_prepare_store_sends_no_exists_for_the_keys_it_offers():
    from vllm.v1.kv_offload.base import ReqContext

    from kvstage.integrations.vllm import KVStageOffloadingManager
    from kvstage.storage import LayoutFingerprint, MemoryStore

    store = MemoryStore(LayoutFingerprint.opaque("m", page_bytes=16, page_format="test"))
    asked = []
    real_exists = store.exists
    store.exists = lambda keys: asked.append(list(keys)) or real_exists(keys)
    manager = KVStageOffloadingManager(store)
    try:
        held, new = bytes(36), bytes(35) + b"\x01"
        manager.index.add([held.hex()])
        output = manager.prepare_store([held, new], ReqContext("r"))
        assert output.keys_to_store == [new] and output.store_spec.page_keys == [new.hex()]
        assert not manager.index.refreshing
        manager.index.wait()
        assert asked == []
        assert manager.prepare_store([new], ReqContext("r")).keys_to_store == []  # its store is in flight
    finally:
        manager.shutdown()


def store_url(kind: str, tmp_path, pages: int) -> str:
    """A store of ``kind`` (``memory`` or ``file``) that holds ``pages`` of the rig's blocks (4096
    bytes; a page file adds a header and its key, well under 2048 / 8 bytes)."""
    if kind == "memory":
        return f"memory:{pages * 4096}"
    return f"file:{tmp_path / 'kv'}?capacity_bytes={pages * 4096 + 2048}"


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_a_prefix_stored_in_several_jobs_is_one_chain_evicted_from_its_tail(kind, tmp_path):
    # Chunked prefill (32 tokens a step: 2 blocks) stores a's 6 blocks in 3 jobs; each job's first
    # page must link to the block before it, or chain-aware eviction takes a's head first and no
    # lookup of a's prefix finds anything.
    rig = ConnectorRig(tmp_path / "model", store_url(kind, tmp_path, 8), max_num_batched_tokens=2 * BLOCK)
    try:
        prefix = list(range(1, 6 * BLOCK + 6))  # 6 full blocks and 5 tokens
        run_to_prompt_end(rig, "a", prefix, max_tokens=2)
        rig.run_until_idle()
        storage = rig.manager.storage
        assert storage.stats.pages_stored == 6 and rig.worker.connector_worker.worker.pages_failed == 0
        other = [1000 + token for token in range(4 * BLOCK + 5)]  # unrelated: 4 more pages, 2 evicted
        run_to_prompt_end(rig, "c", other, max_tokens=2)
        rig.run_until_idle()
        assert storage.stats.pages_stored == 10 and storage.stats.pages_evicted == 2
        rig.scheduler.reset_prefix_cache()
        rig.backing.zero_()
        # blocks 0-3 loaded: a's tail went
        assert run_to_prompt_end(rig, "d", prefix, max_tokens=2) == len(prefix) - 4 * BLOCK
        assert_blocks_hold(rig, "d", prefix, 6)
    finally:
        rig.close()


def test_prior_page_keys_follow_the_positions_vllm_records_per_group_as_the_request_grows():
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    from kvstage.integrations.vllm.keys import prior_page_keys

    context = ReqContext(req_id="r")
    hashes = [bytes([i]) * 32 for i in range(4)]
    group0 = [make_offload_key(h, 0) for h in hashes]
    group1 = [make_offload_key(h, 1) for h in hashes]
    for index in range(2):  # vLLM records keys as the request's block hashes grow
        context.set_offload_key_position(group0[index], (index + 1) * 16)
        context.set_offload_key_position(group1[index], (index + 1) * 32)
    assert prior_page_keys(context, [group0[1], group1[1], group0[0]]) == [group0[0].hex(), group1[0].hex(), None]
    for index in range(2, 4):
        context.set_offload_key_position(group0[index], (index + 1) * 16)
    assert prior_page_keys(context, group0[2:]) == [group0[1].hex(), group0[2].hex()]
    assert prior_page_keys(context, [make_offload_key(b"x" * 32, 0)]) == [None]  # no position recorded: unknown
    assert prior_page_keys(ReqContext(req_id="fresh"), group0[:1]) == [None]


def test_a_partial_tail_key_vllm_looked_up_is_no_prior_of_the_next_chunk():
    # vLLM's partial-tail lookup (hash block 16 in blocks of 32) records a position for keys at
    # every hash boundary; a chunk links to the chunk before it, a partial tail to its last chunk
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    from kvstage.integrations.vllm.keys import prior_page_keys

    context = ReqContext(req_id="r")
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(6)]  # the key ending at 16 (i + 1)
    for index in (1, 3, 5):  # the chunks (ends 32, 64, 96), as vLLM records a request's chunks
        context.set_offload_key_position(keys[index], (index + 1) * 16)
    for index in (4, 2):  # partial tails at 80 and 48 looked up, not stored
        context.set_offload_key_position(keys[index], (index + 1) * 16)
    chunks = {0: 32}
    assert prior_page_keys(context, [keys[3], keys[5]], chunk_tokens=chunks) == [keys[1].hex(), keys[3].hex()]
    assert prior_page_keys(context, [keys[4], keys[2]], chunk_tokens=chunks) == [keys[3].hex(), keys[1].hex()]
    assert prior_page_keys(context, [keys[1]], chunk_tokens=chunks) == [None]
    # the order kept in the context is rebuilt for a caller of other chunks (none: every key)
    assert prior_page_keys(context, [keys[3]]) == [keys[2].hex()]
    assert prior_page_keys(context, [keys[3]], chunk_tokens=chunks) == [keys[1].hex()]


def test_a_memory_store_with_writes_of_its_own_takes_the_two_hop_path():
    # put_adopting would keep the blocks' page buffers without running the subclass's _put
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    from kvstage.integrations.vllm import KVStageWorker
    from kvstage.storage import LayoutFingerprint, MemoryStore

    class CheckedWrites(MemoryStore):
        def _put(self, full_keys, pages, full_prior_key=None):
            return super()._put(full_keys, pages, full_prior_key)

    tensors = [torch.zeros((8, 64), dtype=torch.int8) for _ in range(2)]
    kv_caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, 64) for t in tensors], [[CanonicalKVCacheRef(i, 64) for i in range(2)]]
    )
    store = CheckedWrites(LayoutFingerprint.opaque("w", page_bytes=128, page_format="test"))
    worker = KVStageWorker(kv_caches, store, num_host_pages=2)
    try:
        assert worker.copier is not None  # gather + put: the subclass's _put runs
    finally:
        worker.close()


def test_blocks_in_host_memory_move_in_one_hop_to_a_store_that_adopts_and_lends_pages():
    # The store keeps the page buffers the worker filled (no put copy) and lends its pages to loads
    # (no get copy); vLLM sees the same jobs and results as on the two-hop path.
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec

    from kvstage.integrations.vllm import KVStageWorker
    from kvstage.integrations.vllm.manager import KVStageLoadStoreSpec
    from kvstage.offload.one_hop_copies import OneHopCopies

    from adopting_store import AdoptingStore

    generator = torch.Generator().manual_seed(5)
    tensors = [torch.randint(-128, 128, (8, 64), dtype=torch.int8, generator=generator) for _ in range(2)]
    kv_caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, 64) for t in tensors], [[CanonicalKVCacheRef(i, 64) for i in range(2)]]
    )
    store = AdoptingStore(128)
    worker = KVStageWorker(kv_caches, store, num_host_pages=2, report_load_errors=True, reports_stores=True)
    try:
        assert isinstance(worker.keyed, OneHopCopies) and worker.copier is None
        assert worker.submit_store(1, GPULoadStoreSpec([1, 2, 3], [3], [0]), KVStageLoadStoreSpec(["a", "b", "c"]))
        worker.wait({1})
        [stored] = worker.get_finished()
        assert stored.job_id == 1 and stored.success and stored.transfer_size == 3 * 128
        assert store.puts == [(["a", "b"], None, True), (["c"], "b", True)]  # parts of 2, adopting
        for key, block in (("a", 1), ("b", 2), ("c", 3)):
            assert torch.equal(store.page(key), torch.cat([t[block] for t in tensors]).view(torch.uint8))
        store.fail_puts = StorageError("store gone")
        worker.submit_store(2, GPULoadStoreSpec([4], [1], [0]), KVStageLoadStoreSpec(["d"]))
        worker.wait({2})
        assert worker.get_finished()[0].success  # vLLM only frees the blocks; the manager hears d is missing
        assert worker.pages_failed == 1 and worker.take_store_report()[0] == ["d"]
        untouched = [t[5].clone() for t in tensors]
        assert worker.submit_load(3, KVStageLoadStoreSpec(["b", "a", "d"]), GPULoadStoreSpec([6, 7, 5], [3], [0]))
        worker.wait({3})
        [loaded] = worker.get_finished()
        assert loaded.job_id == 3 and loaded.success  # done: its unread block goes to vLLM's scheduler
        assert worker.take_block_ids_with_load_errors() == {5} and worker.loads_failed == 1
        for t in tensors:
            assert torch.equal(t[6], t[2]) and torch.equal(t[7], t[1])
        assert all(torch.equal(t[5], old) for t, old in zip(tensors, untouched))
        assert store.loans_out == 0
    finally:
        worker.close()
