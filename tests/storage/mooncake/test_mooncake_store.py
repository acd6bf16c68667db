"""MooncakeStore against a real mooncake_master on loopback: round trips, dedup, lifecycle."""

from __future__ import annotations

import threading
import time
import uuid
from contextlib import contextmanager

import pytest
import torch

from kvstage.errors import InvalidArgumentError, StorageError
from kvstage.kv_layout import KVLayout
from kvstage.storage import LayoutFingerprint, PutStatus, open_storage
from kvstage.storage.mooncake.store import MooncakeStore


def new_keys(n: int) -> list[str]:
    """Fresh page keys (hex), so tests sharing one master never collide."""
    return [uuid.uuid4().hex for _ in range(n)]


def random_pages(n: int, fingerprint, seed: int) -> torch.Tensor:
    """``[n, page elements]`` bf16 pages of distinct random values (one host-pool chunk)."""
    generator = torch.Generator().manual_seed(seed)
    elements = fingerprint.page_bytes // 2
    return torch.randn(n, elements, generator=generator).to(torch.bfloat16)


@pytest.fixture(scope="module")
def store(mooncake_master, fingerprint):
    """One client for the module; its bounce buffer holds 3 pages so bounced batches split."""
    with MooncakeStore(fingerprint, mooncake_master.url(bounce=3 * fingerprint.page_bytes)) as opened:
        yield opened


def test_zero_copy_round_trip_from_registered_chunks(store, fingerprint):
    pool = random_pages(8, fingerprint, seed=1)
    back = torch.zeros_like(pool)
    store.register_host_buffers([pool, back])
    store.register_host_buffers([pool, back[2:5]])  # again, and a slice inside one: skipped
    keys = new_keys(8)
    bounced_before = store.pages_bounced

    assert store.put(keys, list(pool)) == [PutStatus.STORED] * 8
    assert store.exists(keys + new_keys(1)) == [True] * 8 + [False]
    order = [5, 0, 7, 3, 1, 6, 2, 4]
    assert store.get([keys[i] for i in order], list(back)) == [True] * 8
    for slot, index in enumerate(order):
        assert torch.equal(back[slot], pool[index])
    assert store.pages_bounced == bounced_before  # nothing went through the bounce buffer


def test_unregistered_pages_go_through_the_bounce_buffer(store, fingerprint):
    pages = list(random_pages(7, fingerprint, seed=2))  # 7 pages: bounce chunks of 3, 3, 1
    keys = new_keys(7)
    bounced_before = store.pages_bounced
    assert store.put(keys, pages) == [PutStatus.STORED] * 7
    back = [torch.full_like(pages[0], 7.0) for _ in range(7)]
    assert store.get(keys, back) == [True] * 7
    assert all(torch.equal(a, b) for a, b in zip(back, pages))
    assert store.pages_bounced - bounced_before == 14


def test_existing_keys_are_deduplicated_not_rewritten(store, fingerprint):
    first = random_pages(4, fingerprint, seed=3)
    keys = new_keys(4)
    assert store.put(keys[:2], list(first[:2])) == [PutStatus.STORED] * 2
    stats_before = (store.stats.pages_stored, store.stats.pages_deduplicated)

    other = random_pages(4, fingerprint, seed=4)  # different bytes under the same keys
    assert store.put(keys, list(other)) == [PutStatus.DEDUPLICATED] * 2 + [PutStatus.STORED] * 2
    assert (store.stats.pages_stored, store.stats.pages_deduplicated) == (stats_before[0] + 2, stats_before[1] + 2)

    back = [torch.zeros_like(first[0]) for _ in range(4)]
    assert store.get(keys, back) == [True] * 4
    assert torch.equal(back[0], first[0]) and torch.equal(back[1], first[1])  # the first write stays
    assert torch.equal(back[2], other[2]) and torch.equal(back[3], other[3])


def test_a_second_client_sees_and_deduplicates_the_same_pages(mooncake_master, store, fingerprint):
    pages = random_pages(3, fingerprint, seed=5)
    keys = new_keys(3)
    assert store.put(keys, list(pages)) == [PutStatus.STORED] * 3
    second = open_storage(mooncake_master.url(), fingerprint)
    try:
        assert isinstance(second, MooncakeStore)
        assert second.exists(keys) == [True] * 3
        assert second.put(keys, list(pages)) == [PutStatus.DEDUPLICATED] * 3
        back = torch.zeros_like(pages)
        second.register_host_buffers([back])
        assert second.get(keys, list(back)) == [True] * 3
        assert torch.equal(back, pages)
    finally:
        second.close()


def test_missing_keys_miss_and_leave_the_target_alone(store, fingerprint):
    present = new_keys(1)
    page = random_pages(1, fingerprint, seed=6)[0]
    assert store.put(present, [page]) == [PutStatus.STORED]
    targets = torch.full((3, page.numel()), 3.0, dtype=torch.bfloat16)
    store.register_host_buffers([targets])
    misses_before = store.stats.pages_missed
    assert store.get([new_keys(1)[0], present[0], new_keys(1)[0]], list(targets)) == [False, True, False]
    assert torch.equal(targets[1], page)
    assert bool((targets[0] == 3.0).all()) and bool((targets[2] == 3.0).all())
    assert store.stats.pages_missed == misses_before + 2


def test_another_layout_does_not_see_the_pages(mooncake_master, store, fingerprint):
    keys = new_keys(2)
    assert store.put(keys, list(random_pages(2, fingerprint, seed=7))) == [PutStatus.STORED] * 2
    from dataclasses import replace

    other_rank = replace(fingerprint, tp_rank=1, tp_size=2)  # same page size, other prefix
    with MooncakeStore(other_rank, mooncake_master.url()) as other:
        assert other.exists(keys) == [False, False]


def test_wrong_sized_pages_are_refused_before_anything_is_written(store, fingerprint):
    keys = new_keys(2)
    good = random_pages(1, fingerprint, seed=8)[0]
    with pytest.raises(InvalidArgumentError, match=r"pages\[1\]"):
        store.put(keys, [good, good[:-1]])
    assert store.exists(keys) == [False, False]
    with pytest.raises(InvalidArgumentError, match=r"buffers\[0\]: must be a contiguous CPU tensor"):
        store.register_host_buffers([torch.zeros(4, 4).t()])


def test_close_unregisters_and_is_idempotent(mooncake_master, fingerprint):
    opened = MooncakeStore(fingerprint, mooncake_master.url())
    chunk = random_pages(2, fingerprint, seed=9)
    opened.register_host_buffers([chunk])
    assert opened.put(new_keys(1), [chunk[0]]) == [PutStatus.STORED]
    opened.close()
    # No public view of the registered buffers.
    assert opened._registered == []
    opened.close()
    with pytest.raises(StorageError, match="closed"):
        opened.put(new_keys(1), [chunk[1]])
    with pytest.raises(StorageError, match="closed"):
        opened.register_host_buffers([chunk])


def test_overlapping_buffers_are_refused_before_any_is_registered(store, fingerprint):
    chunk = random_pages(4, fingerprint, seed=10).view(-1)
    half = chunk.numel() // 2
    # No public view of the registered buffers.
    registered_before = len(store._registered)
    overlapping = chunk[half // 2 : half + half // 2]  # straddles the first half's end
    with pytest.raises(InvalidArgumentError, match=r"buffers\[1\]: .* overlaps"):
        store.register_host_buffers([chunk[:half], overlapping])
    assert len(store._registered) == registered_before
    store.register_host_buffers([chunk[:half], chunk, chunk[half:]])  # the views lie inside chunk
    assert len(store._registered) == registered_before + 1


class BlockingClient:
    """The store's Mooncake client with one method held at its start: ``entered`` is set when a
    call of ``method`` arrives, which then waits for ``release`` (at most ``hold_s``) before it
    runs. Every other attribute is the real client's."""

    def __init__(self, client, method: str, hold_s: float = 20.0) -> None:
        self._client, self._method, self._hold_s = client, method, hold_s
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        real = getattr(self._client, name)
        if name != self._method:
            return real

        def held(*args):
            self.entered.set()
            self.release.wait(self._hold_s)
            return real(*args)

        return held


def in_thread(function, *args) -> tuple[threading.Thread, dict]:
    """Start ``function(*args)`` in a daemon thread; its result (or error) lands in the dict."""
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["result"] = function(*args)
        except BaseException as error:  # handed to the test thread
            outcome["error"] = error
        outcome["done_at"] = time.monotonic()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


@contextmanager
def client_held_at(store: MooncakeStore, method: str):
    """Swap the store's client for a :class:`BlockingClient` holding ``method``; restore it after."""
    real = store._store  # the client object is the store's own: the only way to hold its call
    blocking = BlockingClient(real, method)
    store._store = blocking
    try:
        yield blocking
    finally:
        blocking.release.set()
        store._store = real


def test_a_get_completes_while_another_threads_put_is_inside_its_network_call(mooncake_master, fingerprint):
    """Guards the store lock: it once covered Mooncake's calls, so sglang's prefetch waited on its backup."""
    with MooncakeStore(fingerprint, mooncake_master.url()) as store:
        pool = random_pages(4, fingerprint, seed=11)
        back = torch.zeros_like(pool[:2])
        store.register_host_buffers([pool, back])
        stored = new_keys(2)
        assert store.put(stored, list(pool[:2])) == [PutStatus.STORED] * 2
        later = new_keys(2)
        with client_held_at(store, "batch_put_from") as client:
            writer, written = in_thread(store.put, later, list(pool[2:]))
            assert client.entered.wait(10), "the put never reached batch_put_from"
            reader, read = in_thread(store.get, stored, list(back))
            reader.join(5)
            assert not reader.is_alive(), "the get waited for the other thread's put"
            assert "error" not in read and read["result"] == [True, True]
            assert torch.equal(back, pool[:2])
            assert writer.is_alive()  # still held inside its network call
            client.release.set()
            writer.join(10)
        assert written["result"] == [PutStatus.STORED] * 2
        assert written["done_at"] > read["done_at"]
        assert store.exists(later) == [True, True]


def test_two_threads_bouncing_at_once_each_use_their_own_bounce_buffer(mooncake_master, fingerprint):
    """Guards the bounce buffer: one shared buffer would let a get overwrite a held put's bytes."""
    with MooncakeStore(fingerprint, mooncake_master.url(bounce=2 * fingerprint.page_bytes)) as store:
        first, second = list(random_pages(2, fingerprint, seed=12)), list(random_pages(2, fingerprint, seed=13))
        first_keys, second_keys = new_keys(2), new_keys(2)
        assert store.put(second_keys, second) == [PutStatus.STORED] * 2
        with client_held_at(store, "batch_put_from") as client:
            writer, written = in_thread(store.put, first_keys, first)  # bytes now in its bounce buffer
            assert client.entered.wait(10)
            back = [torch.zeros_like(second[0]) for _ in range(2)]
            reader, read = in_thread(store.get, second_keys, back)  # bounced too: another buffer
            reader.join(5)
            assert not reader.is_alive() and read["result"] == [True, True]
            assert all(torch.equal(a, b) for a, b in zip(back, second))
            client.release.set()
            writer.join(10)
        assert written["result"] == [PutStatus.STORED] * 2
        again = [torch.zeros_like(first[0]) for _ in range(2)]
        assert store.get(first_keys, again) == [True, True]
        assert all(torch.equal(a, b) for a, b in zip(again, first))  # the held put's bytes, intact


@pytest.mark.parametrize("admin, removal", [(True, "batch_remove"), (False, "remove_by_regex")])
def test_clear_waits_for_a_put_in_flight_and_a_put_during_clear_lands_after_it(mooncake_master, admin, removal):
    """Guards the clear gate once puts run outside the store lock: a put racing clear lands
    whole after it or not at all. With the admin server clear removes by name, else by regex."""
    fp = LayoutFingerprint(f"gate-{uuid.uuid4().hex[:8]}", KVLayout(2, 2, 2, 64, "bfloat16"), 16)
    url = mooncake_master.url() if admin else mooncake_master.url(admin=None)
    with MooncakeStore(fp, url) as store, MooncakeStore(fp, url) as peer:
        pool = random_pages(4, fp, seed=14)
        store.register_host_buffers([pool])
        early, late = new_keys(2), new_keys(2)
        with client_held_at(store, "batch_put_from") as client:
            writer, written = in_thread(store.put, early, list(pool[:2]))
            assert client.entered.wait(10)
            clearer, cleared = in_thread(store.clear)
            clearer.join(0.5)
            assert clearer.is_alive(), "clear ran while a put was inside its network call"
            client.release.set()
            writer.join(10)
            clearer.join(10)
        assert written["result"] == [PutStatus.STORED] * 2 and cleared["result"] == 2
        assert store.exists(early) == [False, False]  # stored before the clear, removed by it
        store.take_events()
        peer_key = new_keys(1)
        peer.put(peer_key, list(random_pages(1, fp, seed=17)))  # something for the removal call to remove

        with client_held_at(store, removal) as client:
            clearer, cleared = in_thread(store.clear)
            assert client.entered.wait(10)
            writer, written = in_thread(store.put, late, list(pool[2:]))
            writer.join(0.5)
            assert writer.is_alive(), "a put ran while clear was removing"
            client.release.set()
            clearer.join(10)
            writer.join(10)
        assert cleared["result"] == 1 and written["result"] == [PutStatus.STORED] * 2
        assert store.exists(late) == [True, True] and peer.exists(peer_key) == [False]  # landed after the clear
        # The peer's page is named only where the admin server listed it.
        assert [(e.kind, e.key) for e in store.take_events()] == [("removed", k) for k in peer_key if admin] + [
            ("stored", key) for key in late
        ]


def test_close_unregisters_every_bounce_buffer_made_for_calls_at_once(mooncake_master, fingerprint):
    """Guards the per-call bounce buffers: each is registered once, reused, and unregistered at close."""
    store = MooncakeStore(fingerprint, mooncake_master.url(bounce=fingerprint.page_bytes))
    calls: list[tuple[str, int]] = []
    real = store._store  # wrapped to see the registrations: no public view of Mooncake's

    class Recording:
        def __getattr__(self, name):
            method = getattr(real, name)
            if name not in ("register_buffer", "unregister_buffer"):
                return method
            return lambda address, *rest: calls.append((name, address)) or method(address, *rest)

    try:
        first, second = list(random_pages(1, fingerprint, seed=15)), list(random_pages(1, fingerprint, seed=16))
        with client_held_at(store, "batch_put_from") as client:
            client._client = Recording()
            writers = [in_thread(store.put, new_keys(1), pages) for pages in (first, second)]
            deadline = time.monotonic() + 10
            while len(calls) < 2 and time.monotonic() < deadline:  # both hold a buffer, both held
                time.sleep(0.01)
            client.release.set()
            for thread, _ in writers:
                thread.join(10)
        store._store = Recording()
        for _ in range(3):  # later calls reuse the buffers made: nothing more is registered
            assert store.put(new_keys(1), first) == [PutStatus.STORED]
    finally:
        store.close()
    registered = [address for name, address in calls if name == "register_buffer"]
    assert len(registered) == 2 and len(set(registered)) == 2  # one per call bouncing at once
    assert sorted(address for name, address in calls if name == "unregister_buffer") == sorted(registered)
    assert [written["result"] for _, written in writers] == [[PutStatus.STORED]] * 2
