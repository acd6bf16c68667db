"""The KV event records and their msgpack encoding: vLLM 0.33's layout (batch array, tagged map
events, its field names and order), round trips, block hashes from page keys, bad payloads."""

from __future__ import annotations

import msgpack
import pytest

from kvstage.errors import InvalidArgumentError
from kvstage.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, block_hash
from kvstage.events.wire import block_hashes, decode_batch, encode_batch, merge_stored


def sample_batch() -> KVEventBatch:
    return KVEventBatch(
        1767225600.25,
        [
            BlockStored([1, 2**64 - 1], None, list(range(8)), 4),
            BlockStored([3], 2, [9, 9, 9, 9], 4, lora_name="tenant", extra_keys=[("tenant", "salt")]),
            BlockRemoved([2**64 - 1]),
            AllBlocksCleared(),
        ],
        3,
    )


def test_the_payload_is_an_array_of_three_with_tagged_map_events_in_vllms_field_order():
    raw = msgpack.unpackb(encode_batch(sample_batch()))
    assert isinstance(raw, list) and len(raw) == 3
    ts, events, rank = raw
    assert ts == 1767225600.25 and rank == 3
    assert list(events[0]) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    ]  # fmt: skip
    assert events[0] == {
        "type": "BlockStored",
        "block_hashes": [1, 2**64 - 1],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
        "lora_id": None,
        "medium": "STORAGE",
        "lora_name": None,
    }
    assert events[1]["extra_keys"] == [["tenant", "salt"]] and events[1]["lora_name"] == "tenant"
    assert events[1]["parent_block_hash"] == 2
    assert events[2] == {"type": "BlockRemoved", "block_hashes": [2**64 - 1], "medium": "STORAGE"}
    assert events[3] == {"type": "AllBlocksCleared"}


def test_a_batch_survives_encoding_and_decoding():
    batch = sample_batch()
    assert decode_batch(encode_batch(batch)) == batch


def test_decoding_ignores_fields_it_does_not_know_as_vllms_newer_writers_add_them():
    raw = [
        2.0,
        [
            {
                "type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "token_ids": [1, 2],
                "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
                "locality": "LOCAL",
            },
            {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "group_idx": 0},
        ],
        0,
    ]  # fmt: skip
    batch = decode_batch(msgpack.packb(raw))
    assert batch.events == [BlockStored([5], None, [1, 2], 2, None, "GPU"), BlockRemoved([5], "GPU")]


def test_block_hash_is_the_low_64_bits_of_the_page_key_unsigned():
    key = "0123456789abcdef" + "fedcba9876543210"
    assert block_hash(key) == 0xFEDCBA9876543210
    assert block_hash("f" * 64) == 2**64 - 1
    assert block_hash("0" * 32) == 0


@pytest.mark.parametrize("key", ["abc", 12, "g" * 32, None])
def test_block_hash_rejects_what_is_no_hex_key(key):
    with pytest.raises(InvalidArgumentError, match=r"^page_key: must be"):
        block_hash(key)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", r"^payload: not a msgpack"),
        (msgpack.packb({"ts": 1}), r"^payload: a batch is an array"),
        (msgpack.packb([1.0, [{"type": "Nope"}], 0]), r"^payload: unknown event type 'Nope'"),
        (msgpack.packb([1.0, [{"type": "BlockRemoved"}], 0]), r"^payload: an event lacks the field 'block_hashes'"),
        (msgpack.packb([1.0, [[1, 2]], 0]), r"^payload: an event must be a tagged map"),
    ],
)
def test_a_bad_payload_raises_naming_what_is_wrong(payload, message):
    with pytest.raises(InvalidArgumentError, match=message):
        decode_batch(payload)


def test_encoding_refuses_an_object_that_is_no_event():
    with pytest.raises(InvalidArgumentError, match=r"^events: each must be"):
        encode_batch(KVEventBatch(1.0, ["BlockStored"], 0))


def test_merge_stored_joins_a_chains_consecutive_runs_and_nothing_else():
    a = BlockStored([1, 2], None, [0] * 8, 4)
    b = BlockStored([3], 2, [1] * 4, 4)  # continues a
    c = BlockStored([4], 3, [2] * 4, 4, lora_name="x")  # continues b, another namespace
    d = BlockStored([5], 9, [3] * 4, 4)  # another chain
    removed = BlockRemoved([1])
    e = BlockStored([6], 5, [4] * 4, 4)  # continues d, after a removal
    merged = merge_stored([a, b, c, d, removed, e])
    assert merged == [BlockStored([1, 2, 3], None, [0] * 8 + [1] * 4, 4), c, d, removed, e]
    assert a == BlockStored([1, 2], None, [0] * 8, 4)  # inputs unchanged
    salted = [
        BlockStored([1], None, [0] * 4, 4, extra_keys=[("s",)]),
        BlockStored([2], 1, [1] * 4, 4, extra_keys=[("s",)]),
    ]
    assert merge_stored(salted) == [BlockStored([1, 2], None, [0] * 4 + [1] * 4, 4, extra_keys=[("s",)] * 2)]


def test_merge_stored_joins_a_run_of_many_writes_leaving_each_input_unchanged():
    runs = [BlockStored([i], i - 1 if i else None, [i] * 4, 4, extra_keys=[("s",)]) for i in range(5)]
    copies = [
        BlockStored(list(r.block_hashes), r.parent_block_hash, list(r.token_ids), 4, extra_keys=[("s",)]) for r in runs
    ]
    (merged,) = merge_stored(runs)
    assert merged == BlockStored(
        [0, 1, 2, 3, 4], None, [t for i in range(5) for t in [i] * 4], 4, extra_keys=[("s",)] * 5
    )
    assert runs == copies  # the first run's lists were copied before being extended


def test_block_hashes_is_block_hash_of_each_and_rejects_a_bad_key_naming_it():
    keys = ["0123456789abcdef" * 2, "f" * 64, "0" * 16]
    assert block_hashes(keys) == [block_hash(key) for key in keys] and block_hashes([]) == []
    for bad in ("abc", "g" * 32, None):
        with pytest.raises(InvalidArgumentError, match=rf"^page_key: must be .*{bad!r}"):
            block_hashes([keys[0], bad])


def test_the_batcher_joins_a_chains_runs_as_they_come_and_never_changes_what_it_was_given():
    from kvstage.events.wire import EventBatcher

    hashes, tokens = [1], [0, 0]
    given = [BlockStored(hashes, None, tokens, 2), BlockRemoved([7])]
    batcher = EventBatcher()
    batcher.add(given)
    batcher.removed(8)  # after a removal it was given: a new event, the given one unchanged
    batcher.removed(9)
    batcher.stored([2], None, [1, 1], 2)
    batcher.stored([3], 2, [2, 2], 2)  # continues [2]
    batcher.stored([4], 3, [3, 3], 2, medium="CPU")  # another medium: not joined
    batcher.removed(5, "CPU")
    assert batcher.events == [
        BlockStored([1], None, [0, 0], 2),
        BlockRemoved([7]),
        BlockRemoved([8, 9]),
        BlockStored([2, 3], None, [1, 1, 2, 2], 2),
        BlockStored([4], 3, [3, 3], 2, medium="CPU"),
        BlockRemoved([5], "CPU"),
    ]
    assert given == [BlockStored([1], None, [0, 0], 2), BlockRemoved([7])] and hashes == [1] and tokens == [0, 0]
    batcher.stored([6], 1, [5, 5], 2)  # continues nothing just before it (a removal): a new event
    assert batcher.events[-1] == BlockStored([6], 1, [5, 5], 2)
