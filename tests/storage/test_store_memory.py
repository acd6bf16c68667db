"""MemoryStore: exact bytes back, dedup, LRU eviction within a bounded capacity, URL form.

(Chain-aware eviction: ``test_chain_eviction.py``; these tests put one-page chains.)
"""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.kv_layout import KVLayout
from kvstage.storage import LayoutFingerprint, MemoryStore, PutStatus, open_storage

FP = LayoutFingerprint("tiny", KVLayout(2, 2, 1, 4, "float32"), 2)  # 128 bytes


def page(value: float) -> torch.Tensor:
    return torch.arange(32, dtype=torch.float32).add_(value).reshape(2, 2, 2, 1, 4)


def test_put_copies_the_bytes_in_and_get_returns_them():
    store = MemoryStore(FP, capacity_pages=4)
    source = page(1.0)
    assert store.put(["a", "b"], [source, page(2.0)]) == [PutStatus.STORED, PutStatus.STORED]
    source.fill_(-1)  # the host page is reused after put: the store kept its own copy
    into = [torch.zeros(2, 2, 2, 1, 4), torch.zeros(32)]
    assert store.get(["a", "b"], into) == [True, True]
    assert torch.equal(into[0], page(1.0)) and torch.equal(into[1], page(2.0).reshape(-1))
    assert store.exists(["a", "c"]) == [True, False]
    assert store.stats.pages_stored == 2 and store.stats.bytes_put == 256 and store.stats.pages_read == 2


def test_existing_key_is_deduplicated_and_keeps_its_bytes():
    store = MemoryStore(FP, capacity_pages=4)
    store.put(["a"], [page(1.0)])
    assert store.put(["a"], [page(5.0)]) == [PutStatus.DEDUPLICATED]
    into = torch.zeros(32)
    assert store.get(["a"], [into]) == [True]
    assert torch.equal(into, page(1.0).reshape(-1))
    assert store.stats.pages_deduplicated == 1


def test_miss_leaves_the_target_untouched():
    store = MemoryStore(FP, capacity_pages=1)
    into = torch.full((32,), 3.0)
    assert store.get(["nope"], [into]) == [False]
    assert torch.all(into == 3.0) and store.stats.pages_missed == 1


def test_least_recently_used_page_is_evicted_first():
    store = MemoryStore(FP, capacity_bytes=3 * 128 + 100)  # 3 pages
    assert store.capacity_pages == 3
    for key, value in zip("abc", (1, 2, 3)):  # three one-page chains
        store.put([key], [page(value)])
    store.get(["a"], [torch.zeros(32)])  # a is now the most recent
    store.exists(["c"])  # found by the manager's dedup probe: a use too
    assert store.put(["d"], [page(4)]) == [PutStatus.STORED]
    assert store.exists(["a", "b", "c", "d"]) == [True, False, True, True]
    assert len(store) == 3 and store.used_bytes == 384 and store.stats.pages_evicted == 1


def test_zero_capacity_fails_every_put_and_keeps_no_key():
    store = MemoryStore(FP, capacity_pages=0)
    assert store.put(["a"], [page(1)]) == [PutStatus.FAILED]
    assert store.exists(["a"]) == [False] and store.stats.pages_failed == 1


def test_page_of_the_wrong_size_is_rejected_before_anything_is_written():
    store = MemoryStore(FP, capacity_pages=2)
    with pytest.raises(InvalidArgumentError, match=r"^pages\[1\]: 64 bytes"):
        store.put(["a", "b"], [page(1), torch.zeros(16)])
    assert len(store) == 0


def test_open_storage_memory_url():
    assert open_storage("memory", FP).capacity_pages == (1 << 30) // 128
    assert open_storage("memory:1280", FP).capacity_pages == 10
    with pytest.raises(InvalidArgumentError, match=r"^storage: 'memory:lots' capacity: must be a size, got 'lots'"):
        open_storage("memory:lots", FP)


def test_bounds_are_checked():
    with pytest.raises(InvalidArgumentError, match="^capacity_pages: give capacity_bytes or capacity_pages"):
        MemoryStore(FP, capacity_bytes=10, capacity_pages=1)
    with pytest.raises(InvalidArgumentError, match="^capacity_bytes: must be a non-negative int"):
        MemoryStore(FP, capacity_bytes=-1)


def test_a_key_found_by_exists_counts_as_recently_used():
    # The manager deduplicates through exists(): a shared page it finds is in use, so it must
    # not be the next evicted (before, exists() left the LRU order alone: FIFO for shared pages).
    fingerprint = LayoutFingerprint("m", KVLayout(1, 1, 1, 4, "uint8"), 1)
    store = MemoryStore(fingerprint, capacity_pages=2)
    page = torch.zeros(4, dtype=torch.uint8)
    store.put(["a"], [page])
    store.put(["b"], [page])
    assert store.exists(["a", "zz"]) == [True, False]
    store.put(["c"], [page])  # evicts the least recently used: b, not a
    assert store.exists(["a", "b", "c"]) == [True, False, True]


def test_uses_found_by_exists_keep_their_order_across_many_lookups_and_a_bounded_queue(monkeypatch):
    # exists() queues its uses and applies them before the next put or get (a lookup does no
    # recency work); the order must be the same as touching each key at once, also when the
    # queue reaches its bound between two puts.
    monkeypatch.setattr("kvstage.storage.memory_store._MAX_QUEUED_USES", 3)
    fingerprint = LayoutFingerprint("m", KVLayout(1, 1, 1, 4, "uint8"), 1)
    store = MemoryStore(fingerprint, capacity_pages=3)
    page = torch.zeros(4, dtype=torch.uint8)
    for key in "abc":
        store.put([key], [page])
    for _ in range(3):  # 6 uses: the queue is applied once on the way
        assert store.exists(["a", "b"]) == [True, True]
    assert len(store._uses) <= 3
    assert store.exists(["a"]) == [True]  # used order now: c, b, a
    store.put(["d"], [page])  # evicts c (least recently used)
    store.put(["e"], [page])  # evicts b
    assert store.exists(["a", "b", "c", "d", "e"]) == [True, False, False, True, True]


def test_a_key_found_by_many_lookups_takes_the_place_of_its_last_use():
    fingerprint = LayoutFingerprint("m", KVLayout(1, 1, 1, 4, "uint8"), 1)
    store = MemoryStore(fingerprint, capacity_pages=3)
    page = torch.zeros(4, dtype=torch.uint8)
    for key in "abc":
        store.put([key], [page])
    store.exists(["a", "b"])
    store.exists(["c"])
    store.exists(["a"])  # used order now: b, c, a (a's first use no longer counts)
    store.put(["d"], [page])  # evicts b
    store.put(["e"], [page])  # evicts c
    assert store.exists(["a", "b", "c", "d", "e"]) == [True, False, False, True, True]


def test_a_full_store_reuses_the_memory_of_the_pages_it_evicts():
    store = MemoryStore(FP, capacity_pages=2)
    for index, key in enumerate("abcde"):
        assert store.put([key], [page(float(index))]) == [PutStatus.STORED]
    assert store.buffers_allocated == 2 and store.stats.pages_evicted == 3
    into = torch.zeros(32)
    assert store.get(["e"], [into]) == [True] and torch.equal(into, page(4.0).reshape(-1))
    assert store.get(["d"], [into]) == [True] and torch.equal(into, page(3.0).reshape(-1))


def test_pages_of_any_dtype_and_shape_round_trip_byte_for_byte():
    store = MemoryStore(FP, capacity_pages=2)
    source = torch.arange(128, dtype=torch.uint8).reshape(4, 32)  # 128 bytes, another dtype
    assert store.put(["a"], [source]) == [PutStatus.STORED]
    into = torch.empty(64, dtype=torch.int16)
    assert store.get(["a"], [into]) == [True]
    assert torch.equal(into.view(torch.uint8), source.reshape(-1))


def test_a_timing_listener_sees_each_put_and_get_with_the_stats_seconds():
    store = MemoryStore(FP, capacity_pages=4)
    seen = []
    listener = lambda op, num_pages, seconds: seen.append((op, num_pages, seconds))  # noqa: E731
    store.add_timing_listener(listener)
    store.put(["a", "b"], [page(1.0), page(2.0)])
    store.get(["a", "c"], [torch.zeros(32), torch.zeros(32)])
    assert [(op, num_pages) for op, num_pages, _ in seen] == [("put", 2), ("get", 2)]
    assert seen[0][2] == store.stats.put_seconds > 0 and seen[1][2] == store.stats.get_seconds > 0
    store.remove_timing_listener(listener)
    store.put(["d"], [page(3.0)])
    assert len(seen) == 2
    with pytest.raises(InvalidArgumentError, match="^listener: must be callable"):
        store.add_timing_listener(3)


def count_copies():
    """A torch function mode counting ``Tensor.copy_`` calls made inside it."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        copies = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.copy_:
                self.copies += 1
            return func(*args, **(kwargs or {}))

    return Count()


def test_a_calls_host_pages_move_in_one_batch_in_and_out_also_when_the_put_evicts(monkeypatch):
    # A call's contiguous host pages move in one host_copy batch (no copy_), fresh or evicted
    # store rows alike.
    from kvstage.storage import page_runs

    batches = []
    real = page_runs.run_plan
    monkeypatch.setattr(page_runs, "run_plan", lambda plan, *args: (batches.append(len(plan.sizes)), real(plan, *args)))
    store = MemoryStore(FP, capacity_pages=4)
    pool = torch.arange(12 * 32, dtype=torch.float32).reshape(12, 2, 2, 2, 1, 4)
    for round_, keys in enumerate(("abcd", "efgh", "ijkl")):  # each put evicts the last chain
        pages = list(pool[4 * round_ : 4 * round_ + 4].unbind())
        with count_copies() as mode:
            assert store.put(list(keys), pages) == [PutStatus.STORED] * 4
        assert mode.copies == 0 and batches[-1] == 4
        into = torch.zeros(4, 2, 2, 2, 1, 4)
        with count_copies() as mode:
            assert store.get(list(keys), list(into.unbind())) == [True] * 4
        assert mode.copies == 0 and batches[-1] == 4 and torch.equal(into, pool[4 * round_ : 4 * round_ + 4])
    assert len(batches) == 6
    assert store.buffers_allocated == 4 and store.stats.pages_evicted == 8
    into = torch.zeros(3, 32)  # out of order, with a miss: still each page's own bytes
    assert store.get(["l", "zz", "i", "j"], [into[0], torch.zeros(32), into[1], into[2]]) == [True, False, True, True]
    assert torch.equal(into, pool[[11, 8, 9]].reshape(3, 32))


def test_the_memory_of_removed_pages_is_reused_so_allocations_stay_within_the_capacity():
    store = MemoryStore(FP, capacity_pages=4)
    for round_ in range(5):
        keys = [f"{round_}{key}" for key in "abcd"]
        assert store.put(keys, [page(float(round_))] * 4) == [PutStatus.STORED] * 4
        assert store.remove(keys[1:]) == 3  # one page of each round stays
        into = torch.zeros(32)
        assert store.get(keys[:1], [into]) == [True] and torch.equal(into, page(float(round_)).reshape(-1))
    assert store.buffers_allocated == 4 and len(store) == 1  # (each put evicted the last round's page)
    store.clear()
    assert store.put(["x"], [page(9.0)]) == [PutStatus.STORED] and store.buffers_allocated == 5  # clear freed them


def test_a_put_whose_copy_raises_keeps_none_of_its_pages_and_reports_its_evictions(monkeypatch):
    store = MemoryStore(FP, capacity_pages=2)
    store.put(["a", "b"], [page(1.0), page(2.0)])
    store.take_events()

    def broken(pages, buffers, *, into_buffers):
        raise RuntimeError("copy failed")

    monkeypatch.setattr("kvstage.storage.memory_store.copy_pages", broken)
    with pytest.raises(RuntimeError, match="copy failed"):
        store.put(["c", "d"], [page(3.0), page(4.0)])
    monkeypatch.undo()
    assert store.exists(["a", "b", "c", "d"]) == [False] * 4 and len(store) == 0
    assert sorted((e.kind, e.key) for e in store.take_events()) == [("evicted", "a"), ("evicted", "b")]
    assert store.put(["e"], [page(5.0)]) == [PutStatus.STORED] and store.buffers_allocated == 2
    into = torch.zeros(32)
    assert store.get(["e"], [into]) == [True] and torch.equal(into, page(5.0).reshape(-1))


def test_a_get_of_several_keys_marks_its_hits_used_in_key_order_and_skips_its_misses():
    store = MemoryStore(FP, capacity_pages=4)
    for key, value in zip("abcd", (1, 2, 3, 4)):  # four one-page chains, a the oldest
        store.put([key], [page(value)])
    into = [torch.full((32,), -1.0) for _ in range(4)]
    assert store.get(["c", "x", "a", "b"], into) == [True, False, True, True]
    assert torch.equal(into[0], page(3).reshape(-1)) and torch.equal(into[2], page(1).reshape(-1))
    assert torch.equal(into[3], page(2).reshape(-1)) and torch.all(into[1] == -1.0)
    store.take_events()
    # uses now, oldest first: d, c, a, b; each new page evicts the oldest
    for key, value in zip("efg", (5, 6, 7)):
        store.put([key], [page(value)])
    assert [event.key for event in store.take_events() if event.kind == "evicted"] == ["d", "c", "a"]


def test_a_put_whose_buffer_allocation_fails_leaves_no_key_behind_and_keeps_the_victims_memory(monkeypatch):
    store = MemoryStore(FP, capacity_pages=2)
    store.put(["a"], [page(1)])
    real_empty = torch.empty

    def no_memory(*args, **kwargs):
        raise MemoryError("no room for a new buffer")

    monkeypatch.setattr(torch, "empty", no_memory)
    with pytest.raises(MemoryError):
        store.put(["b", "c"], [page(2), page(3)])  # b takes a fresh buffer, c evicts a
    monkeypatch.setattr(torch, "empty", real_empty)
    assert store.exists(["a", "b", "c"]) == [False, False, False] and len(store) == 0
    assert store.remove(["b", "c"]) == 0
    allocated = store.buffers_allocated
    assert store.put(["d"], [page(4)]) == [PutStatus.STORED]  # into a's kept buffer
    assert store.buffers_allocated == allocated
    into = torch.zeros(32)
    assert store.get(["d"], [into]) == [True] and torch.equal(into, page(4).reshape(-1))


def test_a_remove_announces_a_chain_least_recently_used_first_counting_the_lookups_before_it():
    store = MemoryStore(FP, capacity_pages=4)
    store.put(["a", "b", "c"], [page(1), page(2), page(3)])
    store.exists(["b"])  # a lookup's use, queued until the next call that reads recency
    store.take_events()
    assert store.remove(["a"]) == 3
    assert [(event.kind, event.key) for event in store.take_events()] == [
        ("removed", "a"),
        ("removed", "c"),
        ("removed", "b"),
    ]
