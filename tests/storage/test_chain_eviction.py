"""Chain-aware eviction in MemoryStore and FileStore: a chain is evicted from its tail.

A lookup walks a chain from its first page, so a page whose predecessor is gone is never found
again. Only pages with no stored successor are evicted, least recently used first.
"""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.hashing import page_keys, prefill_page_keys
from kvstage.kv_layout import KVLayout
from kvstage.storage import FileStore, LayoutFingerprint, MemoryStore, PutStatus

FP = LayoutFingerprint("tiny", KVLayout(2, 2, 1, 4, "float32"), 4)  # 256 B a page
STORED, DEDUPLICATED, FAILED = PutStatus.STORED, PutStatus.DEDUPLICATED, PutStatus.FAILED

CHAIN = prefill_page_keys(list(range(12)), 4)  # 3 pages
OTHER = prefill_page_keys(list(range(100, 104)), 4)  # 1 page, another chain
THIRD = prefill_page_keys(list(range(200, 204)), 4)
FOURTH = prefill_page_keys(list(range(300, 304)), 4)


def page(value: int) -> torch.Tensor:
    return torch.full((64,), float(value))


def file_page_bytes(tmp_path) -> int:
    probe = FileStore(FP, tmp_path / "probe")
    probe.put(OTHER, [page(0)])
    return probe.used_bytes


def open_store(kind: str, tmp_path, capacity_pages: int):
    if kind == "memory":
        return MemoryStore(FP, capacity_pages=capacity_pages)
    return FileStore(FP, tmp_path / "store", capacity_bytes=capacity_pages * file_page_bytes(tmp_path))


KINDS = ["memory", "file"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_chain_is_evicted_from_its_tail(kind, tmp_path):
    store = open_store(kind, tmp_path, 3)
    assert store.put(CHAIN, [page(1), page(2), page(3)]) == [STORED] * 3
    assert store.put(OTHER, [page(9)]) == [STORED]
    assert store.exists(CHAIN) == [True, True, False]
    assert store.stats.pages_evicted == 1


@pytest.mark.parametrize("kind", KINDS)
def test_evicting_a_tail_exposes_the_page_before_it(kind, tmp_path):
    store = open_store(kind, tmp_path, 3)
    store.put(CHAIN, [page(1), page(2), page(3)])
    store.put(OTHER, [page(9)])
    assert store.exists(CHAIN[2:]) == [False]  # (a miss is no use: the order stays)
    assert store.put(THIRD, [page(8)]) == [STORED]  # the chain's new tail is older than OTHER
    assert store.exists(CHAIN + OTHER + THIRD) == [True, False, False, True, True]
    assert store.stats.pages_evicted == 2


@pytest.mark.parametrize("kind", KINDS)
def test_prior_key_links_a_decode_segment_to_the_previous_segments_last_page(kind, tmp_path):
    store = open_store(kind, tmp_path, 3)
    tokens = list(range(12))
    prefill = prefill_page_keys(tokens[:8], 4)
    decode = page_keys(tokens[8:], 4, prior_hash=prefill[-1])
    assert prefill + decode == CHAIN
    assert store.put(prefill, [page(1), page(2)]) == [STORED] * 2
    assert store.put(decode, [page(3)], prior_key=prefill[-1]) == [STORED]
    store.exists(prefill)  # the prefill pages are now the most recently used: still not candidates
    assert store.put(OTHER, [page(9)]) == [STORED]
    assert store.exists(CHAIN) == [True, True, False]


@pytest.mark.parametrize("kind", KINDS)
def test_least_recently_used_tail_goes_first_and_exists_counts_as_a_use(kind, tmp_path):
    store = open_store(kind, tmp_path, 3)
    store.put(OTHER, [page(1)])
    store.put(THIRD, [page(2)])
    store.put(CHAIN[:1], [page(3)])
    assert store.exists(OTHER) == [True]  # OTHER is used again: THIRD is now the oldest tail
    assert store.put(FOURTH, [page(4)]) == [STORED]
    assert store.exists(OTHER + THIRD + CHAIN[:1] + FOURTH) == [True, False, True, True]


@pytest.mark.parametrize("kind", KINDS)
def test_evicting_a_tail_makes_its_predecessor_a_candidate_after_every_branch(kind, tmp_path):
    store = open_store(kind, tmp_path, 4)
    root = CHAIN[0]
    left = page_keys(range(4, 8), 4, prior_hash=root)
    right = page_keys(range(50, 54), 4, prior_hash=root)  # a second prompt sharing the first page
    store.put([root] + left, [page(1), page(2)])
    store.put(right, [page(3)], prior_key=root)
    store.put(OTHER, [page(4)])
    store.exists([root])  # the root is the most recently used, yet it has successors
    store.put(THIRD, [page(5)])  # evicts left (the oldest tail)
    store.put(FOURTH, [page(6)])  # evicts right; root has no stored successor now
    assert store.exists(left + right) == [False, False]  # (a miss is no use)
    store.put(prefill_page_keys(range(400, 404), 4), [page(7)])  # OTHER is the oldest tail now
    assert store.exists([root] + OTHER + THIRD + FOURTH) == [True, False, True, True]


@pytest.mark.parametrize("kind", KINDS)
def test_a_put_never_evicts_its_prior_key_page_or_its_own_pages(kind, tmp_path):
    store = open_store(kind, tmp_path, 2)
    store.put(CHAIN[:1], [page(1)])  # the oldest page and a tail: the first candidate
    store.put(OTHER, [page(2)])
    assert store.put(CHAIN[1:2], [page(3)], prior_key=CHAIN[0]) == [STORED]
    assert store.exists(CHAIN[:2] + OTHER) == [True, True, False]
    # Two pages of room, three pages of one chain: the third would evict the call's own pages.
    assert store.put(CHAIN[1:], [page(3), page(4)], prior_key=CHAIN[0]) == [DEDUPLICATED, FAILED]
    assert store.exists(CHAIN) == [True, True, False]


@pytest.mark.parametrize("kind", KINDS)
def test_a_page_whose_predecessor_is_not_stored_fails_and_so_does_the_rest_of_its_run(kind, tmp_path):
    store = open_store(kind, tmp_path, 8)
    assert store.put(CHAIN[1:], [page(2), page(3)], prior_key=CHAIN[0]) == [FAILED, FAILED]
    assert store.exists(CHAIN) == [False, False, False]
    small = open_store(kind, tmp_path / "small", 1)
    assert small.put(CHAIN, [page(1), page(2), page(3)]) == [STORED, FAILED, FAILED]
    assert small.stats.pages_failed == 2


@pytest.mark.parametrize("kind", KINDS)
def test_prior_key_is_checked_before_anything_is_written(kind, tmp_path):
    store = open_store(kind, tmp_path, 4)
    with pytest.raises(InvalidArgumentError, match=r"^prior_key: must not be one of keys \(keys\[1\]\)"):
        store.put(CHAIN[:2], [page(1), page(2)], prior_key=CHAIN[1])
    with pytest.raises(ArgumentTypeError, match=r"^prior_key: must be a str key or None, got int"):
        store.put(CHAIN[:1], [page(1)], prior_key=7)
    assert store.exists(CHAIN) == [False] * 3
    assert store.put(CHAIN[:1], [page(1)], prior_key="") == [STORED]  # "": a chain's start, as None


def test_file_store_keeps_recency_and_links_across_a_reopen(tmp_path):
    size = file_page_bytes(tmp_path)
    directory = tmp_path / "store"
    store = FileStore(FP, directory, capacity_bytes=4 * size)
    store.put(CHAIN, [page(1), page(2), page(3)])
    store.put(OTHER, [page(4)])
    assert store.exists(CHAIN[2:]) == [True]  # the chain's tail is now more recent than OTHER
    reopened = FileStore(FP, directory, capacity_bytes=4 * size)
    assert reopened.used_bytes == 4 * size
    assert reopened.put(THIRD, [page(5)]) == [STORED]  # evicts OTHER (recency kept)
    assert reopened.put(FOURTH, [page(6)]) == [STORED]  # evicts the chain's tail (links kept)
    assert reopened.exists(CHAIN + OTHER) == [True, True, False, False]
    into = torch.zeros(64)
    assert reopened.get(CHAIN[1:2], [into]) == [True] and torch.equal(into, page(2))


def test_file_store_reopened_after_a_torn_page_keeps_every_other_page(tmp_path):
    size = file_page_bytes(tmp_path)
    directory = tmp_path / "store"
    store = FileStore(FP, directory, capacity_bytes=4 * size)
    store.put(CHAIN, [page(1), page(2), page(3)])
    store.put(OTHER, [page(4)])
    path = store.path_of(CHAIN[1])
    path.write_bytes(path.read_bytes()[:20])  # a torn header
    reopened = FileStore(FP, directory, capacity_bytes=4 * size)
    assert reopened.used_bytes == 3 * size and not path.exists()
    assert reopened.exists(CHAIN + OTHER) == [True, False, True, True]
    # The chain heals: the dropped page is written again, its successor deduplicated.
    assert reopened.put(CHAIN, [page(1), page(2), page(3)]) == [DEDUPLICATED, STORED, DEDUPLICATED]


def test_many_uses_keep_the_eviction_order_exact():
    # Each use leaves a stale candidate entry behind; the index compacts them away.
    store = MemoryStore(FP, capacity_pages=2)
    store.put(OTHER, [page(1)])
    store.put(THIRD, [page(2)])
    for _ in range(300):
        store.exists(THIRD + OTHER)  # OTHER is used last each time
    # The index's stale entries are private: their bound is what this test checks.
    assert len(store._pages._candidates) <= 2 * 2 + 64
    assert store.put(FOURTH, [page(3)]) == [STORED]
    assert store.exists(OTHER + THIRD + FOURTH) == [True, False, True]


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_a_put_larger_than_the_capacity_never_reports_stored_a_page_it_evicted(tmp_path, kind):
    """A put of 3 pages into a store of 2: no page is reported STORED that a later page of the same
    put evicted (STORED means readable from now on; the manager would count a page storage does
    not hold), and a later put evicts from the chain's tail."""
    fingerprint = LayoutFingerprint("tiny/model", KVLayout(2, 2, 1, 4, "float32"), 2)  # 128-byte pages
    keys = [c * 64 for c in "abc"]
    pages = [torch.full((32,), float(i)) for i in range(3)]
    if kind == "memory":
        store = MemoryStore(fingerprint, capacity_pages=2)
    else:
        probe = FileStore(fingerprint, tmp_path / "probe")
        probe.put(keys[:1], pages[:1])
        store = FileStore(fingerprint, tmp_path / "store", capacity_bytes=2 * probe.used_bytes)
    statuses = store.put(keys, pages)
    present = store.exists(keys)
    for key, status, here in zip(keys, statuses, present):
        assert (status is PutStatus.STORED) == here, (key[0], status, here)
    assert statuses[:2] == [PutStatus.STORED, PutStatus.STORED] and statuses[2] is PutStatus.FAILED
    # A later call still evicts for a new page, from the chain's tail (b), never its start (a).
    assert store.put([keys[2]], [pages[2]]) == [PutStatus.STORED]
    assert store.exists(keys) == [True, False, True]
