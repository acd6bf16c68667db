"""kvstage's vLLM adapter as a vLLM user drives it, from the README's "Use with vLLM" config only,
through vLLM 0.33.0's own code on CPU: ``KVStageTier`` under the ``TieringOffloadingManager``
that vLLM's ``TieringOffloadingSpec`` builds from the README's tier config, and
``KVStageOffloadingSpec`` loaded by ``spec_name`` / ``spec_module_path`` through kvstage's
``KVStageConnector`` (vLLM's ``OffloadingConnector`` plus failed-load reporting, as the README
configures it) with vLLM's real ``Scheduler``, scheduler and worker roles, real block tensors.

Flows that work are ordinary tests; a defect found is a strict xfail naming it until fixed. Two engines
sharing a ``file:`` store are two processes: a child process (its own vLLM) stores, this one loads.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM 0.33.0 is not installed (make .venv-vllm/.installed, then run with .venv-vllm/bin/python)",
)

import torch  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from kvstage.errors import InvalidArgumentError  # noqa: E402
from kvstage.integrations.vllm import KVStageTier  # noqa: E402

from vllm_offloading_config import CHUNK_BYTES, chunks_for, keys_of, offloading_config  # noqa: E402
from vllm_rig import (  # noqa: E402
    ConnectorRig,
    assert_blocks_hold,
    run_to_prompt_end,
    slow_down,
    step_until_writes_in_flight,
)

BLOCK = ConnectorRig.BLOCK_SIZE
PROMPT = list(range(1, 4 * BLOCK + 6))  # 4 full blocks and 5 tokens
CPU_CHUNKS = 4  # the tier rig's CPU primary tier holds 4 chunks
TESTS = Path(__file__).resolve().parents[2]


# -- KVStageTier under vLLM's TieringOffloadingManager ----------------------------------------


def readme_tier_config(storage: str | None, **more) -> dict:
    """The README's ``kv_connector_extra_config`` for the tier (``cpu_bytes_to_use`` sized to
    CPU_CHUNKS chunks), ``storage`` left out when None."""
    tier = {"type": "KVStageTier", "module_path": "kvstage.integrations.vllm", **more}
    if storage is not None:
        tier["storage"] = storage
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": CPU_CHUNKS * CHUNK_BYTES,
        "secondary_tiers": [tier],
    }


class TierEngine:
    """vLLM's tiering manager built by vLLM's spec from the README config, stepped as vLLM's
    scheduler steps it; the test plays vLLM's GPU worker by writing each stored chunk's bytes
    into the CPU tier's chunk."""

    def __init__(self, storage: str | None, **more) -> None:
        self.manager = TieringOffloadingSpec(offloading_config(readme_tier_config(storage, **more))).get_manager()
        self.tier: KVStageTier = self.manager.secondary_tiers[0]
        self.primary = torch.from_numpy(self.manager.primary_tier.get_kv_memoryview().obj).view(torch.uint8)
        self.request = ReqContext(req_id="r0")
        self.manager.on_new_request(self.request)

    def step(self, *, settle: bool = True) -> None:
        """A scheduler step's end; with ``settle`` after the tier's threads finished."""
        with self.manager.lock:
            if settle:
                self.tier.drain_jobs()
                self.tier.index.wait()
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def store(self, keys: list[bytes], chunks: dict[bytes, torch.Tensor], *, settle: bool = True) -> int:
        """Offload ``keys`` as vLLM's scheduler does: when the CPU tier has no free chunk (its
        chunks still cascading) it answers None and the scheduler tries again a step later.
        Returns the steps it waited."""
        for waited in range(20):
            with self.manager.lock:
                output = self.manager.prepare_store(keys, self.request)
                if output is not None:
                    for key, chunk in zip(output.keys_to_store, output.store_spec.chunk_ids):
                        self.primary[int(chunk)] = chunks[key]
                    self.manager.complete_store(keys, self.request)
            self.step(settle=settle or output is None)
            if output is not None:
                return waited
        raise AssertionError("the CPU tier had no free chunk for 20 steps")

    def lookup(self, key: bytes) -> LookupResult:
        with self.manager.lock:
            return self.manager.lookup(key, self.request)

    def promote(self, key: bytes) -> torch.Tensor | None:
        """Look ``key`` up until vLLM answers HIT or MISS (promoting it from the tier on the
        way); the chunk's bytes in the CPU tier on a HIT, None on a MISS."""
        for _ in range(20):
            answer = self.lookup(key)
            if answer is LookupResult.MISS:
                return None
            if answer is LookupResult.HIT:
                with self.manager.lock:
                    spec = self.manager.prepare_load([key], self.request)
                    row = self.primary[int(spec.chunk_ids[0])].clone()
                    self.manager.complete_load([key], self.request)
                return row
            self.step()
        raise AssertionError(f"no HIT or MISS for {key.hex()} after 20 steps")

    def evict_from_cpu_tier(self, filler: list[bytes], chunks: dict[bytes, torch.Tensor]) -> None:
        """Store CPU_CHUNKS other chunks, one at a time, so vLLM's LRU evicts what was there."""
        for key in filler:
            self.store([key], chunks)
        self.step()

    def events(self) -> list:
        with self.manager.lock:
            return list(self.manager.take_events())

    def close(self) -> None:
        self.manager.shutdown()


@pytest.fixture(params=["memory", "file"])
def tier_engine(request, tmp_path):
    engine = TierEngine("memory" if request.param == "memory" else f"file:{tmp_path / 'kv'}")
    yield engine
    engine.close()


def test_tier_chunks_evicted_from_the_cpu_tier_come_back_by_promotion_byte_for_byte(tier_engine):
    keys, filler = keys_of(0, 1), keys_of(*range(100, 100 + CPU_CHUNKS))
    chunks = chunks_for(keys + filler)
    tier_engine.store(keys, chunks)
    tier_engine.evict_from_cpu_tier(filler, chunks)
    assert tier_engine.lookup(keys[0]) is LookupResult.HIT_PENDING  # only the tier holds it now
    for key in keys:
        assert torch.equal(tier_engine.promote(key), chunks[key])
    assert tier_engine.tier.storage.stats.pages_stored == len(keys) + len(filler)


def test_tier_many_chunks_at_once_all_cascade_and_come_back(tmp_path):
    # 24 chunks, 4 a step without waiting for the tier: vLLM's CPU tier (4 chunks) refuses a
    # store while its chunks still cascade, and takes it once the tier's writes freed them.
    engine = TierEngine(f"file:{tmp_path / 'kv'}")
    try:
        keys = keys_of(*range(24))
        chunks = chunks_for(keys)
        waited = [
            engine.store(keys[start : start + CPU_CHUNKS], chunks, settle=False)
            for start in range(0, len(keys), CPU_CHUNKS)
        ]
        engine.step()
        assert sum(waited) > 0  # the CPU tier was full: vLLM waited for the cascades
        assert engine.tier.storage.stats.pages_stored == len(keys)
        for key in keys[:8]:  # long evicted from the CPU tier
            assert torch.equal(engine.promote(key), chunks[key])
    finally:
        engine.close()


def test_tier_a_corrupt_page_is_a_miss_never_wrong_bytes(tmp_path):
    engine = TierEngine(f"file:{tmp_path / 'kv'}")
    try:
        keys, filler = keys_of(0), keys_of(*range(100, 100 + CPU_CHUNKS))
        chunks = chunks_for(keys + filler)
        engine.store(keys, chunks)
        engine.evict_from_cpu_tier(filler, chunks)
        (page,) = [path for path in (tmp_path / "kv").rglob("*") if path.is_file() and keys[0].hex() in path.name]
        data = bytearray(page.read_bytes())
        data[len(data) // 2] ^= 0xFF
        page.write_bytes(bytes(data))
        assert engine.promote(keys[0]) is None  # the promotion fails for that key: vLLM misses it
        assert engine.lookup(keys[0]) is LookupResult.MISS  # and keeps missing it (recomputes)
        assert not page.exists()  # the reader removed the corrupt page
    finally:
        engine.close()


def test_tier_take_events_as_vllms_publisher_drains_them(tmp_path):
    engine = TierEngine(f"file:{tmp_path / 'kv'}")
    try:
        keys = keys_of(0, 1, 2)
        engine.store(keys, chunks_for(keys))
        taken = [event for event in engine.events() if event.medium.name == "STORAGE"]
        assert [key for event in taken if not event.removed for key in event.keys] == keys
        assert all(event.ownership == "KVStageTier" for event in taken)
        assert engine.events() == []  # drained: a second take gives nothing new
    finally:
        engine.close()


def test_tier_pages_survive_vllms_cache_reset_and_shutdown_with_writes_in_flight(tmp_path):
    # vLLM's TieringOffloadingManager.reset_cache keeps secondary tiers (persistent stores) by
    # design; shutdown finishes queued writes, so a fresh engine finds every page.
    engine = TierEngine(f"file:{tmp_path / 'kv'}")
    keys = keys_of(*range(4))
    chunks = chunks_for(keys)
    try:
        engine.store(keys, chunks)
        with engine.manager.lock:
            engine.manager.reset_cache()
        more = keys_of(10, 11)
        chunks.update(chunks_for(more, seed=12))
        slow_down(engine.tier.storage, "put")
        engine.store(more, chunks, settle=False)
        assert engine.tier.has_pending_work()  # their cascade is still writing at shutdown
    finally:
        engine.close()
    fresh = TierEngine(f"file:{tmp_path / 'kv'}")
    try:
        for key in keys + more:
            assert torch.equal(fresh.promote(key), chunks[key])
    finally:
        fresh.close()


def prefill_engine(root: str) -> None:
    """Another engine, run in a child process: its tier and its spec store under ``root``
    (tier chunks ``keys_of(0..3)``, the spec's PROMPT blocks), then it shuts down."""
    root_path = Path(root)
    engine = TierEngine(f"file:{root_path / 'tier'}")
    keys = keys_of(*range(4))
    try:
        engine.store(keys, chunks_for(keys))
    finally:
        engine.close()
    rig = ConnectorRig(root_path / "model", f"file:{root_path / 'spec'}")
    try:
        rig.add_request("a", PROMPT, max_tokens=1)
        rig.run_until_idle()
        assert rig.manager.storage.stats.pages_stored == 4
    finally:
        rig.close()


@pytest.fixture(scope="module")
def other_engine_root(tmp_path_factory) -> Path:
    """A directory a child process's engine stored into (see :func:`prefill_engine`)."""
    root = tmp_path_factory.mktemp("shared-kv")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }
    script = "import sys, test_vllm_user; test_vllm_user.prefill_engine(sys.argv[1])"
    done = subprocess.run(
        [sys.executable, "-c", script, str(root)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def test_tier_a_second_engine_promotes_what_another_process_stored(other_engine_root):
    engine = TierEngine(f"file:{other_engine_root / 'tier'}")
    try:
        keys = keys_of(*range(4))
        chunks = chunks_for(keys)
        assert engine.lookup(keys[0]) is LookupResult.RETRY  # the tier asks the store on a thread
        for key in keys:
            assert torch.equal(engine.promote(key), chunks[key])
    finally:
        engine.close()


def test_tier_a_misspelled_option_raises_naming_it_and_the_valid_ones():
    with pytest.raises(
        InvalidArgumentError,
        match=r"^miss_tll_s: not an option of KVStageTier .*\['storage', 'model_id', 'read_threads', 'miss_ttl_s', 'hit_ttl_s', 'locality'\]",
    ):
        TierEngine("memory", miss_tll_s=5)


def test_tier_without_storage_raises_naming_it_and_the_rule():
    # the spec requires storage too; a tier that fell back to a private in-process store would
    # silently share nothing with other engines and keep nothing across restarts
    with pytest.raises(InvalidArgumentError, match=r'^storage: required in the KVStageTier config: .* write "memory"'):
        TierEngine(None)


def test_tier_a_bad_locality_raises_naming_it():
    with pytest.raises(
        InvalidArgumentError, match=r"^locality: must be one of \['LOCAL', 'REMOTE'\] or None, got 'far'"
    ):
        TierEngine("memory", locality="far")


@pytest.mark.parametrize("where", ["tier", "spec"])
def test_a_storage_url_of_an_unknown_scheme_raises_naming_storage(where, tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"^storage\b"):
        if where == "tier":
            TierEngine("flie:/var/cache/kvstage")
        else:
            ConnectorRig(tmp_path / "model", "flie:/var/cache/kvstage")


@pytest.mark.parametrize("where", ["tier", "spec"])
def test_a_store_that_cannot_hold_one_page_raises_at_construction(where, tmp_path):
    with pytest.raises(InvalidArgumentError, match="storage"):
        if where == "tier":
            TierEngine("memory:100").close()
        else:
            ConnectorRig(tmp_path / "model", "memory:100").close()


# -- KVStageOffloadingSpec through KVStageConnector (vLLM's OffloadingConnector) ---------------


def test_spec_a_second_engine_loads_what_another_process_stored_byte_for_byte(other_engine_root):
    rig = ConnectorRig(other_engine_root / "model", f"file:{other_engine_root / 'spec'}")
    try:
        scheduled = run_to_prompt_end(rig, "b", PROMPT)
        assert scheduled == len(PROMPT) - 4 * BLOCK  # 4 blocks loaded, only the 5 tokens past them computed
        assert rig.manager.storage.stats.pages_read == 4
        assert_blocks_hold(rig, "b", PROMPT, 4)
    finally:
        rig.close()


@pytest.fixture
def rig(tmp_path):
    """A ConnectorRig over a ``file:`` store in ``tmp_path``, closed after the test."""
    rig = ConnectorRig(tmp_path / "model", f"file:{tmp_path / 'kv'}")
    yield rig
    rig.close()


def test_spec_many_requests_at_once_are_all_stored_and_load_byte_for_byte(rig):
    prompts = {f"r{i}": [1000 * i + t for t in range(1, 2 * BLOCK + 3)] for i in range(4)}
    for request_id, prompt in prompts.items():  # one step schedules all four
        rig.add_request(request_id, prompt, max_tokens=2)
    rig.run_until_idle()
    assert rig.manager.storage.stats.pages_stored == 8  # 2 full blocks each, all distinct
    rig.scheduler.reset_prefix_cache()
    rig.backing.zero_()
    for request_id, prompt in prompts.items():
        assert run_to_prompt_end(rig, request_id + "'", prompt) == 2
        assert_blocks_hold(rig, request_id + "'", prompt, 2)


def test_spec_shutdown_waits_for_writes_in_flight(tmp_path):
    rig = ConnectorRig(tmp_path / "model", f"file:{tmp_path / 'kv'}")
    slow_down(rig.manager.storage, "put")
    rig.add_request("a", PROMPT, max_tokens=1)
    worker = step_until_writes_in_flight(rig)
    assert worker.keyed.jobs_in_flight  # a write is in flight at shutdown
    rig.close()
    fresh = ConnectorRig(tmp_path / "model", f"file:{tmp_path / 'kv'}")
    try:
        assert run_to_prompt_end(fresh, "b", PROMPT) == len(PROMPT) - 4 * BLOCK
        assert_blocks_hold(fresh, "b", PROMPT, 4)
    finally:
        fresh.close()


def test_spec_a_request_aborted_while_its_load_runs_frees_and_the_next_one_loads(rig):
    from vllm.v1.request import RequestStatus

    rig.add_request("a", PROMPT, max_tokens=1)
    rig.run_until_idle()
    rig.scheduler.reset_prefix_cache()
    rig.backing.zero_()
    get = slow_down(rig.manager.storage, "get")
    rig.add_request("b", PROMPT, max_tokens=3)
    rig.step()
    assert rig.worker.connector_worker.worker.keyed.jobs_in_flight == 1  # b's load is reading
    rig.scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    rig.run_until_idle()
    rig.manager.storage.get = get
    rig.backing.zero_()
    assert run_to_prompt_end(rig, "c", PROMPT) == len(PROMPT) - 4 * BLOCK
    assert_blocks_hold(rig, "c", PROMPT, 4)


def test_spec_a_corrupt_page_is_recomputed_never_loaded(rig, tmp_path):
    rig.add_request("a", PROMPT, max_tokens=1)
    rig.run_until_idle()
    for page in (path for path in (tmp_path / "kv").rglob("*") if path.is_file() and path.stat().st_size > 1024):
        data = bytearray(page.read_bytes())
        data[len(data) // 2] ^= 0xFF
        page.write_bytes(bytes(data))
    rig.scheduler.reset_prefix_cache()
    rig.backing.zero_()
    run_to_prompt_end(rig, "b", PROMPT)
    assert_blocks_hold(rig, "b", PROMPT, 4)


def test_spec_pages_evicted_by_another_process_are_recomputed(rig, tmp_path):
    rig.add_request("a", PROMPT, max_tokens=1)
    rig.run_until_idle()
    for page in (tmp_path / "kv").glob("*.kvpage"):  # another process evicts them
        page.unlink()
    rig.scheduler.reset_prefix_cache()
    rig.backing.zero_()
    assert run_to_prompt_end(rig, "b", PROMPT) == len(PROMPT)
    assert_blocks_hold(rig, "b", PROMPT, 4)


def test_spec_pages_are_listed_and_evicted_by_kvstage_store(tmp_path):
    rig = ConnectorRig(tmp_path / "model", f"file:{tmp_path / 'kv'}")
    try:
        rig.add_request("a", PROMPT, max_tokens=1)
        rig.run_until_idle()
        prefix = rig.manager.storage.prefix
    finally:
        rig.close()
    command = [sys.executable, "-m", "kvstage", "store", f"file:{tmp_path / 'kv'}"]
    listed = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and prefix in listed.stdout, listed.stdout + listed.stderr
    evicted = subprocess.run([*command, "--evict", prefix], capture_output=True, text=True, timeout=60)
    assert evicted.returncode == 0, evicted.stderr
    assert not list((tmp_path / "kv").glob("*.kvpage"))


def test_spec_a_prompt_longer_than_the_host_pool_does_not_kill_the_engine(tmp_path):
    rig = ConnectorRig(tmp_path / "model", "memory", extra_config={"num_host_pages": 3})
    try:
        rig.add_request("a", PROMPT, max_tokens=1)  # 4 full blocks: a job of 4, in parts of 3 and 1
        rig.run_until_idle()
        assert rig.manager.storage.stats.pages_stored == 4 and rig.worker.connector_worker.worker.pages_failed == 0
        rig.scheduler.reset_prefix_cache()
        rig.backing.zero_()
        assert run_to_prompt_end(rig, "b", PROMPT) == len(PROMPT) - 4 * BLOCK  # loaded in parts too
        assert_blocks_hold(rig, "b", PROMPT, 4)
    finally:
        rig.close()


def test_spec_no_page_written_before_a_reset_is_loaded_after_it(rig):
    slow_down(rig.manager.storage, "put")
    rig.add_request("a", PROMPT, max_tokens=1)
    worker = step_until_writes_in_flight(rig)
    assert worker.keyed.jobs_in_flight  # a's store is writing ...
    assert rig.scheduler.reset_prefix_cache(reset_connector=True)  # ... when the weights change
    rig.run_until_idle()
    rig.backing.zero_()
    assert run_to_prompt_end(rig, "b", PROMPT) == len(PROMPT)  # nothing of a's KV is loaded


def test_spec_a_store_that_cannot_write_is_reported_done_and_never_hit(tmp_path):
    # memory:4096 holds one block (a page is 4096 bytes): of a's 4-block chain the store keeps the
    # first and fails the rest (a put never evicts its own pages). vLLM's worker sees every job
    # done; the scheduler offers only the block the store holds.
    rig = ConnectorRig(tmp_path / "model", "memory:4096")
    try:
        rig.add_request("a", PROMPT, max_tokens=1)
        rig.run_until_idle()
        worker = rig.worker.connector_worker.worker
        assert rig.manager.storage.stats.pages_stored == 1 and worker.pages_failed == 3
        rig.scheduler.reset_prefix_cache()
        rig.backing.zero_()
        assert run_to_prompt_end(rig, "b", PROMPT) == len(PROMPT) - BLOCK  # one block loaded, no failed load
        assert worker.loads_failed == 0
        assert_blocks_hold(rig, "b", PROMPT, 4)
    finally:
        rig.close()


def test_spec_a_failed_load_reports_its_blocks_and_the_keys_are_not_offered_again(rig, tmp_path):
    rig.add_request("a", PROMPT, max_tokens=1)
    rig.run_until_idle()
    for page in (tmp_path / "kv").glob("*.kvpage"):  # another process evicts them, unseen here
        page.unlink()
    rig.scheduler.reset_prefix_cache()
    rig.backing.zero_()
    worker = rig.worker.connector_worker.worker
    assert run_to_prompt_end(rig, "b", PROMPT) == len(PROMPT)
    assert worker.loads_failed == 1  # one load was offered from the stale index, and failed ...
    key = rig.scheduler.requests["b"].block_hashes[0]
    assert not rig.manager.index.holds(make_offload_key(key, 0).hex())  # ... and is not offered again
    assert_blocks_hold(rig, "b", PROMPT, 4)


def unreadable(storage, key: str) -> None:
    """Make the page ``key`` exist but never read, as a file giving EIO or a Mooncake replica whose
    transfer fails while the master keeps the key: ``exists`` says yes, ``get`` misses it."""
    get = storage.get

    def failing_get(keys, into):
        return [hit and page_key != key for page_key, hit in zip(keys, get(keys, into))]

    storage.get = failing_get


def test_spec_a_page_that_exists_but_cannot_be_read_fails_one_load_then_is_recomputed(rig):
    a = rig.add_request("a", PROMPT, max_tokens=1)
    rig.run_until_idle()
    first = make_offload_key(a.block_hashes[0], 0).hex()
    assert rig.manager.storage.exists([first]) == [True]
    unreadable(rig.manager.storage, first)
    rig.scheduler.reset_prefix_cache()
    rig.backing.zero_()
    worker = rig.worker.connector_worker.worker
    rig.add_request("b", PROMPT, max_tokens=3)
    for _ in range(60):  # b's load fails once; then its blocks are computed (a loop: dozens of failed loads)
        rig.step()
        if "b" not in rig.scheduler.requests:
            break
    assert "b" not in rig.scheduler.requests, f"b is not done after 60 steps: {worker.loads_failed} failed loads"
    assert worker.loads_failed == 1
    assert rig.manager.index.lookup(first) is False  # a miss for miss_ttl_s, not asked of the store again


@pytest.mark.parametrize(
    "backend, simple, connector",
    [
        ("native", "0", "OffloadingConnector"),
        ("native", "1", "SimpleCPUOffloadConnector"),
        ("lmcache", "0", "LMCacheMPConnector"),
    ],
)  # the names vLLM's --kv-offloading-backend writes
def test_vllms_kv_offloading_size_with_kvstages_connector_raises_saying_what_to_do(
    tmp_path, monkeypatch, backend, simple, connector
):
    # vLLM's own config code rewrites kv_connector to OffloadingConnector and keeps kvstage's module
    # path, then its factory looks that name up there while the config is validated (pydantic
    # reports a ValueError as a ValidationError, itself a ValueError; an AttributeError went raw).
    from transformers import LlamaConfig
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig

    LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    ).save_pretrained(tmp_path)
    monkeypatch.setenv("VLLM_USE_SIMPLE_KV_OFFLOAD", simple)
    with pytest.raises(
        ValueError,
        match=rf"kv_connector: vLLM's --kv-offloading-size .*'{backend}' replaced kvstage's connector with '{connector}'.* leave out --kv-offloading-size",
    ):
        VllmConfig(
            model_config=ModelConfig(
                model=str(tmp_path),
                tokenizer=str(tmp_path),
                skip_tokenizer_init=True,
                dtype="float16",
                max_model_len=512,
            ),
            device_config=DeviceConfig(device="cpu"),
            cache_config=CacheConfig(
                block_size=16, enable_prefix_caching=True, kv_offloading_size=1.0, kv_offloading_backend=backend
            ),  # --kv-offloading-size 1
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVStageConnector",
                kv_connector_module_path="kvstage.integrations.vllm",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config={
                    "spec_name": "KVStageOffloadingSpec",
                    "spec_module_path": "kvstage.integrations.vllm",
                    "storage": f"file:{tmp_path / 'kv'}",
                },
            ),
        )


def test_other_missing_names_of_the_package_are_attribute_errors():
    import kvstage.integrations.vllm as package

    assert not hasattr(package, "KVStageConector")


def shm_regions() -> set[str]:
    return {path.name for path in Path("/dev/shm").glob("vllm_offload_*")}


def test_kvstages_connector_with_another_spec_raises_before_vllm_builds_its_shared_memory(tmp_path):
    # vLLM's TieringOffloadingSpec with cpu_bytes_to_use maps /dev/shm/vllm_offload_<engine>.mmap
    # as it is built: the check must come before vLLM's connector builds the spec.
    before = shm_regions()
    config = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 1 << 20,
        "secondary_tiers": [
            {"type": "KVStageTier", "module_path": "kvstage.integrations.vllm", "storage": f"file:{tmp_path / 'kv'}"}
        ],
    }
    with pytest.raises(
        InvalidArgumentError,
        match=r"spec_name: KVStageConnector runs 'KVStageOffloadingSpec'.*got 'TieringOffloadingSpec'",
    ):
        ConnectorRig(tmp_path / "model", None, connector_config=config)
    assert shm_regions() - before == set()


@pytest.mark.parametrize(
    "config, rule",
    [
        ({}, r"spec_name: required.*'KVStageOffloadingSpec'.*spec_module_path 'kvstage.integrations.vllm'"),
        ({"spec_name": "KVStageOffloadingSpec"}, r"spec_module_path: required.*'kvstage.integrations.vllm'"),
        (
            {"spec_name": "KVStageOffloadingSpec", "spec_module_path": "kvstage.integrations.vlm"},
            r"spec_module_path: cannot load 'KVStageOffloadingSpec' from 'kvstage.integrations.vlm'",
        ),
        (
            {"spec_name": "KVStageTier", "spec_module_path": "kvstage.integrations.vllm"},
            r"spec_name: KVStageConnector runs 'KVStageOffloadingSpec'.*got 'KVStageTier', not an OffloadingSpec",
        ),
    ],
    ids=["no spec_name", "no spec_module_path", "misspelled spec_module_path", "a tier as the spec"],
)
def test_kvstages_connector_without_its_spec_raises_naming_the_key_and_the_value(tmp_path, config, rule):
    before = shm_regions()
    with pytest.raises(InvalidArgumentError, match=rule):
        ConnectorRig(tmp_path / "model", None, connector_config={"storage": f"file:{tmp_path / 'kv'}", **config})
    assert shm_regions() - before == set()


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_spec_a_corrupt_page_mid_chain_recomputes_from_it_and_keeps_the_blocks_before(rig, caplog):
    a = rig.add_request("a", PROMPT, max_tokens=1)
    rig.run_until_idle()
    flip_a_byte(rig.manager.storage.path_of(make_offload_key(a.block_hashes[2], 0).hex()))  # the page at chain index 2
    rig.scheduler.reset_prefix_cache()
    rig.backing.zero_()
    worker = rig.worker.connector_worker.worker
    reported = []
    take = worker.take_block_ids_with_load_errors
    worker.take_block_ids_with_load_errors = lambda: _taken(take, reported)  # what vLLM's scheduler is told
    scheduled = run_to_prompt_end(rig, "b", PROMPT)
    assert worker.loads_failed == 1
    assert scheduled == len(PROMPT) - 2 * BLOCK  # blocks 0 and 1 loaded, from block 2 on computed
    assert sorted(reported) == sorted(rig.block_ids("b")[2:4])
    assert_blocks_hold(rig, "b", PROMPT, 4)
    assert "page missing or corrupt in the store" in caplog.text and "None" not in caplog.text


def _taken(take, reported: list) -> set[int]:
    blocks = take()
    reported.extend(blocks)
    return blocks


def test_spec_a_store_that_is_full_warns_with_the_stores_cause(tmp_path, caplog):
    rig = ConnectorRig(tmp_path / "model", "memory:4096")  # one page: the rest of the chain is refused
    try:
        rig.add_request("a", PROMPT, max_tokens=1)
        rig.run_until_idle()
    finally:
        rig.close()
    [warning] = [record.getMessage() for record in caplog.records if "store job" in record.getMessage()]
    assert "wrote 1 of 4 pages" in warning and "None" not in warning, warning


def test_spec_under_the_fail_policy_a_failed_load_warns_that_the_request_fails(tmp_path, caplog):
    rig = ConnectorRig(tmp_path / "model", f"file:{tmp_path / 'kv'}", load_failure_policy="fail")
    try:
        rig.add_request("a", PROMPT, max_tokens=1)
        rig.run_until_idle()
        for page in (tmp_path / "kv").glob("*.kvpage"):  # another process evicts them, unseen here
            page.unlink()
        rig.scheduler.reset_prefix_cache()
        rig.add_request("b", PROMPT, max_tokens=3)
        rig.run_until_idle()
    finally:
        rig.close()
    [warning] = [record.getMessage() for record in caplog.records if "load job" in record.getMessage()]
    assert "computed again" not in warning and "kv_load_failure_policy 'fail'" in warning, warning


def test_tier_a_store_that_is_full_warns_with_the_cause_not_none(caplog):
    engine = TierEngine(f"memory:{CHUNK_BYTES}")  # one page: of a 2-chunk chain the store refuses the second
    try:
        keys = keys_of(0, 1)
        engine.store(keys, chunks_for(keys))
        engine.step()
    finally:
        engine.close()
    [warning] = [record.getMessage() for record in caplog.records if "store job" in record.getMessage()]
    assert "wrote 1 of 2 pages" in warning and "None" not in warning and "no room" in warning, warning


def test_spec_a_store_refusing_a_chain_warns_with_the_stores_error(tmp_path, caplog):
    # Chunked prefill stores a's chain in one job a step, each chained to the job before; when the
    # store drops the first job's pages (another process's eviction, here a clear) the next job's
    # put fails with the store's MissingPriorError, which the warning must carry.
    # The clear runs just before the second job's put (not after a step that may already have seen
    # that put land, as on a loaded machine).
    rig = ConnectorRig(tmp_path / "model", "memory", max_num_batched_tokens=2 * BLOCK)
    try:
        storage = rig.manager.storage
        priors = []

        def hooked(real_put):
            def put(keys, pages, *, prior_key=None):
                priors.append(prior_key)
                if len(priors) == 2:
                    assert storage.stats.pages_stored == 2  # the first job: blocks 0 and 1
                    storage.clear()
                return real_put(keys, pages, prior_key=prior_key)

            return put

        storage.put = hooked(storage.put)
        if hasattr(storage, "put_adopting"):  # a store that adopts pages: the worker's one-hop path
            storage.put_adopting = hooked(storage.put_adopting)
        rig.add_request("a", PROMPT, max_tokens=1)
        rig.run_until_idle()
    finally:
        rig.close()
    assert len(priors) >= 2 and priors[0] is None and priors[1] is not None, priors
    warnings = [record.getMessage() for record in caplog.records if "store job" in record.getMessage()]
    assert warnings and all("MissingPriorError" in warning for warning in warnings), warnings
