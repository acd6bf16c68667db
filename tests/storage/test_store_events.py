"""Store events of the memory and file stores: stored, evicted (by the store's own chain
eviction), removed (clear, a corrupt page dropped); a bounded queue drained without blocking,
its overflow counted; under a writer and a drainer thread.

(Mooncake: ``mooncake/test_mooncake_clear_events.py``.)
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.hashing import prefill_page_keys
from kvstage.kv_layout import KVLayout
from kvstage.storage import FileStore, LayoutFingerprint, MemoryStore, PutStatus, StoreEvent

FP = LayoutFingerprint("tiny", KVLayout(2, 2, 1, 4, "float32"), 4)  # 256 B a page


def page(value: float) -> torch.Tensor:
    return torch.arange(64, dtype=torch.float32).add_(value)


def chain(start: int, pages: int) -> list[str]:
    return prefill_page_keys(list(range(start, start + 4 * pages)), 4)


def file_page_bytes(tmp_path) -> int:
    probe = FileStore(FP, tmp_path / "probe")
    probe.put(["0" * 64], [page(0)])
    return probe.used_bytes


def make(kind: str, tmp_path, *, capacity_pages: int = 10_000, **options):
    if kind == "memory":
        return MemoryStore(FP, capacity_pages=capacity_pages, **options)
    return FileStore(FP, tmp_path / "pages", capacity_bytes=capacity_pages * file_page_bytes(tmp_path), **options)


def kinds(events: list[StoreEvent]) -> list[tuple[str, str]]:
    return [(event.kind, event.key) for event in events]


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_each_stored_page_is_one_event_dedup_and_failures_none(kind, tmp_path):
    store = make(kind, tmp_path)
    keys = chain(0, 3)
    before = time.monotonic()
    store.put(keys[:2], [page(0), page(1)])
    store.put(keys[:2], [page(0), page(1)])  # deduplicated
    store.put([keys[2]], [page(2)], prior_key="f" * 64)  # FAILED: its predecessor is not stored
    events = store.take_events()
    assert kinds(events) == [("stored", keys[0]), ("stored", keys[1])]
    tier = "memory" if kind == "memory" else "file"
    for event in events:
        assert (event.tier, event.page_bytes, event.key_space) == (tier, FP.page_bytes, FP.prefix())
        assert before <= event.time_s <= time.monotonic()
    assert events[0].time_s <= events[1].time_s
    assert store.take_events() == []
    assert (store.stats.events_stored, store.stats.events_evicted, store.stats.events_removed) == (2, 0, 0)


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_chain_eviction_reports_each_evicted_page(kind, tmp_path):
    store = make(kind, tmp_path, capacity_pages=3)
    first, second = chain(0, 2), chain(100, 2)
    store.put(first, [page(0), page(1)])
    store.put(second[:1], [page(2)])
    store.take_events()
    store.put(second[1:], [page(3)], prior_key=second[0])  # evicts first's tail
    assert kinds(store.take_events()) == [("evicted", first[1]), ("stored", second[1])]
    assert store.stats.events_evicted == store.stats.pages_evicted == 1


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_clear_reports_each_removed_page(kind, tmp_path):
    store = make(kind, tmp_path)
    keys = chain(0, 4)
    store.put(keys, [page(i) for i in range(4)])
    store.take_events()
    assert store.clear() == 4
    events = store.take_events()
    assert sorted(kinds(events)) == sorted(("removed", key) for key in keys)
    assert store.stats.events_removed == 4


def test_a_corrupt_page_dropped_by_a_reader_is_reported_removed(tmp_path):
    store = make("file", tmp_path)
    keys = chain(0, 1)
    store.put(keys, [page(0)])
    path = store.path_of(keys[0])
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    store.take_events()
    assert store.get(keys, [torch.zeros(64)]) == [False]
    assert kinds(store.take_events()) == [("removed", keys[0])]
    assert store.stats.pages_removed == 1 and not path.exists()


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_a_full_queue_drops_the_oldest_and_counts_them(kind, tmp_path):
    store = make(kind, tmp_path, event_capacity=3)
    keys = chain(0, 5)
    assert store.put(keys, [page(i) for i in range(5)]) == [PutStatus.STORED] * 5  # never blocked
    assert [event.key for event in store.take_events(max_events=2)] == keys[2:4]
    assert [event.key for event in store.take_events()] == keys[4:]
    assert store.stats.events_dropped == 2 and store.stats.events_stored == 5
    off = make(kind, tmp_path / "off", event_capacity=0)
    off.put(keys[:2], [page(0), page(1)])
    assert off.take_events() == [] and off.stats.events_dropped == 2


def test_bad_event_arguments_raise_naming_them(tmp_path):
    with pytest.raises(InvalidArgumentError, match="event_capacity: must be an int >= 0"):
        MemoryStore(FP, event_capacity=-1)
    with pytest.raises(InvalidArgumentError, match="event_capacity"):
        FileStore(FP, tmp_path, event_capacity=1.5)
    store = MemoryStore(FP)
    with pytest.raises(InvalidArgumentError, match="max_events: must be None or an int >= 0"):
        store.take_events(max_events=-1)


@pytest.mark.parametrize("kind", ["memory", "file"])
@pytest.mark.parametrize("event_capacity", [100_000, 16])
def test_a_writer_and_a_drainer_thread_lose_nothing_uncounted(kind, event_capacity, tmp_path):
    store = make(kind, tmp_path, capacity_pages=40, event_capacity=event_capacity)
    chains = [chain(1000 * i, 3) for i in range(50)]  # 150 pages into 40: evictions too
    taken: list[StoreEvent] = []
    done = threading.Event()

    def writer() -> None:
        for index, keys in enumerate(chains):
            store.put(keys, [page(index + i) for i in range(3)])
            if index % 10 == 9:
                store.clear()
        done.set()

    def drainer() -> None:
        while not done.is_set():
            taken.extend(store.take_events(max_events=7))
        taken.extend(store.take_events())

    threads = [threading.Thread(target=writer), threading.Thread(target=drainer)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stats = store.stats
    recorded = stats.events_stored + stats.events_evicted + stats.events_removed
    assert len(taken) + stats.events_dropped == recorded
    assert stats.events_stored == stats.pages_stored == 150
    assert stats.events_evicted == stats.pages_evicted and stats.events_removed == stats.pages_removed
    assert stats.pages_stored == stats.pages_evicted + stats.pages_removed + len(store_keys(store, chains))
    if event_capacity > recorded:  # nothing dropped: the events replay the store's state
        assert stats.events_dropped == 0
        present: set[str] = set()
        for event in taken:
            if event.kind == "stored":
                assert event.key not in present
                present.add(event.key)
            else:
                present.remove(event.key)
        assert present == store_keys(store, chains)


def store_keys(store, chains) -> set[str]:
    keys = [key for keys in chains for key in keys]
    return {key for key, hit in zip(keys, store.exists(keys)) if hit}


def test_the_managers_metrics_count_the_stores_events():
    from offload_rig import make_rig

    fingerprint = LayoutFingerprint("rig", KVLayout(2, 2, 1, 4, "int32"), 4)
    store = MemoryStore(fingerprint, capacity_pages=4, event_capacity=4)
    rig = make_rig(page_size=4, offload_stride=8, storage=store)
    others = torch.zeros(2, 64, dtype=torch.int32)
    store.put(["1" * 64], [others[0]])  # two one-page chains of other requests
    store.put(["2" * 64], [others[1]])
    req = rig.new_request("r", range(4), 32)  # its prompt page: stored by the "prefill side"
    for token in range(100, 109):  # 8 more tokens with KV: 2 pages; the 4-page store evicts one
        rig.decode(req, token)
    assert rig.manager.finish(req)
    rig.copy_stream.complete_all()
    rig.manager.poll()
    m = rig.manager.metrics
    assert m.pages_stored == 2
    assert (m.store_events_stored, m.store_events_evicted, m.store_events_removed) == (5, 1, 0)
    assert store.clear() == 4
    m = rig.manager.metrics
    assert (m.store_events_stored, m.store_events_evicted, m.store_events_removed) == (5, 1, 4)
    assert m.store_events_dropped == 10 - 4
    assert [event.kind for event in store.take_events()] == ["removed"] * 4
