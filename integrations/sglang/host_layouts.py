"""sglang's HiCache host pool layouts, as views in kvstage's page byte order.

kvstage stores a page as ``[num_layers, kv_parts, page_size, num_heads, head_dim]`` (row-major,
:meth:`kvstage.kv_layout.KVLayout.page_shape`). sglang 0.5.23's host pools
(``sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost``, ``...pool_host.mla.MLATokenToKVPoolHost``)
hand out one page as ``get_data_page(index, flat=False)``, whose shape depends on the pool's
``layout``:

=================  ======================================  ===========================
layout             MHA page (K/V first)                    MLA page
=================  ======================================  ===========================
layer_first        ``[2, L, page_size, H, D]``              ``[L, page_size, 1, D]``
page_first         ``[2, page_size, L, H, D]``              ``[page_size, L, 1, D]``
page_first_direct  ``[2, 1, L, page_size, H, D]``           ``[1, L, page_size, 1, D]``
page_head          ``[2, 1, H, page_size, L, D]``           (not an MLA layout)
=================  ======================================  ===========================

:func:`page_view` permutes that page into kvstage's order without copying (a strided view);
the same permutation reads a legacy flat page (``get_data_page(index, flat=True)``). Only MLA
``page_first_direct`` is contiguous in kvstage's order (a page moves without a permuting copy).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from kvstage.errors import InvalidArgumentError
from kvstage.kv_layout import KVLayout

__all__ = ["MHA_LAYOUTS", "MLA_LAYOUTS", "host_kv_layout", "page_view", "page_views", "flat_page_view"]

# layout -> (the shape of one page as get_data_page(flat=False) gives it, from (L, ps, H, D);
#            the permutation from that page to [L, kv_parts, ps, H, D])
_Shape = Callable[[int, int, int, int], tuple[int, ...]]
_ToKvstage = Callable[[torch.Tensor], torch.Tensor]

MHA_LAYOUTS: dict[str, tuple[_Shape, _ToKvstage]] = {
    "layer_first": (lambda L, ps, H, D: (2, L, ps, H, D), lambda p: p.permute(1, 0, 2, 3, 4)),
    "page_first": (lambda L, ps, H, D: (2, ps, L, H, D), lambda p: p.permute(2, 0, 1, 3, 4)),
    "page_first_direct": (lambda L, ps, H, D: (2, 1, L, ps, H, D), lambda p: p.squeeze(1).permute(1, 0, 2, 3, 4)),
    "page_head": (lambda L, ps, H, D: (2, 1, H, ps, L, D), lambda p: p.squeeze(1).permute(3, 0, 2, 1, 4)),
}
MLA_LAYOUTS: dict[str, tuple[_Shape, _ToKvstage]] = {
    "layer_first": (lambda L, ps, H, D: (L, ps, 1, D), lambda p: p.unsqueeze(1)),
    "page_first": (lambda L, ps, H, D: (ps, L, 1, D), lambda p: p.permute(1, 0, 2, 3).unsqueeze(1)),
    "page_first_direct": (lambda L, ps, H, D: (1, L, ps, 1, D), lambda p: p.squeeze(0).unsqueeze(1)),
}


def _is_mla(host_pool: Any) -> bool:
    return hasattr(host_pool, "kv_cache_dim")


def _table(host_pool: Any) -> dict[str, tuple[_Shape, _ToKvstage]]:
    return MLA_LAYOUTS if _is_mla(host_pool) else MHA_LAYOUTS


def host_kv_layout(host_pool: Any) -> KVLayout:
    """The :class:`KVLayout` of one token of an sglang MHA or MLA host pool.

    MHA: ``kv_parts=2``, ``num_heads=host_pool.head_num``, ``head_dim=host_pool.head_dim``;
    MLA: ``kv_parts=1``, ``num_heads=1``, ``head_dim=host_pool.kv_cache_dim``. ``num_layers``
    is ``host_pool.layer_num`` (a pipeline stage's layers, plus draft-model layers where the
    pool holds them).

    Raises:
        InvalidArgumentError: the pool's layout is not one listed in the module docstring (e.g.
            ``page_unified``, NPU ``page_first_kv_split``); an MHA pool whose V head size differs
            from its K head size; a pool of another kind (hybrid SWA/Mamba, K-only, DeepSeek V4).
    """
    layout = getattr(host_pool, "layout", None)
    table = _table(host_pool)
    if layout not in table:
        kind = "MLA" if _is_mla(host_pool) else "MHA"
        raise InvalidArgumentError(
            f"mem_pool_host: {kind} host layout {layout!r} is not supported; use one of {sorted(table)}"
        )
    if _is_mla(host_pool):
        return KVLayout(host_pool.layer_num, 1, 1, host_pool.kv_cache_dim, host_pool.dtype)
    if not hasattr(host_pool, "head_num") or not hasattr(host_pool, "v_head_dim"):
        raise InvalidArgumentError(
            f"mem_pool_host: {type(host_pool).__name__} is not an MHA or MLA host pool "
            "(hybrid SWA/Mamba and other pools are not supported)"
        )
    if host_pool.v_head_dim != host_pool.head_dim:
        raise InvalidArgumentError(
            f"mem_pool_host: V head size {host_pool.v_head_dim} differs from K head size "
            f"{host_pool.head_dim}; kvstage pages need equal K and V rows"
        )
    return KVLayout(host_pool.layer_num, 2, host_pool.head_num, host_pool.head_dim, host_pool.dtype)


def page_view(host_pool: Any, index: int) -> torch.Tensor:
    """The page of ``host_pool`` starting at token ``index`` (a multiple of ``page_size``) as a
    view of the pool's memory (sglang's own ``get_data_page``, permuted; no copy) whose
    row-major elements are kvstage's ``[num_layers, kv_parts, page_size, num_heads, head_dim]``
    page; where ``page_size, num_heads, head_dim`` are contiguous in the pool (layer_first,
    page_first_direct) they are one dimension, which lets torch copy the page in long runs."""
    view = _table(host_pool)[host_pool.layout][1](host_pool.get_data_page(index, flat=False))
    return view.view(view.shape[0], view.shape[1], -1) if _row_is_one_run(view) else view


def page_views(host_pool: Any, starts: list[int]) -> list[torch.Tensor]:
    """``[page_view(host_pool, start) for start in starts]``, in one torch call a page: a host
    pool's pages are one view at a fixed storage step apart (sglang slices its buffer by page), so
    the first and last pages' views give every other one by ``as_strided``; evenly spaced
    ascending starts take one ``as_strided`` and one ``unbind`` for all (128 pages: 0.35 ms ->
    0.15 ms); where the first and last do not agree on shape and strides, or the step is not
    whole, each page is viewed on its own."""
    if len(starts) < 3 or getattr(host_pool, "dcp_size", 1) != 1:
        return [page_view(host_pool, start) for start in starts]
    page_size = host_pool.page_size
    first, last = page_view(host_pool, starts[0]), page_view(host_pool, starts[-1])
    pages_apart = (starts[-1] - starts[0]) // page_size
    offset = first.storage_offset()
    step, rest = divmod(last.storage_offset() - offset, pages_apart) if pages_apart else (0, 1)
    if rest or first.shape != last.shape or first.stride() != last.stride():
        return [page_view(host_pool, start) for start in starts]
    shape, strides, base = first.shape, first.stride(), starts[0]
    spacing = (starts[1] - base) // page_size
    if spacing > 0 and step > 0 and starts == list(range(base, starts[-1] + 1, spacing * page_size)):
        # evenly spaced (a request's adjacent pages): one view of them all, cut in one C call
        run = first.as_strided((len(starts), *shape), (spacing * step, *strides), offset)
        return list(run.unbind(0))
    middle = [first.as_strided(shape, strides, offset + (start - base) // page_size * step) for start in starts[1:-1]]
    return [first, *middle, last]


def _row_is_one_run(view: torch.Tensor) -> bool:
    """Whether the last three dims of ``view`` are one strided run (torch's rule for viewing
    them as one dim: size-1 dims aside, each stride is the next one's times its size).
    Decided from the strides, so the per-page path never pays for a failed ``view``'s error."""
    expected = None
    for size, stride in zip(reversed(view.shape[2:]), reversed(view.stride()[2:])):
        if size == 1:
            continue
        if expected is not None and stride != expected:
            return False
        expected = stride * size
    return True


def flat_page_view(host_pool: Any, flat_page: torch.Tensor, kv_layout: KVLayout) -> torch.Tensor:
    """A flat page in the host pool's layout order (sglang's legacy ``get``/``set`` values,
    ``get_data_page(index, flat=True)``) as a ``[num_layers, kv_parts, page_size, num_heads,
    head_dim]`` view.

    Raises:
        InvalidArgumentError: ``flat_page`` is not a contiguous CPU tensor of the page's
            element count and the pool's dtype.
    """
    shape_of, to_kvstage = _table(host_pool)[host_pool.layout]
    page_size = host_pool.page_size
    shape = shape_of(kv_layout.num_layers, page_size, kv_layout.num_heads, kv_layout.head_dim)
    expected = kv_layout.page_bytes(page_size) // kv_layout.itemsize
    if (
        not isinstance(flat_page, torch.Tensor)
        or flat_page.device.type != "cpu"
        or not flat_page.is_contiguous()
        or flat_page.numel() != expected
        or flat_page.dtype != kv_layout.dtype
    ):
        got = (
            f"{tuple(flat_page.shape)} {flat_page.dtype} on {flat_page.device}"
            if isinstance(flat_page, torch.Tensor)
            else type(flat_page).__name__
        )
        raise InvalidArgumentError(
            f"value: must be a contiguous CPU {kv_layout.dtype_name} tensor of {expected} elements "
            f"(one flat page), got {got}"
        )
    return to_kvstage(flat_page.view(shape))
