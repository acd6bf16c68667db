"""sglang's flavour of the KV events (``event_format=SGLANG_FORMAT``) through a real
OffloadManager: sglang's block hashes (first 16 hex digits, signed), its L3 tier ``"DISK"``,
``cache_salt`` as its own field, and no vLLM-only fields on the wire. (sglang's own decoder
reads these payloads in tests/integrations/sglang/test_sglang_kv_events.py.)"""

from __future__ import annotations

import msgpack
import pytest

from kvstage.errors import InvalidArgumentError
from kvstage.events import (
    SGLANG_FORMAT,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVEventSubscriber,
    sglang_block_hash,
)
from kvstage.events.sglang_format import encode_sglang_batch
from kvstage.events.wire import merge_stored

from offload_rig import make_rig

PAGE = 2


@pytest.fixture
def sglang_publisher():
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", event_format=SGLANG_FORMAT)
    yield pub
    pub.close()


def test_sglang_block_hash_is_the_first_16_hex_digits_signed():
    assert sglang_block_hash("0000000000000005" + "f" * 48) == 5
    assert sglang_block_hash("ffffffffffffffff" + "0" * 48) == -1
    assert sglang_block_hash("8000000000000000") == -(1 << 63)
    with pytest.raises(InvalidArgumentError, match="page_key: must be hexadecimal"):
        sglang_block_hash("z" * 16)


def test_the_wire_maps_carry_sglangs_fields_only():
    stored = BlockStored([1], None, [5, 6], 2, "lora-7", "DISK", [("lora-7", "salt")], "salt")
    ts, events, rank = msgpack.unpackb(encode_sglang_batch(KVEventBatch(1.0, [stored, BlockRemoved([1], "DISK")], 0)))
    assert (ts, rank) == (1.0, 0)
    assert events == [
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "parent_block_hash": None,
            "token_ids": [5, 6],
            "block_size": 2,
            "lora_id": None,
            "medium": "DISK",
            "cache_salt": "salt",
        },
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "DISK"},
    ]


def test_runs_of_different_salts_are_not_joined():
    first = BlockStored([1], None, [5, 6], 2, cache_salt="a")
    same, other = BlockStored([2], 1, [7, 8], 2, cache_salt="a"), BlockStored([2], 1, [7, 8], 2, cache_salt="b")
    assert merge_stored([first, same])[0].block_hashes == [1, 2]
    assert len(merge_stored([first, other])) == 2


def test_a_manager_publishing_in_sglangs_flavour_names_pages_by_sglangs_hashes_at_disk(sglang_publisher, connected):
    sub = KVEventSubscriber(sglang_publisher.endpoint, replay_endpoint=sglang_publisher.replay_endpoint)
    connected(sglang_publisher, sub)
    rig = make_rig(page_size=PAGE, store_prompt=True, kv_events=sglang_publisher)
    req = rig.new_request("a", [11, 12, 13, 14], 4, cache_salt="tenant-a")
    rig.manager.offload(req)
    rig.copy_stream.complete_all()
    req.done = True
    rig.manager.finish(req)
    rig.copy_stream.complete_all()
    rig.manager.drain()
    keys = rig.chain(req)
    events = []
    while sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored)) < 2:
        batches = sub.poll(5.0)
        assert batches, "no batch"
        events += [e for _, batch in batches for e in batch.events if isinstance(e, BlockStored)]
    sub.close()
    assert [h for e in events for h in e.block_hashes] == [sglang_block_hash(key) for key in keys]
    assert [t for e in events for t in e.token_ids] == [11, 12, 13, 14]
    assert {(e.medium, e.cache_salt, e.block_size) for e in events} == {("DISK", "tenant-a", PAGE)}
    assert events[0].parent_block_hash is None


def _dynamo_helpers():
    """test_dynamo.py's indexer helpers (this suite imports test files by path, not by name)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("dynamo_helpers", Path(__file__).with_name("test_dynamo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dynamos_indexer_reads_the_sglang_flavour_at_its_disk_tier_and_drops_it_after_clear():
    dynamo = _dynamo_helpers()
    Indexer, _until_connected, store_prefix = dynamo.Indexer, dynamo._until_connected, dynamo.store_prefix
    dynamo.require_dynamo()
    publisher = KVEventPublisher("tcp://127.0.0.1:0", topic="engine-1", event_format=SGLANG_FORMAT)
    indexer = Indexer(publisher.endpoint, 4)
    try:
        _until_connected(indexer, publisher)
        rig = make_rig(page_size=4, store_prompt=True, kv_events=publisher)
        prompt = list(range(100, 100 + 4 * 4 + 1))
        req = store_prefix(rig, "a", prompt)
        assert rig.manager.metrics.pages_stored == 4
        assert min(sglang_block_hash(key) for key in rig.chain(req)) < 0  # a signed hash among them
        assert indexer.wait_for(prompt, 16) == 16
        assert rig.manager.flush() == 4
        rig.manager.poll()
        assert indexer.wait_for(prompt, 0) == 0
        rig.manager.close()
    finally:
        indexer.stop()
        publisher.close()
