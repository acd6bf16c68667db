"""MooncakeStore against a real mooncake_master on loopback: round trips, dedup, lifecycle."""

from __future__ import annotations

import uuid

import pytest
import torch

from kvstage.errors import InvalidArgumentError, StorageError
from kvstage.storage.mooncake.store import MooncakeStore
from kvstage.storage import PutStatus, open_storage


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
    assert opened._registered == []
    opened.close()
    with pytest.raises(StorageError, match="closed"):
        opened.put(new_keys(1), [chunk[1]])
    with pytest.raises(StorageError, match="closed"):
        opened.register_host_buffers([chunk])


def test_overlapping_buffers_are_refused_before_any_is_registered(store, fingerprint):
    chunk = random_pages(4, fingerprint, seed=10).view(-1)
    half = chunk.numel() // 2
    registered_before = len(store._registered)
    overlapping = chunk[half // 2 : half + half // 2]  # straddles the first half's end
    with pytest.raises(InvalidArgumentError, match=r"buffers\[1\]: .* overlaps"):
        store.register_host_buffers([chunk[:half], overlapping])
    assert len(store._registered) == registered_before
    store.register_host_buffers([chunk[:half], chunk, chunk[half:]])  # the views lie inside chunk
    assert len(store._registered) == registered_before + 1
