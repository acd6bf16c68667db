"""Host-to-host copies of many rows in one call, with streaming stores.

glibc's ``memcpy`` streams (non-temporal stores, no read-for-ownership of the target) only above
``glibc.cpu.x86_non_temporal_threshold`` (192 MiB on a 32 MiB-L3 EPYC), so a loop of 1 MiB row
copies (``numpy.copyto``, ``copy_``) runs ~1.7x slower than one large copy of the same bytes, and
an engine cannot set glibc tunables after start. :func:`copy_rows` checks a batch of rows, then
copies all of them in one call of the optional C extension ``kvstage.kernels._host_copy``
(``kernels/_host_copy.c``: SSE2 streaming stores for rows of at least ``STREAM_MIN_BYTES``, the GIL
released for the batch). Without the extension (not built, or ``KVSTAGE_PURE_PYTHON_HOST_COPY``
set) each row is one ``memmove`` (what ``numpy.copyto`` does for contiguous bytes), the GIL
released per row. :func:`describe_host_copy` (and ``kvstage info``) says which runs.

:func:`plan_rows` and :func:`run_plan` split the work for callers that copy one batch on several
threads (:class:`kvstage.offload.row_copies.RowCopies`): check once, then one call a share.
"""

from __future__ import annotations

import ctypes
import importlib
import os
from types import ModuleType
from typing import NamedTuple, NoReturn, Sequence

import numpy as np
import torch

from kvstage.errors import ArgumentTypeError, DeviceMismatchError, InvalidArgumentError, require

__all__ = ["PURE_PYTHON_ENV", "RowPlan", "copy_rows", "describe_host_copy", "plan_addresses", "plan_rows", "run_plan"]

PURE_PYTHON_ENV = "KVSTAGE_PURE_PYTHON_HOST_COPY"


def _load_compiled() -> tuple[ModuleType | None, str]:
    """``(kvstage.kernels._host_copy or None, why it is not used)``."""
    if os.environ.get(PURE_PYTHON_ENV, "").strip().lower() not in ("", "0", "false", "no"):
        return None, f"{PURE_PYTHON_ENV} is set"
    try:
        return importlib.import_module("kvstage.kernels._host_copy"), ""
    except ImportError as exc:  # the optional extension was not built (no compiler)
        return None, f"kvstage.kernels._host_copy not built: {exc}"


_compiled, _why_fallback = _load_compiled()


def describe_host_copy() -> str:
    """How :func:`copy_rows` copies here, one line (for ``kvstage info``): ``"compiled (SSE2
    streaming stores from 4096-byte rows)"``, or ``"memmove per row (<why>)"``."""
    if _compiled is None:
        return f"memmove per row ({_why_fallback})"
    return f"compiled ({_compiled.LIBRARY} from {_compiled.STREAM_MIN_BYTES}-byte rows)"


class RowPlan(NamedTuple):
    """A checked batch of row copies (from :func:`plan_rows`).

    Attributes:
        targets, sources: ``[rows]`` uint64, each row's target and source address.
        sizes: ``[rows]`` uint64, each row's bytes.
        keep: the arrays and tensors the addresses point into (kept alive by the plan).
    """

    targets: np.ndarray
    sources: np.ndarray
    sizes: np.ndarray
    keep: tuple


def _span(row: object, side: str, index: int, writable: bool) -> tuple[int, int]:
    """``(address, bytes)`` of one row: a contiguous CPU tensor or numpy array (the checks that
    pass first, cheaply: a batch holds thousands of rows; :func:`_refuse` says which failed)."""
    if isinstance(row, torch.Tensor):
        if row.is_cpu and row.layout is torch.strided and row.is_contiguous():
            return row.data_ptr(), row.nbytes
    elif isinstance(row, np.ndarray):
        flags = row.flags
        if flags.c_contiguous and (flags.writeable or not writable) and not row.dtype.hasobject:
            return row.__array_interface__["data"][0], row.nbytes
    _refuse(row, f"{side}[{index}]", writable)


def _refuse(row: object, argument: str, writable: bool) -> NoReturn:
    """Raise the error naming the rule ``row`` breaks (see :func:`_span`)."""
    if isinstance(row, torch.Tensor):
        require(
            row.is_cpu,
            argument,
            lambda: f"must be a CPU tensor (a host-to-host copy), got device {row.device}",
            DeviceMismatchError,
        )
        require(row.layout is torch.strided, argument, lambda: f"must be a strided tensor, got layout {row.layout}")
        raise InvalidArgumentError(f"{argument}: must be contiguous, got strides {row.stride()}")
    if isinstance(row, np.ndarray):
        require(row.flags.c_contiguous, argument, lambda: f"must be C-contiguous, got strides {row.strides}")
        require(
            not row.dtype.hasobject,
            argument,
            lambda: f"must hold plain values, not Python objects (dtype {row.dtype})",
        )
        raise InvalidArgumentError(f"{argument}: must be writable (a copy's target), got a read-only array")
    raise ArgumentTypeError(f"{argument}: must be a torch.Tensor or numpy.ndarray, got {type(row).__name__}")


def _overlap(starts: np.ndarray, ends: np.ndarray, is_target: np.ndarray) -> tuple[int, int] | None:
    """Indices ``(i, j)`` into the spans of a target ``i`` and another span ``j`` sharing a byte
    (sources may share bytes with each other), or None. Empty spans never overlap."""
    live = np.flatnonzero(ends > starts)
    if not len(live):
        return None
    order = live[np.argsort(starts[live], kind="stable")]
    s, e, t = starts[order], ends[order], is_target[order]
    # The furthest end of the spans before each one (all of them; the targets among them).
    none = np.zeros(1, dtype=np.uint64)
    before_all = np.concatenate((none, np.maximum.accumulate(e)[:-1]))
    before_target = np.concatenate((none, np.maximum.accumulate(np.where(t, e, none))[:-1]))
    bad = np.flatnonzero(np.where(t, s < before_all, s < before_target))
    if not len(bad):
        return None
    k = int(bad[0])
    earlier = np.flatnonzero((e[:k] > s[k]) & (t[:k] | t[k]))
    i, j = int(order[k]), int(order[int(earlier[0])])
    return (i, j) if is_target[i] else (j, i)


def plan_rows(targets: Sequence, sources: Sequence) -> RowPlan:
    """Check a batch of row copies and take their addresses, writing nothing.

    Args:
        targets: rows written: contiguous CPU ``torch.Tensor`` or C-contiguous writable
            ``numpy.ndarray`` (any dtype and shape: a row is its bytes).
        sources: as many rows read, the same kinds (read-only arrays allowed); ``sources[i]``
            has as many bytes as ``targets[i]``. No target may share a byte with another
            target or any source (sources may share bytes with each other).

    Returns:
        The :class:`RowPlan`, for :func:`run_plan`.

    Raises:
        ArgumentTypeError: a row that is neither a tensor nor an array; ``targets`` or
            ``sources`` not a sequence.
        DeviceMismatchError: a row on a device other than the CPU.
        InvalidArgumentError: a non-contiguous row, a read-only target, a pair of different
            byte sizes, different counts of targets and sources, overlapping rows.
    """
    for name, rows in (("targets", targets), ("sources", sources)):
        require(
            isinstance(rows, Sequence) and not isinstance(rows, (str, bytes)),
            name,
            lambda: f"must be a sequence of tensors or arrays, got {type(rows).__name__}",
            ArgumentTypeError,
        )
    require(
        len(targets) == len(sources),
        "sources",
        lambda: f"must hold as many rows as targets ({len(targets)}), got {len(sources)}",
    )
    count = len(targets)
    target_addresses, source_addresses, sizes = [], [], []
    for index in range(count):
        target_address, target_bytes = _span(targets[index], "targets", index, True)
        source_address, source_bytes = _span(sources[index], "sources", index, False)
        if target_bytes != source_bytes:
            raise InvalidArgumentError(
                f"sources[{index}]: must have as many bytes as targets[{index}] ({target_bytes}), got {source_bytes}"
            )
        target_addresses.append(target_address)
        source_addresses.append(source_address)
        sizes.append(target_bytes)
    return plan_addresses(target_addresses, source_addresses, sizes, (tuple(targets), tuple(sources)))


def plan_addresses(
    targets: list[int], sources: list[int], sizes: list[int], keep: tuple, *, check_overlap: bool = True
) -> RowPlan:
    """:func:`plan_rows` for a caller that took its rows' addresses itself (checked rows it
    holds: contiguous host memory, ``sizes[i]`` bytes at ``targets[i]`` and at ``sources[i]``):
    only the overlap rule is checked here, unless ``check_overlap`` is False (targets the caller
    owns alone, disjoint from each other and every source: a store's own buffers). ``keep``
    holds what the addresses point into.

    Raises:
        InvalidArgumentError: a target shares a byte with another target or a source.
    """
    count = len(targets)
    spans = np.array((targets, sources, sizes), dtype=np.uint64).reshape(3, count)
    if not check_overlap:
        return RowPlan(spans[0], spans[1], spans[2], keep)
    starts = np.concatenate((spans[0], spans[1]))
    ends = starts + np.concatenate((spans[2], spans[2]))
    clash = _overlap(starts, ends, np.arange(2 * count) < count)
    if clash is not None:
        names = [f"targets[{i}]" if i < count else f"sources[{i - count}]" for i in clash]
        raise InvalidArgumentError(f"{names[0]}: must not share bytes with another row, but overlaps {names[1]}")
    return RowPlan(spans[0], spans[1], spans[2], keep)


def run_plan(plan: RowPlan, first: int = 0, step: int = 1) -> None:
    """Copy the rows ``first, first + step, ...`` of a checked plan (one C call, or one
    ``memmove`` a row without the extension); the GIL is released while bytes move."""
    targets, sources, sizes = plan.targets[first::step], plan.sources[first::step], plan.sizes[first::step]
    if _compiled is not None:
        if step != 1:
            targets, sources, sizes = map(np.ascontiguousarray, (targets, sources, sizes))
        _compiled.copy_rows(targets, sources, sizes)
        return
    for target, source, size in zip(targets.tolist(), sources.tolist(), sizes.tolist()):
        ctypes.memmove(target, source, size)


def copy_rows(targets: Sequence, sources: Sequence) -> None:
    """Copy each ``sources[i]`` into ``targets[i]`` (host memory, byte for byte), the whole
    batch in one call; checked first (:func:`plan_rows`), so bad input writes nothing.

    Args:
        targets, sources: as in :func:`plan_rows`.

    Raises:
        ArgumentTypeError, DeviceMismatchError, InvalidArgumentError: as :func:`plan_rows`.
    """
    run_plan(plan_rows(targets, sources))
