"""The torch reference of the state gather/scatter: per state tensor one ``index_select`` /
``index_copy_`` (one ``copy_`` for a single slot given on CPU) between its slot rows and its
columns of the staging buffer.

Like the KV reference it moves bytes: each tensor's slot rows and its staging columns are
viewed as words of the widest size (up to 16 bytes) dividing the row, the strides and the
addresses, so every dtype (fp8 too, which has no CPU ``index_select``) takes one path. With
pinned host staging for a CUDA pool (torch ops need one device) the snapshots go through a
compact device buffer and one ``copy_``.
"""

from __future__ import annotations

import threading
import weakref

import torch

from kvstage.kernels.state_layout import StateTransfer, check_state_transfer
from kvstage.kernels.state_pool import StatePool
from kvstage.kernels.words import WORD_DTYPES, widest_word
from kvstage.nvtx_ranges import nvtx_range

__all__ = ["gather_state_reference", "scatter_state_reference"]


def _word_view(t: torch.Tensor, rows: int, row_bytes: int, stride_bytes: int, word: int) -> torch.Tensor:
    """``[rows, row_bytes // word]`` words of ``t``'s slot rows, ``stride_bytes`` apart."""
    storage = t.untyped_storage()
    view = torch.empty(0, dtype=WORD_DTYPES[word], device=t.device)
    stride = stride_bytes // word if rows > 1 else row_bytes // word
    return view.set_(storage, (t.data_ptr() - storage.data_ptr()) // word, (rows, row_bytes // word), (stride, 1))


# Per pool and (staging alignment, more than one snapshot): each tensor's word and slot-row view,
# built once: per call only the staging columns are sliced.
_PLANS: "weakref.WeakKeyDictionary[StatePool, dict[tuple[int, bool], list[tuple[int, torch.Tensor]]]]" = (
    weakref.WeakKeyDictionary()
)
_PLANS_LOCK = threading.Lock()


def _pool_rows(pool: StatePool, alignment: int, multi: bool) -> list[tuple[int, torch.Tensor]]:
    with _PLANS_LOCK:
        plan = _PLANS.setdefault(pool, {}).get((alignment, multi))
        if plan is None:
            plan = []
            for t, row, stride, aligned in zip(
                pool.tensors, pool.row_bytes, pool.slot_stride_bytes, pool.word_alignment
            ):
                addresses = [t.untyped_storage().data_ptr()] + ([pool.snapshot_bytes] if multi else [])
                word = widest_word(row, addresses, min(aligned, alignment))
                plan.append((word, _word_view(t, pool.num_slots, row, stride, word)))
            _PLANS[pool][(alignment, multi)] = plan
        return plan


def _planes(plan: StateTransfer):
    """Yield ``(pool_rows [num_slots, w], staging_columns [num_ids, w])`` word views per state tensor."""
    pool, staging = plan.pool, plan.staging
    alignment = widest_word(16, [staging.data_ptr(), staging.untyped_storage().data_ptr()])
    multi = plan.num_ids > 1
    flat = staging.view(-1)
    rows = _pool_rows(pool, alignment, multi)
    for k in plan.tensors:
        (word, pool_rows), offset, row = rows[k], pool.offsets[k], pool.row_bytes[k]
        if multi:  # the snapshot stride is a multiple of the word (the word rule counts it)
            yield pool_rows, staging[:, offset : offset + row].view(WORD_DTYPES[word])
        else:  # one snapshot: a flat slice (the stride of a single row is free)
            yield pool_rows, flat[offset : offset + row].view(WORD_DTYPES[word]).view(1, -1)


# Up to this many snapshots whose ids the host can read, a gather copies row by row (one pass
# per row); beyond, index_select then one copy (two passes, fewer Python steps).
ROW_BY_ROW = 16


def _host_slots(plan: StateTransfer) -> list[int] | None:
    """The slots of a call of at most :data:`ROW_BY_ROW` ids readable on the host, else None."""
    if plan.num_ids <= ROW_BY_ROW and plan.slot_ids_cpu is not None:
        return plan.slot_ids_cpu.tolist()
    return None


def _compact(plan: StateTransfer) -> StateTransfer:
    """The same call with a new staging buffer on the pool's device (for pinned host staging)."""
    compact = torch.empty(tuple(plan.staging.shape), dtype=torch.uint8, device=plan.pool.device)
    return StateTransfer(plan.pool, compact, plan.slot_ids, plan.slot_ids_cpu, plan.tensors)


def run_gather_state_torch(plan: StateTransfer) -> None:
    """Execute a validated state gather with ``index_select`` (or a ``copy_`` per row for few host-known slots)."""
    if plan.num_ids == 0:
        return
    if plan.staging.device != plan.pool.device:
        inner = _compact(plan)
        run_gather_state_torch(inner)
        plan.staging.copy_(inner.staging, non_blocking=True)
        return
    slots = _host_slots(plan)
    index = plan.slot_ids.long()
    with nvtx_range("gather_state_reference"):
        for pool_rows, columns in _planes(plan):
            if slots is not None:
                for i, slot in enumerate(slots):
                    columns[i].copy_(pool_rows[slot])
            else:
                columns.copy_(pool_rows.index_select(0, index))


def run_scatter_state_torch(plan: StateTransfer) -> None:
    """Execute a validated state scatter with ``index_copy_`` (or a ``copy_`` for one host-known slot)."""
    if plan.num_ids == 0:
        return
    if plan.staging.device != plan.pool.device:
        inner = _compact(plan)
        inner.staging.copy_(plan.staging, non_blocking=True)
        run_scatter_state_torch(inner)
        return
    slots = _host_slots(plan)
    index = plan.slot_ids.long()
    with nvtx_range("scatter_state_reference"):
        for pool_rows, columns in _planes(plan):
            if slots is not None and len(slots) == 1:
                pool_rows[slots[0]].copy_(columns[0])
            else:
                pool_rows.index_copy_(0, index, columns)


def gather_state_reference(
    pool: StatePool,
    slot_ids: torch.Tensor | list[int],
    staging: torch.Tensor,
    *,
    check_bounds: bool | None = None,
    tensors: range | None = None,
) -> None:
    """State snapshots to staging, torch reference: ``staging[i]`` gets slot ``slot_ids[i]``'s snapshot.

    Args and raises: as :func:`kvstage.kernels.gather_state` (errors from
    :func:`kvstage.kernels.state_layout.check_state_transfer`, before anything is written).
    """
    run_gather_state_torch(check_state_transfer(pool, slot_ids, staging, check_bounds=check_bounds, tensors=tensors))


def scatter_state_reference(
    staging: torch.Tensor,
    pool: StatePool,
    slot_ids: torch.Tensor | list[int],
    *,
    check_bounds: bool | None = None,
    tensors: range | None = None,
) -> None:
    """Staging to state slots, torch reference: the inverse of :func:`gather_state_reference`.

    Args and raises: as :func:`kvstage.kernels.scatter_state`.
    """
    plan = check_state_transfer(pool, slot_ids, staging, scatter=True, check_bounds=check_bounds, tensors=tensors)
    run_scatter_state_torch(plan)
