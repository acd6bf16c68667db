"""kvstage's vLLM adapter as a vLLM user drives it, from the README's "Use with vLLM" config only,
through vLLM 0.33.0's own code on CPU: ``KVStageTier`` under the ``TieringOffloadingManager``
that vLLM's ``TieringOffloadingSpec`` builds from the README's tier config, and
``KVStageOffloadingSpec`` loaded by ``spec_name`` / ``spec_module_path`` through vLLM's
``OffloadingConnector`` (its real ``Scheduler``, scheduler and worker roles, real block tensors).

Flows that work are ordinary tests; each defect found is a strict xfail naming it. Two engines
sharing a ``file:`` store are two processes: a child process (its own vLLM) stores, this one loads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector", reason="vLLM 0.33.0 is not installed (make .venv-vllm/.installed, then run with .venv-vllm/bin/python)")

import torch  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402
from vllm_rig import CHUNK_BYTES, ConnectorRig, offloading_config  # noqa: E402

from kvstage.errors import InvalidArgumentError  # noqa: E402
from kvstage.integrations.vllm import KVStageTier  # noqa: E402

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
    return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": CPU_CHUNKS * CHUNK_BYTES, "secondary_tiers": [tier]}


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


def keys_of(*ids: int) -> list[bytes]:
    return [make_offload_key(f"user-block-{i}".encode().ljust(32, b"."), 0) for i in ids]


def chunks_for(keys: list[bytes], seed: int = 11) -> dict[bytes, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {key: torch.randint(0, 256, (CHUNK_BYTES,), dtype=torch.uint8, generator=generator) for key in keys}


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
        waited = [engine.store(keys[start:start + CPU_CHUNKS], chunks, settle=False) for start in range(0, len(keys), CPU_CHUNKS)]
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
