"""The torch reference of gather/scatter: ``index_select`` / ``index_copy_`` per (part, layer).

This is the oracle the Triton kernels are tested against (itself tested against plain
Python loops), and the default path on CPU. It moves bytes, like the kernels: every buffer
is viewed as rows of the widest word (up to 16 bytes) that divides the row and every base
address, so fp8, bf16, int8, ... take one path (and dtypes without ``index_select``
kernels, such as fp8 on CPU, still work).

Speed (the CPU target is 70% of a plain ``copy_`` of the same bytes) comes from two facts
decided once per call: when the host pages form one consecutive run (in any order, the
usual case for a fresh host allocation) the host side is a plain slice, so gather is one
``index_select`` (whole pages when the slots come as aligned page runs) and scatter one
``index_copy_``; otherwise each plane costs an ``index_select`` plus an ``index_copy_``.
``index_copy_`` costs per element, hence the 16-byte words.

With pinned host staging for a CUDA pool (torch ops need one device) it runs staged: the
batch goes through a compact device buffer and one ``copy_`` per run of host pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstage.kernels.layout import Transfer, check_transfer, copy_runs, split_staged, to_device_async
from kvstage.kernels.pool import KVPool
from kvstage.kernels.words import as_words, widest_word
from kvstage.nvtx_ranges import nvtx_range

__all__ = ["gather_reference", "scatter_reference"]

# index_copy_ (scatter) costs per element, so it moves 16-byte words; index_select (gather)
# measured fastest on 8-byte words.
GATHER_MAX_WORD, SCATTER_MAX_WORD = 8, 16


def _word(plan: Transfer, max_word: int) -> int:
    """The copy word (:func:`widest_word`) of the pool's rows and buffers and the staging buffer."""
    return widest_word(plan.pool.row_bytes, [plan.staging.data_ptr()], min(max_word, plan.pool.word_alignment))


def _host_planes(plan: Transfer, word: int):
    """Yield ``(device_rows [num_slots, w], host_plane [num_host_pages, page_size, w])`` per (part, layer)."""
    pool, ps = plan.pool, plan.page_size
    staging = as_words(plan.staging, pool.row_bytes, word)
    if plan.layout == "page_first":  # [P, L, parts, ps, w]: plane (l, p) is a strided [P, ps, w]
        staging5 = staging.view(plan.num_host_pages, pool.num_layers, pool.kv_parts, ps, -1)
        planes = lambda p, layer: staging5[:, layer, p]  # noqa: E731
    else:  # [parts, L, P * ps, w]: plane (p, l) is contiguous
        staging4 = staging.view(pool.kv_parts, pool.num_layers, plan.num_host_pages, ps, -1)
        planes = lambda p, layer: staging4[p, layer]  # noqa: E731
    for p in range(pool.kv_parts):
        for layer in plan.layers:
            yield as_words(pool.buffers[p][layer], pool.row_bytes, word), planes(p, layer)


@dataclass
class _Route:
    """How one call's indices map, decided once per call (the same for every plane).

    run_start: first host page when the batch's host pages are one consecutive run (in any
        order), else None. Then the batch is sorted by host page, and the host side is a plain
        slice ``[run_start, run_start + num_pages)``: no indexed access at all.
    device_index: the device-side index, in host order when ``run_start`` is set: device page
        numbers when ``whole_pages``, else slots (token rows).
    whole_pages: every page is an aligned run of slots (``slots[i * ps + j] == k * ps + j``)
        and the host side is one run, so the device side moves whole pages.
    host_page_ids: the host page of each page of the batch (int64), for the indexed host side
        when ``run_start`` is None.
    """

    run_start: int | None
    device_index: torch.Tensor
    whole_pages: bool
    host_page_ids: torch.Tensor


def _whole_pages(device_rows: torch.Tensor, page_size: int) -> torch.Tensor:
    """``device_rows [num_slots, w]`` as ``[num_slots // page_size, page_size * w]`` (the tail
    slots after the last whole page, which no aligned page run can reach, are left out)."""
    whole = device_rows.shape[0] // page_size * page_size
    return device_rows[:whole].view(-1, page_size * device_rows.shape[1])


def _aligned_page_starts(slot_indices: torch.Tensor, page_size: int) -> torch.Tensor | None:
    """The first slot of each page when every page is an aligned run of slots, else None (CPU tensors only)."""
    pages = slot_indices.long().reshape(-1, page_size)
    first = pages[:, 0]
    aligned = (first % page_size == 0) & (pages == first[:, None] + torch.arange(page_size)).all(1)
    return first if bool(aligned.all()) else None


def _route(plan: Transfer) -> _Route:
    """Decide the route from what the host can read without a device sync (:func:`on_host`):
    the host page ids (for a run) and the slots (for whole pages) as given on CPU. Indices that
    live on the device are never read on the host: they take the indexed route."""
    ps, n, device = plan.page_size, plan.num_pages, plan.slot_indices.device
    slot_indices, host_page_ids = plan.slot_indices.long(), plan.host_page_ids.long()
    indexed = _Route(None, slot_indices, False, host_page_ids)  # host pages anywhere: index both sides
    if plan.host_page_ids_cpu is None:
        return indexed
    host = plan.host_page_ids_cpu.long()
    low, high = int(host.min()), int(host.max())
    if high - low != n - 1:
        return indexed
    # Distinct ids (validated) spanning n values: one run, sorted by host page.
    order = torch.argsort(host)
    first = _aligned_page_starts(plan.slot_indices_cpu, ps) if ps > 1 and plan.slot_indices_cpu is not None else None
    if first is not None:
        return _Route(low, to_device_async((first // ps)[order], device), True, host_page_ids)
    return _Route(low, slot_indices.reshape(n, ps)[to_device_async(order, device)].reshape(-1), False, host_page_ids)


def run_gather_torch(plan: Transfer) -> None:
    """Execute a validated gather with ``index_select`` (and ``copy_`` / ``index_copy_`` into staging)."""
    if plan.num_pages == 0:
        return
    if plan.staging.device != plan.pool.device:  # host staging for a CUDA pool: torch ops need one device
        inner, outer = split_staged(plan)
        run_gather_torch(inner)
        copy_runs(outer, inner.staging, to_staging=True)
        return
    ps, n = plan.page_size, plan.num_pages
    word = _word(plan, GATHER_MAX_WORD)
    route = _route(plan)
    with nvtx_range("gather_reference"):
        for device_rows, host_plane in _host_planes(plan, word):
            w = device_rows.shape[1]
            if route.run_start is None:  # host pages anywhere: select the rows, then index_copy_ whole pages
                rows = device_rows.index_select(0, route.device_index).view(n, ps, w)
                host_plane.index_copy_(0, route.host_page_ids, rows)
                continue
            target = host_plane[route.run_start : route.run_start + n]  # [n, ps, w], host order
            if route.whole_pages:  # one pass: whole pages straight into the staging slice
                torch.index_select(_whole_pages(device_rows, ps), 0, route.device_index, out=target.view(n, ps * w))
            elif ps == 1:  # one pass: rows straight into the staging slice
                torch.index_select(device_rows, 0, route.device_index, out=target.view(n, w))
            else:  # scattered rows of multi-token pages: select, then one strided copy
                target.copy_(device_rows.index_select(0, route.device_index).view(n, ps, w))


def run_scatter_torch(plan: Transfer) -> None:
    """Execute a validated scatter with ``index_copy_`` (and ``index_select`` from staging when needed)."""
    if plan.num_pages == 0:
        return
    if plan.staging.device != plan.pool.device:
        inner, outer = split_staged(plan)
        copy_runs(outer, inner.staging, to_staging=False)
        run_scatter_torch(inner)
        return
    ps, n = plan.page_size, plan.num_pages
    word = _word(plan, SCATTER_MAX_WORD)
    route = _route(plan)
    with nvtx_range("scatter_reference"):
        for device_rows, host_plane in _host_planes(plan, word):
            w = device_rows.shape[1]
            if route.run_start is None:
                source = host_plane.index_select(0, route.host_page_ids)  # [n, ps, w] in batch order
                device_rows.index_copy_(0, route.device_index, source.view(n * ps, w))
                continue
            source = host_plane[route.run_start : route.run_start + n]  # [n, ps, w], host order
            if route.whole_pages:
                _whole_pages(device_rows, ps).index_copy_(0, route.device_index, source.reshape(n, ps * w))
            else:
                device_rows.index_copy_(0, route.device_index, source.reshape(n * ps, w))


def gather_reference(
    pool: KVPool,
    staging: torch.Tensor,
    slot_indices: torch.Tensor,
    host_page_ids: torch.Tensor,
    *,
    page_size: int,
    layout: str = "page_first",
    check_bounds: bool | None = None,
) -> None:
    """Device to host, torch reference: copy the pages at ``slot_indices`` of every layer into ``staging``.

    Token ``j`` of page ``i`` (``slot_indices[i * page_size + j]``) of every (part, layer)
    lands at host page ``host_page_ids[i]``, token ``j``, of ``staging`` (see
    :func:`kvstage.kernels.staging_shape` for the layouts).

    Args:
        pool: the device pool.
        staging: contiguous buffer of :func:`staging_shape` ``(pool, num_host_pages, page_size, layout)``.
        slot_indices: int32/int64 ``[num_pages * page_size]`` device slots, token order within each page.
        host_page_ids: int32/int64 ``[num_pages]`` distinct pages of ``staging``.
        page_size: tokens per page.
        layout: ``"page_first"`` or ``"layer_first"``.
        check_bounds: see :func:`kvstage.kernels.layout.check_transfer`.

    Raises:
        The errors of :func:`kvstage.kernels.layout.check_transfer`, before anything is written.
    """
    plan = check_transfer(
        pool, staging, slot_indices, host_page_ids, page_size=page_size, layout=layout, check_bounds=check_bounds
    )
    run_gather_torch(plan)


def scatter_reference(
    staging: torch.Tensor,
    pool: KVPool,
    slot_indices: torch.Tensor,
    host_page_ids: torch.Tensor,
    *,
    page_size: int,
    layout: str = "page_first",
    layer: int | None = None,
    check_bounds: bool | None = None,
) -> None:
    """Host to device, torch reference: the inverse of :func:`gather_reference`.

    Args:
        layer: ``None`` moves every layer; an int moves that layer only (both parts).
        Others: as :func:`gather_reference`; no slot may repeat in ``slot_indices`` (see
        :func:`kvstage.kernels.layout.check_transfer`).

    Raises:
        The errors of :func:`kvstage.kernels.layout.check_transfer`, before anything is written.
    """
    plan = check_transfer(
        pool,
        staging,
        slot_indices,
        host_page_ids,
        page_size=page_size,
        layout=layout,
        layer=layer,
        check_bounds=check_bounds,
        scatter=True,
    )
    run_scatter_torch(plan)
