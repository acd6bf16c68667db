"""KV events in sglang's format for the L3 tier sglang never announces: kvstage's payloads read
by sglang 0.5.23's own msgspec decoder (``sglang.srt.disaggregation.kv_events.KVEventBatch``),
from KVStageStorage under sglang's real HiCacheController and from the decode drop-in, on
127.0.0.1 (run inside tools/in-netns.sh)."""

from __future__ import annotations

import random
import time
from array import array

import msgspec
import pytest
import zmq
from sglang.srt.disaggregation.kv_events import AllBlocksCleared as SglAllBlocksCleared
from sglang.srt.disaggregation.kv_events import BlockRemoved as SglBlockRemoved
from sglang.srt.disaggregation.kv_events import BlockStored as SglBlockStored
from sglang.srt.disaggregation.kv_events import KVEventBatch as SglKVEventBatch
from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_storage_hash_str, hash_str_to_int64

from kvstage.errors import InvalidArgumentError
from kvstage.events import SGLANG_FORMAT, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, sglang_block_hash
from kvstage.events.sglang_format import encode_sglang_batch
from kvstage.integrations.sglang import KVStageStorage

from decode_rig import DecodeSide, run_until_released, settings_installed
from sglang_rig import (
    PAGE_SIZE,
    hicache_controller,
    host_pool,
    mha_device_pool,
    one_rank_gloo_world,
    random_canonical,
    set_host,
)

DECODE = msgspec.msgpack.Decoder(SglKVEventBatch)


@pytest.fixture(scope="module", autouse=True)
def one_rank_world(tmp_path_factory):
    with one_rank_gloo_world(tmp_path_factory.mktemp("gloo")) as world:
        yield world


class Sub:
    """A raw ZMQ SUB on ``endpoint``; every message's payload decoded by sglang's decoder."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        time.sleep(0.3)  # PUB drops what it sends before the subscription arrives
        self.seqs: list[int] = []

    def events(self, until, timeout: float = 10.0) -> list:
        """sglang events received until ``until(events)`` holds."""
        got: list = []
        deadline = time.monotonic() + timeout
        while not until(got):
            assert time.monotonic() < deadline, f"no such events in {timeout} s: {got}"
            if self.sock.poll(100):
                _, seq, payload = self.sock.recv_multipart()
                self.seqs.append(int.from_bytes(seq, "big"))
                got += DECODE.decode(payload).events
        return got

    def close(self) -> None:
        self.sock.close()


def stored(events) -> list:
    return [event for event in events if isinstance(event, SglBlockStored)]


def assert_one_chain(events: list, hashes: list[int]) -> None:
    """``events`` announce ``hashes`` in order as one chain from the root (the publisher may
    join consecutive runs into one event)."""
    assert [h for e in events for h in e.block_hashes] == hashes
    assert [e.parent_block_hash for e in events] == [None] + [e.block_hashes[-1] for e in events[:-1]]


def test_sglangs_decoder_reads_every_kind_kvstage_encodes_with_sglangs_fields():
    batch = KVEventBatch(
        12.5,
        [
            BlockStored([1, -2], None, list(range(8)), 4, "lora-7", "DISK", [("lora-7", "t")] * 2, "t"),
            BlockStored([3], -2, [8, 9, 10, 11], 4, None, "DISK"),
            BlockRemoved([1, -2, 3], "DISK"),
            AllBlocksCleared(),
        ],
        3,
    )
    got = DECODE.decode(encode_sglang_batch(batch))
    assert (got.ts, got.attn_dp_rank) == (12.5, 3)
    assert got.events == [
        SglBlockStored([1, -2], None, list(range(8)), 4, None, medium="DISK", cache_salt="t"),
        SglBlockStored([3], -2, [8, 9, 10, 11], 4, None, medium="DISK"),
        SglBlockRemoved([1, -2, 3], medium="DISK"),
        SglAllBlocksCleared(),
    ]
    assert SGLANG_FORMAT.medium == StorageMedium.DISK.value  # sglang's own name for its L3 tier


def test_block_hashes_are_sglangs_hash_str_to_int64_of_the_page_hash():
    rng = random.Random(5)
    keys = [f"{rng.getrandbits(256):064x}" for _ in range(200)] + ["f" * 64, "8" + "0" * 63, "7" + "f" * 63]
    assert [sglang_block_hash(key) for key in keys] == [hash_str_to_int64(key) for key in keys]
    with pytest.raises(InvalidArgumentError, match="page_key"):
        sglang_block_hash("abc")


def test_an_unknown_kv_events_key_or_a_replay_without_endpoint_is_refused_naming_it(tmp_path):
    from sglang_rig import storage_config

    with pytest.raises(InvalidArgumentError, match="extra_config.kv_events_endpoint: required"):
        KVStageStorage(storage_config("memory", kv_events_topic="engine-1"))
    with pytest.raises(InvalidArgumentError, match="extra_config.kv_events_endpoint: must be a non-empty str"):
        KVStageStorage(storage_config("memory", kv_events_endpoint=5557))


def test_sglangs_controller_writing_to_kvstage_storage_announces_l3_pages_removals_and_clear():
    device = mha_device_pool()
    host = host_pool(device, "page_first")
    cc = hicache_controller(device, host, "memory", extra={"kv_events_endpoint": "tcp://127.0.0.1:0"})
    backend = cc.storage_backend
    sub = Sub(backend.announcer.publisher.endpoint)
    try:
        set_host(host, random_canonical(host, seed=4))
        first = RadixKey(array("q", range(50, 50 + 3 * PAGE_SIZE)))
        first_hashes = get_storage_hash_str(first, page_size=PAGE_SIZE)
        # sglang passes prefix_keys with hicache_storage_pass_prefix_keys: [] at the root
        cc.write_storage(host.alloc(3 * PAGE_SIZE), first.token_ids, hash_value=first_hashes, prefix_keys=[])
        assert cc.ack_backup_queue.get(timeout=30).completed_tokens == 3 * PAGE_SIZE
        # the next turn continues the chain: sglang passes the pages before it as prefix_keys
        tokens = list(first.token_ids) + list(range(900, 900 + 2 * PAGE_SIZE))
        all_hashes = get_storage_hash_str(RadixKey(array("q", tokens)), page_size=PAGE_SIZE)
        cc.write_storage(
            host.alloc(2 * PAGE_SIZE), tokens[3 * PAGE_SIZE :], hash_value=all_hashes[3:], prefix_keys=first_hashes
        )
        assert cc.ack_backup_queue.get(timeout=30).completed_tokens == 2 * PAGE_SIZE
        events = sub.events(lambda got: sum(len(e.block_hashes) for e in stored(got)) >= 5)
        ints = [hash_str_to_int64(value) for value in all_hashes]  # sglang's own event hashes of these pages
        assert_one_chain(stored(events), ints)
        for event in stored(events):
            # no token ids: sglang 0.5.23 hands its L3 backend keys and host slots only
            assert (event.token_ids, event.block_size, event.medium) == ([], PAGE_SIZE, "DISK")
        assert backend.announcer.pages_announced == 5
        # without prefix_keys a run's parent is unknown: stored, not announced
        other = RadixKey(array("q", range(700, 700 + 2 * PAGE_SIZE)))
        cc.write_storage(
            host.alloc(2 * PAGE_SIZE), other.token_ids, hash_value=get_storage_hash_str(other, page_size=PAGE_SIZE)
        )
        assert cc.ack_backup_queue.get(timeout=30).completed_tokens == 2 * PAGE_SIZE
        assert (backend.kv_events_unannounced, backend.announcer.pages_announced) == (2, 5)

        backend.clear()  # sglang's flush_cache
        removed = sub.events(lambda got: sum(len(e.block_hashes) for e in got if isinstance(e, SglBlockRemoved)) >= 7)
        other_ints = [hash_str_to_int64(value) for value in get_storage_hash_str(other, page_size=PAGE_SIZE)]
        assert sorted(h for e in removed for h in e.block_hashes) == sorted(ints + other_ints)  # every page removed
        assert {e.medium for e in removed} == {"DISK"}
        assert sub.seqs == list(range(len(sub.seqs)))  # one stream, no gap
    finally:
        cc.detach_storage_backend()
        sub.close()


def test_only_tp_rank_0_binds_the_publisher():
    from sglang_rig import kvstage_backend

    host = host_pool(mha_device_pool(), "page_first")
    rank_1 = kvstage_backend("memory", host, tp_rank=1, tp_size=2, kv_events_endpoint="tcp://127.0.0.1:0")
    assert rank_1.announcer is None and rank_1.store is not None
    rank_1.close()


def test_the_decode_drop_in_announces_its_pages_with_token_ids_in_sglangs_format(tmp_path, one_rank_world):
    url = f"file:{tmp_path / 'store'}"
    with settings_installed(url, extra={"kv_events_endpoint": "tcp://127.0.0.1:0"}):
        side = DecodeSide("mha", one_rank_world)
        publisher = side.manager.kv_event_publisher
        assert publisher.event_format is SGLANG_FORMAT
        sub = Sub(publisher.endpoint)
        try:
            prompt = [300, 301]  # shorter than a page: the decode side's pages start the chain
            req = side.admit("turn-1", prompt, max_tokens=11)
            for step in range(11):
                side.decode_step(req, 1000 + step)
                side.manager.check_offload_progress()
            run_until_released(side, [req])
            side.manager.release_host_resources()
            kv_tokens = prompt + [1000 + i for i in range(10)]  # the last sampled token has no KV
            whole = len(kv_tokens) // PAGE_SIZE * PAGE_SIZE
            events = sub.events(lambda got: sum(len(e.block_hashes) for e in stored(got)) >= whole // PAGE_SIZE)
            hashes = get_storage_hash_str(RadixKey(array("q", kv_tokens[:whole])), page_size=PAGE_SIZE)
            assert_one_chain(stored(events), [hash_str_to_int64(h) for h in hashes])
            assert [t for e in stored(events) for t in e.token_ids] == kv_tokens[:whole]
            assert {(e.block_size, e.medium) for e in stored(events)} == {(PAGE_SIZE, "DISK")}
        finally:
            sub.close()
