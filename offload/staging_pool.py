"""``StagingPool``: host staging tensors of a hybrid model's component copies, reused.

A component's entries (a state snapshot, a sliding window's or a sidecar's pages) move through
host memory on their way to and from a store, one staging tensor per copy. A fresh tensor costs
more than the copy itself: pinned memory is registered with the driver, and plain memory is
faulted in and zero-filled by the kernel on first touch. So a copy takes a buffer that an
earlier copy gave back, and allocates only when none is free (as the host page pool does for
the full-attention pages).

Buffers are kept by ``(rows, row shape, dtype)`` with the rows rounded up to a power of two, so
runs of a few more or fewer pages share buffers; a copy uses the buffer's leading rows.
"""

from __future__ import annotations

import threading

import torch

from kvstage.errors import is_int, require

__all__ = ["DEFAULT_STAGING_BYTES", "StagingPool"]

DEFAULT_STAGING_BYTES = 2 << 30  # free buffers kept at most (2 GiB)


class StagingPool:
    """Reused host staging buffers (module doc).

    Args:
        pinned: allocate pinned (page-locked) memory, for asynchronous device copies.
        max_bytes: bytes of free buffers kept; a buffer given back past it is dropped.

    Raises:
        InvalidArgumentError: ``max_bytes`` is not an int >= 0.

    Thread-safe: a reader thread takes buffers while the manager's thread gives them back.
    """

    def __init__(self, pinned: bool, max_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        require(is_int(max_bytes) and max_bytes >= 0, "max_bytes", lambda: f"must be an int >= 0, got {max_bytes!r}")
        self.pinned, self.max_bytes = pinned, max_bytes
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()
        self.allocated = 0  # buffers allocated (a steady state allocates none)

    @property
    def free_bytes(self) -> int:
        """Bytes of the free buffers kept now."""
        return self._free_bytes

    def take(self, rows: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous buffer ``[capacity, *row_shape]`` of ``dtype`` with ``capacity >= rows``
        (``rows`` rounded up to a power of two): a free one, else a new one. Use its first
        ``rows`` rows; give the buffer itself back with :meth:`give` once no copy uses it."""
        key = (1 << max(rows - 1, 0).bit_length(), tuple(row_shape), dtype)
        with self._lock:
            free = self._free.get(key)
            if free:
                buffer = free.pop()
                self._free_bytes -= buffer.nbytes
                return buffer
            self.allocated += 1
        return torch.empty((key[0], *key[1]), dtype=dtype, pin_memory=self.pinned)

    def give(self, buffer: torch.Tensor) -> None:
        """``buffer`` (from :meth:`take`) is free again: no copy reads or writes it any more."""
        key = (buffer.shape[0], tuple(buffer.shape[1:]), buffer.dtype)
        with self._lock:
            if self._free_bytes + buffer.nbytes > self.max_bytes:
                return  # dropped: the pool keeps what a steady state reuses, not every peak
            self._free.setdefault(key, []).append(buffer)
            self._free_bytes += buffer.nbytes
