"""KVEventAnnouncer through a real OffloadManager (``kv_events=``): every stored page announced
self-describing (its tokens, the page size, the previous page as parent, the namespace), in the
store's order with its evictions and removals; what it cannot announce is counted."""

from __future__ import annotations

import pytest

from kvstage.errors import ArgumentTypeError
from kvstage.events import BlockRemoved, BlockStored, KVEventPublisher, KVEventSubscriber, block_hash
from kvstage.storage import MemoryStore

from offload_rig import make_rig

PAGE = 2


def finish(rig, req) -> None:
    req.done = True
    rig.manager.finish(req)
    rig.copy_stream.complete_all()
    rig.manager.drain()


def hashes(keys) -> list[int]:
    return [block_hash(key) for key in keys]


def pages(events) -> list[tuple[int, int | None, list[int]]]:
    """Every stored page of ``events``: (hash, parent hash, token ids), in stream order (the
    publisher may join a chain's consecutive runs into one event)."""
    out = []
    for event in events:
        if isinstance(event, BlockStored):
            size = event.block_size
            for index, value in enumerate(event.block_hashes):
                parent = event.parent_block_hash if index == 0 else event.block_hashes[index - 1]
                out.append((value, parent, event.token_ids[index * size : (index + 1) * size]))
    return out


def stall_encoding(monkeypatch):
    """Make the publisher's sending thread stop inside its next batch's encoding: returns
    ``(release, encoding)``, events set to let it go on and set by it once it stopped there."""
    import threading

    import kvstage.events.publisher as publisher_module

    release, encoding = threading.Event(), threading.Event()
    real_encode = publisher_module.encode_batch

    def stalled(batch):
        encoding.set()
        release.wait(10)
        return real_encode(batch)

    monkeypatch.setattr(publisher_module, "encode_batch", stalled)
    return release, encoding


def test_a_stored_prompt_and_its_decode_strides_are_announced_as_one_chain(publisher, stream):
    rig = make_rig(page_size=PAGE, store_prompt=True, kv_events=publisher)
    prompt = [11, 12, 13, 14, 15]
    req = rig.new_request("a", prompt, 8)
    rig.manager.offload(req)  # the prompt's 2 whole pages
    rig.copy_stream.complete_all()
    rig.manager.poll()
    for token in (21, 22, 23, 24):  # two decode pages of 2 tokens: [15, 21], [22, 23]
        rig.decode(req, token)
        rig.manager.offload(req)
        rig.copy_stream.complete_all()
        rig.manager.poll()
    finish(rig, req)
    keys = rig.chain(req)
    assert len(keys) == 4 and rig.manager.metrics.pages_stored == 4
    stored = stream()
    assert pages(stored) == [
        (block_hash(keys[0]), None, [11, 12]),
        (block_hash(keys[1]), block_hash(keys[0]), [13, 14]),
        (block_hash(keys[2]), block_hash(keys[1]), [15, 21]),
        (block_hash(keys[3]), block_hash(keys[2]), [22, 23]),
    ]
    assert {(event.block_size, event.medium, event.lora_name, event.extra_keys) for event in stored} == {
        (PAGE, "STORAGE", None, None)
    }
    assert rig.manager._announcer.pages_announced == 4


def test_the_namespace_is_announced_as_lora_name_and_extra_keys_per_page(publisher, stream):
    rig = make_rig(page_size=PAGE, store_prompt=True, kv_events=publisher)
    req = rig.new_request("a", [1, 2, 3, 4, 5], 2, extra_key="lora-x", cache_salt="tenant-7")
    finish(rig, req)
    [event] = stream()
    assert event.block_hashes == hashes(rig.chain(req)) and event.token_ids == [1, 2, 3, 4]
    assert event.lora_name == "lora-x" and event.extra_keys == [("lora-x", "tenant-7")] * 2
    other = rig.new_request("b", [1, 2, 3, 4, 5], 2, cache_salt="tenant-8")  # same tokens, another tenant
    finish(rig, other)
    [event] = stream()
    assert event.block_hashes == hashes(rig.chain(other)) != hashes(rig.chain(req))
    assert event.lora_name is None and event.extra_keys == [("tenant-8",)] * 2


def _two_chains_one_eviction(store_class, publisher):
    """A rig on a ``store_class`` store of 3 pages that stores two 2-page chains (the second
    evicts the first chain's tail): the rig, the store and the two requests."""
    layout = make_rig(page_size=PAGE).storage.fingerprint
    store = store_class(layout, capacity_pages=3)
    rig = make_rig(page_size=PAGE, store_prompt=True, storage=store, kv_events=publisher)
    first = rig.new_request("a", [1, 2, 3, 4, 5], 2)
    finish(rig, first)
    second = rig.new_request("b", [7, 8, 9, 10, 11], 2)  # 2 pages more than the 3 the store holds: 1 evicted
    finish(rig, second)
    return rig, store, first, second


def test_evictions_and_a_flush_are_announced_after_the_pages_they_remove(publisher, stream):
    rig, store, first, second = _two_chains_one_eviction(MemoryStore, publisher)
    events = stream()
    assert store.stats.pages_evicted == 1
    evicted = [event for event in events if isinstance(event, BlockRemoved)]
    assert evicted == [BlockRemoved([block_hash(rig.chain(first)[1])])]  # the first chain's tail
    assert [type(event) for event in events] == [BlockStored, BlockRemoved, BlockStored]  # room made, then stored
    assert rig.manager.flush() == 3
    rig.manager.poll()
    [removed] = stream()
    assert sorted(removed.block_hashes) == sorted(hashes(rig.chain(first)[:1] + rig.chain(second)))
    # After the flush the same prompt is announced again from the root.
    again = rig.new_request("c", [1, 2, 3, 4, 5], 2)
    finish(rig, again)
    [event] = [event for event in stream() if isinstance(event, BlockStored)]
    assert event.block_hashes == hashes(rig.chain(first)) and event.parent_block_hash is None


class _OwnTakeEvents(MemoryStore):
    """A store whose class has its own take_events (as a wrapper tier's): the announcer must read
    that, not the queue's chunks beneath it."""

    taken = 0

    def take_events(self, max_events=None):
        self.taken += 1
        return super().take_events(max_events)


def test_a_store_with_its_own_take_events_is_read_through_it_in_the_same_order(publisher, stream):
    rig, store, first, second = _two_chains_one_eviction(_OwnTakeEvents, publisher)
    events = stream()
    assert store.taken >= 2 and store.stats.pages_evicted == 1
    assert [type(event) for event in events] == [BlockStored, BlockRemoved, BlockStored]
    assert events[1] == BlockRemoved([block_hash(rig.chain(first)[1])])
    assert pages(events) == [
        (block_hash(rig.chain(first)[0]), None, [1, 2]),
        (block_hash(rig.chain(first)[1]), block_hash(rig.chain(first)[0]), [3, 4]),
        (block_hash(rig.chain(second)[0]), None, [7, 8]),
        (block_hash(rig.chain(second)[1]), block_hash(rig.chain(second)[0]), [9, 10]),
    ]


def test_pages_already_announced_are_not_announced_again_and_a_continuation_names_them(publisher, stream):
    rig = make_rig(page_size=PAGE, store_prompt=True, kv_events=publisher)
    finish(rig, rig.new_request("a", [1, 2, 3, 4, 5], 2))
    longer = rig.new_request("b", [1, 2, 3, 4, 5, 6, 7], 2)  # deduplicates 2 pages, stores the third
    finish(rig, longer)
    keys = rig.chain(longer)
    assert rig.manager.metrics.pages_deduplicated == 2
    assert pages(stream()) == [
        (block_hash(keys[0]), None, [1, 2]),
        (block_hash(keys[1]), block_hash(keys[0]), [3, 4]),
        (block_hash(keys[2]), block_hash(keys[1]), [5, 6]),
    ]  # the deduplicated pages once


def test_a_chain_whose_parent_this_stream_never_announced_is_counted_not_sent(publisher, stream):
    rig = make_rig(page_size=PAGE, store_prompt=False, kv_events=publisher)  # the prefill side stored the prompt
    req = rig.new_request("a", [1, 2, 3, 4, 5], 4)
    for token in (6, 7, 8):
        rig.decode(req, token)
    finish(rig, req)
    assert rig.manager.metrics.pages_stored == 1
    assert stream() == []  # the prefill side's put: no tokens known, so nothing self-describing to send
    announcer = rig.manager._announcer
    assert announcer.pages_unanchored == 1 and announcer.pages_without_tokens == 2 and announcer.pages_announced == 0


def test_writes_on_the_default_worker_threads_keep_the_stores_order(publisher, stream):
    from kvstage.offload.copy_stream import CopyStream

    layout = make_rig(page_size=PAGE).storage.fingerprint
    store = MemoryStore(layout, capacity_pages=4)
    rig = make_rig(
        page_size=PAGE, store_prompt=True, storage=store, kv_events=publisher, copy_stream=CopyStream("cpu"),
        store_workers=None,
    )  # fmt: skip
    reqs = [rig.new_request(str(i), [100 * i + t for t in range(5)], 2) for i in range(6)]
    for req in reqs:
        req.done = True
        rig.manager.finish(req)
    rig.manager.drain()
    live: set[int] = set()
    for event in stream():  # replaying the stream leaves what the store holds
        if isinstance(event, BlockStored):
            assert event.parent_block_hash is None or event.parent_block_hash in live
            live.update(event.block_hashes)
        else:
            live.difference_update(event.block_hashes)
    held = {block_hash(key) for req in reqs for key in rig.chain(req) if store.exists([key]) == [True]}
    assert live == held and len(held) == 4
    rig.manager.close()


def test_an_endpoint_string_makes_a_publisher_the_manager_closes(collect):
    rig = make_rig(page_size=PAGE, store_prompt=True, kv_events="tcp://127.0.0.1:0")
    announcer = rig.manager._announcer
    assert announcer.owns_publisher and announcer.publisher.endpoint.startswith("tcp://127.0.0.1:")
    with KVEventSubscriber(announcer.publisher.endpoint) as sub:
        rig.manager.close()
        with pytest.raises(Exception, match=r"publish\(\) after close\(\)"):
            announcer.publisher.publish([BlockRemoved([1])])
    del sub


def test_kv_events_of_another_type_is_refused_naming_the_argument():
    with pytest.raises(ArgumentTypeError, match=r"^kv_events: must be None, a KVEventPublisher or an endpoint str"):
        make_rig(page_size=PAGE, kv_events=5557)


def test_an_announcement_that_fails_never_fails_the_write(publisher, monkeypatch):
    rig = make_rig(page_size=PAGE, store_prompt=True, kv_events=publisher)
    monkeypatch.setattr(KVEventPublisher, "publish", lambda self, events: 1 / 0)
    finish(rig, rig.new_request("a", [1, 2, 3, 4, 5], 2))
    assert rig.manager.metrics.pages_stored == 2 and rig.manager.metrics.pages_failed == 0
    assert rig.manager._announcer.errors == 1


def _replayed(endpoint: str) -> list[tuple[int, bytes]]:
    """(seq, payload) of every batch a publisher's replay socket still holds."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    out = []
    while sock.poll(5000):
        _, _, seq, payload = sock.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            sock.close()
            return out
        out.append((int.from_bytes(seq, "big"), payload))
    sock.close()
    raise AssertionError(f"no end marker after {out!r}")


class _NoEvents:
    """A store that records no events (every written page reads as held already)."""

    def take_events(self) -> list:
        return []


def test_writes_queued_while_the_sender_is_busy_go_out_joined_in_order_and_past_the_bound_are_a_gap(monkeypatch):

    from kvstage.events import KVEventAnnouncer
    from kvstage.events.wire import decode_batch

    release, encoding = stall_encoding(monkeypatch)
    keys = [f"{index:032x}" for index in range(1, 5)]
    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", max_pending=3) as pub:
        announcer = KVEventAnnouncer(pub, _NoEvents(), block_size=2)
        pub.publish([BlockRemoved([0])])
        assert encoding.wait(10)  # the sender holds batch 0
        prior = None
        for index, key in enumerate(keys):  # 3 wait for the sender; the 4th finds the bound reached
            announcer.written([key], [index, index], prior, (None, None), ())
            prior = key
        assert len(pub._pending) == 1  # one publish call for the writes queued meanwhile
        release.set()
        assert pub.flush(10)
        sent = _replayed(pub.replay_endpoint)
        assert pub.dropped == 1 and announcer.pages_announced == 3 and announcer.errors == 0
    assert [seq for seq, _ in sent] == [0, 2]  # seq 1 stands for the dropped write
    assert decode_batch(sent[1][1]).events == [
        BlockStored(hashes(keys[:3]), None, [0, 0, 1, 1, 2, 2], 2)
    ]  # one chain, in write order


def test_queued_writes_of_a_chain_whose_later_page_is_live_are_announced_each_on_its_own(monkeypatch):

    from kvstage.events import KVEventAnnouncer
    from kvstage.events.wire import decode_batch

    release, encoding = stall_encoding(monkeypatch)
    root, other, tail = (f"{index:032x}" for index in (1, 2, 3))
    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        announcer = KVEventAnnouncer(pub, _NoEvents(), block_size=2)
        announcer.written([root], [1, 1], None, (None, None), ())  # live on the stream
        assert encoding.wait(10)  # the sender holds that batch: the next writes queue behind it
        announcer.written([other], [2, 2], None, (None, None), ())  # another chain's root
        announcer.written([root], [1, 1], other, (None, None), ())  # continues it with a live page
        announcer.written([tail], [3, 3], root, (None, None), ())  # continues that
        release.set()
        assert pub.flush(10)
        sent = _replayed(pub.replay_endpoint)
        assert announcer.pages_announced == 3 and announcer.errors == 0
    assert [decode_batch(payload).events for _, payload in sent] == [
        [BlockStored(hashes([root]), None, [1, 1], 2)],
        [BlockStored(hashes([other]), None, [2, 2], 2), BlockStored(hashes([tail]), block_hash(root), [3, 3], 2)],
    ]  # the live page not again, and the page after it names it as parent, as separate writes would


def test_an_announcer_whose_drain_the_full_publisher_dropped_announces_its_writes_with_the_next_one(monkeypatch):

    from kvstage.events import KVEventAnnouncer

    release, encoding = stall_encoding(monkeypatch)
    first, second = f"{1:032x}", f"{2:032x}"
    with KVEventPublisher("tcp://127.0.0.1:0", max_pending=2) as pub:
        announcer = KVEventAnnouncer(pub, _NoEvents(), block_size=2)
        pub.publish([BlockRemoved([0])])
        assert encoding.wait(10)  # the sender holds that batch
        pub.publish([BlockRemoved([1])])
        pub.publish([BlockRemoved([2])])  # the queue's two places taken
        announcer.written([first], [1, 1], None, (None, None), ())  # its drain is dropped
        assert pub.dropped == 1
        release.set()
        assert pub.flush(10)
        announcer.written([second], [2, 2], first, (None, None), ())
        assert pub.flush(10)
        assert announcer.pages_announced == 2 and announcer.errors == 0  # both writes, none lost
