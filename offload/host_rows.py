"""The row plans of one-hop copies between a pool in host memory and host pages of their own.

A gather or scatter between a KV pool (or a state pool) in host memory and host pages that are
whole buffers (the pages a memory store adopts and lends) is a batch of contiguous byte rows,
copied by :meth:`RowCopies.copy_plan <kvstage.offload.row_copies.RowCopies.copy_plan>` (streaming
stores, one C call a thread: :mod:`kvstage.kernels.host_copy`): no index ops, no staging between.
A KV page's bytes are the host page layout ``[num_layers, kv_parts, page_size, num_heads,
head_dim]``: for each layer and part, the page's slots' rows; a page whose slots are one aligned
run (``slots[j] == k * page_size + j``, the usual case) is one row a (layer, part), any other page
one row a slot. A state snapshot's bytes are each state tensor's slot row at its offset
(:class:`~kvstage.kernels.StatePool`).

The plans are built as address arithmetic on numpy arrays (a 32-page request's 768 rows in tens
of microseconds; as torch views they took ~15 ms, as numpy views ~0.8 ms), from memory the
caller checked: the pool's buffers (contiguous, in host memory: :func:`kv_rows`,
:func:`state_rows`), pages of the host page layout, slots in the pool's range. The plan keeps
the pages and the pool alive (``RowPlan.keep``). :func:`kv_rows` and :func:`state_rows` answer
None where a pool cannot be copied this way: the caller then takes the kernels' path.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from kvstage.errors import require
from kvstage.kernels.host_copy import RowPlan

__all__ = ["KVRows", "StateRows", "kv_rows", "state_rows"]


def _plan(host: np.ndarray, device: np.ndarray, sizes: np.ndarray, to_host: bool, keep: tuple) -> RowPlan:
    host, device = host.reshape(-1), device.reshape(-1)
    sizes = np.broadcast_to(sizes, host.shape).astype(np.uint64)
    return RowPlan(host, device, sizes, keep) if to_host else RowPlan(device, host, sizes, keep)


class KVRows:
    """A host-memory KV pool's buffer addresses (:func:`kv_rows`) and the row plans of pages to
    or from it (:meth:`plan`)."""

    def __init__(self, kv_pool: Any, page_size: int) -> None:
        self.kv_pool, self.page_size = kv_pool, page_size
        self.kv_parts, self.num_layers = kv_pool.kv_parts, kv_pool.num_layers
        self.row_bytes = kv_pool.buffers[0][0][0].nbytes  # a slot's bytes in one (part, layer)
        self.plane_bytes = page_size * self.row_bytes
        # bases[layer, part]: the buffer's address (the host page's plane order)
        self.bases = np.array(
            [[kv_pool.buffers[p][j].data_ptr() for p in range(self.kv_parts)] for j in range(self.num_layers)],
            dtype=np.uint64,
        )
        planes = np.arange(self.num_layers * self.kv_parts, dtype=np.uint64).reshape(self.num_layers, self.kv_parts)
        self.plane_offsets = planes * np.uint64(self.plane_bytes)  # a plane's offset in a host page

    def plan(
        self, pages: Sequence[torch.Tensor], slot_indices: torch.Tensor, *, to_host: bool, layer: int | None = None
    ) -> RowPlan:
        """The rows that move page ``i``'s slots ``slot_indices[i * page_size : (i + 1) *
        page_size]`` to (``to_host``) or from ``pages[i]`` (contiguous host pages of the page
        layout), every layer or only ``layer``, page by page (``slot_indices``: a CPU int tensor
        of ``len(pages)`` whole pages).

        Raises:
            InvalidArgumentError: a slot outside the pool (nothing planned)."""
        num_pages, page_size = len(pages), self.page_size
        layers = slice(None) if layer is None else slice(layer, layer + 1)
        bases, offsets = self.bases[layers], self.plane_offsets[layers]  # [layers, parts]
        if not num_pages:
            empty = np.zeros(0, dtype=np.uint64)
            return RowPlan(empty, empty, empty, ())
        slots = slot_indices.long().view(num_pages, page_size).numpy()
        low, high = int(slots.min()), int(slots.max())  # addresses are computed from them: never out of the pool
        num_slots = self.kv_pool.buffers[0][0].shape[0]
        require(
            low >= 0 and high < num_slots,
            "slot_indices",
            lambda: f"every slot must be in [0, {num_slots}), got {low if low < 0 else high}",
        )
        slots = slots.astype(np.uint64)
        first = slots[:, 0]
        aligned = (first % page_size == 0) & (slots == first[:, None] + np.arange(page_size, dtype=np.uint64)).all(1)
        addresses = np.array([page.data_ptr() for page in pages], dtype=np.uint64)
        row = np.uint64(self.row_bytes)
        if aligned.all():  # one row a (page, layer, part)
            host = addresses[:, None, None] + offsets[None]
            device = bases[None] + (first * row)[:, None, None]
            return _plan(host, device, np.uint64(self.plane_bytes), to_host, (tuple(pages), self.kv_pool))
        # one row a slot (a page of aligned slots too: still its bytes, in the same order)
        tokens = np.arange(page_size, dtype=np.uint64) * row
        host = addresses[:, None, None, None] + offsets[None, :, :, None] + tokens[None, None, None, :]
        device = bases[None, :, :, None] + (slots * row)[:, None, None, :]
        return _plan(host, device, row, to_host, (tuple(pages), self.kv_pool))


def kv_rows(kv_pool: Any, page_size: int) -> KVRows | None:
    """:class:`KVRows` of ``kv_pool`` (``buffers[part][layer]``, ``[num_slots, ...]``), or None
    when it is not in host memory or a buffer is not contiguous."""
    if torch.device(kv_pool.device).type != "cpu":
        return None
    for part in kv_pool.buffers:
        for buffer in part:
            if buffer.device.type != "cpu" or not buffer.is_contiguous() or buffer.shape[0] == 0:
                return None
    return KVRows(kv_pool, page_size)


class StateRows:
    """A host-memory state pool's tensor addresses (:func:`state_rows`) and the row plans of a
    slot's snapshot (:meth:`plan`)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.bases = np.array([t.data_ptr() for t in pool.tensors], dtype=np.uint64)
        self.strides = np.array([t[0].nbytes for t in pool.tensors], dtype=np.uint64)  # a slot's row, contiguous
        self.offsets = np.array(pool.offsets, dtype=np.uint64)

    def plan(self, snapshot: torch.Tensor, slot: int, *, to_host: bool, tensors: range | None = None) -> RowPlan:
        """The rows that move state slot ``slot`` of every state tensor (or only the tensors
        ``tensors``, a range of indices such as ``pool.layers[l]``) to (``to_host``) or from
        ``snapshot`` (``uint8 [snapshot_bytes]``, contiguous)."""
        chosen = slice(None) if tensors is None else slice(tensors.start, tensors.stop)
        sizes = self.strides[chosen]
        host = np.uint64(snapshot.data_ptr()) + self.offsets[chosen]
        device = self.bases[chosen] + np.uint64(slot) * sizes
        return _plan(host, device, sizes, to_host, (snapshot, self.pool))


def state_rows(pool: Any) -> StateRows | None:
    """:class:`StateRows` of a :class:`~kvstage.kernels.StatePool`, or None when a tensor is not
    in host memory or not contiguous."""
    for t in pool.tensors:
        if t.device.type != "cpu" or not t.is_contiguous() or t.shape[0] == 0:
            return None
    return StateRows(pool)
