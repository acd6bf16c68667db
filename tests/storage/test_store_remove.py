"""StorageBackend.remove on the memory and file stores: the keys and the chain after them go,
with ``removed`` events naming the component; change listeners hear stores, evictions and
removals off the store's lock."""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.hashing import page_keys, prefill_page_keys
from kvstage.kv_layout import KVLayout
from kvstage.model_layout import FullAttention, ModelLayout, SlidingWindow
from kvstage.storage import FileStore, LayoutFingerprint, MemoryStore

FP = LayoutFingerprint("tiny", KVLayout(2, 2, 1, 4, "float32"), 4)  # 256 B a page
CHAIN = prefill_page_keys(list(range(16)), 4)  # 4 pages
BRANCH = page_keys(range(50, 54), 4, prior_hash=CHAIN[1])  # a second prompt sharing 2 pages
OTHER = prefill_page_keys(list(range(100, 104)), 4)


def page(value: int) -> torch.Tensor:
    return torch.full((64,), float(value))


def open_store(kind: str, tmp_path, fp=FP, **options):
    return MemoryStore(fp, **options) if kind == "memory" else FileStore(fp, tmp_path / "store", **options)


def fill(store) -> None:
    store.put(CHAIN, [page(i) for i in range(4)])
    store.put(BRANCH, [page(9)], prior_key=CHAIN[1])
    store.put(OTHER, [page(8)])


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_remove_takes_the_keys_and_every_page_after_them_in_their_chains(kind, tmp_path):
    store = open_store(kind, tmp_path)
    fill(store)
    store.take_events()
    assert store.remove([CHAIN[2]]) == 2  # CHAIN[2] and CHAIN[3]
    assert store.exists(CHAIN + BRANCH + OTHER) == [True, True, False, False, True, True]
    assert store.remove([CHAIN[1], "ab" * 32]) == 2  # CHAIN[1] and the branch after it; a key not stored is skipped
    assert store.exists(CHAIN + BRANCH + OTHER) == [True, False, False, False, False, True]
    events = store.take_events()
    assert sorted(e.key for e in events) == sorted(CHAIN[1:] + BRANCH)
    assert {(e.kind, e.key_space, e.component) for e in events} == {("removed", store.prefix, "")}
    assert store.stats.pages_removed == 4 and store.remove([]) == 0
    if kind == "file":
        assert sorted(path.name for path in store.directory.glob("*.kvpage")) == sorted(
            store.file_name(key) for key in (CHAIN[0], OTHER[0])
        )


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_remove_checks_its_keys_before_removing_anything(kind, tmp_path):
    store = open_store(kind, tmp_path)
    fill(store)
    with pytest.raises(InvalidArgumentError, match=r"^keys\[1\]: must be a non-empty str"):
        store.remove([CHAIN[0], ""])
    assert store.exists(CHAIN) == [True] * 4


def test_a_file_store_removes_a_page_another_process_wrote(tmp_path):
    first, second = FileStore(FP, tmp_path / "store"), FileStore(FP, tmp_path / "store")
    first.put(OTHER, [page(1)])  # second has not indexed it
    assert second.remove(OTHER) == 1 and first.exists(OTHER) == [False]
    assert [e.kind for e in second.take_events()] == ["removed"]


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_events_of_a_hybrid_component_name_it(kind, tmp_path):
    layout = ModelLayout(
        2,
        (FullAttention((0,), KVLayout(1, 2, 1, 4, "float32")), SlidingWindow((1,), KVLayout(1, 2, 1, 4, "float32"), 5)),
    )
    fp = layout.fingerprints("m", page_size=4)["swa"]
    store = open_store(kind, tmp_path, fp)
    store.put(OTHER, [torch.zeros(fp.page_bytes, dtype=torch.uint8)])
    store.remove(OTHER)
    assert [(e.kind, e.component) for e in store.take_events()] == [("stored", "swa"), ("removed", "swa")]


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_change_listeners_hear_links_evictions_and_removals_and_may_call_the_store(kind, tmp_path):
    size = FP.page_bytes
    if kind == "file":  # a page file's bytes, header included
        probe = FileStore(FP, tmp_path / "probe")
        probe.put(OTHER, [page(0)])
        size = probe.used_bytes
    store = open_store(kind, tmp_path, capacity_bytes=3 * size)
    heard = []

    def listener(changed, kind_, keys, priors):
        heard.append((kind_, list(keys), priors))
        changed.exists(keys[:1])  # the store's lock is not held: no deadlock

    store.add_change_listener(listener)
    store.put(CHAIN[:3], [page(1), page(2), page(3)])
    assert heard == [("stored", CHAIN[:3], [None, CHAIN[0], CHAIN[1]])]
    store.put(OTHER, [page(4)])  # evicts the chain's tail first
    assert heard[1:] == [("evicted", [CHAIN[2]], None), ("stored", OTHER, [None])]
    store.remove([CHAIN[0]])
    assert heard[3][0] == "removed" and sorted(heard[3][1]) == sorted(CHAIN[:2]) and heard[3][2] is None
    store.remove_change_listener(listener)
    store.clear()
    assert len(heard) == 4
