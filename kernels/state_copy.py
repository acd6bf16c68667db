"""The public state gather (D2H) and scatter (H2D): a request's state snapshot in one launch.

``gather_state(pool, slot_ids, staging)`` writes slot ``slot_ids[i]``'s snapshot (every state
tensor's slot row, packed in :attr:`StatePool.tensors` order: see :mod:`kvstage.kernels.state_pool`)
to ``staging[i]``; ``scatter_state(staging, pool, slot_ids)`` is the inverse. ``backend`` as
:func:`kvstage.kernels.gather` (``"auto"``, ``"triton"``, ``"torch"``). Every call runs on the
current stream of the pool's device with that device current, and never syncs the device
(ids on the device are not read on the host unless ``check_bounds`` asks); the ``_async``
forms run it on a side stream after the producer (:func:`kvstage.kernels.launch_after`).
"""

from __future__ import annotations

import torch

from kvstage.errors import ArgumentTypeError, is_int, require
from kvstage.kernels.backend import resolve_backend
from kvstage.kernels.state_layout import StateTransfer, check_state_transfer
from kvstage.kernels.state_pool import StatePool
from kvstage.kernels.state_reference import run_gather_state_torch, run_scatter_state_torch
from kvstage.kernels.streams import CopyHandle, launch_after
from kvstage.kernels.transfer import _device_guard
from kvstage.nvtx_ranges import nvtx_range

__all__ = ["gather_state", "gather_state_async", "scatter_state", "scatter_state_async", "warm_up_state"]


def _check_max_programs(max_programs: object) -> None:
    require(
        max_programs is None or (is_int(max_programs) and max_programs >= 1),
        "max_programs",
        lambda: f"must be None or an int >= 1, got {max_programs!r}",
    )


def _run(plan: StateTransfer, *, gather: bool, backend: str, max_programs: int | None) -> None:
    if plan.num_ids == 0:
        return
    if backend == "torch":
        (run_gather_state_torch if gather else run_scatter_state_torch)(plan)
        return
    from kvstage.kernels import triton_state  # imported late: importing triton is slow and optional

    triton_state.launch_state(plan, gather=gather, max_programs=max_programs)


def _copy(
    pool: StatePool,
    slot_ids,
    staging: torch.Tensor,
    *,
    gather: bool,
    backend: str,
    check_bounds: bool | None,
    max_programs: int | None,
    tensors: range | None,
) -> None:
    require(
        isinstance(pool, StatePool),
        "pool",
        lambda: f"must be a StatePool, got {type(pool).__name__}",
        ArgumentTypeError,
    )
    with _device_guard(pool.device):
        plan = check_state_transfer(
            pool, slot_ids, staging, scatter=not gather, check_bounds=check_bounds, tensors=tensors
        )
        _check_max_programs(max_programs)
        chosen = resolve_backend(backend, pool.device.type == "cuda")
        with nvtx_range("gather_state" if gather else "scatter_state"):
            _run(plan, gather=gather, backend=chosen, max_programs=max_programs)


def gather_state(
    pool: StatePool,
    slot_ids: torch.Tensor | list[int],
    staging: torch.Tensor,
    *,
    backend: str = "auto",
    check_bounds: bool | None = None,
    max_programs: int | None = None,
    tensors: range | None = None,
) -> None:
    """Device to host: ``staging[i]`` gets the snapshot of state slot ``slot_ids[i]``, one launch for every tensor.

    Args:
        pool: the state pool (:class:`StatePool`).
        slot_ids: int32/int64 ``[num_ids]`` state slots (any 1-D view, on the pool's device or
            CPU) or a list of ints; a slot may repeat.
        staging: uint8 ``[num_ids, pool.snapshot_bytes]``, contiguous: pinned host memory for a
            CUDA pool, or a tensor on the pool's device.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        check_bounds: check ids that live on the device (a device sync); default on for CPU
            pools, off for CUDA pools. Ids given on CPU are always checked.
        max_programs: cap on the Triton grid (``None`` = the KV kernel's default).
        tensors: a ``range`` of tensor indices to move alone (e.g. ``pool.layers[l]``, for
            layer-by-layer loading), each at its columns of the full snapshot; ``None`` = all.

    Raises:
        ArgumentTypeError, DeviceMismatchError, InvalidArgumentError: from validation, before
            anything is written (:func:`kvstage.kernels.state_layout.check_state_transfer`);
            InvalidArgumentError also for a bad ``backend`` or ``max_programs``.
        BackendUnavailableError: ``backend="triton"`` where Triton cannot run.
    """
    _copy(
        pool,
        slot_ids,
        staging,
        gather=True,
        backend=backend,
        check_bounds=check_bounds,
        max_programs=max_programs,
        tensors=tensors,
    )


def scatter_state(
    staging: torch.Tensor,
    pool: StatePool,
    slot_ids: torch.Tensor | list[int],
    *,
    backend: str = "auto",
    check_bounds: bool | None = None,
    max_programs: int | None = None,
    tensors: range | None = None,
) -> None:
    """Host to device: state slot ``slot_ids[i]`` gets the snapshot ``staging[i]``; the inverse of :func:`gather_state`.

    No slot may repeat (its content would be unspecified): an expanded view is rejected, and
    repeated values wherever the ids are checked. ``tensors=pool.layers[l]`` loads one layer's
    state (the rest of the snapshot is not read), so loading can overlap the forward pass.

    Raises:
        As :func:`gather_state`; InvalidArgumentError also for a repeated slot.
    """
    _copy(
        pool,
        slot_ids,
        staging,
        gather=False,
        backend=backend,
        check_bounds=check_bounds,
        max_programs=max_programs,
        tensors=tensors,
    )


def gather_state_async(
    pool: StatePool,
    slot_ids: torch.Tensor | list[int],
    staging: torch.Tensor,
    *,
    stream: "torch.cuda.Stream | None",
    after: "torch.cuda.Event | torch.cuda.Stream | None" = None,
    **options: object,
) -> CopyHandle:
    """:func:`gather_state` on ``stream`` after the producer (see :func:`kvstage.kernels.launch_after`);
    ``options`` are its keyword arguments. Do not read or reuse ``staging`` before the handle completes."""
    return launch_after(
        lambda: gather_state(pool, slot_ids, staging, **options),  # type: ignore[arg-type]
        stream=stream,
        after=after,
        keep_alive=(slot_ids, staging),
    )


def scatter_state_async(
    staging: torch.Tensor,
    pool: StatePool,
    slot_ids: torch.Tensor | list[int],
    *,
    stream: "torch.cuda.Stream | None",
    after: "torch.cuda.Event | torch.cuda.Stream | None" = None,
    **options: object,
) -> CopyHandle:
    """:func:`scatter_state` on ``stream`` after the producer; the consumer must wait for the handle
    (``handle.wait()`` on its stream) before reading the state, and ``staging`` must not change before then."""
    return launch_after(
        lambda: scatter_state(staging, pool, slot_ids, **options),  # type: ignore[arg-type]
        stream=stream,
        after=after,
        keep_alive=(slot_ids, staging),
    )


def warm_up_state(pool: StatePool, *, backend: str = "auto") -> int:
    """Compile the state kernel's variants for ``pool`` and build its tables ahead of the hot path.

    Returns:
        The variants compiled (0 for the torch backend and under the interpreter).

    Raises:
        ArgumentTypeError: ``pool`` is not a :class:`StatePool`.
        InvalidArgumentError: a bad ``backend``; BackendUnavailableError: ``"triton"`` where it cannot run.
    """
    require(
        isinstance(pool, StatePool),
        "pool",
        lambda: f"must be a StatePool, got {type(pool).__name__}",
        ArgumentTypeError,
    )
    if resolve_backend(backend, pool.device.type == "cuda") != "triton":
        return 0
    from kvstage.kernels import triton_state

    with _device_guard(pool.device):
        return triton_state.warm_up_state(pool)
