"""The row pairs of one-hop copies between a pool in host memory and host pages of their own.

A gather or scatter between a KV pool (or a state pool) in host memory and host pages that are
whole buffers (the pages a memory store adopts and lends) is a list of ``(target, source)``
contiguous byte rows, copied by :class:`~kvstage.offload.row_copies.RowCopies`: no index ops,
no staging between. A KV page's bytes are the host page layout ``[num_layers, kv_parts,
page_size, num_heads, head_dim]``: for each layer and part, the page's slots' rows; a page
whose slots are one aligned run (``slots[j] == k * page_size + j``, the usual case) is one row a
(layer, part), any other page one row a slot. A state snapshot's bytes are each state tensor's
slot row at its offset (:class:`~kvstage.kernels.StatePool`).

The rows are numpy views (slicing a numpy array costs a tenth of a torch view: 768 rows of a
32-page request take ~0.8 ms, against ~15 ms as torch views). :func:`kv_rows` and
:func:`state_rows` answer None where the pool cannot be copied this way (not in host
memory, a buffer not contiguous): the caller then takes the kernels' path.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["KVRows", "StateRows", "kv_rows", "state_rows"]


class KVRows:
    """A host-memory KV pool's buffers as ``uint8 [num_slots, row_bytes]`` numpy arrays, built
    once (:func:`kv_rows`), and the row pairs of pages to or from them (:meth:`pairs`)."""

    def __init__(self, rows: list[list[np.ndarray]], page_size: int) -> None:
        self.rows, self.page_size = rows, page_size
        self.kv_parts, self.num_layers = len(rows), len(rows[0])
        self.num_slots = rows[0][0].shape[0]

    def pairs(
        self, pages: Sequence[torch.Tensor], slot_indices: torch.Tensor, *, to_host: bool, layer: int | None = None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """The pairs that move page ``i``'s slots ``slot_indices[i * page_size : (i + 1) *
        page_size]`` to (``to_host``) or from ``pages[i]`` (contiguous host pages of the page
        layout), every layer or only ``layer``. The slots are the caller's, checked in range
        (a CPU int tensor of ``len(pages)`` whole pages)."""
        num_pages, page_size = len(pages), self.page_size
        if not num_pages:
            return []
        layers = range(self.num_layers) if layer is None else (layer,)
        parts, rows = self.kv_parts, self.rows
        slots = slot_indices.long().view(num_pages, page_size)
        first = slots[:, 0]
        aligned = ((first % page_size == 0) & (slots == first[:, None] + torch.arange(page_size)).all(1)).tolist()
        pairs = []
        for page, start, whole, page_slots in zip(pages, first.tolist(), aligned, slots):
            planes = page.view(torch.uint8).numpy().reshape(self.num_layers, parts, -1)
            for j in layers:
                for p in range(parts):
                    plane, device = planes[j, p], rows[p][j]
                    if whole:
                        block = device[start : start + page_size].reshape(-1)
                        pairs.append((plane, block) if to_host else (block, plane))
                        continue
                    plane_rows = plane.reshape(page_size, -1)
                    for t, slot in enumerate(page_slots.tolist()):
                        pairs.append((plane_rows[t], device[slot]) if to_host else (device[slot], plane_rows[t]))
        return pairs


def kv_rows(kv_pool: Any, page_size: int) -> KVRows | None:
    """:class:`KVRows` of ``kv_pool`` (``buffers[part][layer]``, ``[num_slots, ...]``), or None
    when it is not in host memory or a buffer is not contiguous."""
    if torch.device(kv_pool.device).type != "cpu":
        return None
    rows = []
    for part in kv_pool.buffers:
        views = []
        for buffer in part:
            if buffer.device.type != "cpu" or not buffer.is_contiguous():
                return None
            views.append(buffer.view(torch.uint8).view(buffer.shape[0], -1).numpy())
        rows.append(views)
    return KVRows(rows, page_size)


class StateRows:
    """A host-memory state pool's tensors as ``uint8 [num_slots, row_bytes]`` numpy arrays,
    built once (:func:`state_rows`), and the pairs of a slot's snapshot (:meth:`pairs`)."""

    def __init__(self, rows: list[np.ndarray], offsets: list[int]) -> None:
        self.rows, self.offsets = rows, offsets

    def pairs(
        self, snapshot: torch.Tensor, slot: int, *, to_host: bool, tensors: range | None = None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """The pairs that move state slot ``slot`` of every state tensor (or only the tensors
        ``tensors``, a range of indices such as ``pool.layers[l]``) to (``to_host``) or from
        ``snapshot`` (``uint8 [snapshot_bytes]``, contiguous)."""
        snapshot_bytes = snapshot.view(torch.uint8).numpy().reshape(-1)
        pairs = []
        for k in range(len(self.rows)) if tensors is None else tensors:
            row = self.rows[k][slot]
            part = snapshot_bytes[self.offsets[k] : self.offsets[k] + row.nbytes]
            pairs.append((part, row) if to_host else (row, part))
        return pairs


def state_rows(pool: Any) -> StateRows | None:
    """:class:`StateRows` of a :class:`~kvstage.kernels.StatePool`, or None when a tensor is not
    in host memory or not contiguous."""
    rows = []
    for t in pool.tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        rows.append(t.view(torch.uint8).view(t.shape[0], -1).numpy())
    return StateRows(rows, list(pool.offsets))
