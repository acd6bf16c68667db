"""RowCopies: many host-memory copies of whole rows, split between plain threads.

A worker thread's ``torch`` copies of many 1 MiB rows run about half as fast as the same copies
on the main thread (its OpenMP team does not stay warm between the small parallel regions), and
``torch.set_num_threads`` is process-wide. Here each thread copies its share of the rows with
``numpy.copyto`` (one single-threaded ``memcpy`` a row, the GIL released): the caller's thread
takes one share, ``threads - 1`` helper threads the others.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch

from kvstage.errors import is_int, require

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
            pairs: ``(target, source)``: contiguous CPU tensors of the same dtype and shape (the
                caller's rows and page slices: checked by the caller, not here), targets not
                overlapping each other nor any source.

        Raises:
            whatever a copy raised (the first share's, after every share ended).
        """
        arrays = [(target.numpy(), source.numpy()) for target, source in pairs]
        if self._helpers is None or len(arrays) < 2:
            _copy_share(arrays, 0, 1)
            return
        shares = min(self.threads, len(arrays))
        futures = [self._helpers.submit(_copy_share, arrays, index, shares) for index in range(1, shares)]
        try:
            _copy_share(arrays, 0, shares)
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


def _copy_share(arrays: list[tuple[np.ndarray, np.ndarray]], first: int, step: int) -> None:
    for target, source in arrays[first::step]:
        np.copyto(target, source)
