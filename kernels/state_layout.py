"""The checks every state gather/scatter runs before it touches memory, and their result.

:func:`check_state_transfer` validates one call and returns a :class:`StateTransfer`, the
normalized description that the torch reference and the Triton launcher both execute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstage.errors import ArgumentTypeError, is_int, require
from kvstage.kernels.layout import check_index, check_staging_buffer, on_host, to_device_async
from kvstage.kernels.state_pool import StatePool

__all__ = ["StateTransfer", "check_state_transfer"]


@dataclass
class StateTransfer:
    """One validated state gather or scatter, ready to execute.

    Attributes:
        pool: the state pool.
        staging: uint8 ``[num_ids, pool.snapshot_bytes]``, contiguous; pinned host, or on the pool's device.
        slot_ids: int32/int64 ``[num_ids]`` state slots, on the pool's device (any 1-D view).
        slot_ids_cpu: ``slot_ids`` as given when readable on the host without a sync, else None.
        tensors: the state tensors moved (indices into ``pool.tensors``): all, or one layer's.
    """

    pool: StatePool
    staging: torch.Tensor
    slot_ids: torch.Tensor
    slot_ids_cpu: torch.Tensor | None
    tensors: range

    @property
    def num_ids(self) -> int:
        """Snapshots moved by this call."""
        return self.slot_ids.numel()


def _as_slot_ids(slot_ids: object, pool: StatePool) -> torch.Tensor:
    if isinstance(slot_ids, (list, tuple)):
        require(
            all(is_int(s) for s in slot_ids),
            "slot_ids",
            lambda: f"a list must hold ints, got {[type(s).__name__ for s in slot_ids]}",
            ArgumentTypeError,
        )
        return torch.tensor(slot_ids, dtype=torch.int64)
    require(
        isinstance(slot_ids, torch.Tensor),
        "slot_ids",
        lambda: f"must be a torch.Tensor or a list of ints, got {type(slot_ids).__name__}",
        ArgumentTypeError,
    )
    return check_index("slot_ids", slot_ids, pool.device)


def _check_staging(staging: object, pool: StatePool, num_ids: int) -> None:
    staging = check_staging_buffer(staging, pool.device, torch.uint8, "torch.uint8 (a snapshot is bytes)")
    want = pool.staging_shape(num_ids)
    require(
        tuple(staging.shape) == want,
        "staging",
        lambda: f"must be [len(slot_ids), snapshot_bytes] = {list(want)}, got shape {tuple(staging.shape)}",
    )
    require(staging.is_contiguous(), "staging", "must be contiguous")


def check_state_transfer(
    pool: StatePool,
    slot_ids: torch.Tensor | list[int],
    staging: torch.Tensor,
    *,
    scatter: bool = False,
    check_bounds: bool | None = None,
    tensors: range | None = None,
) -> StateTransfer:
    """Validate a state gather/scatter before anything is written; return the :class:`StateTransfer`.

    ``slot_ids`` may be any 1-D view (read by its strides) or a list of ints; CPU ids for a CUDA
    pool reach the device through pinned memory (no host sync).

    Args:
        check_bounds: check ids that live on the device (a device sync); ``None`` = on for a CPU
            pool, off for a CUDA pool. Ids given on CPU are always checked (no sync needed).
        scatter: the copy writes the pool: no slot may repeat (its content would be unspecified).
        tensors: a ``range`` of tensor indices (step 1, non-empty, within the pool) to move alone,
            e.g. one layer's (:attr:`StatePool.layers`); each keeps its columns of the full
            snapshot. ``None`` = every tensor.

    Raises:
        ArgumentTypeError: ``pool`` not a :class:`StatePool`; ``slot_ids`` not an int32/int64
            tensor or list of ints; ``staging`` not a uint8 tensor.
        DeviceMismatchError: ``slot_ids`` on a third device; ``staging`` neither on the pool's
            device nor (CUDA pool) pinned host memory.
        InvalidArgumentError: ``slot_ids`` not 1-D, out of ``[0, num_slots)``, or repeated in a
            scatter (an expanded view repeats one); ``staging`` not ``[len(slot_ids),
            snapshot_bytes]`` or not contiguous; ``tensors`` not such a range.
    """
    require(
        isinstance(pool, StatePool),
        "pool",
        lambda: f"must be a StatePool, got {type(pool).__name__}",
        ArgumentTypeError,
    )
    if tensors is None:
        tensors = range(pool.num_tensors)
    require(
        isinstance(tensors, range) and tensors.step == 1 and 0 <= tensors.start < tensors.stop <= pool.num_tensors,
        "tensors",
        lambda: f"must be None or a non-empty range(start, stop) within [0, {pool.num_tensors}], got {tensors!r}",
    )
    slot_ids = _as_slot_ids(slot_ids, pool)
    num_ids = slot_ids.numel()
    _check_staging(staging, pool, num_ids)
    require(
        not scatter or num_ids <= 1 or slot_ids.stride(0) != 0,
        "slot_ids",
        "must not repeat a slot in a scatter (an expanded view repeats one; the slot's content would be unspecified)",
    )
    if check_bounds is None:
        check_bounds = pool.device.type == "cpu"
    if num_ids and (check_bounds or on_host(slot_ids)):
        values = slot_ids.tolist()
        low, high = min(values), max(values)
        require(
            0 <= low and high < pool.num_slots,
            "slot_ids",
            lambda: f"must be in [0, {pool.num_slots}) (the pool's state slots), got min {low} max {high}",
        )
        require(
            not scatter or len(set(values)) == num_ids,
            "slot_ids",
            lambda: f"must not repeat a slot in a scatter (the slot's content would be unspecified), got {values}",
        )
    cpu_ids = slot_ids if on_host(slot_ids) else None
    return StateTransfer(pool, staging, to_device_async(slot_ids, pool.device), cpu_ids, tensors)
