"""The public gather (D2H) and scatter (H2D): validate, pick the backend and mode, launch.

``backend``: ``"auto"`` (native Triton on CUDA, the Triton interpreter on CPU under
``TRITON_INTERPRET=1``, else the torch reference), ``"triton"`` or ``"torch"``; see
:mod:`kvstage.kernels.backend`.

``mode``:

* ``"kernel"``: the Triton kernel reads the pool and writes pinned host memory directly
  (zero-copy over PCIe), one launch for every layer.
* ``"staged"``: the kernel gathers into a compact device buffer, then one
  ``cudaMemcpyAsync`` per run of consecutive host pages moves it on the copy engine (scatter:
  the reverse). Costs a device buffer of the batch's bytes; leaves the SMs to the forward
  pass during the PCIe part. On CPU it runs the same two steps (the buffer is a CPU tensor),
  which only serves to test it.

Every call runs on the current stream of the pool's device, with that device made current
for the call (wrap it in :mod:`kvstage.kernels.streams` to run it on a side stream after the
producer's event). Nothing on the way to the launch syncs the device: index tensors that live
on the device are never read on the host (unless ``check_bounds`` asks for it), and CPU ones
reach the device through pinned memory.
"""

from __future__ import annotations

import contextlib

import torch

from kvstage.errors import ArgumentTypeError, is_int, require
from kvstage.kernels.backend import resolve_backend
from kvstage.kernels.layout import Transfer, check_transfer, copy_runs, split_staged
from kvstage.kernels.pool import KVPool
from kvstage.kernels.reference import run_gather_torch, run_scatter_torch
from kvstage.nvtx_ranges import nvtx_range

__all__ = ["MODES", "gather", "scatter", "warm_up"]

MODES = ("kernel", "staged")


def _check_mode(mode: object, max_programs: object) -> None:
    require(mode in MODES, "mode", f"must be one of {MODES}, got {mode!r}")
    require(
        max_programs is None or (is_int(max_programs) and max_programs >= 1),
        "max_programs",
        f"must be None or an int >= 1, got {max_programs!r}",
    )


def _device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` the current CUDA device for one copy; nothing for a CPU pool.

    A Triton launch, torch's allocations and ``non_blocking`` copies use the *current*
    device's current stream; with another device current, the kernel would be queued there
    with this pool's pointers (CUDA: a kernel runs on the device of the stream it is launched
    on; PyTorch: ``torch.cuda.device`` sets the device for the enclosed calls).
    """
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check_pool(pool: object) -> None:
    require(isinstance(pool, KVPool), "pool", lambda: f"must be a KVPool, got {type(pool).__name__}", ArgumentTypeError)


def _execute(plan: Transfer, *, gather: bool, backend: str, max_programs: int | None) -> None:
    """Run one validated copy on ``backend`` (``"triton"`` or ``"torch"``)."""
    if backend == "torch":
        (run_gather_torch if gather else run_scatter_torch)(plan)
    else:
        from kvstage.kernels import triton_copy  # imported late: importing triton is slow and optional

        triton_copy.launch(plan, gather=gather, max_programs=max_programs)


def _staged(plan: Transfer, *, gather: bool, backend: str, max_programs: int | None) -> None:
    """``mode="staged"``: kernel <-> compact buffer on the pool's device, ``copy_`` <-> staging.

    Reads ``host_page_ids`` on the host to find runs: they must be given on CPU (see
    :func:`kvstage.kernels.layout.split_staged`).
    """
    inner, outer = split_staged(plan)
    if gather:
        _execute(inner, gather=True, backend=backend, max_programs=max_programs)
        copy_runs(outer, inner.staging, to_staging=True)
    else:
        copy_runs(outer, inner.staging, to_staging=False)
        _execute(inner, gather=False, backend=backend, max_programs=max_programs)


def _run(plan: Transfer, *, gather: bool, backend: str, mode: str, max_programs: int | None) -> None:
    if mode == "staged":
        _staged(plan, gather=gather, backend=backend, max_programs=max_programs)
    else:
        _execute(plan, gather=gather, backend=backend, max_programs=max_programs)


def warm_up(pool: KVPool, page_size: int, *, backend: str = "auto") -> int:
    """Prepare copies of ``pool`` at ``page_size`` ahead of the hot path; call once after building the pool.

    With native Triton it compiles every kernel variant those copies use (both directions,
    int32 and int64 indices, any batch size, layout or layer: seconds of compiling that the
    first copies would otherwise pay) and builds the pool's offset table (an H2D copy).

    Args:
        pool: the device pool.
        page_size: tokens per page of the copies to come.
        backend: as :func:`gather`; nothing to prepare for ``"torch"``.

    Returns:
        The number of kernel variants compiled (0 for the torch backend and under the interpreter).

    Raises:
        ArgumentTypeError: ``pool`` is not a :class:`KVPool`.
        InvalidArgumentError: ``page_size`` is not a positive int; a bad ``backend``.
        BackendUnavailableError: ``backend="triton"`` where Triton cannot run.
    """
    _check_pool(pool)
    require(is_int(page_size) and page_size >= 1, "page_size", lambda: f"must be a positive int, got {page_size!r}")
    if resolve_backend(backend, pool.device.type == "cuda") != "triton":
        return 0
    from kvstage.kernels import triton_copy

    with _device_guard(pool.device):
        return triton_copy.warm_up(pool, page_size)


def gather(
    pool: KVPool,
    staging: torch.Tensor,
    slot_indices: torch.Tensor,
    host_page_ids: torch.Tensor,
    *,
    page_size: int,
    layout: str = "page_first",
    backend: str = "auto",
    mode: str = "kernel",
    check_bounds: bool | None = None,
    max_programs: int | None = None,
) -> None:
    """Device to host: copy ``num_pages`` pages of every layer from ``pool`` into ``staging``, one launch.

    Token ``j`` of page ``i`` (device slot ``slot_indices[i * page_size + j]``) of every
    (part, layer) lands at host page ``host_page_ids[i]``, token ``j``.

    Args:
        pool: the device pool (:class:`KVPool`).
        staging: contiguous ``staging_shape(pool, num_host_pages, page_size, layout)`` of
            ``pool.dtype``: pinned host memory for a CUDA pool, or a tensor on the pool's device.
        slot_indices: int32/int64 ``[num_pages * page_size]`` device slots (a ``req_to_token``
            slice; the slots of a page need not be contiguous), on the pool's device or CPU;
            any 1-D view (read by its strides; expanded: one slot for every token).
        host_page_ids: int32/int64 ``[num_pages]`` distinct host pages, on the pool's device
            or CPU; any 1-D view (read by its strides).
        page_size: tokens per page.
        layout: ``"page_first"`` or ``"layer_first"``.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        mode: ``"kernel"`` or ``"staged"`` (see the module doc).
        check_bounds: check slots (and device-resident host page ids) against their ranges;
            default on for CPU pools, off for CUDA pools (it costs a device sync: the one
            sync a caller can ask for).
        max_programs: cap on the Triton grid (programs loop over the work); ``None`` = the
            launch heuristic's default, small so the forward pass keeps its SMs.

    An empty batch (no pages) is validated and launches nothing.

    Raises:
        ArgumentTypeError, DeviceMismatchError, InvalidArgumentError: from validation,
            before anything is written (see :func:`kvstage.kernels.layout.check_transfer`);
            InvalidArgumentError also for a bad ``mode``, ``backend`` or ``max_programs``, and
            for ``host_page_ids`` on the device in a staged copy (``mode="staged"``, or the
            torch backend with host staging for a CUDA pool), whose runs are read on the host.
        BackendUnavailableError: ``backend="triton"`` where Triton cannot run.
    """
    _check_pool(pool)
    with _device_guard(pool.device):
        plan = check_transfer(
            pool, staging, slot_indices, host_page_ids, page_size=page_size, layout=layout, check_bounds=check_bounds
        )
        _check_mode(mode, max_programs)
        chosen = resolve_backend(backend, pool.device.type == "cuda")
        if plan.num_pages == 0:
            return
        with nvtx_range("gather"):
            _run(plan, gather=True, backend=chosen, mode=mode, max_programs=max_programs)


def scatter(
    staging: torch.Tensor,
    pool: KVPool,
    slot_indices: torch.Tensor,
    host_page_ids: torch.Tensor,
    *,
    page_size: int,
    layout: str = "page_first",
    layer: int | None = None,
    backend: str = "auto",
    mode: str = "kernel",
    check_bounds: bool | None = None,
    max_programs: int | None = None,
) -> None:
    """Host to device: the inverse of :func:`gather`, for every layer or one ``layer``.

    Args:
        layer: ``None`` moves every layer in one launch; an int moves that layer (both parts),
            so that loading can overlap the forward pass layer by layer.
        Others: as :func:`gather`. No slot may repeat in ``slot_indices`` (its content would
        be unspecified): an expanded view is rejected, and repeated values are rejected where
        the slots are checked (``check_bounds``).

    Raises:
        As :func:`gather`; also InvalidArgumentError for ``layer`` out of range.
    """
    _check_pool(pool)
    with _device_guard(pool.device):
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
        _check_mode(mode, max_programs)
        chosen = resolve_backend(backend, pool.device.type == "cuda")
        if plan.num_pages == 0:
            return
        with nvtx_range("scatter"):
            _run(plan, gather=False, backend=chosen, mode=mode, max_programs=max_programs)
