"""RowCopies: many host-memory copies of whole rows, split between plain threads.

A worker thread's ``torch`` copies of many 1 MiB rows run about half as fast as the same copies
on the main thread (its OpenMP team does not stay warm between the small parallel regions), and
``torch.set_num_threads`` is process-wide. Here each thread copies its share of the rows with
``numpy.copyto`` (one single-threaded ``memcpy`` a row, the GIL released): the caller's thread
takes one share, ``threads - 1`` helper threads the others. Shares are consecutive rows of equal
bytes (a row across a boundary is cut there): rows of unequal sizes taken in turns left one
thread with nearly all the bytes (a state snapshot's 64 KiB conv rows alternate with its 2 MiB
recurrent rows). A batch under :data:`ONE_THREAD_BYTES` stays on the caller's thread (waking a
helper costs more than it saves).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch

from kvstage.errors import is_int, require

__all__ = ["ONE_THREAD_BYTES", "RowCopies"]

ONE_THREAD_BYTES = 256 << 10


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
                dtype and shape (the caller's rows and page slices: checked by the caller, not
                here), targets not overlapping each other nor any source.

        Raises:
            whatever a copy raised (the first share's, after every share ended).
        """
        arrays = [(_array(target), _array(source)) for target, source in pairs]
        total = sum(target.nbytes for target, _ in arrays)
        if self._helpers is None or total < ONE_THREAD_BYTES:
            _copy_share(arrays)
            return
        first, *others = _shares(arrays, total, self.threads)
        futures = [self._helpers.submit(_copy_share, share) for share in others]
        try:
            _copy_share(first)
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


def _array(rows: torch.Tensor | np.ndarray) -> np.ndarray:
    return rows if isinstance(rows, np.ndarray) else rows.numpy()


def _shares(arrays: list[tuple[np.ndarray, np.ndarray]], total: int, count: int) -> list[list]:
    """``arrays`` in ``count`` runs of consecutive rows of about ``total / count`` bytes each, a
    row across a boundary cut there (as flat bytes: the rows are contiguous)."""
    shares: list[list] = [[] for _ in range(count)]
    size = -(-total // count)
    index, room = 0, size
    for target, source in arrays:
        while target.nbytes > room and index < count - 1:
            if room:
                flat_target, flat_source = target.reshape(-1).view(np.uint8), source.reshape(-1).view(np.uint8)
                shares[index].append((flat_target[:room], flat_source[:room]))
                target, source = flat_target[room:], flat_source[room:]
            index, room = index + 1, size
        shares[index].append((target, source))
        room -= target.nbytes
    return [share for share in shares if share]


def _copy_share(arrays: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for target, source in arrays:
        np.copyto(target, source)
