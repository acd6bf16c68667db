"""KVStageTier under vLLM 0.33.0's own TieringOffloadingManager, built by vLLM's
TieringOffloadingSpec from a kv_connector_extra_config naming the tier by module path, over
kvstage's memory and file stores, on CPU.

The flow is vLLM's: prepare_store / complete_store put chunks in the CPU primary tier (its real
shared-memory region; the test writes each chunk's bytes as the GPU copy would) and cascade them
to the tier; the CPU tier's LRU evicts them; a lookup finds them in the tier (HIT_PENDING while
the promotion runs, then HIT) and the promoted chunk's bytes equal the stored ones. A corrupted
page reads as a miss, never as wrong bytes. Store events arrive as vLLM OffloadingEvents.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.spec",
    reason="vLLM 0.33.0 is not installed (make .venv-vllm/.installed, then run with .venv-vllm/bin/python)",
)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext, ScheduleEndContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from kvstage.errors import InvalidArgumentError  # noqa: E402
from kvstage.integrations.vllm import KVStageTier  # noqa: E402
from kvstage.storage import FileStore  # noqa: E402

from vllm_offloading_config import CHUNK_BYTES, chunks_for, keys_of, offloading_config  # noqa: E402

NUM_CHUNKS = 4  # the CPU tier's slots


def tier_config(storage: str, **more) -> dict:
    return {"type": "KVStageTier", "module_path": "kvstage.integrations.vllm", "storage": storage, **more}


class Rig:
    """vLLM's tiering manager with one KVStageTier, stepped as vLLM's scheduler steps it."""

    def __init__(
        self, storage: str, *, events: bool = True, engine_id: str | None = None, window_chunks: int | None = None
    ) -> None:
        extra = {"cpu_bytes_to_use": NUM_CHUNKS * CHUNK_BYTES, "secondary_tiers": [tier_config(storage)]}
        config = offloading_config(extra, events=events, engine_id=engine_id, window_chunks=window_chunks)
        self.spec = TieringOffloadingSpec(config)
        self.manager = self.spec.get_manager()
        self.tier: KVStageTier = self.manager.secondary_tiers[0]
        self.primary = torch.from_numpy(self.manager.primary_tier.get_kv_memoryview().obj).view(torch.uint8)
        self.request = ReqContext(req_id="r0")
        self.manager.on_new_request(self.request)

    def step(self) -> None:
        """End a scheduler step after the tier's threads finished what was submitted."""
        with self.manager.lock:
            self.tier.drain_jobs()
            self.tier.index.wait()
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def store(
        self, keys: list[bytes], chunk_bytes: dict[bytes, torch.Tensor], request: ReqContext | None = None
    ) -> None:
        """GPU -> CPU tier as vLLM's worker would, then cascade to the tier; one step.
        ``request``: the request storing them (default: the rig's)."""
        request = request or self.request
        with self.manager.lock:
            output = self.manager.prepare_store(keys, request)
            for key, chunk in zip(output.keys_to_store, output.store_spec.chunk_ids):
                self.primary[int(chunk)] = chunk_bytes[key]
            self.manager.complete_store(keys, request)
        self.step()

    def store_one_at_a_time(self, keys: list[bytes], chunk_bytes: dict[bytes, torch.Tensor]) -> None:
        """:meth:`store` each key on its own (past NUM_CHUNKS keys the CPU tier's LRU evicts the
        oldest), then a step, whose cascade completions release the CPU chunks."""
        for key in keys:
            self.store([key], chunk_bytes)
        self.step()

    def lookup(self, key: bytes) -> LookupResult:
        with self.manager.lock:
            return self.manager.lookup(key, self.request)

    def primary_bytes(self, key: bytes) -> torch.Tensor:
        with self.manager.lock:
            spec = self.manager.prepare_load([key], self.request)
            row = self.primary[int(spec.chunk_ids[0])].clone()
            self.manager.complete_load([key], self.request)
        return row

    def events(self) -> list:
        with self.manager.lock:
            return list(self.manager.take_events())

    def close(self) -> None:
        self.manager.shutdown()


@pytest.fixture(params=["memory", "file"])
def rig(request, tmp_path):
    rig = Rig("memory" if request.param == "memory" else f"file:{tmp_path / 'kv'}")
    yield rig
    rig.close()


def test_stored_chunks_cascade_to_the_store_byte_for_byte(rig):
    keys = keys_of(0, 1, 2)
    chunks = chunks_for(keys)
    rig.store(keys, chunks)
    store = rig.tier.storage
    for key in keys:
        into = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
        assert store.get([key.hex()], [into]) == [True]
        assert torch.equal(into, chunks[key])
    assert store.stats.pages_stored == 3


def test_chunks_evicted_from_the_cpu_tier_come_back_by_promotion_with_equal_bytes(rig):
    keys = keys_of(*range(NUM_CHUNKS + 2))
    chunks = chunks_for(keys)
    rig.store_one_at_a_time(keys, chunks)  # the CPU tier's LRU evicts the oldest two
    evicted = keys[:2]
    assert rig.lookup(evicted[0]) is LookupResult.HIT_PENDING  # in the tier: promotion queued
    assert rig.lookup(evicted[0]) is LookupResult.HIT_PENDING
    rig.step()  # vLLM submits the promotion at the step's end; the reader thread runs it
    rig.step()
    assert rig.lookup(evicted[0]) is LookupResult.HIT
    assert torch.equal(rig.primary_bytes(evicted[0]), chunks[evicted[0]])
    assert rig.tier.storage.stats.pages_read == 1


def test_a_corrupted_page_reads_as_a_miss_and_is_removed(tmp_path):
    rig = Rig(f"file:{tmp_path / 'kv'}")
    try:
        keys = keys_of(*range(NUM_CHUNKS + 1))
        chunks = chunks_for(keys)
        rig.store_one_at_a_time(keys, chunks)
        victim = keys[0]
        store: FileStore = rig.tier.storage
        path = store.path_of(victim.hex())
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF  # a flipped bit in the payload, the file's size unchanged
        path.write_bytes(bytes(data))
        rig.events()
        assert rig.lookup(victim) is LookupResult.HIT_PENDING  # the index still says held
        rig.step()
        rig.step()
        assert rig.lookup(victim) is LookupResult.MISS  # the promotion failed: never wrong bytes
        assert not path.exists()
        removed = [event for event in rig.events() if event.medium is Medium.STORAGE and event.removed]
        assert [event.keys for event in removed] == [[victim]]
    finally:
        rig.close()


def test_a_failed_store_and_a_failed_promotion_are_logged_with_the_stores_error(caplog):
    rig = Rig("memory")
    try:
        keys = keys_of(0)
        job = TransferJob(1, keys, np.array([0]), is_promotion=False, req_context=rig.request)

        def refuse(*args, **kwargs):
            raise OSError("disk full")

        rig.tier.storage.put = refuse
        rig.tier.storage.get = refuse
        with caplog.at_level("WARNING", logger="kvstage.integrations.vllm.tier"):
            rig.tier.submit_store(job)
            rig.tier.drain_jobs()
            [stored] = rig.tier.get_finished_jobs()
            rig.tier.submit_load(TransferJob(2, keys, np.array([1]), is_promotion=True, req_context=rig.request))
            rig.tier.drain_jobs()
            [promoted] = rig.tier.get_finished_jobs()
        assert not stored.success and not promoted.success
        warnings = [r.getMessage() for r in caplog.records if r.name == "kvstage.integrations.vllm.tier"]
        assert len(warnings) == 2 and all("disk full" in w for w in warnings), warnings
        assert "store job 1 wrote 0 of 1 pages" in warnings[0] and "promotion job 2 of 1 pages" in warnings[1]
    finally:
        rig.close()


def test_store_events_arrive_as_vllm_events_stored_and_evicted(tmp_path):
    # A store with room for 3 pages: the 4th and 5th evict chain tails (each chunk its own chain).
    rig = Rig(f"memory:{3 * CHUNK_BYTES}")
    try:
        keys = keys_of(*range(5))
        chunks = chunks_for(keys)
        for key in keys:
            rig.store([key], chunks)
        events = [event for event in rig.events() if event.medium is Medium.STORAGE]
        stored = [key for event in events if not event.removed for key in event.keys]
        evicted = [key for event in events if event.removed for key in event.keys]
        assert stored == keys
        assert len(evicted) == 2 and set(evicted) <= set(keys[:3])
        assert all(event.ownership == "KVStageTier" for event in events)
        for key in evicted:  # the index heard of the evictions: no promotion of a page that is gone
            assert rig.tier.lookup(key, rig.request) is LookupResult.MISS
    finally:
        rig.close()


def test_no_vllm_events_while_vllm_publishes_none():
    rig = Rig("memory", events=False)
    try:
        rig.store(keys_of(0), chunks_for(keys_of(0)))
        assert rig.events() == []
        assert rig.tier.storage.stats.pages_stored == 1
    finally:
        rig.close()


def test_a_second_engine_finds_pages_another_stored_without_a_blocking_lookup(tmp_path):
    url = f"file:{tmp_path / 'kv'}"
    first = Rig(url)
    keys = keys_of(0, 1)
    chunks = chunks_for(keys)
    try:
        first.store(keys, chunks)
    finally:
        first.close()
    second = Rig(url)
    try:
        assert second.lookup(keys[0]) is LookupResult.RETRY  # the store is being asked
        second.step()
        assert second.lookup(keys[0]) is LookupResult.HIT_PENDING  # found: promotion queued
        second.step()
        second.step()
        assert second.lookup(keys[0]) is LookupResult.HIT
        assert torch.equal(second.primary_bytes(keys[0]), chunks[keys[0]])
    finally:
        second.close()


@pytest.mark.parametrize("submit", ["submit_store", "submit_load"])
def test_a_job_of_more_keys_than_chunks_raises_naming_it_and_submits_nothing(submit):
    rig = Rig("memory")
    try:
        submitted = []
        # The tier's workers are private: wrapped to see what a job submits.
        workers = rig.tier._workers
        for name in ("read", "write"):
            real = getattr(workers, name)
            setattr(workers, name, lambda fn, real=real: submitted.append(fn) or real(fn))
        job = TransferJob(
            7, keys_of(0, 1), np.array([0]), is_promotion=submit == "submit_load", req_context=rig.request
        )
        with pytest.raises(InvalidArgumentError, match="job_metadata"):
            getattr(rig.tier, submit)(job)
        assert submitted == []
        assert not rig.tier.has_pending_work()
    finally:
        rig.close()


def test_a_bad_storage_url_raises_naming_it_before_the_manager_exists():
    with pytest.raises(InvalidArgumentError, match="storage"):
        Rig("nosuch://x")


def test_a_hybrid_models_chunks_of_two_groups_cascade_and_come_back(rig):
    # One job holding chunks of KV groups 0 and 1 (a hybrid model's full and sliding layers).
    keys = [make_offload_key(f"block-{i}".encode().ljust(32, b"."), i % 2) for i in range(NUM_CHUNKS + 2)]
    chunks = chunks_for(keys)
    rig.store_one_at_a_time(keys, chunks)
    assert rig.tier.storage.stats.pages_stored == len(keys)
    assert rig.lookup(keys[1]) is LookupResult.HIT_PENDING  # group 1's chunk, evicted from the CPU tier
    rig.step()
    rig.step()
    assert rig.lookup(keys[1]) is LookupResult.HIT
    assert torch.equal(rig.primary_bytes(keys[1]), chunks[keys[1]])


def test_the_tier_over_a_real_mooncake_master(tmp_path):
    from kvstage.storage.mooncake.store import master_binary, mooncake_available

    from mooncake_master import LocalMooncakeMaster

    if not (mooncake_available() and master_binary()):
        pytest.skip("the Mooncake store is not installed (make .venv/.mooncake)")
    with LocalMooncakeMaster(tmp_path / "master.log") as master:
        rig = Rig(master.url())
        try:
            keys = keys_of(*range(NUM_CHUNKS + 2))
            chunks = chunks_for(keys)
            rig.store_one_at_a_time(keys, chunks)
            assert rig.lookup(keys[0]) is LookupResult.HIT_PENDING
            rig.step()
            rig.step()
            assert rig.lookup(keys[0]) is LookupResult.HIT
            assert torch.equal(rig.primary_bytes(keys[0]), chunks[keys[0]])
        finally:
            rig.close()


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_a_prefix_cascaded_in_several_jobs_is_one_chain_evicted_from_its_tail(kind, tmp_path):
    # vLLM stores a chunked prefill's chunks a job a step and records each key's end token in the
    # request's ReqContext (its connector scheduler's update_offload_keys, as here); each job's
    # first page must link to the request's chunk before it, or the tier store's chain-aware
    # eviction takes the oldest job's head first.
    url = "memory:32768" if kind == "memory" else f"file:{tmp_path / 'kv'}?capacity_bytes={8 * CHUNK_BYTES + 2048}"
    rig = Rig(url)  # the tier store holds 8 chunks (a page file's header and key: under 256 bytes)
    try:
        prefix, other = keys_of(*range(6)), keys_of(*range(4), tag="other")
        chunks = chunks_for(prefix + other)
        for keys, request in ((prefix, rig.request), (other, ReqContext(req_id="r1"))):
            for index, key in enumerate(keys):
                request.set_offload_key_position(key, (index + 1) * 16)
            rig.manager.on_new_request(request)
            for start in range(0, len(keys), 2):  # 2 chunks a step
                rig.store(keys[start : start + 2], chunks, request)
        storage = rig.tier.storage
        assert storage.stats.pages_stored == 10 and storage.stats.pages_evicted == 2
        assert storage.exists([key.hex() for key in prefix]) == [True] * 4 + [False] * 2  # a's tail went
    finally:
        rig.close()


def test_a_partial_tail_key_looked_up_between_two_jobs_does_not_break_the_chain(tmp_path):
    # With hash blocks finer than a chunk (prefix_match_unit), vLLM's connector scheduler also
    # records a position for each partial-tail key it looks up (a hash boundary inside a chunk:
    # here 24, in 16-token chunks); the next job's chunk links to the chunk before it, not to
    # that key: before, its page was refused as unreachable (1 of 2 pages stored)
    rig = Rig(f"file:{tmp_path / 'kv'}")
    try:
        chunk_keys, tail = keys_of(0, 1), keys_of(9, tag="tail")[0]
        chunks = chunks_for(chunk_keys)
        rig.request.set_offload_key_position(chunk_keys[0], 16)
        rig.store(chunk_keys[:1], chunks)
        rig.request.set_offload_key_position(tail, 24)  # looked up, never stored
        rig.request.set_offload_key_position(chunk_keys[1], 32)
        rig.store(chunk_keys[1:], chunks)
        storage = rig.tier.storage
        assert storage.stats.pages_stored == 2
        assert storage.exists([key.hex() for key in chunk_keys]) == [True, True]
    finally:
        rig.close()


@pytest.mark.parametrize("window_chunks", [1, 2])  # a Mamba state group, a sliding window of 2 chunks
def test_a_window_or_state_chunk_whose_chunk_before_vllm_never_stored_is_stored(window_chunks, tmp_path):
    # vLLM records a position for every chunk of every group but stores only a window's or a
    # state's chunks that can serve a hit: such a chunk links to no predecessor (as in
    # KVStageOffloadingSpec). Before, the tier linked it to the chunk before it and the store
    # refused it as unreachable.
    rig = Rig(f"file:{tmp_path / 'kv'}", window_chunks=window_chunks)
    try:
        from vllm.v1.kv_offload.base import make_offload_key

        full = keys_of(0, 1, 2)
        state = [make_offload_key(f"state-{i}".encode().ljust(32, b"."), 1) for i in range(3)]
        chunks = chunks_for(full + state)
        for index in range(3):
            rig.request.set_offload_key_position(full[index], (index + 1) * 16)
            rig.request.set_offload_key_position(state[index], (index + 1) * 16)
        rig.store(full[:2], chunks)
        rig.store([full[2], state[2]], chunks)  # the group-1 chunk at 48 only, as vLLM stores it
        storage = rig.tier.storage
        assert storage.exists([key.hex() for key in full + state]) == [True] * 3 + [False, False, True]
        assert storage.stats.pages_failed == 0
    finally:
        rig.close()
