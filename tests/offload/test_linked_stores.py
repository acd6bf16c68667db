"""Chain-aware eviction across a hybrid model's component stores (LinkedStores) on real stores:
each store filled past its capacity with a hybrid layout's pages and snapshots, so every
component evicts; after each request, every restorable length loads byte for byte and no
entry is left whose chain before it is gone."""

from __future__ import annotations

import threading

import pytest
import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.hashing import prefill_page_keys
from kvstage.kv_layout import KVLayout
from kvstage.model_layout import FullAttention, ModelLayout, PageSidecar, RequestState, SlidingWindow, TensorSpec
from kvstage.offload.linked_stores import LinkedStores
from kvstage.offload.restorable import pages_to_load, restorable_lengths, swa_store_mask
from kvstage.storage import FileStore, MemoryStore, PutStatus

PAGE = 2
SNAPSHOT_EVERY = 2  # pages between snapshots (the resume lengths)
STATE = (TensorSpec("conv", (3, 2), "bfloat16"), TensorSpec("recurrent", (2, 5), "float32"))
LAYOUT = ModelLayout(
    4,
    (
        SlidingWindow((0,), KVLayout(1, 2, 1, 4, "float32"), window=5),  # 2 pages before a length
        FullAttention((1, 3), KVLayout(2, 2, 1, 4, "float32")),
        PageSidecar((1, 3), (TensorSpec("index", (6,), "uint8"),), name="indexer"),
        RequestState((1, 2), STATE),
    ),
)
FINGERPRINTS = LAYOUT.fingerprints("m", page_size=PAGE)
# Entries each store holds at most: every component evicts (the state store soonest).
CAPACITY = {"full": 14, "indexer": 11, "swa": 7, "state": 3}
SWA = LAYOUT.component("swa")


def entry(name: str, key: str) -> torch.Tensor:
    """The bytes of component ``name``'s entry under ``key`` (distinct per both)."""
    size = FINGERPRINTS[name].page_bytes
    seed = int(key[:8], 16) ^ (hash(name) & 0xFFFF)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def open_stores(kind: str, tmp_path) -> dict:
    if kind == "memory":
        return {name: MemoryStore(fp, capacity_pages=CAPACITY[name]) for name, fp in FINGERPRINTS.items()}
    stores = {}
    for name, fp in FINGERPRINTS.items():
        probe = FileStore(fp, tmp_path / f"probe-{name}")
        probe.put(["ab" * 8], [entry(name, "ab" * 8)])
        stores[name] = FileStore(fp, tmp_path / "store", capacity_bytes=CAPACITY[name] * probe.used_bytes)
    return stores


def held(store) -> set[str]:
    """The keys a store holds, asked without counting as a use."""
    if isinstance(store, MemoryStore):
        return set(store._pages.keys())  # keyed by page keys
    return {page_key for _, page_key in store._room.values()}


def write(stores: dict, tokens: list[int]) -> list[str]:
    """Store a request as the offload manager does: its full pages, the other components' entries
    of the full pages stored (as chain starts), the window pages before each snapshot length,
    a snapshot every SNAPSHOT_EVERY pages when the full store holds its key."""
    keys = prefill_page_keys(tokens, PAGE)
    answer = stores["full"].put(keys, [entry("full", key) for key in keys])
    count = next((i for i, status in enumerate(answer) if status is PutStatus.FAILED), len(keys))
    stores["indexer"].put(keys[:count], [entry("indexer", key) for key in keys[:count]])
    lengths = [k * PAGE for k in range(SNAPSHOT_EVERY, count + 1, SNAPSHOT_EVERY) if k * PAGE < len(tokens)]
    mask = swa_store_mask(SWA, PAGE, lengths, count)
    window = [key for key, keep in zip(keys, mask) if keep]
    for key in window:  # one put a page: the window's runs are not contiguous
        stores["swa"].put([key], [entry("swa", key)])
    for length in lengths:
        key = keys[length // PAGE - 1]
        if stores["full"].exists([key])[0]:
            stores["state"].put([key], [entry("state", key)])
    return keys


def check(stores: dict, requests: list[tuple[list[int], list[str]]]) -> int:
    """Every restorable length of every request loads byte for byte; no entry is left whose
    chain before it is gone (full or sidecar page missing before it; a snapshot whose window
    lost a page). The restorable lengths found, summed."""
    holding = {name: held(store) for name, store in stores.items()}
    found = 0
    for tokens, keys in requests:
        present = {name: [key in holding[name] for key in keys] for name in stores}
        first_gap = min(
            (i for name in ("full", "indexer") for i, there in enumerate(present[name]) if not there), default=len(keys)
        )
        for name in stores:
            assert not any(present[name][first_gap:]), f"{name} holds entries after the chain's gap at page {first_gap}"
        window = SWA.window_pages(PAGE)
        for k in range(1, len(keys) + 1):
            if present["state"][k - 1]:
                assert all(present["swa"][max(0, k - window) : k]), f"a snapshot at page {k} lost its window"
        lengths = restorable_lengths(LAYOUT, PAGE, len(tokens), present).lengths
        assert all(k * PAGE in lengths for k in range(1, len(keys) + 1) if present["state"][k - 1])
        for length in lengths:
            for name, pages in pages_to_load(LAYOUT, PAGE, length).items():
                wanted = [keys[i] for i in pages]
                into = [torch.empty(FINGERPRINTS[name].page_bytes, dtype=torch.uint8) for _ in wanted]
                assert stores[name].get(wanted, into) == [True] * len(wanted)
                assert all(torch.equal(got, entry(name, key)) for got, key in zip(into, wanted))
        found += len(lengths)
    return found


def prompts(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 1000, (4,), generator=generator).tolist()  # a prefix some requests share
    out = []
    for index in range(count):
        length = int(torch.randint(7, 14, (1,), generator=generator))
        tail = torch.randint(1000, 9000, (length,), generator=generator).tolist()
        out.append(shared + tail if index % 3 == 0 else tail)
    return out


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_evictions_take_their_dependents_and_every_restorable_length_loads(kind, tmp_path):
    stores = open_stores(kind, tmp_path)
    linked = LinkedStores(LAYOUT, stores, PAGE)
    requests, found = [], 0
    for tokens in prompts(14):
        requests.append((tokens, write(stores, tokens)))
        found += check(stores, requests)
    evicted = {name: store.stats.pages_evicted for name, store in stores.items()}
    assert all(count > 0 for count in evicted.values()), evicted  # every component evicted
    assert found > 0  # some lengths stayed restorable
    removed = linked.dependents_removed
    assert removed["full"] > 0 and removed["state"] > 0 and removed["indexer"] + removed["swa"] > 0, removed
    for name, store in stores.items():
        events = store.take_events()
        assert {event.component for event in events} == {name}  # every event names its component
        assert {event.key_space for event in events} == {store.prefix}
        assert sum(event.kind == "removed" for event in events) == removed[name] == store.stats.pages_removed
        assert sum(event.kind == "evicted" for event in events) == evicted[name]
    linked.close()


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_without_links_evicted_entries_leave_their_dependents_behind(kind, tmp_path):
    # The failure LinkedStores fixes: stores evicting on their own keep entries no lookup can use.
    stores = open_stores(kind, tmp_path)
    requests = []
    with pytest.raises(AssertionError, match="holds entries after the chain's gap|lost its window"):
        for tokens in prompts(14):
            requests.append((tokens, write(stores, tokens)))
            check(stores, requests)


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_clear_covers_every_component_and_an_orphan_entry_is_removed_when_stored(kind, tmp_path):
    stores = open_stores(kind, tmp_path)
    linked = LinkedStores(LAYOUT, stores, PAGE)
    keys = write(stores, list(range(9)))
    orphan = prefill_page_keys(list(range(500, 504)), PAGE)[:1]  # its full page was never stored
    assert stores["indexer"].put(orphan, [entry("indexer", orphan[0])]) == [PutStatus.STORED]
    assert not held(stores["indexer"]) & set(orphan) and linked.dependents_removed["indexer"] == 1
    total = sum(len(held(store)) for store in stores.values())
    assert total > len(keys) and linked.clear() == total
    assert all(not held(store) for store in stores.values())


def test_bad_arguments_are_named_before_any_store_is_linked(tmp_path):
    stores = open_stores("memory", tmp_path)
    with pytest.raises(InvalidArgumentError, match=r"^stores: must map every component of the layout"):
        LinkedStores(LAYOUT, {name: stores[name] for name in ("full", "swa")}, PAGE)
    with pytest.raises(InvalidArgumentError, match=r"^max_links: must be an int >= 1, got 0"):
        LinkedStores(LAYOUT, stores, PAGE, max_links=0)
    with pytest.raises(ArgumentTypeError, match=r"^layout: must be a kvstage.model_layout.ModelLayout"):
        LinkedStores("all", stores, PAGE)
    assert all(not store._change_listeners for store in stores.values())


def test_with_few_links_kept_a_chain_still_loses_what_follows_its_gap(tmp_path):
    # The memory store's own chains take the full pages after a removed one even when the
    # linker forgot their links; the other components' entries after it are removed with them.
    stores = open_stores("memory", tmp_path)
    LinkedStores(LAYOUT, stores, PAGE, max_links=1)
    tokens = list(range(9))
    keys = write(stores, tokens)
    stores["indexer"].remove([keys[1]])
    assert stores["full"].exists(keys) == [True, False, False, False]
    assert check(stores, [(tokens, keys)]) == 0  # nothing restorable past page 1 (no snapshot at 1)


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_threads_evicting_in_every_store_at_once_never_deadlock(kind, tmp_path):
    # Each thread's puts evict in every component and remove dependents from the others while
    # the other threads hold those stores' locks in turn: the cascades run off every lock.
    stores = open_stores(kind, tmp_path)
    linked = LinkedStores(LAYOUT, stores, PAGE)
    failures = []

    def writer(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        try:
            for _ in range(25):
                write(stores, torch.randint(0, 10**6, (11,), generator=generator).tolist())
        except BaseException as error:  # reported below
            failures.append(error)

    threads = [threading.Thread(target=writer, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads) and not failures
    assert sum(linked.dependents_removed.values()) > 0
    assert all(len(held(store)) <= CAPACITY[name] for name, store in stores.items())
