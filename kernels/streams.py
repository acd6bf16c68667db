"""Run a copy on a side stream, ordered after the producer's work, and hand back its completion.

The copy must never read KV that the forward pass is still writing: :func:`launch_after`
records an event on the producing stream (default: the current stream), makes the side
stream wait for it, launches the copy there, and records a completion event. It keeps the
tensors the copy reads (index tensors made for this batch, staging) alive until the copy
ends: ``record_stream`` tells torch's caching allocator not to reuse their memory before the
side stream is done, and the returned :class:`CopyHandle` holds references until its event
has completed.

On CPU (``stream=None``) the copy runs at once in the calling thread and the handle is
complete on return, so callers keep one code path.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from kvstage.errors import ArgumentTypeError, require
from kvstage.kernels.pool import KVPool
from kvstage.kernels.transfer import gather, scatter

__all__ = ["CopyHandle", "gather_async", "launch_after", "scatter_async", "side_stream"]


class CopyHandle:
    """The completion of one copy started by :func:`launch_after`.

    Attributes:
        event: the ``torch.cuda.Event`` recorded after the copy, or ``None`` (ran inline on CPU).
    """

    __slots__ = ("event", "_keep_alive")

    def __init__(self, event: "torch.cuda.Event | None", keep_alive: tuple) -> None:
        self.event = event
        self._keep_alive: tuple | None = keep_alive if event is not None else None

    def query(self) -> bool:
        """True when the copy has finished (never blocks); then releases the kept tensors."""
        if self.event is None or self.event.query():
            self._keep_alive = None
            return True
        return False

    def synchronize(self) -> None:
        """Block the calling thread until the copy has finished."""
        if self.event is not None:
            self.event.synchronize()
        self._keep_alive = None

    def wait(self, stream: "torch.cuda.Stream | None" = None) -> None:
        """Make ``stream`` (default: current) wait for the copy without blocking the host (CUDA only; no-op inline)."""
        if self.event is not None:
            (stream if stream is not None else torch.cuda.current_stream()).wait_event(self.event)


def side_stream(device: torch.device | str | None = None) -> "torch.cuda.Stream":
    """A new CUDA stream on ``device`` for copies (default priority, so it never preempts compute)."""
    return torch.cuda.Stream(device=device)


def launch_after(
    copy: Callable[[], object],
    *,
    stream: "torch.cuda.Stream | None",
    producer: "torch.cuda.Stream | None" = None,
    ready: "torch.cuda.Event | None" = None,
    keep_alive: Iterable[torch.Tensor] = (),
) -> CopyHandle:
    """Run ``copy()`` on ``stream`` after the work already queued on ``producer``; return its handle.

    Args:
        copy: launches the copy on the current stream (e.g. a ``functools.partial`` of
            :func:`kvstage.kernels.gather`).
        stream: the side stream; ``None`` runs ``copy()`` inline (CPU pools).
        producer: the stream whose queued work must finish first (default: the current stream).
        ready: an event already recorded by the producer to wait for instead of recording one.
        keep_alive: tensors the copy uses that the caller may drop before it ends (CUDA tensors
            get ``record_stream(stream)``; all are referenced by the handle until it completes).

    Raises:
        ArgumentTypeError: ``stream`` is neither ``None`` nor a ``torch.cuda.Stream``.
    """
    tensors = tuple(keep_alive)
    if stream is None:
        copy()
        return CopyHandle(None, ())
    require(isinstance(stream, torch.cuda.Stream), "stream", f"must be a torch.cuda.Stream or None, got {type(stream).__name__}", ArgumentTypeError)
    if ready is None:
        ready = torch.cuda.Event()
        ready.record(producer if producer is not None else torch.cuda.current_stream(stream.device))
    stream.wait_event(ready)
    with torch.cuda.stream(stream):
        copy()
        done = torch.cuda.Event()
        done.record(stream)
    for t in tensors:
        if t.is_cuda:
            t.record_stream(stream)
    return CopyHandle(done, tensors)


def gather_async(
    pool: KVPool,
    staging: torch.Tensor,
    slot_indices: torch.Tensor,
    host_page_ids: torch.Tensor,
    *,
    stream: "torch.cuda.Stream | None",
    producer: "torch.cuda.Stream | None" = None,
    **options: object,
) -> CopyHandle:
    """:func:`kvstage.kernels.gather` on ``stream`` after ``producer``'s queued work (see :func:`launch_after`).

    Validation errors are raised from this call, before the copy is queued. ``options`` are gather's
    keyword arguments (``page_size``, ``layout``, ``backend``, ``mode``, ...).
    """
    return launch_after(
        lambda: gather(pool, staging, slot_indices, host_page_ids, **options),  # type: ignore[arg-type]
        stream=stream, producer=producer, keep_alive=(slot_indices, host_page_ids, staging),
    )


def scatter_async(
    staging: torch.Tensor,
    pool: KVPool,
    slot_indices: torch.Tensor,
    host_page_ids: torch.Tensor,
    *,
    stream: "torch.cuda.Stream | None",
    producer: "torch.cuda.Stream | None" = None,
    **options: object,
) -> CopyHandle:
    """:func:`kvstage.kernels.scatter` on ``stream`` after ``producer``'s queued work (see :func:`launch_after`).

    The consumer (the forward pass) must wait for the returned handle before reading the
    pool (``handle.wait()`` on its stream).
    """
    return launch_after(
        lambda: scatter(staging, pool, slot_indices, host_page_ids, **options),  # type: ignore[arg-type]
        stream=stream, producer=producer, keep_alive=(slot_indices, host_page_ids, staging),
    )
