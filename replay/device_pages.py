"""The replay engine's device KV pool: which device it lives on, and its pages' free list."""

from __future__ import annotations

from typing import Sequence

import torch

from kvstage.errors import InvalidArgumentError

__all__ = ["DevicePagePool", "pick_device"]


class DevicePagePool:
    """Free-list allocator of the device KV pool's pages (page p holds slots ``[p*ps, (p+1)*ps)``)."""

    def __init__(self, num_pages: int) -> None:
        self.capacity = num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    def alloc(self, n: int) -> list[int] | None:
        """``n`` pages, or None (nothing changed) when fewer are free."""
        if n > len(self._free):
            return None
        pages = self._free[-n:][::-1] if n else []
        del self._free[len(self._free) - n :]
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Give pages back."""
        self._free.extend(reversed(pages))


def pick_device(requested: str | None) -> torch.device:
    """The device KV pool's device: ``requested``, else CUDA when available, else CPU.

    Raises:
        InvalidArgumentError: ``requested`` is not a device string torch knows, or is a CUDA
            device and CUDA is not available (names ``--device``).
    """
    if requested is not None:
        try:
            device = torch.device(requested)
        except RuntimeError as error:
            raise InvalidArgumentError(f"--device: {requested!r} is not a device: {error}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise InvalidArgumentError("--device: cuda was asked for but CUDA is not available")
        return device
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
