"""StoreIndex: what a store holds, answered on the engine's thread without waiting for the store.

A real MemoryStore behind real StoreWorkers threads. What must hold: a key the index has not
seen answers None (unknown) at once and its exists() runs on a reader thread; after poll() the
store's answer is cached; keys added or discarded answer at once; a miss is asked again once its
answer is older than miss_ttl_s (another process may have stored it); a discard made while a
refresh is in flight is not undone by that refresh's stale answer; a store that cannot answer
makes its keys miss for miss_ttl_s (logged once, counted); bad arguments raise.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.offload import StoreIndex, StoreWorkers
from kvstage.storage import LayoutFingerprint, MemoryStore

FINGERPRINT = LayoutFingerprint.opaque("m", page_bytes=64, page_format="test")


def page(value: int) -> torch.Tensor:
    return torch.full((64,), value, dtype=torch.uint8)


@pytest.fixture
def store_and_workers():
    store, workers = MemoryStore(FINGERPRINT), StoreWorkers()
    yield store, workers
    workers.close()


def settled(index: StoreIndex) -> None:
    """Until every queued key has its answer (an engine instead polls once a step)."""
    while index.refreshing:
        index.wait()
        index.poll()


def held_exists(store: MemoryStore) -> tuple[threading.Event, object]:
    """Make ``store.exists`` wait (up to 5 s) until the returned gate is set, so a refresh stays
    in flight; returns the gate and the store's own ``exists``."""
    gate = threading.Event()
    real_exists = store.exists
    store.exists = lambda keys: (gate.wait(5), real_exists(keys))[1]
    return gate, real_exists


def test_unknown_keys_answer_none_then_the_stores_answer_once_polled(store_and_workers):
    store, workers = store_and_workers
    store.put(["a1", "a2"], [page(1), page(2)])
    index = StoreIndex(store, workers)
    assert [index.lookup(key) for key in ("a1", "a2", "b1")] == [None, None, None]
    settled(index)
    assert [index.lookup(key) for key in ("a1", "a2", "b1")] == [True, True, False]
    assert store.stats.pages_read == 0  # exists only: no page was read


def test_the_engine_thread_never_runs_exists(store_and_workers):
    store, workers = store_and_workers
    callers = []
    real_exists = store.exists
    store.exists = lambda keys: callers.append(threading.current_thread().name) or real_exists(keys)
    index = StoreIndex(store, workers)
    index.lookup("a1")
    settled(index)
    assert callers and all(name.startswith("kvstage-store-read") for name in callers)


def test_added_and_discarded_keys_answer_at_once(store_and_workers):
    store, workers = store_and_workers
    index = StoreIndex(store, workers)
    index.add(["a1", "a2"])
    assert index.lookup("a1") is True and len(index) == 2
    index.discard(["a1"])
    assert index.lookup("a1") is False and len(index) == 1


def test_a_miss_is_asked_again_after_its_ttl(store_and_workers):
    store, workers = store_and_workers
    now = [100.0]
    index = StoreIndex(store, workers, miss_ttl_s=1.0, clock=lambda: now[0])
    index.lookup("a1")
    settled(index)
    assert index.lookup("a1") is False
    store.put(["a1"], [page(1)])  # another process stores it
    now[0] += 0.5
    assert index.lookup("a1") is False  # still the cached answer
    now[0] += 0.6
    assert index.lookup("a1") is None  # stale: asked again
    settled(index)
    assert index.lookup("a1") is True


def test_a_discard_during_a_refresh_is_not_undone_by_its_stale_answer(store_and_workers):
    store, workers = store_and_workers
    store.put(["a1"], [page(1)])
    gate, _ = held_exists(store)
    index = StoreIndex(store, workers)
    assert index.lookup("a1") is None
    index.discard(["a1"])  # e.g. a read found it corrupted while exists() was on its way
    gate.set()
    settled(index)
    assert index.lookup("a1") is False


def test_keys_asked_while_a_refresh_runs_go_in_the_next_one(store_and_workers):
    store, workers = store_and_workers
    store.put(["a1", "b1"], [page(1), page(2)])
    batches = []
    real_exists = store.exists
    store.exists = lambda keys: batches.append(list(keys)) or real_exists(keys)
    index = StoreIndex(store, workers)
    index.lookup("a1")
    index.lookup("b1")
    index.lookup("a1")  # asked twice, queued once
    settled(index)
    assert index.lookup("a1") is True and index.lookup("b1") is True
    assert sorted(key for batch in batches for key in batch) == ["a1", "b1"]


def test_queued_keys_are_asked_at_most_batch_keys_at_a_time_in_lookup_order(store_and_workers):
    store, workers = store_and_workers
    store.put(["k1", "k3"], [page(1), page(3)])
    gate, real_exists = held_exists(store)
    batches = []
    store.exists = lambda keys: (gate.wait(5), batches.append(list(keys)), real_exists(keys))[2]
    index = StoreIndex(store, workers, batch_keys=2)
    for key in ("k0", "k1", "k2", "k3", "k4", "k5", "k6"):
        assert index.lookup(key) is None  # k0 leaves at once; the rest queue behind it
    gate.set()
    settled(index)
    assert batches == [["k0"], ["k1", "k2"], ["k3", "k4"], ["k5", "k6"]]
    assert [index.lookup(key) for key in ("k0", "k1", "k2", "k3", "k4")] == [False, True, False, True, False]


def test_a_store_error_makes_the_keys_miss_until_miss_ttl_s_then_asks_again(store_and_workers):
    store, workers = store_and_workers
    store.put(["a1"], [page(1)])
    real_exists = store.exists
    failures = [1]

    def flaky(keys):
        if failures:
            failures.pop()
            raise OSError("store down")
        return real_exists(keys)

    store.exists = flaky
    now = [0.0]
    index = StoreIndex(store, workers, miss_ttl_s=1.0, clock=lambda: now[0])
    index.lookup("a1")
    settled(index)
    assert index.lookup("a1") is False  # a miss while the store cannot answer
    now[0] = 1.5
    assert index.lookup("a1") is None  # asked again after miss_ttl_s
    settled(index)
    assert index.lookup("a1") is True and index.refreshes_failed == 1


@pytest.mark.parametrize(
    ("arguments", "message"), [({"miss_ttl_s": -1}, "miss_ttl_s"), ({"batch_keys": 0}, "batch_keys")]
)
def test_bad_arguments_raise_naming_them(store_and_workers, arguments, message):
    store, workers = store_and_workers
    with pytest.raises(InvalidArgumentError, match=message):
        StoreIndex(store, workers, **arguments)


def test_a_held_key_older_than_hit_ttl_answers_true_and_is_checked_in_the_background(store_and_workers):
    store, workers = store_and_workers
    now = [0.0]
    index = StoreIndex(store, workers, hit_ttl_s=5.0, clock=lambda: now[0])
    index.add(["a1", "b1"])  # e.g. a worker in another process wrote them; then its store evicts a1
    store.put(["b1"], [page(2)])
    now[0] = 6.0
    assert index.lookup("a1") is True and index.lookup("b1") is True  # stale, still answered at once
    settled(index)
    assert index.lookup("a1") is False  # the store said it is gone
    assert index.lookup("b1") is True and not index.refreshing  # confirmed: fresh again
    now[0] = 10.0
    index.lookup("b1")
    assert not index.refreshing  # 4 s after its confirmation: not asked again


def test_without_hit_ttl_held_keys_are_never_asked_again(store_and_workers):
    store, workers = store_and_workers
    now = [0.0]
    index = StoreIndex(store, workers, clock=lambda: now[0])
    index.add(["a1"])
    now[0] = 1e6
    assert index.lookup("a1") is True and not index.refreshing


def test_reset_forgets_every_answer_and_ignores_the_refresh_in_flight(store_and_workers):
    store, workers = store_and_workers
    store.put(["a1"], [page(1)])
    gate, real_exists = held_exists(store)
    index = StoreIndex(store, workers)
    index.add(["b1"])
    index.lookup("a1")  # in flight when the store is cleared
    store.exists = real_exists
    store.clear()
    index.reset()
    gate.set()
    assert len(index) == 0 and index.lookup("b1") is None  # asked again
    settled(index)
    assert index.lookup("a1") is None  # the answer from before the clear was not taken
    settled(index)
    assert index.lookup("a1") is False and index.lookup("b1") is False


def test_forget_makes_the_next_lookup_ask_the_store_and_ignores_the_answer_in_flight(store_and_workers):
    store, workers = store_and_workers
    store.put(["held"], [page(1)])
    index = StoreIndex(store, workers)
    index.add(["held", "never-written"])  # e.g. a store job another process reported done
    index.discard(["gone"])
    assert index.holds("never-written") and not index.holds("gone")
    assert index.lookup("other") is None  # a refresh is in flight ...
    index.forget(["held", "never-written", "gone", "other"])  # ... its answer about "other" is older
    assert index.lookup("other") is None  # queued again for the next refresh
    assert not index.holds("held") and not index.holds("never-written")
    assert [index.lookup(key) for key in ("held", "never-written", "gone")] == [None, None, None]
    settled(index)
    assert [index.lookup(key) for key in ("held", "never-written", "gone")] == [True, False, False]
    assert index.holds("held") and not index.holds("never-written")
    assert index.lookup("other") is False  # answered by the refresh after forget(), not the one before


def test_changes_are_recorded_only_while_a_refresh_is_in_flight_and_old_misses_are_pruned(store_and_workers):
    store, workers = store_and_workers
    now = [0.0]
    index = StoreIndex(store, workers, miss_ttl_s=1.0, clock=lambda: now[0])
    keys = [f"k{i}" for i in range(100_000)]
    index.add(keys)
    index.discard(keys)
    # The index's memory of misses is private: its bound is what this test checks.
    assert len(index._changed_while_asking) == 0  # no refresh in flight: nothing to protect
    assert len(index._missing) == 100_000 and len(index) == 0
    now[0] = 0.5
    index.discard(["late"])
    index.poll()
    assert len(index._missing) == 100_001  # none older than miss_ttl_s yet
    now[0] = 1.2
    index.poll()
    assert list(index._missing) == ["late"]  # the 100,000 older than miss_ttl_s are gone
    assert index.lookup("k7") is None  # a pruned miss is asked again, as an expired one was
    index.discard(["k8"])  # a refresh is in flight now: its answer must not undo this discard
    assert index._changed_while_asking == {"k8"}
    settled(index)
    assert index.lookup("k8") is False and index.lookup("k7") is False


def test_a_refresh_that_raises_is_logged_once_counted_and_its_keys_miss_for_miss_ttl_s(store_and_workers, caplog):
    store, workers = store_and_workers
    calls = []

    def dead_exists(keys):
        calls.append(list(keys))
        raise ConnectionError("master gone")

    store.exists = dead_exists
    now = [0.0]
    index = StoreIndex(store, workers, miss_ttl_s=1.0, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="kvstage.offload.store_index"):
        assert index.lookup("a") is None
        settled(index)
        assert index.lookup("a") is False and len(calls) == 1  # a miss: no second failing exists
        now[0] = 1.5
        assert index.lookup("a") is None  # asked again after miss_ttl_s
        settled(index)
    assert index.refreshes_failed == 2 and len(calls) == 2
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvstage.offload.store_index"]
    assert len(warnings) == 1 and "master gone" in warnings[0], warnings


def test_store_events_apply_in_order_and_only_counted_stored_keys_become_held():
    store, workers = MemoryStore(FINGERPRINT, capacity_pages=1), StoreWorkers()
    try:
        store.put(["a"], [page(1)])
        store.put(["b"], [page(2)])  # evicts a
        store.put(["a"], [page(1)])  # evicts b: a stored, gone, stored again
        events = store.take_events()
        assert [(event.kind, event.key) for event in events] == [
            ("stored", "a"),
            ("evicted", "a"),
            ("stored", "b"),
            ("evicted", "b"),
            ("stored", "a"),
        ]
        index = StoreIndex(store, workers)
        index.apply_events(events, "another key space")
        assert len(index) == 0 and not index.refreshing
        index.apply_events(events, store.prefix)
        assert index.holds("a") and not index.holds("b") and index.lookup("b") is False
        other = StoreIndex(store, workers)
        other.apply_events(events, store.prefix, counts_stored=lambda key: key != "a")
        assert not other.holds("a") and not other.holds("b") and other.lookup("b") is False
    finally:
        workers.close()
