"""kvstage's KV events in vLLM 0.33.0's own format, both ways: vLLM's msgspec decoder
(``vllm.distributed.kv_events.KVEventBatch``) reads kvstage's payloads, those of a real
OffloadManager's stream too; kvstage's subscriber reads vLLM's own ``ZmqEventPublisher``,
replay included."""

from __future__ import annotations

import time

import pytest

kv_events = pytest.importorskip(
    "vllm.distributed.kv_events",
    reason="vLLM 0.33.0 is not installed (make .venv-vllm/.installed, then run with .venv-vllm/bin/python)",
)

import msgspec  # noqa: E402

from kvstage.events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVEventSubscriber,
    block_hash,
    encode_batch,
)

from offload_rig import make_rig  # noqa: E402

DECODER = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)


def test_vllms_decoder_reads_every_kind_of_kvstage_event():
    batch = KVEventBatch(
        12.5,
        [
            BlockStored([1, 2**64 - 1], None, list(range(8)), 4, lora_name="x", extra_keys=[("x", "salt")] * 2),
            BlockStored([3], 2**64 - 1, [8, 9, 10, 11], 4),
            BlockRemoved([1]),
            AllBlocksCleared(),
        ],
        1,
    )
    decoded = DECODER.decode(encode_batch(batch))
    assert decoded.ts == 12.5 and decoded.data_parallel_rank == 1
    first, second, removed, cleared = decoded.events
    assert isinstance(first, kv_events.BlockStored) and isinstance(second, kv_events.BlockStored)
    assert (first.block_hashes, first.parent_block_hash, first.token_ids, first.block_size) == (
        [1, 2**64 - 1], None, list(range(8)), 4,
    )  # fmt: skip
    assert (first.medium, first.lora_name, first.lora_id) == (kv_events.MEDIUM_STORAGE, "x", None)
    assert [tuple(keys) for keys in first.extra_keys] == [("x", "salt")] * 2
    assert second.parent_block_hash == 2**64 - 1 and second.extra_keys is None
    assert isinstance(removed, kv_events.BlockRemoved) and removed.block_hashes == [1]
    assert removed.medium == kv_events.MEDIUM_STORAGE
    assert isinstance(cleared, kv_events.AllBlocksCleared)


def test_kvstage_encodes_a_batch_to_the_msgpack_values_vllm_writes_in_its_key_order():
    ours = KVEventBatch(3.0, [BlockStored([7], 6, [1, 2], 2), BlockRemoved([7]), AllBlocksCleared()], 0)
    theirs = kv_events.KVEventBatch(
        ts=3.0,
        events=[
            kv_events.BlockStored(
                block_hashes=[7], parent_block_hash=6, token_ids=[1, 2], block_size=2, lora_id=None,
                medium="STORAGE", lora_name=None,
            ),
            kv_events.BlockRemoved(block_hashes=[7], medium="STORAGE"),
            kv_events.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )  # fmt: skip
    import msgpack

    # Equal values with keys in the same order (msgspec sizes its map headers otherwise).
    mine, vllms = msgpack.unpackb(encode_batch(ours)), msgpack.unpackb(msgspec.msgpack.Encoder().encode(theirs))
    assert mine == vllms
    assert [list(event) for event in mine[1]] == [list(event) for event in vllms[1]]


def test_a_managers_stream_decodes_with_vllms_decoder():
    import zmq

    publisher = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    rig = make_rig(page_size=2, store_prompt=True, kv_events=publisher)
    req = rig.new_request("a", [5, 6, 7, 8, 9], 2)
    req.done = True
    rig.manager.finish(req)
    rig.copy_stream.complete_all()
    rig.manager.drain()
    assert rig.manager.flush() == 2
    rig.manager.close()
    time.sleep(0.2)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(publisher.replay_endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    payloads = []
    while sock.poll(5000):
        frames = sock.recv_multipart()
        if frames[2] == kv_events.ZmqEventPublisher.END_SEQ:
            break
        payloads.append(frames[3])
    sock.close()
    publisher.close()
    events = [event for payload in payloads for event in DECODER.decode(payload).events]
    keys = rig.chain(req)
    assert len(events) == 2
    stored, removed = events
    assert isinstance(stored, kv_events.BlockStored) and isinstance(removed, kv_events.BlockRemoved)
    assert stored.block_hashes == [block_hash(key) for key in keys] and stored.token_ids == [5, 6, 7, 8]
    assert stored.block_size == 2 and stored.parent_block_hash is None and stored.medium == "STORAGE"
    assert sorted(removed.block_hashes) == sorted(block_hash(key) for key in keys)


def test_kvstages_subscriber_reads_vllms_own_publisher_and_its_replay(tmp_path):
    # vLLM binds wildcard and ipc endpoints (a tcp host it connects to): ipc stays on this machine.
    endpoint, replay_endpoint = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    publisher = kv_events.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=endpoint, replay_endpoint=replay_endpoint, topic="vllm"
    )
    try:
        for i in range(5):  # before the subscriber connects: only replay has them
            publisher.publish(kv_events.KVEventBatch(ts=float(i), events=[kv_events.BlockRemoved([i], "GPU")]))
        time.sleep(0.2)
        with KVEventSubscriber(endpoint, replay_endpoint=replay_endpoint, topic="vllm") as sub:
            got: list = []
            deadline = time.monotonic() + 10
            i = 5
            while not got and time.monotonic() < deadline:
                publisher.publish(kv_events.KVEventBatch(ts=float(i), events=[kv_events.BlockRemoved([i], "GPU")]))
                i += 1
                got = sub.poll(0.05)
            got += sub.poll(0.3)
            seqs = [seq for seq, _ in got]
            assert seqs == list(range(len(seqs))) and len(seqs) >= 6 and sub.gaps == 0
            assert [batch.events for _, batch in got[:5]] == [[BlockRemoved([i], "GPU")] for i in range(5)]
    finally:
        publisher.shutdown()
