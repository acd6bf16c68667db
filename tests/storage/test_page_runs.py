"""page_runs.copy_pages: the same bytes as one copy a page; contiguous host pages in one
host_copy batch, other pages in one copy per regular run."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvstage.storage import page_runs
from kvstage.storage.page_runs import copy_pages

PAGE_BYTES = 96  # [2, 3, 8] bfloat16


class CountCopies(TorchFunctionMode):
    """Counts ``Tensor.copy_`` calls made inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            self.copies += 1
        return func(*args, **(kwargs or {}))


def host(num_pages: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(-(2**15), 2**15, (num_pages, 2, 3, 8), dtype=torch.int16, generator=generator)
    return raw.view(torch.bfloat16)


def rows(num: int) -> list[torch.Tensor]:
    return list(torch.zeros((num, PAGE_BYTES), dtype=torch.uint8).unbind())


def as_bytes(page: torch.Tensor) -> torch.Tensor:
    return page.contiguous().view(-1).view(torch.uint8)


@pytest.fixture
def batches(monkeypatch):
    """The plans page_runs hands host_copy.run_plan (each: its row count)."""
    calls = []
    real = page_runs.run_plan

    def run_plan(plan, *args):
        calls.append(len(plan.sizes))
        real(plan, *args)

    monkeypatch.setattr(page_runs, "run_plan", run_plan)
    return calls


@pytest.fixture
def copy_path_only(monkeypatch):
    """Every page through the copy_ runs (what contiguous pages took before host_copy)."""
    monkeypatch.setattr(page_runs, "_streamed", lambda pages, buffers, into_buffers: set())


def test_contiguous_pages_move_in_one_streaming_batch_and_back(batches):
    pages, buffers = list(host(6, seed=1).unbind()), rows(6)
    with CountCopies() as mode:
        copy_pages(pages, buffers, into_buffers=True)
    assert (mode.copies, batches) == (0, [6])
    assert all(torch.equal(buffer, as_bytes(page)) for page, buffer in zip(pages, buffers))
    targets = list(torch.zeros(6, 2, 3, 8, dtype=torch.bfloat16).unbind())
    with CountCopies() as mode:
        copy_pages(targets, buffers, into_buffers=False)
    assert (mode.copies, batches) == (0, [6, 6])
    assert all(torch.equal(as_bytes(t), as_bytes(p)) for t, p in zip(targets, pages))


def test_contiguous_and_strided_pages_in_one_call_each_take_their_path(batches):
    pool = torch.randint(-100, 100, (2, 16, 8)).to(torch.bfloat16)
    strided = [pool[:, 4 * i : 4 * i + 4].transpose(0, 1) for i in range(2)]  # [4, 2, 8], not contiguous
    whole = list(torch.randint(-100, 100, (3, 4, 2, 8)).to(torch.bfloat16).unbind())
    pages = [whole[0], strided[0], whole[1], strided[1], whole[2]]
    size = 4 * 2 * 8 * 2
    buffers = [torch.full((size + 32,), 7, dtype=torch.uint8) for _ in pages]  # longer than a page
    with CountCopies() as mode:
        copy_pages(pages, buffers, into_buffers=True)
    assert batches == [3] and mode.copies == 2  # the strided pages: different storages, one copy_ each
    for page, buffer in zip(pages, buffers):
        assert torch.equal(buffer[:size], as_bytes(page)) and bool((buffer[size:] == 7).all())
    targets = [torch.zeros(4, 2, 8, dtype=torch.bfloat16) for _ in pages]
    copy_pages(targets, buffers, into_buffers=False)
    assert all(torch.equal(as_bytes(t), as_bytes(p)) for t, p in zip(targets, pages))


def test_a_large_batch_is_split_over_threads_with_the_same_bytes(monkeypatch, batches):
    monkeypatch.setattr(page_runs, "THREADED_MIN_BYTES", 3 * PAGE_BYTES)
    split = []
    copies = page_runs._threads()
    real = copies.copy_plan
    monkeypatch.setattr(copies, "copy_plan", lambda plan: (split.append(len(plan.sizes)), real(plan)))
    for count, expected in ((2, []), (7, [7])):  # 2 pages: below the (patched) threshold
        pages, buffers = list(host(count, seed=count).unbind()), rows(count)
        copy_pages(pages, buffers, into_buffers=True)
        assert all(torch.equal(buffer, as_bytes(page)) for page, buffer in zip(pages, buffers))
        targets = list(torch.zeros(count, 2, 3, 8, dtype=torch.bfloat16).unbind())
        copy_pages(targets, buffers, into_buffers=False)
        assert all(torch.equal(as_bytes(t), as_bytes(p)) for t, p in zip(targets, pages))
        assert split == 2 * expected
    assert batches == [2, 2]  # the small batches ran on the calling thread


def test_adjacent_pages_into_adjacent_rows_move_in_one_copy_and_back(copy_path_only):
    pages, buffers = list(host(6, seed=1).unbind()), rows(6)
    with CountCopies() as mode:
        copy_pages(pages, buffers, into_buffers=True)
    assert mode.copies == 1
    assert all(torch.equal(buffer, as_bytes(page)) for page, buffer in zip(pages, buffers))
    targets = list(torch.zeros(6, 2, 3, 8, dtype=torch.bfloat16).unbind())
    with CountCopies() as mode:
        copy_pages(targets, buffers, into_buffers=False)
    assert mode.copies == 1
    assert all(torch.equal(as_bytes(t), as_bytes(p)) for t, p in zip(targets, pages))


def test_strided_page_views_at_a_regular_step_move_in_one_copy():
    # layer_first-like: page i of a [2, tokens, 8] buffer is [:, 4i:4i+4] transposed, not contiguous
    pool = torch.randint(-100, 100, (2, 16, 8)).to(torch.bfloat16)
    pages = [pool[:, 4 * i : 4 * i + 4].transpose(0, 1) for i in range(4)]
    assert not pages[0].is_contiguous()
    buffers = list(torch.zeros((4, 4 * 2 * 8 * 2), dtype=torch.uint8).unbind())
    with CountCopies() as mode:
        copy_pages(pages, buffers, into_buffers=True)
    assert mode.copies == 1
    assert all(torch.equal(b, as_bytes(p)) for p, b in zip(pages, buffers))
    back = torch.zeros_like(pool)
    targets = [back[:, 4 * i : 4 * i + 4].transpose(0, 1) for i in range(4)]
    with CountCopies() as mode:
        copy_pages(targets, buffers, into_buffers=False)
    assert mode.copies == 1 and torch.equal(back.view(torch.int16), pool.view(torch.int16))


def test_irregular_pages_and_buffers_are_copied_in_runs_with_the_bytes_of_one_copy_a_page(copy_path_only):
    source = host(10, seed=3)
    slab = rows(10)
    pages = [source[0], source[1], source[2], source[5], source[6], source[7], host(1, seed=4)[0], source[3]]
    buffers = [slab[0], slab[1], slab[2], slab[3], slab[5], slab[6], slab[7], slab[8]]
    with CountCopies() as mode:
        copy_pages(pages, buffers, into_buffers=True)
    # runs: pages 0-2 into rows 0-2; pages 5, 6 into rows 3, 5 (steps 1 and 2: a run too); page 7
    # (the row step changed); another tensor's page; page 3 (back in the first storage, alone)
    assert mode.copies == 5
    assert all(torch.equal(b, as_bytes(p)) for p, b in zip(pages, buffers))
    assert not slab[4].any() and not slab[9].any()


@pytest.mark.parametrize("same", [True, False])
def test_targets_that_share_memory_are_written_one_page_after_another(same):
    # the same target twice (a get of a key twice into one page), or overlapping windows: the
    # last page wins, as with one copy a page; never one copy into overlapping memory
    values = host(3, seed=5)
    buffers = rows(3)
    copy_pages(list(values.unbind()), buffers, into_buffers=True)
    flat = torch.zeros(3 * 48, dtype=torch.bfloat16)
    if same:
        targets = [flat[:48].view(2, 3, 8)] * 3
        expected = as_bytes(values[2])
    else:  # windows 8 elements apart over 48-element pages
        targets = [flat[8 * i : 8 * i + 48].view(2, 3, 8) for i in range(3)]
        reference = torch.zeros_like(flat)
        for i in range(3):
            reference[8 * i : 8 * i + 48] = values[i].reshape(-1)
        expected = as_bytes(reference[:64])
    with CountCopies() as mode:
        copy_pages(targets, buffers, into_buffers=False)
    assert mode.copies == 3
    assert torch.equal(as_bytes(flat)[: expected.numel()], expected)


@pytest.mark.parametrize(("serial_elements", "copies"), [(100, 3), (48, 1), (30, 1)])
def test_pages_below_torchs_parallel_grain_are_batched_only_while_the_batch_stays_below_it(
    monkeypatch, copy_path_only, serial_elements, copies
):
    # 48-element pages: below a grain of 100, two a copy (96 < 100: still one thread, as each
    # page alone); at or above the grain each page's copy was split already, so all in one
    monkeypatch.setattr("kvstage.storage.page_runs.SERIAL_ELEMENTS", serial_elements)
    pages, buffers = list(host(6, seed=6).unbind()), rows(6)
    with CountCopies() as mode:
        copy_pages(pages, buffers, into_buffers=True)
    assert mode.copies == copies
    assert all(torch.equal(buffer, as_bytes(page)) for page, buffer in zip(pages, buffers))
