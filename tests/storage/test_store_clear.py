"""clear() on the memory and file stores: every page of the key space goes, other key spaces
stay, a put racing a clear lands whole after it or not at all.

(Mooncake: ``mooncake/test_mooncake_clear_events.py``.)
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kvstage.hashing import prefill_page_keys
from kvstage.kv_layout import KVLayout
from kvstage.storage import FileStore, LayoutFingerprint, MemoryStore, PutStatus

FP = LayoutFingerprint("tiny", KVLayout(2, 2, 1, 4, "float32"), 4)  # 256 B a page
OTHER = LayoutFingerprint("tiny-after-weight-update", KVLayout(2, 2, 1, 4, "float32"), 4)
STORED, DEDUPLICATED = PutStatus.STORED, PutStatus.DEDUPLICATED


def page(value: float) -> torch.Tensor:
    return torch.arange(64, dtype=torch.float32).add_(value)


def chain(start: int, pages: int = 3) -> list[str]:
    return prefill_page_keys(list(range(start, start + 4 * pages)), 4)


def make(kind: str, tmp_path, fingerprint=FP):
    if kind == "memory":
        return MemoryStore(fingerprint, capacity_pages=10_000)
    return FileStore(fingerprint, tmp_path / "pages")


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_clear_removes_every_page_and_says_how_many(kind, tmp_path):
    store = make(kind, tmp_path)
    keys = chain(0) + chain(100, 2)
    store.put(keys[:3], [page(i) for i in range(3)])
    store.put(keys[3:], [page(i) for i in range(3, 5)])
    assert store.clear() == 5
    assert store.exists(keys) == [False] * 5
    into = torch.full((64,), -1.0)
    assert store.get([keys[0]], [into]) == [False] and torch.all(into == -1.0)
    assert store.stats.pages_removed == 5
    assert store.clear() == 0
    # Written again after the clear: stored, not deduplicated, with the new bytes.
    assert store.put(keys[:3], [page(10 + i) for i in range(3)]) == [STORED] * 3
    assert store.get([keys[2]], [into]) == [True] and torch.equal(into, page(12))


def test_file_clear_keeps_other_key_spaces_and_survives_a_reopen(tmp_path):
    store = make("file", tmp_path)
    other = make("file", tmp_path, OTHER)
    keys = chain(0)
    store.put(keys, [page(i) for i in range(3)])
    other.put(keys, [page(-i) for i in range(3)])
    assert store.clear() == 3
    assert store.used_bytes == 0
    assert other.exists(keys) == [True] * 3
    into = torch.zeros(64)
    assert other.get([keys[1]], [into]) == [True] and torch.equal(into, page(-1))
    assert FileStore(FP, tmp_path / "pages").exists(keys) == [False] * 3
    assert len(os.listdir(tmp_path / "pages")) == 3  # the other key space's files only


def test_file_clear_removes_pages_another_writer_stored_after_it_opened(tmp_path):
    store = make("file", tmp_path)
    late = make("file", tmp_path)  # e.g. a prefill process sharing the directory
    keys = chain(0)
    late.put(keys, [page(i) for i in range(3)])
    assert store.clear() == 3
    assert late.exists(keys) == [False] * 3
    assert os.listdir(tmp_path / "pages") == []


def test_file_clear_of_hashed_names(tmp_path):
    store = make("file", tmp_path)
    store.put(["../a", "b@c"], [page(1), page(2)])
    assert store.clear() == 2
    assert os.listdir(tmp_path / "pages") == []


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_puts_racing_clears_land_whole_or_not_at_all(kind, tmp_path):
    store = make(kind, tmp_path)
    chains = [chain(1000 * i, 4) for i in range(60)]
    statuses: list[list[PutStatus]] = []
    stop = threading.Event()

    def writer() -> None:
        for index, keys in enumerate(chains):
            statuses.append(store.put(keys, [page(index * 10 + i) for i in range(4)]))
        stop.set()

    thread = threading.Thread(target=writer)
    thread.start()
    cleared = 0
    while not stop.wait(0.002):
        cleared += store.clear()
    thread.join()
    assert all(answer == [STORED] * 4 for answer in statuses)
    present = [store.exists(keys) for keys in chains]
    assert all(found in ([True] * 4, [False] * 4) for found in present)  # never a torn chain
    kept = sum(found[0] for found in present)
    assert cleared + 4 * kept == 4 * len(chains) == store.stats.pages_stored
    for index, keys in enumerate(chains):  # what is there holds its own bytes
        if present[index][0]:
            into = torch.zeros(64)
            assert store.get([keys[3]], [into]) == [True] and torch.equal(into, page(index * 10 + 3))
    if kind == "file":
        files = os.listdir(tmp_path / "pages")
        assert len(files) == 4 * kept
        assert store.used_bytes == sum(os.path.getsize(tmp_path / "pages" / name) for name in files)
