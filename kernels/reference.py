"""The torch reference of gather/scatter: ``index_select`` / ``index_copy_`` per (part, layer).

This is the oracle the Triton kernels are tested against, and the default path on CPU. It
moves bytes, like the kernels: every buffer is viewed as rows of the widest integer word that
divides the row and every base address, so fp8, bf16, int8, ... take one path (and dtypes
that lack ``index_select`` kernels, such as fp8 on CPU, still work).

Per (part, layer) it costs two passes over that layer's share of the batch: ``index_select``
into a temporary, then ``index_copy_`` into place. The temporary is one layer's rows, small
enough to stay in cache.
"""

from __future__ import annotations

import torch

from kvstage.kernels.layout import Transfer, check_transfer
from kvstage.kernels.pool import KVPool
from kvstage.nvtx_ranges import nvtx_range

__all__ = ["gather_reference", "scatter_reference", "word_bytes_for", "as_rows"]

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_bytes_for(row_bytes: int, tensors: list[torch.Tensor]) -> int:
    """The widest word (8, 4, 2 or 1 bytes) dividing ``row_bytes`` and every tensor's start address."""
    for word in (8, 4, 2):
        if row_bytes % word == 0 and all(t.data_ptr() % word == 0 for t in tensors):
            return word
    return 1


def as_rows(t: torch.Tensor, row_bytes: int, word: int) -> torch.Tensor:
    """View contiguous ``t`` as ``[numel * itemsize / row_bytes, row_bytes / word]`` words (no copy)."""
    flat = t.reshape(-1).view(torch.uint8)
    return flat.view(_WORD_DTYPES[word]).view(-1, row_bytes // word)


def _planes(plan: Transfer, word: int):
    """Yield ``(device_rows, staging_plane, host_rows)`` per (part, layer) in ``plan.layers``.

    ``device_rows`` is ``[num_slots, row_words]``; ``staging_plane`` is ``[num_host_pages *
    page_size, row_words]`` (a strided view for page_first) indexed by ``host_rows``.
    """
    pool, ps = plan.pool, plan.page_size
    staging = as_rows(plan.staging, pool.row_bytes, word)  # [all staging rows, row_words]
    pages = plan.pages.long()
    if plan.layout == "page_first":
        # [P, L, parts, ps, w]: plane (l, p) is staging5[:, l, p] -> [P, ps, w]; index whole pages.
        staging5 = staging.view(plan.num_host_pages, pool.num_layers, pool.kv_parts, ps, -1)
        for p in range(pool.kv_parts):
            for layer in plan.layers:
                yield as_rows(pool.buffers[p][layer], pool.row_bytes, word), staging5[:, layer, p], pages
    else:
        staging4 = staging.view(pool.kv_parts, pool.num_layers, plan.num_host_pages * ps, -1)
        host_rows = (pages[:, None] * ps + torch.arange(ps, device=pages.device)).reshape(-1)
        for p in range(pool.kv_parts):
            for layer in plan.layers:
                yield as_rows(pool.buffers[p][layer], pool.row_bytes, word), staging4[p, layer], host_rows


def _word(plan: Transfer) -> int:
    return word_bytes_for(plan.pool.row_bytes, plan.pool.tensors() + [plan.staging])


def run_gather_torch(plan: Transfer) -> None:
    """Execute a validated gather with ``index_select``/``index_copy_``."""
    if plan.n_pages == 0:
        return
    word, ps = _word(plan), plan.page_size
    with nvtx_range("gather_reference"):
        for device_rows, plane, host_index in _planes(plan, word):
            rows = device_rows.index_select(0, plan.slots)
            if plan.layout == "page_first":
                plane.index_copy_(0, host_index, rows.view(plan.n_pages, ps, -1))
            else:
                plane.index_copy_(0, host_index, rows)


def run_scatter_torch(plan: Transfer) -> None:
    """Execute a validated scatter with ``index_select``/``index_copy_``."""
    if plan.n_pages == 0:
        return
    word = _word(plan)
    slots = plan.slots.long()
    with nvtx_range("scatter_reference"):
        for device_rows, plane, host_index in _planes(plan, word):
            rows = plane.index_select(0, host_index).view(plan.n_tokens, -1)
            device_rows.index_copy_(0, slots, rows)


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
        slot_indices: int32/int64 ``[n_pages * page_size]`` device slots, token order within each page.
        host_page_ids: int32/int64 ``[n_pages]`` distinct pages of ``staging``.
        page_size: tokens per page.
        layout: ``"page_first"`` or ``"layer_first"``.
        check_bounds: see :func:`kvstage.kernels.layout.check_transfer`.

    Raises:
        The errors of :func:`kvstage.kernels.layout.check_transfer`, before anything is written.
    """
    plan = check_transfer(pool, staging, slot_indices, host_page_ids, page_size=page_size, layout=layout, check_bounds=check_bounds)
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
        Others: as :func:`gather_reference`. A slot that repeats in ``slot_indices`` receives
        one of its rows (which one is unspecified).

    Raises:
        The errors of :func:`kvstage.kernels.layout.check_transfer`, before anything is written.
    """
    plan = check_transfer(pool, staging, slot_indices, host_page_ids, page_size=page_size, layout=layout, layer=layer, check_bounds=check_bounds)
    run_scatter_torch(plan)
