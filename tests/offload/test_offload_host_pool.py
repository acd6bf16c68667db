"""HostPool: page-first chunks, all-or-nothing alloc/free, counters, page views."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.offload import HostPool


def make_pool(num_pages=5, chunk_pages=2, page_size=4, **kw) -> HostPool:
    return HostPool(
        num_layers=3, kv_parts=2, num_heads=2, head_dim=8, dtype=torch.float16,
        num_pages=num_pages, page_size=page_size, pin=False, chunk_pages=chunk_pages, **kw,
    )


def test_chunks_are_page_first_staging_tensors():
    pool = make_pool(num_pages=5, chunk_pages=2)
    assert [tuple(c.shape) for c in pool.chunks] == [(2, 3, 2, 4, 2, 8), (2, 3, 2, 4, 2, 8), (1, 3, 2, 4, 2, 8)]
    assert pool.page_bytes == 3 * 2 * 4 * 2 * 8 * 2 == 768
    assert pool.capacity == 5 and pool.used == 0 and pool.high_water == 0
    assert not pool.pinned and len(pool.buffers) == 3


def test_default_chunk_holds_the_whole_small_pool():
    pool = make_pool(num_pages=7, chunk_pages=None)
    assert pool.chunk_pages == 7 and len(pool.chunks) == 1


def test_page_is_a_contiguous_view_into_its_chunk():
    pool = make_pool()
    view = pool.page(3)
    assert view.is_contiguous() and tuple(view.shape) == (3, 2, 4, 2, 8)
    view.fill_(7)
    assert torch.all(pool.chunks[1][1] == 7)
    assert view.data_ptr() == pool.chunks[1].data_ptr() + pool.page_bytes
    with pytest.raises(InvalidArgumentError, match=r"^page: must be in \[0, 5\)"):
        pool.page(5)


def test_alloc_hands_out_ascending_new_ids_and_counts():
    pool = make_pool()
    first = pool.alloc(2)
    second = pool.alloc(2)
    assert first == [0, 1] and second == [2, 3]
    first.append(99)  # the caller owns the list: the pool is unaffected
    assert pool.used == 4 and pool.free_pages == 1 and pool.high_water == 4
    assert pool.alloc(0) == []
    pool.free([0, 1])
    assert pool.used == 2 and pool.high_water == 4
    assert pool.alloc(3) == [0, 1, 4]
    assert pool.high_water == 5


def test_alloc_when_full_returns_none_and_changes_nothing():
    pool = make_pool()
    held = pool.alloc(4)
    assert pool.alloc(2) is None
    assert pool.used == 4 and pool.high_water == 4
    assert pool.alloc(1) == [4]
    pool.free(held)
    with pytest.raises(InvalidArgumentError, match=r"^n: must be a non-negative int"):
        pool.alloc(-1)


@pytest.mark.parametrize(
    "bad, rule",
    [
        ([0, 3], r"^ids\[1\]: page 3 is not allocated"),  # never handed out
        ([0, 7], r"^ids\[1\]: must be a page id in \[0, 5\)"),  # foreign
        ([0, -1], r"^ids\[1\]: must be a page id"),
        ([0, True], r"^ids\[1\]: must be a page id"),
        ([0, 1, 0], r"^ids: a page id repeats"),
    ],
    ids=["unallocated", "out-of-range", "negative", "bool", "repeat"],
)
def test_free_rejects_bad_ids_and_frees_nothing(bad, rule):
    pool = make_pool()
    pool.alloc(2)
    with pytest.raises(InvalidArgumentError, match=rule):
        pool.free(bad)
    assert pool.used == 2 and pool.is_allocated(0) and pool.is_allocated(1)


def test_double_free_is_rejected():
    pool = make_pool()
    ids = pool.alloc(3)
    pool.free(ids[:2])
    with pytest.raises(InvalidArgumentError, match=r"^ids\[0\]: page 0 is not allocated \(double free"):
        pool.free([0, 2])
    assert pool.used == 1 and pool.is_allocated(2)


def test_locate_groups_ids_by_chunk_in_order():
    pool = make_pool(num_pages=5, chunk_pages=2)
    assert pool.locate([]) == []
    assert pool.locate([2, 3]) == [(1, [0, 1], [0, 1])]
    assert pool.locate([4, 1, 0, 3]) == [(2, [0], [0]), (0, [1, 2], [1, 0]), (1, [3], [1])]


def test_like_copies_the_kv_pool_layout():
    kv = SimpleNamespace(num_layers=2, kv_parts=1, num_heads=1, head_dim=16, dtype=torch.bfloat16)
    pool = HostPool.like(kv, num_pages=3, page_size=8, pin=False)
    assert pool.page_shape == (2, 1, 8, 1, 16) and pool.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "change, error, rule",
    [
        ({"num_pages": 0}, InvalidArgumentError, r"^num_pages: must be a positive int"),
        ({"page_size": 2.0}, InvalidArgumentError, r"^page_size: must be a positive int"),
        ({"kv_parts": 3}, InvalidArgumentError, r"^kv_parts: must be 1 \(MLA\) or 2"),
        ({"dtype": "float16"}, ArgumentTypeError, r"^dtype: must be a torch.dtype"),
        ({"chunk_pages": 0}, InvalidArgumentError, r"^chunk_pages: must be a positive int"),
    ],
)
def test_bad_arguments_name_the_argument(change, error, rule):
    args = dict(num_layers=1, kv_parts=2, num_heads=1, head_dim=4, dtype=torch.float32, num_pages=2, page_size=2, pin=False)
    args.update(change)
    with pytest.raises(error, match=rule):
        HostPool(**args)


@pytest.mark.parametrize("host_ids", [[2, 3], [4, 1, 0, 3], [3, 1]])  # one chunk, three chunks, a gap
def test_gather_copy_puts_every_page_in_its_host_page(host_ids):
    from kvstage.kernels import KVPool

    pool = make_pool(num_pages=5, chunk_pages=2)
    buffers = [[torch.randn(40, 2, 8).half() for _ in range(3)] for _ in range(2)]
    kv_pool = KVPool.mha(buffers[0], buffers[1])
    assert pool.alloc(5) == [0, 1, 2, 3, 4]
    for chunk in pool.chunks:
        chunk.fill_(-7)  # poison: what the copy does not write stays -7
    device_pages = [9, 0, 5, 7][: len(host_ids)]
    slots = torch.tensor([p * 4 + j for p in device_pages for j in range(4)])
    copy, keep = pool.gather_copy(kv_pool, slots, host_ids, backend="torch")
    assert len(keep) == len(pool.locate(host_ids))
    copy()
    for device_page, host_id in zip(device_pages, host_ids):
        expected = torch.stack([torch.stack([buffers[p][layer][device_page * 4 : device_page * 4 + 4] for p in range(2)]) for layer in range(3)])
        assert torch.equal(pool.page(host_id), expected)
    untouched = [page for page in range(5) if page not in host_ids]
    assert all(bool((pool.page(page) == -7).all()) for page in untouched)


def test_gather_copy_names_bad_host_ids_and_slots_before_any_copy():
    from kvstage.kernels import KVPool

    pool = make_pool(num_pages=5, chunk_pages=2)
    kv_pool = KVPool.mha([torch.zeros(40, 2, 8).half()] * 3, [torch.zeros(40, 2, 8).half()] * 3)
    pool.alloc(2)  # pages 0 and 1
    slots = torch.arange(8)
    for bad in ([0, 7], [0, -1], [0, True], [0, 3]):  # out of range, negative, a bool, not allocated
        with pytest.raises(InvalidArgumentError, match=r"^host_ids\[1\]: must be an allocated page of this pool"):
            pool.gather_copy(kv_pool, slots, bad)
    with pytest.raises(InvalidArgumentError, match="^slots: must be a 1-D tensor of len.host_ids. . page_size = 8 slots"):
        pool.gather_copy(kv_pool, torch.arange(4), [0, 1])
    copy, keep = pool.gather_copy(kv_pool, slots, [0, 1], backend="torch")
    copy()
