"""The memory store's batched page copy: contiguous host pages in one streaming call, the
others one ``copy_`` per run of pages.

Contiguous CPU pages (sglang's ``page_first`` / ``page_first_direct`` pages, vLLM's blocks) move
in one :func:`kvstage.kernels.host_copy.copy_rows` batch: streaming stores, which a ``copy_`` of
one page (glibc ``memcpy`` below its 192 MiB non-temporal threshold) never uses. A batch of at
least ``THREADED_MIN_BYTES`` is split over ``torch.get_num_threads()`` threads (a
:class:`~kvstage.offload.row_copies.RowCopies` shared by the process), as torch splits one large
``copy_``: on one thread, 128 MLA pages of 0.56 MiB took 0.65-0.67 of one ``copy_`` of their
bytes on 2 threads. Rows
``copy_rows`` refuses (targets that overlap: one key read into two views of a page) and other
pages take the ``copy_`` path below, in their order.

For those, a call's pages are often a regular stride apart on both sides: host pool pages a call moves are
adjacent in the pool, and the memory store's buffers are rows of one allocation. Such a run of
``n`` pages moves as one ``copy_`` of two ``[n, *page]`` strided views, so torch splits one
large copy over its intra-op threads (one wait for the slowest thread) instead of one per page,
and Python pays one call. Any other pair of pages is copied on its own, as before.

Pages smaller than torch's parallel grain (a copy of fewer elements runs on the calling thread)
are batched only as far as a batch stays below it: a batch that crossed it would wake torch's
other threads where the pages' own copies never did, and on a loaded machine waiting for a
descheduled thread costs milliseconds (a hybrid DSA call of 4 small pages: 0.6 ms -> 17 ms).
"""

from __future__ import annotations

import threading

import torch

from kvstage.errors import InvalidArgumentError
from kvstage.kernels.host_copy import plan_addresses, run_plan

__all__ = ["copy_pages"]

THREADED_MIN_BYTES = 4 << 20  # a smaller batch stays on the calling thread (no hand-off, no wait)
SERIAL_ELEMENTS = 32768  # torch's at::internal::GRAIN_SIZE: a copy of fewer elements is not split


def _as(buffer: torch.Tensor, page: torch.Tensor) -> torch.Tensor:
    """The first bytes of a store buffer (flat ``uint8``) viewed as ``page``'s dtype and shape."""
    return buffer[: page.numel() * page.element_size()].view(page.dtype).view(page.shape)


def _place(tensor: torch.Tensor) -> tuple:
    """What two tensors must share to be one strided view: storage, dtype, shape, strides."""
    return tensor.untyped_storage().data_ptr(), tensor.dtype, tensor.shape, tensor.stride()


def _runs(pages: list[torch.Tensor], buffers: list[torch.Tensor]) -> list[tuple[int, int, int, int]]:
    """``(first, count, page step, buffer step)`` of each maximal run of positions whose pages
    (elements) and buffers (bytes) are each one positive storage step apart in one storage."""
    runs = []
    first, count = 0, 0
    place = buffer_place = None
    page_step = buffer_step = 0
    previous_offset = previous_buffer = 0
    for position, (page, buffer) in enumerate(zip(pages, buffers)):
        here, offset = _place(page), page.storage_offset()
        buffer_here, buffer_offset = _place(buffer), buffer.storage_offset()
        steps = offset - previous_offset, buffer_offset - previous_buffer
        if count and here == place and buffer_here == buffer_place:
            if count == 1 and steps[0] > 0 and steps[1] > 0:
                page_step, buffer_step = steps
                count += 1
            elif count > 1 and steps == (page_step, buffer_step):
                count += 1
            else:
                runs.append((first, count, page_step, buffer_step))
                first, count = position, 1
        else:
            if count:
                runs.append((first, count, page_step, buffer_step))
            first, count, place, buffer_place = position, 1, here, buffer_here
        previous_offset, previous_buffer = offset, buffer_offset
    if count:
        runs.append((first, count, page_step, buffer_step))
    return runs


def _split(runs: list[tuple[int, int, int, int]], pages: list[torch.Tensor]) -> list[tuple[int, int, int, int]]:
    """The runs cut so that a run of pages each below :data:`SERIAL_ELEMENTS` stays below it."""
    cut = []
    for first, count, page_step, buffer_step in runs:
        numel = pages[first].numel()
        most = count if numel >= SERIAL_ELEMENTS else max(1, (SERIAL_ELEMENTS - 1) // max(numel, 1))
        for start in range(first, first + count, most):
            cut.append((start, min(most, first + count - start), page_step, buffer_step))
    return cut


def _without_overlap(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether no two elements of a view of ``shape`` and ``strides`` share memory (sufficient
    test: each stride, smallest first, passes the span of the dims below it)."""
    span = 1
    for size, stride in sorted((pair for pair in zip(shape, strides) if pair[0] != 1), key=lambda pair: pair[1]):
        if stride < span:
            return False
        span += (size - 1) * stride
    return True


def _streamed(pages: list[torch.Tensor], buffers: list[torch.Tensor], into_buffers: bool) -> set[int]:
    """Copy the contiguous CPU pages in one :func:`~kvstage.kernels.host_copy.copy_rows` batch;
    their positions (none where the batch is refused: then every page takes ``copy_``). One pass
    takes the addresses: a put of 128 pages paid ~0.3 ms for three (the choice, the buffers'
    slices, the plan's own checks)."""
    chosen, page_addresses, buffer_addresses, sizes = [], [], [], []
    for i, (page, buffer) in enumerate(zip(pages, buffers)):
        if page.is_cpu and buffer.is_cpu and page.is_contiguous() and buffer.is_contiguous():
            size = page.nbytes
            if buffer.nbytes >= size:  # a short buffer: the copy_ path below raises for it
                chosen.append(i)
                page_addresses.append(page.data_ptr())
                buffer_addresses.append(buffer.data_ptr())
                sizes.append(size)
    if not chosen:
        return set()
    keep = (pages, buffers)
    if into_buffers:
        # A put's targets are the store's own buffers: disjoint rows no caller can reach (a page
        # on loan is never a victim's buffer), so the overlap check (0.1 ms a 128-page call) is moot.
        plan = plan_addresses(buffer_addresses, page_addresses, sizes, keep, check_overlap=False)
    else:
        try:
            plan = plan_addresses(page_addresses, buffer_addresses, sizes, keep)
        except InvalidArgumentError:  # overlapping targets (one key read into two views): copy_ in order
            return set()
    if sum(sizes) >= THREADED_MIN_BYTES:
        _threads().copy_plan(plan)
    else:
        run_plan(plan)
    return set(chosen)


_copies = None
_copies_lock = threading.Lock()


def _threads():
    """The process's :class:`~kvstage.offload.row_copies.RowCopies` for large batches, made on
    first use (imported here: ``kvstage.offload`` imports the stores)."""
    global _copies
    with _copies_lock:
        if _copies is None:
            from kvstage.offload.row_copies import RowCopies

            _copies = RowCopies()
        return _copies


def copy_pages(pages: list[torch.Tensor], buffers: list[torch.Tensor], *, into_buffers: bool) -> None:
    """Copy ``pages[i]`` into ``buffers[i]`` (``into_buffers``) or ``buffers[i]`` into
    ``pages[i]``: contiguous CPU pages in one streaming batch, the others one ``copy_`` per run
    of positions where both sides step evenly through one storage (and a run of pages written
    is free of overlap), one ``copy_`` a page otherwise.

    Args:
        pages: CPU tensors of any dtype, shape and strides (their elements in row-major order
            are a page's bytes).
        buffers: flat ``uint8`` CPU tensors, at least as long as each page's bytes.
        into_buffers: the direction (a store's put: True; its get: False). True: the buffers
            are the caller's own memory, disjoint from each other and from every page (not
            checked: a store's buffers are).
    """
    done = _streamed(pages, buffers, into_buffers)
    if len(done) == len(pages):
        return
    if done:
        rest = [i for i in range(len(pages)) if i not in done]
        pages, buffers = [pages[i] for i in rest], [buffers[i] for i in rest]
    for first, count, page_step, buffer_step in _split(_runs(pages, buffers), pages):
        page, buffer = pages[first], buffers[first]
        size = page.numel() * page.element_size()
        if count > 1 and buffer_step % page.element_size() == 0 and (buffer_step >= size or not into_buffers):
            shape, strides = (count, *page.shape), (page_step, *page.stride())
            if into_buffers or _without_overlap(shape, strides):
                rows = buffer.as_strided((count, size), (buffer_step, 1), buffer.storage_offset())
                stored = rows.view(page.dtype).view(shape)
                held = page.as_strided(shape, strides, page.storage_offset())
                (stored.copy_(held) if into_buffers else held.copy_(stored))
                continue
        for position in range(first, first + count):
            page, buffer = pages[position], buffers[position]
            (_as(buffer, page).copy_(page) if into_buffers else page.copy_(_as(buffer, page)))
