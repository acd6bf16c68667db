"""Host staging layouts and the checks every gather/scatter runs before it touches memory.

Two staging layouts (the names sglang's transfer kernels use):

* ``page_first``: ``[num_host_pages, num_layers, kv_parts, page_size, num_heads, head_dim]``:
  one host page of every layer and part is one contiguous block (one storage object per page).
* ``layer_first``: ``[kv_parts, num_layers, num_host_pages * page_size, num_heads, head_dim]``:
  host page ``h`` is token rows ``h * page_size ... h * page_size + page_size - 1`` of every
  ``[part, layer]`` plane, like the device pool itself.

:func:`check_transfer` validates one call and returns a :class:`Transfer`, the normalized
description that the torch reference and the Triton launcher both execute.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvstage.errors import ArgumentTypeError, DeviceMismatchError, is_int, require
from kvstage.kernels.pool import KVPool

__all__ = [
    "LAYOUTS",
    "Transfer",
    "check_transfer",
    "copy_runs",
    "on_host",
    "page_runs",
    "split_staged",
    "staging_shape",
    "to_device_async",
]

LAYOUTS = ("page_first", "layer_first")
INDEX_DTYPES = (torch.int32, torch.int64)


def on_host(t: torch.Tensor) -> bool:
    """True when ``t``'s values can be read on the host without syncing a device (a CPU tensor).

    The one place that decides it: a tensor for which this is false is never read on the
    host by a copy (no ``.cpu()``, ``.item()``, ``.tolist()``, ``bool()``, ``torch.unique``),
    unless the caller asked for ``check_bounds``.
    """
    return t.device.type == "cpu"


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without blocking the host: the copy is queued on ``device``'s current stream.

    A CPU tensor bound for a CUDA device goes through pinned memory: a ``non_blocking`` copy
    from pageable memory may be synchronous (CUDA runtime API, "API synchronization behavior":
    cudaMemcpyAsync from pageable host memory; PyTorch's "pin_memory() and non_blocking"
    guide). torch's pinned allocator keeps the pinned block until the copy has run, and the
    result, allocated on the stream the copy and the kernel then use, may be dropped right
    after the launch (the caching allocator reuses it only for later work on that stream).
    """
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
    return t.to(device, non_blocking=True)


def _check_page_size(page_size: object) -> None:
    require(
        is_int(page_size) and page_size >= 1,
        "page_size",
        lambda: f"must be a positive int, got {page_size!r}",
    )


def _check_layout(layout: object) -> None:
    require(layout in LAYOUTS, "layout", lambda: f"must be one of {LAYOUTS}, got {layout!r}")


def staging_shape(pool: KVPool, num_host_pages: int, page_size: int, layout: str = "page_first") -> tuple[int, ...]:
    """The shape of a host staging buffer holding ``num_host_pages`` pages of ``pool``.

    Args:
        pool: the device pool whose pages the buffer holds.
        num_host_pages: pages in the buffer (>= 0).
        page_size: tokens per page (>= 1).
        layout: ``"page_first"`` -> ``(num_host_pages, num_layers, kv_parts, page_size, num_heads, head_dim)``;
            ``"layer_first"`` -> ``(kv_parts, num_layers, num_host_pages * page_size, num_heads, head_dim)``.

    Raises:
        ArgumentTypeError: ``pool`` is not a :class:`KVPool`.
        InvalidArgumentError: a negative page count, a page size < 1, an unknown layout.
    """
    require(isinstance(pool, KVPool), "pool", lambda: f"must be a KVPool, got {type(pool).__name__}", ArgumentTypeError)
    require(
        is_int(num_host_pages) and num_host_pages >= 0,
        "num_host_pages",
        lambda: f"must be an int >= 0, got {num_host_pages!r}",
    )
    _check_page_size(page_size)
    _check_layout(layout)
    if layout == "page_first":
        return (num_host_pages, pool.num_layers, pool.kv_parts, page_size, pool.num_heads, pool.head_dim)
    return (pool.kv_parts, pool.num_layers, num_host_pages * page_size, pool.num_heads, pool.head_dim)


@dataclass
class Transfer:
    """One validated gather or scatter, ready to execute.

    Attributes:
        pool: the device pool.
        staging: the staging buffer (contiguous; pinned host, or on the pool's device).
        slot_indices: ``[num_pages * page_size]`` int32/int64 device slot per token, on the pool's
            device (any 1-D view; a copy made here for CPU indices is kept by this object).
        host_page_ids: ``[num_pages]`` int32/int64 host page ids, on the pool's device (any 1-D view).
        page_size: tokens per page.
        layout: ``"page_first"`` or ``"layer_first"``.
        layers: the layers moved, ``range(num_layers)`` or one layer.
        num_host_pages: pages the staging buffer holds.
        host_page_ids_cpu: ``host_page_ids`` as given when :func:`on_host` (readable without a
            sync), else None.
        slot_indices_cpu: ``slot_indices`` as given when :func:`on_host`, else None.
    """

    pool: KVPool
    staging: torch.Tensor
    slot_indices: torch.Tensor
    host_page_ids: torch.Tensor
    page_size: int
    layout: str
    layers: range
    num_host_pages: int
    host_page_ids_cpu: torch.Tensor | None = None
    slot_indices_cpu: torch.Tensor | None = None

    @property
    def num_pages(self) -> int:
        """Pages moved by this call."""
        return self.host_page_ids.numel()

    @property
    def num_tokens(self) -> int:
        """Token rows moved per (part, layer): ``num_pages * page_size``."""
        return self.slot_indices.numel()


def check_index(name: str, t: object, device: torch.device) -> torch.Tensor:
    """Check an index tensor argument: int32/int64, 1-D, on ``device`` or on CPU; return it.

    Raises:
        ArgumentTypeError: not a tensor, or another dtype.
        InvalidArgumentError: not 1-D.
        DeviceMismatchError: on another device than ``device`` and not on CPU.
    """
    require(
        isinstance(t, torch.Tensor), name, lambda: f"must be a torch.Tensor, got {type(t).__name__}", ArgumentTypeError
    )
    assert isinstance(t, torch.Tensor)
    require(t.dtype in INDEX_DTYPES, name, lambda: f"dtype must be int32 or int64, got {t.dtype}", ArgumentTypeError)
    require(t.dim() == 1, name, lambda: f"must be 1-D, got shape {tuple(t.shape)}")
    require(
        t.device == device or t.device.type == "cpu",
        name,
        lambda: f"must be on the pool's device ({device}) or on CPU, got {t.device}",
        DeviceMismatchError,
    )
    return t


def check_staging_buffer(staging: object, device: torch.device, dtype: torch.dtype, dtype_rule: str) -> torch.Tensor:
    """Check a staging argument: a tensor of ``dtype``, pinned host memory for a CUDA pool, else on ``device``.

    ``dtype_rule`` names the rule in the error (e.g. "the pool's torch.bfloat16").

    Raises:
        ArgumentTypeError: not a tensor, or another dtype.
        DeviceMismatchError: pageable host memory for a CUDA pool, or another device.
    """
    require(
        isinstance(staging, torch.Tensor),
        "staging",
        lambda: f"must be a torch.Tensor, got {type(staging).__name__}",
        ArgumentTypeError,
    )
    assert isinstance(staging, torch.Tensor)
    require(
        staging.dtype == dtype,
        "staging",
        lambda: f"dtype must be {dtype_rule}, got {staging.dtype}",
        ArgumentTypeError,
    )
    if device.type == "cuda" and staging.device.type == "cpu":
        # The kernel reads/writes host memory over PCIe through its device address: only
        # page-locked memory has one; pageable memory would fault.
        require(
            staging.is_pinned(),
            "staging",
            "host staging for a CUDA pool must be pinned (torch.empty(..., pin_memory=True))",
            DeviceMismatchError,
        )
    else:
        require(
            staging.device == device,
            "staging",
            lambda: f"must be pinned host memory or on the pool's device ({device}), got {staging.device}",
            DeviceMismatchError,
        )
    return staging


def _check_staging(staging: object, pool: KVPool, page_size: int, layout: str) -> int:
    """Check the staging buffer against the pool; return how many host pages it holds."""
    staging = check_staging_buffer(staging, pool.device, pool.dtype, f"the pool's {pool.dtype}")
    if layout == "page_first":
        names = ("num_host_pages", "num_layers", "kv_parts", "page_size", "num_heads", "head_dim")
        want = (None, pool.num_layers, pool.kv_parts, page_size, pool.num_heads, pool.head_dim)
    else:
        names = ("kv_parts", "num_layers", "num_host_tokens", "num_heads", "head_dim")
        want = (pool.kv_parts, pool.num_layers, None, pool.num_heads, pool.head_dim)
    require(
        staging.dim() == len(names),
        "staging",
        lambda: f"{layout} staging must be [{', '.join(names)}], got shape {tuple(staging.shape)}",
    )
    for dim, (name, expected) in enumerate(zip(names, want)):
        if expected is not None:
            require(
                staging.shape[dim] == expected,
                "staging",
                lambda: (
                    f"dim {dim} ({name}) must be {expected}, got {staging.shape[dim]} (shape {tuple(staging.shape)})"
                ),
            )
    require(staging.is_contiguous(), "staging", "must be contiguous")
    if layout == "page_first":
        return int(staging.shape[0])
    tokens = int(staging.shape[2])
    require(
        tokens % page_size == 0,
        "staging",
        lambda: f"dim 2 (num_host_tokens) must be a multiple of page_size {page_size}, got {tokens}",
    )
    return tokens // page_size


# Up to this many ids, Python's min/max/set on a list beat three torch reductions (~30 us).
_SMALL_INDEX = 256


def _range_and_distinct(ids: torch.Tensor) -> tuple[int, int, int]:
    """``(min, max, number of distinct values)`` of a non-empty 1-D index tensor."""
    if ids.device.type == "cpu" and ids.numel() <= _SMALL_INDEX:
        values = ids.tolist()
        return min(values), max(values), len(set(values))
    return int(ids.min()), int(ids.max()), torch.unique(ids).numel()


def check_transfer(
    pool: KVPool,
    staging: torch.Tensor,
    slot_indices: torch.Tensor,
    host_page_ids: torch.Tensor,
    *,
    page_size: int,
    layout: str = "page_first",
    layer: int | None = None,
    check_bounds: bool | None = None,
    scatter: bool = False,
) -> Transfer:
    """Validate a gather/scatter before anything is written; return the normalized :class:`Transfer`.

    Index tensors may be any 1-D view (strided, with a storage offset, or expanded): the
    copies read them by their strides. Index tensors on CPU for a CUDA pool are copied to the
    device through pinned memory (:func:`to_device_async`: no host sync).

    A scatter must not write one slot twice (its content would be unspecified: on a GPU a
    mix of both rows). An expanded ``slot_indices`` (stride 0, more than one element) is
    rejected in a scatter; repeated values are rejected where the slots are checked
    (``check_bounds``) and are the caller's responsibility otherwise. A gather may read a
    slot more than once.

    Args:
        check_bounds: check every device slot against ``[0, num_slots)`` (a scatter: and that
            none repeats), and host page ids that live on the device. ``None`` = on for a CPU
            pool, off for a CUDA pool, where it reads the indices back to the host (a device
            sync). Host page ids that live on CPU are always checked (no sync needed).
        scatter: the copy writes the pool (``scatter``) rather than the staging buffer.

    Raises:
        ArgumentTypeError: ``pool`` not a :class:`KVPool`; staging dtype differs from the pool's;
            an index tensor that is not a tensor or not int32/int64.
        DeviceMismatchError: staging neither on the pool's device nor (CUDA pool) pinned host
            memory; an index tensor on a third device.
        InvalidArgumentError: bad ``page_size``/``layout``/``layer``; staging shape does not
            match the pool (layers, parts, page size, heads, head_dim) or is not contiguous;
            ``slot_indices`` does not hold ``len(host_page_ids) * page_size`` indices; a host
            page id out of range or repeated (an expanded ``host_page_ids`` repeats one); a
            scatter's ``slot_indices`` expanded; (``check_bounds``) a slot out of range, or
            repeated in a scatter.
    """
    require(isinstance(pool, KVPool), "pool", lambda: f"must be a KVPool, got {type(pool).__name__}", ArgumentTypeError)
    _check_page_size(page_size)
    _check_layout(layout)
    num_host_pages = _check_staging(staging, pool, page_size, layout)
    check_index("slot_indices", slot_indices, pool.device)
    check_index("host_page_ids", host_page_ids, pool.device)
    num_pages = host_page_ids.numel()
    require(
        slot_indices.numel() == num_pages * page_size,
        "slot_indices",
        lambda: (
            f"must hold len(host_page_ids) * page_size = {num_pages} * {page_size} = {num_pages * page_size} indices, got {slot_indices.numel()}"
        ),
    )
    # A stride-0 view of more than one element repeats its value: known without reading it.
    require(
        num_pages <= 1 or host_page_ids.stride(0) != 0,
        "host_page_ids",
        "must not repeat a page id within one call (an expanded view repeats one)",
    )
    require(
        not scatter or slot_indices.numel() <= 1 or slot_indices.stride(0) != 0,
        "slot_indices",
        "must not repeat a slot in a scatter (an expanded view repeats one; the slot's content would be unspecified)",
    )
    if layer is None:
        layers = range(pool.num_layers)
    else:
        require(is_int(layer), "layer", lambda: f"must be None or an int, got {layer!r}", ArgumentTypeError)
        require(0 <= layer < pool.num_layers, "layer", lambda: f"must be in [0, {pool.num_layers}), got {layer}")
        layers = range(layer, layer + 1)
    if check_bounds is None:
        check_bounds = pool.device.type == "cpu"
    if num_pages and (check_bounds or on_host(host_page_ids)):
        low, high, distinct = _range_and_distinct(host_page_ids)
        require(
            0 <= low and high < num_host_pages,
            "host_page_ids",
            lambda: f"must be in [0, {num_host_pages}) (the staging buffer's pages), got min {low} max {high}",
        )
        require(distinct == num_pages, "host_page_ids", "must not repeat a page id within one call")
    if num_pages and check_bounds:
        if scatter:
            low, high, distinct = _range_and_distinct(slot_indices)
        else:
            low, high, distinct = int(slot_indices.min()), int(slot_indices.max()), slot_indices.numel()
        require(
            0 <= low and high < pool.num_slots,
            "slot_indices",
            lambda: f"must be in [0, {pool.num_slots}) (the pool's slots), got min {low} max {high}",
        )
        require(
            distinct == slot_indices.numel(),
            "slot_indices",
            "must not repeat a slot in a scatter (the slot's content would be unspecified)",
        )
    return Transfer(
        pool,
        staging,
        to_device_async(slot_indices, pool.device),
        to_device_async(host_page_ids, pool.device),
        page_size,
        layout,
        layers,
        num_host_pages,
        host_page_ids_cpu=host_page_ids if on_host(host_page_ids) else None,
        slot_indices_cpu=slot_indices if on_host(slot_indices) else None,
    )


def page_runs(host_page_ids: list[int]) -> list[tuple[int, int, int]]:
    """``(first batch page, first host page, length)`` of each run of consecutive host page ids."""
    runs: list[tuple[int, int, int]] = []
    for i, host in enumerate(host_page_ids):
        if runs and runs[-1][1] + runs[-1][2] == host:
            first, start, length = runs[-1]
            runs[-1] = (first, start, length + 1)
        else:
            runs.append((i, host, 1))
    return runs


def copy_runs(plan: Transfer, compact: torch.Tensor, *, to_staging: bool) -> None:
    """Move whole pages between ``compact`` (batch page ``i`` at page ``i``) and ``plan.staging``.

    One ``copy_`` per run of consecutive host pages (page_first; per (part, layer) and run for
    layer_first, whose pages are not contiguous across layers), ``non_blocking`` so that a
    pinned-host <-> device copy is one ``cudaMemcpyAsync`` on the current stream. Only the
    layers of ``plan.layers`` move: for one layer of a page_first buffer that is a strided
    copy, which torch stages through a contiguous host copy (correct, not fast: a per-layer
    scatter should use ``mode="kernel"``).
    """
    ps = plan.page_size
    all_layers = len(plan.layers) == plan.pool.num_layers
    for first, start, length in page_runs(plan.host_page_ids.tolist()):
        if plan.layout == "page_first" and all_layers:
            pairs = [(plan.staging[start : start + length], compact[first : first + length])]
        elif plan.layout == "page_first":
            pairs = [
                (plan.staging[start : start + length, layer], compact[first : first + length, layer])
                for layer in plan.layers
            ]
        else:
            pool = plan.pool
            pairs = [
                (
                    plan.staging[p, layer, start * ps : (start + length) * ps],
                    compact[p, layer, first * ps : (first + length) * ps],
                )
                for p in range(pool.kv_parts)
                for layer in plan.layers
            ]
        for host, device in pairs:
            if to_staging:
                host.copy_(device, non_blocking=True)
            else:
                device.copy_(host, non_blocking=True)


def split_staged(plan: Transfer) -> tuple[Transfer, Transfer]:
    """Split a transfer in two for ``mode="staged"``: ``(inner, outer)``.

    ``inner`` moves the batch between the pool and a new compact buffer on the pool's device
    (``inner.staging``; batch page ``i`` at page ``i``); ``outer`` carries the host page ids on
    the host for :func:`copy_runs` between that buffer and the real staging buffer.

    Raises:
        InvalidArgumentError: ``host_page_ids`` are not readable on the host (:func:`on_host`):
            their runs are found on the host, and reading device ids would sync the device.
    """
    require(
        plan.host_page_ids_cpu is not None,
        "host_page_ids",
        lambda: (
            f"a staged copy (mode='staged', or the torch backend with host staging for a CUDA pool) needs them on CPU, got {plan.host_page_ids.device}: their runs are read on the host, and reading device ids would sync the device"
        ),
    )
    pool = plan.pool
    compact = torch.empty(
        staging_shape(pool, plan.num_pages, plan.page_size, plan.layout), dtype=pool.dtype, device=pool.device
    )
    ordinal = torch.arange(plan.num_pages, dtype=torch.int64, device=pool.device)
    inner = replace(
        plan,
        staging=compact,
        host_page_ids=ordinal,
        num_host_pages=plan.num_pages,
        host_page_ids_cpu=torch.arange(plan.num_pages),
    )
    outer = replace(plan, host_page_ids=plan.host_page_ids_cpu)
    return inner, outer
