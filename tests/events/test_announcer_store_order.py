"""KVEventAnnouncer on real stores, driven by hand: the store's events and the writes' calls
interleaved as a writer thread and the engine's poll can interleave them. Each test replays the
stream as a router would and compares what it claims with what the store holds."""

from __future__ import annotations

import torch

from kvstage.events import BlockRemoved, BlockStored, KVEventAnnouncer, block_hash
from kvstage.hashing import prefill_page_keys
from kvstage.kv_layout import KVLayout
from kvstage.storage import LayoutFingerprint, MemoryStore

FP = LayoutFingerprint("tiny", KVLayout(2, 2, 1, 4, "float32"), 4)  # 4 tokens, 256 B a page
PAGE = FP.page_size
NO_NAMESPACE = (None, None)


def page(value: float) -> torch.Tensor:
    return torch.arange(64, dtype=torch.float32).add_(value)


def tokens_of(start: int, pages: int) -> list[int]:
    return list(range(start, start + PAGE * pages))


def chain(start: int, pages: int) -> list[str]:
    return prefill_page_keys(tokens_of(start, pages), PAGE)


def claimed(events) -> set[int]:
    """The block hashes a router holds after ``events``, in order (a stored block whose parent
    it does not hold is dropped, as Dynamo's indexer does)."""
    live: set[int] = set()
    for event in events:
        if isinstance(event, BlockStored):
            if event.parent_block_hash is None or event.parent_block_hash in live:
                live.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            live.difference_update(event.block_hashes)
        else:
            live.clear()
    return live


def held(store, keys) -> set[int]:
    return {block_hash(key) for key, there in zip(keys, store.exists(keys)) if there}


def test_a_page_the_polls_saw_stored_and_removed_before_its_write_was_told_is_not_claimed(publisher, stream):
    store = MemoryStore(FP, capacity_pages=10)
    announcer = KVEventAnnouncer(publisher, store, block_size=PAGE)
    keys = chain(0, 2)
    store.put(keys, [page(0), page(1)])  # the writer thread's put recorded both pages stored
    store.clear()  # a flush right after it, before the writer thread calls written()
    announcer.poll()  # the engine's poll takes the stored and the removed pages
    announcer.written(keys, tokens_of(0, 2), None, NO_NAMESPACE, ())
    assert publisher.flush(10)
    assert claimed(stream()) == held(store, keys) == set()
    assert announcer.pages_announced == 0 and announcer.pages_without_tokens == 0 and announcer.errors == 0


def test_a_page_the_poll_saw_stored_before_its_write_was_told_is_announced_with_its_tokens(publisher, stream):
    store = MemoryStore(FP, capacity_pages=10)
    announcer = KVEventAnnouncer(publisher, store, block_size=PAGE)
    keys = chain(0, 2)
    store.put(keys, [page(0), page(1)])
    announcer.poll()  # takes the stored pages first: no tokens known yet
    announcer.written(keys, tokens_of(0, 2), None, NO_NAMESPACE, ())
    assert publisher.flush(10)
    events = stream()
    assert events == [BlockStored([block_hash(key) for key in keys], None, tokens_of(0, 2), PAGE)]
    assert claimed(events) == held(store, keys) and len(held(store, keys)) == 2
    assert announcer.pages_announced == 2 and announcer.pages_without_tokens == 0


def test_a_page_another_write_saw_stored_and_evicted_before_its_own_write_was_told_is_not_claimed(publisher, stream):
    store = MemoryStore(FP, capacity_pages=2)
    announcer = KVEventAnnouncer(publisher, store, block_size=PAGE)
    first, second = chain(0, 1), chain(100, 2)
    store.put(first, [page(0)])  # writer thread A stored it, and has not told the announcer yet
    store.put(second, [page(1), page(2)])  # writer thread B's put evicts A's page to make room
    announcer.written(second, tokens_of(100, 2), None, NO_NAMESPACE, ())  # B told first: takes A's events
    announcer.written(first, tokens_of(0, 1), None, NO_NAMESPACE, ())
    assert publisher.flush(10)
    assert store.exists(first) == [False]
    assert claimed(stream()) == held(store, first + second) == {block_hash(key) for key in second}


def test_a_page_stored_again_after_the_polls_saw_it_go_is_announced_by_the_write_that_tells_it(publisher, stream):
    store = MemoryStore(FP, capacity_pages=10)
    announcer = KVEventAnnouncer(publisher, store, block_size=PAGE)
    keys = chain(0, 1)
    store.put(keys, [page(0)])
    store.clear()
    announcer.poll()  # stored and removed, its write not told
    store.put(keys, [page(0)])  # a second writer stores it again
    announcer.written(keys, tokens_of(0, 1), None, NO_NAMESPACE, ())  # the first write, told now
    announcer.written(keys, tokens_of(0, 1), None, NO_NAMESPACE, ())  # the second
    assert publisher.flush(10)
    assert claimed(stream()) == held(store, keys) == {block_hash(keys[0])}
    assert announcer.pages_announced == 1


def corrupt(path) -> None:
    """Flip the last byte of a page file (its payload): the same size, a checksum that fails."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_file_page_found_corrupt_and_rewritten_by_the_same_put_stays_claimed(publisher, stream, tmp_path):
    from kvstage.storage import FileStore

    store = FileStore(FP, tmp_path)
    announcer = KVEventAnnouncer(publisher, store, block_size=PAGE)
    keys = chain(0, 3)
    store.put(keys, [page(0), page(1), page(2)])
    announcer.written(keys, tokens_of(0, 3), None, NO_NAMESPACE, ())
    corrupt(store.path_of(keys[1]))
    store.put(keys, [page(0), page(1), page(2)])  # finds the page corrupt: removed, then written again
    announcer.written(keys, tokens_of(0, 3), None, NO_NAMESPACE, ())
    assert publisher.flush(10)
    events = stream()
    assert store.stats.pages_removed == 1 and [event.kind for event in store.take_events()] == []
    assert claimed(events) == held(store, keys) and len(held(store, keys)) == 3
    assert events[-2:] == [
        BlockRemoved([block_hash(keys[1])]),
        BlockStored([block_hash(keys[1])], block_hash(keys[0]), tokens_of(PAGE, 1), PAGE),
    ]  # the corrupt page's removal first, then the page written again, its parent named
    store.close()


def test_evicting_another_key_space_of_the_directory_retracts_none_of_this_key_spaces_pages(
    publisher, stream, tmp_path
):
    from kvstage.storage import FileStore

    other_layout = LayoutFingerprint("old-model", FP.layout, PAGE)
    store, other = FileStore(FP, tmp_path), FileStore(other_layout, tmp_path)
    announcer = KVEventAnnouncer(publisher, store, block_size=PAGE)
    keys = chain(0, 2)  # the same page keys in both key spaces
    store.put(keys, [page(0), page(1)])
    announcer.written(keys, tokens_of(0, 2), None, NO_NAMESPACE, ())
    other.put(keys, [page(0), page(1)])
    assert store.evict_key_space(other_layout.prefix()) == 2  # the old model's pages
    announcer.poll()
    assert publisher.flush(10)
    assert claimed(stream()) == held(store, keys) and len(held(store, keys)) == 2
    assert announcer.pages_removed == 0
    store.close()
    other.close()


def test_store_events_dropped_by_a_full_queue_make_the_announcer_retract_every_page_it_announced(publisher, stream):
    store = MemoryStore(FP, capacity_pages=100, event_capacity=4)
    announcer = KVEventAnnouncer(publisher, store, block_size=PAGE)
    keys, others = chain(0, 3), chain(100, 3)
    store.put(keys, [page(0), page(1), page(2)])
    announcer.written(keys, tokens_of(0, 3), None, NO_NAMESPACE, ())
    assert store.clear() == 3  # 3 removals ...
    store.put(others, [page(3), page(4), page(5)])  # ... and 3 stores: the oldest 2 removals dropped
    assert store.stats.events_dropped == 2
    announcer.poll()
    assert publisher.flush(10)
    events = stream()
    assert claimed(events) == held(store, keys) == set()
    # the removal taken, joined with the retraction of what was still live on the stream
    assert events[-1] == BlockRemoved([block_hash(keys[2]), *sorted(block_hash(key) for key in keys[:2])])
    assert announcer.resyncs == 1
    store.put(keys, [page(0), page(1), page(2)])  # announced again from the root
    announcer.written(keys, tokens_of(0, 3), None, NO_NAMESPACE, ())
    assert publisher.flush(10)
    assert claimed(stream()) == held(store, keys) and len(held(store, keys)) == 3


def test_a_store_with_its_events_off_is_refused_naming_the_rule(publisher):
    import pytest

    from kvstage.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"^storage: its event_capacity must be >= 1 \(store events on\)"):
        KVEventAnnouncer(publisher, MemoryStore(FP, capacity_pages=10, event_capacity=0), block_size=PAGE)


def test_announcer_arguments_that_break_a_rule_are_refused_naming_them(publisher):
    import pytest

    from kvstage.errors import ArgumentTypeError, InvalidArgumentError

    store = MemoryStore(FP, capacity_pages=10)
    with pytest.raises(InvalidArgumentError, match=r"^block_size: must be an int >= 1, got 0"):
        KVEventAnnouncer(publisher, store, block_size=0)
    with pytest.raises(ArgumentTypeError, match=r"^storage: must be a store with take_events\(\), got NoneType"):
        KVEventAnnouncer(publisher, None, block_size=PAGE)
    with pytest.raises(ArgumentTypeError, match=r"^publisher: must be a KVEventPublisher, got str"):
        KVEventAnnouncer("tcp://127.0.0.1:0", store, block_size=PAGE)
    with pytest.raises(InvalidArgumentError, match=r"^medium: must be None or a str, got 5"):
        KVEventAnnouncer(publisher, store, block_size=PAGE, medium=5)


def test_a_write_told_with_a_token_count_that_does_not_match_its_pages_is_refused_before_anything_is_taken(
    publisher, stream
):
    import pytest

    from kvstage.errors import InvalidArgumentError

    store = MemoryStore(FP, capacity_pages=10)
    announcer = KVEventAnnouncer(publisher, store, block_size=PAGE)
    keys = chain(0, 2)
    store.put(keys, [page(0), page(1)])
    with pytest.raises(InvalidArgumentError, match=r"^tokens: must be empty or block_size \(4\) per key, 8, got 7"):
        announcer.written(keys, tokens_of(0, 2)[:7], None, NO_NAMESPACE, ())
    announcer.written(keys, tokens_of(0, 2), None, NO_NAMESPACE, ())  # the store's events were left for it
    assert publisher.flush(10)
    assert stream() == [BlockStored([block_hash(key) for key in keys], None, tokens_of(0, 2), PAGE)]


def prime_with_another_writers_pages(publisher, store, announcer) -> tuple[str, str]:
    """Another writer of ``store`` stores two pages (no write of ``announcer`` tells them) and
    one of them is removed; the announcer's poll takes those events. Returns (kept, removed)."""
    kept, removed = chain(900, 1)[0], chain(950, 1)[0]
    store.put([kept], [page(9)])
    store.put([removed], [page(9)])
    store.remove([removed])
    announcer.poll()
    assert publisher.flush(10)
    return kept, removed


def hold_the_sender(publisher):
    """Block the publisher's sending thread in a deferred call until the returned event is set,
    so the writes made meanwhile are queued together for one drain."""
    import threading

    gate, holding = threading.Event(), threading.Event()

    def hold(batcher):
        holding.set()
        gate.wait(10)

    publisher.publish(hold)
    assert holding.wait(10)
    return gate


def test_a_chains_queued_writes_stay_one_run_while_another_writers_pages_are_remembered(publisher, stream):
    # Before: any remembered page of another writer (stored, or stored and removed, with no
    # write of this announcer to claim it: never forgotten) sent every write through the
    # per-write path and the per-page claim loop, for good.
    store = MemoryStore(FP, capacity_pages=20)
    announcer = KVEventAnnouncer(publisher, store, block_size=PAGE)
    prime_with_another_writers_pages(publisher, store, announcer)
    assert len(announcer._untold) == 1 and len(announcer._gone_untold) == 1
    per_write, claims = [], []
    announce, claim = announcer._announce, announcer._claim
    announcer._announce = lambda *call: per_write.append(call) or announce(*call)
    announcer._claim = lambda *args: claims.append(args) or claim(*args)
    keys = chain(0, 4)
    gate = hold_the_sender(publisher)
    for index, key in enumerate(keys):
        prior = keys[index - 1] if index else None
        store.put([key], [page(index)], prior_key=prior)
        announcer.written([key], tokens_of(index * PAGE, 1), prior, NO_NAMESPACE, ())
    gate.set()
    assert publisher.flush(10)
    events = stream()
    assert per_write == [] and claims == []  # one run, no page of it remembered: no claim
    assert events[-1] == BlockStored([block_hash(key) for key in keys], None, tokens_of(0, 4), PAGE)
    assert claimed(events) >= held(store, keys) == {block_hash(key) for key in keys}
    assert announcer.pages_announced == 4 and announcer.pages_without_tokens == 2 and announcer.errors == 0


def test_a_chains_queued_writes_with_a_page_seen_stored_and_removed_before_told_are_told_one_by_one(publisher, stream):
    store = MemoryStore(FP, capacity_pages=20)
    announcer = KVEventAnnouncer(publisher, store, block_size=PAGE)
    prime_with_another_writers_pages(publisher, store, announcer)
    keys = chain(0, 3)
    for index, key in enumerate(keys):  # stored, not told yet
        store.put([key], [page(index)], prior_key=keys[index - 1] if index else None)
    store.remove([keys[1]])  # the middle page goes before its write is told
    announcer.poll()  # takes the three stores and the removal
    gate = hold_the_sender(publisher)
    for index, key in enumerate(keys):
        announcer.written([key], tokens_of(index * PAGE, 1), keys[index - 1] if index else None, NO_NAMESPACE, ())
    gate.set()
    assert publisher.flush(10)
    events = stream()
    assert claimed(events) == held(store, keys) == {block_hash(keys[0])}  # (the store dropped the tail too)
    assert announcer.pages_announced == 1 and announcer.errors == 0
