"""RowCopies: many host-memory copies of whole rows, split between plain threads.

A worker thread's ``torch`` copies of many 1 MiB rows run about half as fast as the same copies
on the main thread (its OpenMP team does not stay warm between the small parallel regions), and
``torch.set_num_threads`` is process-wide. Here the rows are checked once
(:func:`kvstage.kernels.host_copy.plan_rows`) and each thread copies its share in one
:func:`~kvstage.kernels.host_copy.run_plan` call (streaming stores, the GIL released: glibc's
``memcpy`` of a 1 MiB row does not stream): the caller's thread takes one share, ``threads - 1``
helper threads the others. A caller that builds the addresses itself from memory it owns hands
over a :class:`~kvstage.kernels.host_copy.RowPlan` (:meth:`RowCopies.copy_plan`).

Shares are consecutive rows of equal bytes (a row across a boundary is cut there): rows of
unequal sizes taken in turns left one thread with nearly all the bytes (a state snapshot's 64 KiB
conv rows alternate with its 2 MiB recurrent rows). A batch under :data:`ONE_THREAD_BYTES` stays
on the caller's thread: waking a helper costs more than it saves, and each hand-off needs the
GIL, which another thread's Python work (a store's put) holds for up to the switch interval
(a sliding window's two pages, 3 MiB: 0.17 ms on one thread, 0.31 on two, alone; ~2.3 ms on two
beside a put).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch

from kvstage.errors import is_int, require
from kvstage.kernels.host_copy import RowPlan, plan_rows, run_plan

__all__ = ["ONE_THREAD_BYTES", "RowCopies"]

ONE_THREAD_BYTES = 4 << 20


class RowCopies:
    """Copies of ``(target, source)`` tensor pairs between host buffers, on ``threads`` threads.

    Args:
        threads: threads that copy at once (>= 1; the caller's thread is one of them); None:
            ``torch.get_num_threads()``, the threads one ``copy_`` uses.

    Raises:
        InvalidArgumentError: ``threads`` is not an int >= 1.
    """

    def __init__(self, threads: int | None = None) -> None:
        threads = torch.get_num_threads() if threads is None else threads
        require(is_int(threads) and threads >= 1, "threads", lambda: f"must be an int >= 1 or None, got {threads!r}")
        self.threads = threads
        self._helpers = ThreadPoolExecutor(threads - 1, thread_name_prefix="kvstage-rows") if threads > 1 else None

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each ``source`` into its ``target``; returns when every pair is copied.

        Args:
            pairs: ``(target, source)``: contiguous CPU tensors (or numpy arrays) of the same
                byte size (the caller's rows and page slices), targets not overlapping each
                other nor any source.

        Raises:
            InvalidArgumentError: a pair breaks a rule above (:func:`~kvstage.kernels.host_copy.plan_rows`;
                nothing is copied).
            whatever a share's copy raised (the first share's, after every share ended).
        """
        self.copy_plan(plan_rows([target for target, _ in pairs], [source for _, source in pairs]))

    def copy_plan(self, plan: RowPlan) -> None:
        """Copy the rows of ``plan`` (checked by :func:`plan_rows`, or built by a caller from
        addresses of memory it holds alive in ``plan.keep``); returns when every row is copied.

        Raises:
            whatever a share's copy raised (the first share's, after every share ended).
        """
        total = int(plan.sizes.sum()) if len(plan.sizes) else 0
        if self._helpers is None or total < ONE_THREAD_BYTES:
            run_plan(plan)
            return
        first, *others = _shares(plan, total, self.threads)
        futures = []
        try:
            for share in others:  # a submit that raises (closed meanwhile) still waits for those queued
                futures.append(self._helpers.submit(run_plan, share))
            run_plan(first)
        finally:
            for future in futures:
                future.exception()  # wait for every share, so no copy runs on after a failure returns
        for future in futures:
            future.result()

    def close(self) -> None:
        """Stop the helper threads (after the copies in flight). Idempotent."""
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)
            self._helpers = None


def _shares(plan: RowPlan, total: int, count: int) -> list[RowPlan]:
    """``plan`` in at most ``count`` runs of consecutive rows of about ``total / count`` bytes
    each, a row across a boundary cut there (its head ends one share, its tail starts the next)."""
    size = -(-total // count)
    ends = np.cumsum(plan.sizes, dtype=np.uint64)  # each row's end, in bytes of the batch
    shares = []
    start_row, start_cut = 0, 0  # the share's first row, and the bytes of it earlier shares took
    for index in range(1, count + 1):
        boundary = min(index * size, total)
        row = int(np.searchsorted(ends, boundary, side="left"))  # the row holding byte boundary - 1
        if row >= len(ends):
            row = len(ends) - 1
        rows = slice(start_row, row + 1)
        targets, sources, sizes = (a[rows].copy() for a in (plan.targets, plan.sources, plan.sizes))
        row_start = int(ends[row] - plan.sizes[row])
        tail = boundary - row_start  # bytes of the last row in this share (and earlier ones)
        if start_cut:
            targets[0] += np.uint64(start_cut)
            sources[0] += np.uint64(start_cut)
            sizes[0] -= np.uint64(start_cut)
        sizes[-1] -= np.uint64(int(plan.sizes[row]) - tail)
        shares.append(RowPlan(targets, sources, sizes, plan.keep))
        if boundary >= total:
            break
        start_row, start_cut = (row, tail) if tail < int(plan.sizes[row]) else (row + 1, 0)
    return [share for share in shares if int(share.sizes.sum())]
