"""What the manager and the copier need from their collaborators, as typed Protocols.

Any object with these members works (kvstage's own classes, an engine's adapters, test
doubles); :func:`isinstance` checks the members' presence (``runtime_checkable``).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from kvstage.kernels.streams import CopyHandle
from kvstage.kv_layout import KVLayout

__all__ = ["CopyStreamLike", "KVPoolLike", "PageHasherLike", "StoreWorkersLike"]


@runtime_checkable
class PageHasherLike(Protocol):
    """Page keys (:class:`kvstage.hashing.PageHasher`)."""

    page_size: int

    def seed(self, extra_key: str | None = None, cache_salt: str | None = None) -> str | None:
        """The namespace seed (the first page's prior), or None without a namespace."""
        ...

    def prefill_keys(self, tokens: Any, extra_key: str | None = None, cache_salt: str | None = None) -> list[str]:
        """Keys of every whole page of ``tokens``, from the namespace seed."""
        ...

    def continue_keys(self, tokens: Any, prior_hash: str | None) -> list[str]:
        """Keys of every whole page of ``tokens``, continuing from ``prior_hash``."""
        ...


@runtime_checkable
class CopyStreamLike(Protocol):
    """Where copies run (:class:`kvstage.offload.CopyStream`, :class:`kvstage.offload.ManualCopyStream`)."""

    in_order: bool

    def submit(self, copy: Callable[[], None], *, keep: Sequence[Any] = (), after: Any = None) -> CopyHandle:
        """Run ``copy()`` after the producer ``after``; its completion handle."""
        ...

    def close(self) -> None:
        """Stop whatever the stream runs on."""
        ...


@runtime_checkable
class KVPoolLike(Protocol):
    """The device KV pool (:class:`kvstage.kernels.KVPool`)."""

    layout: KVLayout
    device: torch.device
    num_layers: int
    num_slots: int


@runtime_checkable
class StoreWorkersLike(Protocol):
    """Where store writes and reads run (:class:`kvstage.offload.StoreWorkers`)."""

    def write(self, call: Callable[[], Any]) -> Future:
        """Run a write; its future."""
        ...

    def read(self, call: Callable[[], Any]) -> Future:
        """Run a read; its future."""
        ...

    def close(self) -> None:
        """Finish queued calls and stop."""
        ...
