"""The rule every copy's slot indices follow (the full pages' and a window's alike)."""

from __future__ import annotations

from typing import Any

import torch

from kvstage.errors import ArgumentTypeError, DeviceMismatchError, InvalidArgumentError

__all__ = ["check_slots"]


def check_slots(
    slot_indices: Any, argument: str, *, device: torch.device, num_slots: int, page_size: int, distinct: bool = False
) -> int:
    """Check the slot indices of a copy into or out of a pool; returns their number of pages.

    A 1-D int32/int64 tensor on the pool's ``device``, whole pages of ``page_size``; on CPU
    (where reading them costs no device sync) every slot in ``[0, num_slots)`` and, with
    ``distinct`` (a scatter: two rows into one slot), no slot twice. On CUDA the range is the
    engine's promise: checking it would sync with the device.

    Raises:
        ArgumentTypeError, DeviceMismatchError, InvalidArgumentError: naming ``argument``.
    """
    if (
        not isinstance(slot_indices, torch.Tensor)
        or slot_indices.dim() != 1
        or slot_indices.dtype not in (torch.int32, torch.int64)
    ):
        described = (
            f"{slot_indices.dtype} tensor of shape {tuple(slot_indices.shape)}"
            if isinstance(slot_indices, torch.Tensor)
            else type(slot_indices).__name__
        )
        raise ArgumentTypeError(f"{argument}: must be a 1-D int32/int64 tensor, got {described}")
    if slot_indices.device != device:
        raise DeviceMismatchError(f"{argument}: must be on the pool's device {device}, got {slot_indices.device}")
    count = slot_indices.shape[0]
    if count % page_size:
        raise InvalidArgumentError(f"{argument}: {count} slots is not a whole number of pages of {page_size}")
    if count and slot_indices.device.type == "cpu":
        low, high = int(slot_indices.min()), int(slot_indices.max())
        if low < 0 or high >= num_slots:
            raise InvalidArgumentError(
                f"{argument}: every slot must be in [0, {num_slots}), got {low if low < 0 else high}"
            )
        if distinct and torch.unique(slot_indices).numel() != count:
            raise InvalidArgumentError(f"{argument}: a slot repeats (two rows would be written into one slot)")
    return count // page_size
