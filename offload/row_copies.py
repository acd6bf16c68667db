"""RowCopies: many host-memory copies of whole rows, split between plain threads.

A worker thread's ``torch`` copies of many 1 MiB rows run about half as fast as the same copies
on the main thread (its OpenMP team does not stay warm between the small parallel regions), and
``torch.set_num_threads`` is process-wide. Here the rows are checked once
(:func:`kvstage.kernels.host_copy.plan_rows`) and each thread copies its share in one
:func:`~kvstage.kernels.host_copy.run_plan` call (streaming stores, the GIL released: glibc's
``memcpy`` of a 1 MiB row does not stream): the caller's thread takes one share, ``threads - 1``
helper threads the others.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from kvstage.errors import is_int, require
from kvstage.kernels.host_copy import RowPlan, plan_rows, run_plan

__all__ = ["RowCopies"]


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
            pairs: ``(target, source)``: contiguous CPU tensors of the same byte size (the
                caller's rows and page slices), targets not overlapping each other nor any
                source.

        Raises:
            InvalidArgumentError: a pair breaks a rule above (:func:`~kvstage.kernels.host_copy.plan_rows`;
                nothing is copied).
            whatever a share's copy raised (the first share's, after every share ended).
        """
        self.copy_plan(plan_rows([target for target, _ in pairs], [source for _, source in pairs]))

    def copy_plan(self, plan: RowPlan) -> None:
        """Copy a checked batch (:func:`~kvstage.kernels.host_copy.plan_rows`), its rows split
        between the threads; returns when every row is copied.

        Raises:
            whatever a share's copy raised (the first share's, after every share ended).
        """
        rows = len(plan.sizes)
        if self._helpers is None or rows < 2:
            run_plan(plan)
            return
        shares = min(self.threads, rows)
        futures = [self._helpers.submit(run_plan, plan, index, shares) for index in range(1, shares)]
        try:
            run_plan(plan, 0, shares)
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
