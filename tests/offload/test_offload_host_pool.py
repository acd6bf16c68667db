"""HostPool: page-first host buffers, all-or-nothing alloc/free, counters, page views, argument checks."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.kv_layout import KVLayout
from kvstage.offload import HostPool

from offload_rig import host_pool, make_rig


def make_pool(num_pages=5, buffer_pages=2, page_size=4, **kw) -> HostPool:
    return host_pool(
        num_layers=3,
        kv_parts=2,
        num_heads=2,
        head_dim=8,
        dtype=torch.float16,
        num_pages=num_pages,
        page_size=page_size,
        pin=False,
        buffer_pages=buffer_pages,
        **kw,
    )


def test_host_buffers_are_page_first_staging_tensors():
    pool = make_pool(num_pages=5, buffer_pages=2)
    assert [tuple(c.shape) for c in pool.buffers] == [(2, 3, 2, 4, 2, 8), (2, 3, 2, 4, 2, 8), (1, 3, 2, 4, 2, 8)]
    assert pool.page_bytes == 3 * 2 * 4 * 2 * 8 * 2 == 768
    assert pool.capacity == 5 and pool.used == 0 and pool.high_water == 0
    assert not pool.pinned and len(pool.buffers) == 3


def test_default_host_buffer_holds_the_whole_small_pool():
    pool = make_pool(num_pages=7, buffer_pages=None)
    assert pool.buffer_pages == 7 and len(pool.buffers) == 1


def test_page_is_a_contiguous_view_into_its_host_buffer():
    pool = make_pool()
    view = pool.page(3)
    assert view.is_contiguous() and tuple(view.shape) == (3, 2, 4, 2, 8)
    view.fill_(7)
    assert torch.all(pool.buffers[1][1] == 7)
    assert view.data_ptr() == pool.buffers[1].data_ptr() + pool.page_bytes
    with pytest.raises(InvalidArgumentError, match=r"^host_page_id: must be in \[0, 5\)"):
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
    with pytest.raises(InvalidArgumentError, match=r"^num_pages: must be a non-negative int"):
        pool.alloc(-1)


@pytest.mark.parametrize(
    "bad, rule",
    [
        ([0, 3], r"^host_page_ids\[1\]: page 3 is not allocated"),  # never handed out
        ([0, 7], r"^host_page_ids\[1\]: must be a page id in \[0, 5\)"),  # foreign
        ([0, -1], r"^host_page_ids\[1\]: must be a page id"),
        ([0, True], r"^host_page_ids\[1\]: must be a page id"),
        ([0, 1, 0], r"^host_page_ids: a page id repeats"),
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
    with pytest.raises(InvalidArgumentError, match=r"^host_page_ids\[0\]: page 0 is not allocated \(double free"):
        pool.free([0, 2])
    assert pool.used == 1 and pool.is_allocated(2)


def test_locate_groups_ids_by_host_buffer_in_order():
    pool = make_pool(num_pages=5, buffer_pages=2)
    assert pool.locate([]) == []
    assert pool.locate([2, 3]) == [(1, [0, 1], [0, 1])]
    assert pool.locate([4, 1, 0, 3]) == [(2, [0], [0]), (0, [1, 2], [1, 0]), (1, [3], [1])]


def test_like_copies_the_kv_pool_layout():
    kv = SimpleNamespace(layout=KVLayout(2, 1, 1, 16, torch.bfloat16))
    pool = HostPool.like(kv, num_pages=3, page_size=8, pin=False)
    assert pool.page_shape == (2, 1, 8, 1, 16) and pool.buffers[0].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "change, error, rule",
    [
        ({"num_pages": 0}, InvalidArgumentError, r"^num_pages: must be a positive int"),
        ({"page_size": 2.0}, InvalidArgumentError, r"^page_size: must be a positive int"),
        ({"kv_parts": 3}, InvalidArgumentError, r"^kv_parts: must be 1 \(MLA\) or 2"),
        ({"dtype": "Tensor"}, ArgumentTypeError, r"^dtype: 'Tensor' names no torch dtype"),
        ({"dtype": 3}, ArgumentTypeError, r"^dtype: must be a torch.dtype or its name"),
        ({"buffer_pages": 0}, InvalidArgumentError, r"^buffer_pages: must be a positive int"),
    ],
)
def test_bad_arguments_name_the_argument(change, error, rule):
    args = dict(
        num_layers=1, kv_parts=2, num_heads=1, head_dim=4, dtype=torch.float32, num_pages=2, page_size=2, pin=False
    )
    args.update(change)
    with pytest.raises(error, match=rule):
        host_pool(**args)


def test_layout_must_be_a_kv_layout():
    with pytest.raises(ArgumentTypeError, match="^layout: must be a KVLayout"):
        HostPool((1, 2, 1, 4, torch.float32), num_pages=2, page_size=2, pin=False)


def test_host_pool_free_of_a_numpy_page_id():
    """``free`` of a page id given as ``np.int64`` (as an engine's numpy bookkeeping hands it) frees it."""
    pool = HostPool.like(make_rig(page_size=2).kv_pool, num_pages=4, page_size=2, pin=False)
    ids = pool.alloc(1)
    pool.free([np.int64(ids[0])])
    assert pool.used == 0


ARGS = dict(num_layers=1, kv_parts=2, num_heads=1, head_dim=4, dtype=torch.float32, num_pages=2, page_size=2, pin=False)


@pytest.mark.parametrize(
    "change, rule",
    [
        ({"num_layers": True}, r"^num_layers: must be a positive int"),
        ({"num_pages": True}, r"^num_pages: must be a positive int"),
        ({"kv_parts": 2.0}, r"^kv_parts: must be 1 \(MLA\) or 2"),
        ({"kv_parts": True}, r"^kv_parts: must be 1 \(MLA\) or 2"),
        ({"buffer_pages": True}, r"^buffer_pages: must be a positive int"),
    ],
)
def test_bools_and_floats_are_not_sizes(change, rule):
    """Sizes given as ``True`` or ``2.0`` are refused naming the argument (a bool is an int in Python)."""
    with pytest.raises(InvalidArgumentError, match=rule):
        host_pool(**{**ARGS, **change})


def test_alloc_of_a_bool_is_an_error_and_changes_nothing():
    """``alloc(True)`` raises naming ``num_pages`` and allocates nothing."""
    pool = host_pool(**ARGS)
    with pytest.raises(InvalidArgumentError, match=r"^num_pages: must be a non-negative int, got True"):
        pool.alloc(True)
    assert pool.used == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works where CUDA is")
def test_pin_without_an_accelerator_names_the_argument():
    """``pin=True`` on a machine without CUDA raises naming ``pin``."""
    with pytest.raises(InvalidArgumentError, match=r"^pin: "):
        host_pool(**{**ARGS, "pin": True})


class _Loan:
    def __init__(self) -> None:
        self.ended = 0

    def end(self) -> None:
        self.ended += 1


def test_pages_of_their_own_lend_in_until_the_last_is_freed_and_replace_keeps_the_page_bytes():
    pool = host_pool(**{**ARGS, "buffer_pages": 1, "num_pages": 4})
    assert pool.own_pages and not host_pool(**ARGS).own_pages
    ids = pool.alloc(3)
    own = [pool.page(i).data_ptr() for i in ids]
    lent = [torch.randint(0, 256, (pool.page_bytes,), dtype=torch.uint8) for _ in range(2)]
    loan = _Loan()
    pool.lend_in(ids[:2], lent, loan)
    assert [pool.page(i).data_ptr() for i in ids[:2]] == [page.data_ptr() for page in lent]
    assert torch.equal(pool.page(ids[0]).view(torch.uint8).reshape(-1), lent[0]) and pool.pages_lent_in == 2
    pool.free([ids[0]])
    assert loan.ended == 0 and pool.page(ids[0]).data_ptr() == own[0]  # its own buffer back
    pool.free([ids[1], ids[2]])
    assert loan.ended == 1 and pool.pages_lent_in == 0 and pool.page(ids[1]).data_ptr() == own[1]
    page = pool.alloc(1)[0]
    spare = torch.empty(pool.page_bytes, dtype=torch.uint8)
    pool.replace(page, spare)
    assert pool.page(page).data_ptr() == spare.data_ptr() and pool.buffers_allocated == 0
    pool.replace(page, torch.empty(2 * pool.page_bytes, dtype=torch.uint8)[: pool.page_bytes])  # part of a buffer
    assert pool.buffers_allocated == 1 and pool.page(page).untyped_storage().nbytes() == pool.page_bytes


def test_lend_in_and_replace_refuse_bad_input_before_changing_anything():
    shared = host_pool(**ARGS)
    with pytest.raises(InvalidArgumentError, match=r"^host_pool: replace\(\) needs one page a buffer"):
        shared.replace(shared.alloc(1)[0], None)
    pool = host_pool(**{**ARGS, "buffer_pages": 1})
    ids = pool.alloc(2)
    own = [pool.page(i).data_ptr() for i in ids]
    page = torch.zeros(pool.page_bytes, dtype=torch.uint8)
    with pytest.raises(InvalidArgumentError, match=r"^host_page_id: 5 is not an allocated host page"):
        pool.replace(5, page)
    with pytest.raises(
        InvalidArgumentError, match=r"^pages\[1\]: must be a contiguous CPU tensor of \d+ bytes, got 3 bytes"
    ):
        pool.lend_in(ids, [page, torch.zeros(3, dtype=torch.uint8)], _Loan())
    strided = torch.zeros(2 * pool.page_bytes, dtype=torch.uint8)[::2]
    with pytest.raises(InvalidArgumentError, match=r"^pages\[1\]: must be a contiguous CPU tensor"):
        pool.lend_in(ids, [page, strided], _Loan())  # its view would fail after page 0 changed
    with pytest.raises(
        InvalidArgumentError, match=r"^host_page_ids\[1\]: \d+ is not .* \(or it repeats in this call\)"
    ):
        pool.lend_in([ids[0], ids[0]], [page, page.clone()], _Loan())  # would alias a lent page for good
    assert pool.pages_lent_in == 0 and [pool.page(i).data_ptr() for i in ids] == own
    with pytest.raises(InvalidArgumentError, match=r"^host_page_ids\[0\]: 7 is not an allocated host page of its own"):
        pool.lend_in([7], [page], _Loan())
    assert pool.pages_lent_in == 0
    pool.lend_in([ids[0]], [page], _Loan())
    with pytest.raises(
        InvalidArgumentError, match=r"^host_page_ids\[0\]: \d+ is not an allocated host page of its own"
    ):
        pool.lend_in([ids[0]], [page], _Loan())  # lent in already
