"""Dynamo's standalone KV indexer (``ai-dynamo-runtime``) fed by vLLM 0.33.0's own KV-event
path: vLLM's real ``Scheduler`` with ``KVStageOffloadingSpec`` (``self_describing_kv_events``)
publishes through its ``ZmqEventPublisher``, the indexer subscribes to it, and its ``/query``
overlap at the disk tier is the prefix the spec stored (once vLLM's GPU prefix cache let it go:
Dynamo counts its GPU tier at the disk tier too), one block less after the store lost its last
page, and 0 after a connector cache reset.

The indexer binds 0.0.0.0 and vLLM's publisher ``tcp://*:PORT``: run inside the network
namespace (``bash tools/in-netns.sh``), which has loopback only.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM 0.33.0 is not installed (make .venv-vllm/.installed, then run with .venv-vllm/bin/python)",
)
pytest.importorskip("zmq")

from dynamo_rig import Indexer, free_port, require_dynamo  # noqa: E402
from vllm_rig import ConnectorRig  # noqa: E402

BLOCK = ConnectorRig.BLOCK_SIZE
SELF_DESCRIBING = {"self_describing_kv_events": True}  # token ids, parent, block size: what Dynamo indexes by
PAGE_BYTES = 2 * BLOCK * ConnectorRig.NUM_KV_HEADS * ConnectorRig.HEAD_SIZE * 2 * len(ConnectorRig.LAYERS)


def zmq_events_config(port: int):
    """vLLM's ZMQ publisher on ``tcp://*:PORT`` (it takes a wildcard endpoint to bind; the
    namespace has loopback only)."""
    from vllm.config import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}", topic="kvstage")


def _until_connected(indexer: Indexer, publisher) -> None:
    """Publish a probe block through vLLM's publisher until the indexer sees it (a SUB gets
    nothing sent before it connected), then remove it."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    probe, probe_hash = [200 + i % 50 for i in range(BLOCK)], 0xABCDEF
    deadline = time.monotonic() + 20
    while indexer.disk_overlap(probe) != BLOCK:
        assert time.monotonic() < deadline, "dynamo.indexer never received vLLM's KV events"
        stored = BlockStored([probe_hash], None, probe, BLOCK, None, "STORAGE", None)
        publisher.publish(KVEventBatch(ts=time.time(), events=[stored]))
        time.sleep(0.1)
    publisher.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved([probe_hash], "STORAGE")]))
    assert indexer.wait_for(probe, 0) == 0


def _storage_hashes(events: list, kind: type) -> set:
    return {h for event in events if isinstance(event, kind) and event.medium == "STORAGE" for h in event.block_hashes}


def test_dynamo_indexer_sees_the_specs_stored_prefix_its_removal_and_reset(tmp_path):
    require_dynamo()
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, EventPublisherFactory
    from vllm.v1.kv_offload.base import make_offload_key

    rig = ConnectorRig(tmp_path / "model", f"file:{tmp_path / 'kv'}", extra_config=SELF_DESCRIBING)
    port, indexer = free_port(), None
    try:  # vLLM's ZMQ publisher instead of the rig's null one
        rig.scheduler.kv_event_publisher.shutdown()
        publisher = rig.scheduler.kv_event_publisher = EventPublisherFactory.create(zmq_events_config(port), 0)
        sent: list = []  # every event vLLM published, in order
        publish = publisher.publish
        publisher.publish = lambda batch: (sent.extend(batch.events), publish(batch))[1]
        indexer = Indexer(f"tcp://127.0.0.1:{port}", BLOCK)
        _until_connected(indexer, publisher)

        first = list(range(1, 3 * BLOCK + 3))  # 3 full blocks and 2 tokens
        request = rig.add_request("a", first)
        rig.run_until_idle()
        store = rig.manager.storage
        assert store.stats.pages_stored == 3
        assert indexer.wait_for(first, 3 * BLOCK) == 3 * BLOCK
        assert indexer.disk_overlap(first[: 2 * BLOCK] + [7] * BLOCK) == 2 * BLOCK  # matches as far as they agree

        # A filler of 30 blocks takes every GPU block: vLLM evicts the first's from its prefix
        # cache (BlockRemoved at GPU), so only the store holds them. Dynamo counts a block at its
        # GPU tier at the disk tier too.
        filler = [200 + i % 50 for i in range(30 * BLOCK + 2)]
        rig.add_request("filler", filler)
        rig.run_until_idle()
        assert store.stats.pages_stored == 33
        assert indexer.overlaps(first) == {"gpu": 0, "cpu": 0, "disk": 3 * BLOCK}
        assert indexer.disk_overlap(filler) == 30 * BLOCK

        # The store loses the first prompt's last page: its workers report it, vLLM announces it removed.
        assert store.remove([make_offload_key(request.block_hashes[2], 0).hex()]) == 1
        rig.run(2)
        assert indexer.wait_for(first, 2 * BLOCK) == 2 * BLOCK
        assert indexer.disk_overlap(filler) == 30 * BLOCK

        held = _storage_hashes(sent, BlockStored) - _storage_hashes(sent, BlockRemoved)
        assert len(held) == 32
        before = len(sent)
        assert rig.scheduler.reset_prefix_cache(reset_connector=True)  # the store cleared
        rig.run(2)  # vLLM publishes the connector's events of a step
        # vLLM's own GPU reset sends AllBlocksCleared (Dynamo drops every tier of the worker on
        # it); the connector's clear then announces every page it held removed.
        assert _storage_hashes(sent[before:], BlockRemoved) == held
        assert indexer.wait_for(first, 0) == 0
        assert indexer.wait_for(filler, 0) == 0
    finally:
        log = indexer.stop() if indexer is not None else ""
        rig.close()
        rig.scheduler.kv_event_publisher.shutdown()
        print(log[-4000:])
