"""sglang 0.5.23's hybrid host pools as the components of one kvstage
:class:`~kvstage.model_layout.ModelLayout`, and the bytes of each component's entry.

sglang's ``HybridCacheController`` registers one host pool per kind
(``register_mem_host_pool_v2(host_pool, name)``, names from ``PoolName``); each becomes a
component with its own key space (:meth:`ModelLayout.fingerprints`):

=============  ===============================  =========================  ===========================
pool name      host pool (exact class)          component                  one entry
=============  ===============================  =========================  ===========================
``kv``         the anchor (MHA / MLA host)      ``FullAttention`` "kv"     a page (kvstage's order)
``swa``        ``MHA``/``MLATokenToKVPoolHost``  ``SlidingWindow`` "swa"    a page of the window layers
``indexer``    ``DSAIndexerPoolHost``           ``PageSidecar`` "indexer"  a page's index keys + scales
``mamba``      ``MambaPoolHost``                ``RequestState`` "mamba"   one host slot's state
=============  ===============================  =========================  ===========================

Layer numbers are positions in the host pools, not the model's layer ids (the host pools do not
carry those): the ``kv`` pool's layers first, then ``swa``'s, then ``mamba``'s; the indexer rows
sit on the ``kv`` layers. Every key space's digest covers all of it (counts, shapes, dtypes, the
window, the page size). The entry bytes, in kvstage's order: a KV page as
:meth:`KVLayout.page_shape`; an indexer page per layer, the page's ``page_size`` rows of packed
keys and scales as sglang's DSA pool packs them (one uint8 tensor per token); a Mamba slot per
layer, its conv tensors in order, then its temporal (SSM) tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from kvstage.errors import InvalidArgumentError
from kvstage.integrations.sglang.host_layouts import host_kv_layout, page_view
from kvstage.model_layout import (
    FullAttention,
    LayoutComponent,
    ModelLayout,
    PageSidecar,
    RequestState,
    SlidingWindow,
    TensorSpec,
)

__all__ = ["entry_pieces", "hybrid_layout", "pack", "unpack"]


def hybrid_layout(pools: dict[str, Any], kv_dtype: torch.dtype, config: Any, window: int | None) -> ModelLayout:
    """The :class:`ModelLayout` of a hybrid host pool set (module doc).

    Args:
        pools: sglang pool name -> host pool: ``kv`` (the anchor) and any of ``swa``,
            ``indexer``, ``mamba`` (checked by
            :func:`~kvstage.integrations.sglang.pool_kinds.require_stored_v2_pool`).
        kv_dtype: the ``kv`` pool's KV dtype (fp8 resolved from ``config.kv_cache_dtype``).
        config: the :class:`~kvstage.integrations.sglang.key_space.ExtraConfig` (its ``kv_dtype``
            resolves the SWA pool's).
        window: the sliding window in tokens (``extra_config.sliding_window``); needed with ``swa``.

    Raises:
        InvalidArgumentError: ``swa`` without ``window``; as the component builders below.
    """
    kv = kv_component("kv", pools["kv"], 0, kv_dtype)
    components: list[LayoutComponent] = [kv]
    end = kv.num_layers
    if "swa" in pools:
        if window is None:
            raise InvalidArgumentError(
                "extra_config.sliding_window: required with an 'swa' host pool (the model's sliding window in "
                "tokens: it decides which window pages restore a length, and is part of every key space)"
            )
        host = pools["swa"]
        swa = kv_component("swa", host, end, config.kv_dtype(host.dtype, "swa host pool"), window)
        components.append(swa)
        end += swa.num_layers
    if "indexer" in pools:
        components.append(indexer_component(pools["indexer"], kv))
    if "mamba" in pools:
        mamba = mamba_component(pools["mamba"], end)
        components.append(mamba)
        end += mamba.num_layers
    return ModelLayout(end, tuple(components))


def kv_component(name: str, host_pool: Any, first: int, kv_dtype: torch.dtype, window: int | None = None):
    """A ``FullAttention`` (``window`` None) or ``SlidingWindow`` component over an MHA / MLA host
    pool's ``layer_num`` layers from ``first``, its dtype ``kv_dtype`` (fp8 resolved).

    Raises:
        InvalidArgumentError: as :func:`~kvstage.integrations.sglang.host_layouts.host_kv_layout`.
    """
    layout = host_kv_layout(host_pool)
    layout = type(layout)(layout.num_layers, layout.kv_parts, layout.num_heads, layout.head_dim, kv_dtype)
    layers = tuple(range(first, first + layout.num_layers))
    if window is None:
        return FullAttention(layers, layout, name=name)
    return SlidingWindow(layers, layout, window, name=name)


def indexer_component(host_pool: Any, kv: LayoutComponent) -> PageSidecar:
    """The DSA indexer's ``PageSidecar`` on the ``kv`` component's layers.

    Raises:
        InvalidArgumentError: its layer count differs from the KV pool's, or its page stride is
            not ``page_size`` rows.
    """
    if host_pool.layer_num != kv.num_layers:
        raise InvalidArgumentError(
            f"host pool 'indexer': {host_pool.layer_num} layers, the KV pool has {kv.num_layers}; "
            "kvstage stores index rows beside each KV layer"
        )
    row, rest = divmod(host_pool.indexer_page_stride_size, host_pool.page_size)
    if rest:
        raise InvalidArgumentError(
            f"host pool 'indexer': a page of {host_pool.indexer_page_stride_size} elements is not "
            f"{host_pool.page_size} equal rows"
        )
    return PageSidecar(kv.layers, (TensorSpec("index_k_scale", (row,), host_pool.indexer_dtype),), name="indexer")


def _mamba_tensors(host_pool: Any) -> list[tuple[str, tuple[int, ...], torch.dtype, list[torch.Tensor]]]:
    """(name, per-slot shape, dtype, buffer) per state tensor, in entry order: conv, then temporal."""
    tensors = [
        (f"conv{index}", tuple(shape), host_pool.conv_dtype, buffer)
        for index, (shape, buffer) in enumerate(zip(host_pool.conv_state_shapes, host_pool.conv_buffer))
    ]
    if host_pool.temporal_state_elem_size > 0:  # conv-only linear attention has none
        tensors.append(
            ("temporal", tuple(host_pool.temporal_state_shape), host_pool.temporal_dtype, host_pool.temporal_buffer)
        )
    return tensors


def mamba_component(host_pool: Any, first: int) -> RequestState:
    """The Mamba host pool's ``RequestState``: ``num_mamba_layers`` layers from ``first``.

    Raises:
        InvalidArgumentError: a pool with slot side states (kvstage's snapshot has no place for
            them) or a layout other than ``page_first`` / ``page_first_direct``.
    """
    if host_pool.slot_state_buffers:
        raise InvalidArgumentError(
            "host pool 'mamba': slot side states (slot_state_buffers) are not in kvstage's state snapshot"
        )
    if host_pool.layout not in ("page_first", "page_first_direct"):
        raise InvalidArgumentError(f"host pool 'mamba': layout {host_pool.layout!r} is not supported")
    specs = tuple(TensorSpec(name, shape, dtype) for name, shape, dtype, _ in _mamba_tensors(host_pool))
    return RequestState(tuple(range(first, first + host_pool.num_mamba_layers)), specs, name="mamba")


def entry_pieces(component: LayoutComponent, host_pool: Any, index: int) -> list[torch.Tensor]:
    """Views of ``host_pool`` at host slot ``index`` (a page start; a Mamba slot) whose bytes, one
    after another and each row-major, are ``component``'s entry (module doc)."""
    if component.kind in ("full", "swa"):
        return [page_view(host_pool, index)]
    if component.kind == "sidecar":
        page = index // host_pool.page_size
        buffer = host_pool.index_k_with_scale_buffer
        return [buffer[:, page] if host_pool.layout == "layer_first" else buffer[page, :, 0]]
    tensors = _mamba_tensors(host_pool)
    return [buffer[index, layer, 0] for layer in range(host_pool.num_mamba_layers) for *_, buffer in tensors]


def pack(pieces: list[torch.Tensor], entry: torch.Tensor) -> None:
    """Copy ``pieces`` into ``entry`` (uint8, their total bytes), one after another."""
    offset = 0
    for piece in pieces:
        size = piece.numel() * piece.element_size()
        entry[offset : offset + size].copy_(piece.contiguous().reshape(-1).view(torch.uint8))
        offset += size


def unpack(entry: torch.Tensor, pieces: list[torch.Tensor]) -> None:
    """Copy ``entry``'s bytes back into ``pieces`` (the inverse of :func:`pack`)."""
    offset = 0
    for piece in pieces:
        size = piece.numel() * piece.element_size()
        # a clone re-bases a piece whose byte offset its dtype cannot be viewed at
        piece.copy_(entry[offset : offset + size].clone().view(piece.dtype).view(piece.shape))
        offset += size
