"""Run a copy on a side stream, ordered after the producer's work, and hand back its completion.

The copy must never read KV that the forward pass is still writing: :func:`launch_after`
makes the side stream wait for the producer (an event the producer recorded, a stream, or by
default the current stream of the pool's device), launches the copy there under that device,
and records a completion event. It keeps the tensors the copy reads (index tensors made for
this batch, staging) alive until the copy ends: ``record_stream`` tells torch's caching
allocator not to reuse their memory before the side stream is done, and the returned
:class:`CopyHandle` holds references until its event has completed. A copy that raises after
launching part of its work still gets a completion event, and its tensors are held until it.

:class:`CopyHandle` is the one completion type of every asynchronous copy in kvstage: a CUDA
side stream (events), a worker thread (CPU), or a test stream completing copies by hand.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable

import torch

from kvstage.errors import ArgumentTypeError, require
from kvstage.kernels.pool import KVPool
from kvstage.kernels.transfer import gather, scatter

__all__ = ["CopyHandle", "gather_async", "launch_after", "scatter_async", "side_stream"]


_waiter_lock = threading.Lock()  # orders a runner's complete() against a waiter's sleep


class CopyHandle:
    """The completion of one asynchronous copy.

    Made by :func:`launch_after` (CUDA: completion and timing events on the side stream) or
    by a host-side runner (a worker thread or a test), which calls :meth:`complete`.

    Attributes:
        error: the exception the copy raised, or None. On CUDA a launch error is raised by
            :func:`launch_after` itself; asynchronous device faults surface as CUDA errors.
        device: the CUDA device whose stream runs the copy, or None (host-side runner).
    """

    __slots__ = ("error", "device", "_start", "_end", "_done", "_waiter", "_seconds", "_keep", "_on_wait")

    def __init__(self, keep: Iterable[Any] = (), *, on_wait: Callable[["CopyHandle"], None] | None = None) -> None:
        """A handle completed by a host-side runner through :meth:`complete`.

        Args:
            keep: objects (index tensors, staging) held until the copy has completed.
            on_wait: called by :meth:`synchronize` before it blocks (a test stream uses it to
                run the copy on demand).
        """
        self.error: BaseException | None = None
        self.device: torch.device | None = None
        self._start = self._end = None
        self._done = False
        self._waiter: threading.Event | None = None  # made only when a thread waits: launches stay cheap
        self._seconds: float | None = None
        self._keep: tuple | None = tuple(keep)
        self._on_wait = on_wait

    @classmethod
    def recorded(
        cls, start: "torch.cuda.Event", end: "torch.cuda.Event", device: torch.device, keep: Iterable[Any]
    ) -> "CopyHandle":
        """A handle for a copy queued on a CUDA stream between the timing events ``start`` and ``end``."""
        handle = cls(keep)
        handle._start, handle._end, handle.device = start, end, device
        return handle

    def complete(self, *, error: BaseException | None = None, seconds: float | None = None) -> None:
        """Mark a host-side copy done (by its runner): ``error`` if it raised, its duration in seconds."""
        self.error = error
        self._seconds = seconds
        self._keep = None
        with _waiter_lock:
            self._done = True
            waiter = self._waiter
        if waiter is not None:
            waiter.set()

    def query(self) -> bool:
        """True when the copy has finished (successfully or not: see :attr:`error`); never blocks.
        Releases the kept tensors then."""
        if self._end is None or self._done:
            return self._done
        if self._end.query():
            self._done = True
            self._keep = None
            return True
        return False

    def synchronize(self) -> None:
        """Block the calling thread until the copy has finished."""
        if self._end is not None:
            self._end.synchronize()
            self._done = True
            self._keep = None
            return
        if not self._done and self._on_wait is not None:
            self._on_wait(self)
        with _waiter_lock:
            if self._done:
                return
            if self._waiter is None:
                self._waiter = threading.Event()
            waiter = self._waiter
        waiter.wait()

    def wait(self, stream: "torch.cuda.Stream | None" = None) -> None:
        """Make ``stream`` (default: the current stream of the copy's device) wait for the copy
        without blocking the host. A host-side copy is waited for on the host (it has no event
        a stream could wait on)."""
        if self._end is None:
            self.synchronize()
            return
        target = stream if stream is not None else torch.cuda.current_stream(self.device)
        target.wait_event(self._end)

    @property
    def seconds(self) -> float | None:
        """The copy's duration in seconds once it has finished (CUDA: GPU time between its
        timing events), else None."""
        if self._end is not None and self._seconds is None and self.query():
            self._seconds = self._start.elapsed_time(self._end) / 1e3
        return self._seconds


def side_stream(device: torch.device | str | None = None) -> "torch.cuda.Stream":
    """A new CUDA stream on ``device`` for copies (default priority, so it never preempts compute)."""
    return torch.cuda.Stream(device=device)


# Tensors of copies that raised after launching part of their work: held until their
# completion event, since a queued kernel may still read them (pruned at each launch).
_held_after_error: list[tuple[Any, tuple]] = []
_held_lock = threading.Lock()


def _prune_held() -> None:
    with _held_lock:
        _held_after_error[:] = [(event, kept) for event, kept in _held_after_error if not event.query()]


def launch_after(
    copy: Callable[[], object],
    *,
    stream: "torch.cuda.Stream | None",
    after: "torch.cuda.Event | torch.cuda.Stream | None" = None,
    keep_alive: Iterable[Any] = (),
) -> CopyHandle:
    """Run ``copy()`` on ``stream`` after the producer's queued work; return its handle.

    Args:
        copy: launches the copy on the current stream (e.g. a closure over
            :func:`kvstage.kernels.gather`).
        stream: the side stream; ``None`` runs ``copy()`` inline (CPU pools) and returns a
            completed handle.
        after: what the copy must wait for: an event the producer recorded after writing the
            KV, or the producer stream itself (its work queued so far). Default: the current
            stream of ``stream``'s device.
        keep_alive: tensors the copy uses that the caller may drop before it ends (CUDA tensors
            get ``record_stream(stream)``; all are referenced by the handle until it completes).

    Raises:
        ArgumentTypeError: ``stream`` is neither None nor a ``torch.cuda.Stream``, or ``after``
            is neither None, an event nor a stream.
        Whatever ``copy()`` raises; on CUDA its tensors are then held until the work it queued
        has completed.
    """
    kept = tuple(keep_alive)
    if stream is None:
        copy()
        handle = CopyHandle()
        handle.complete(seconds=0.0)
        return handle
    require(
        isinstance(stream, torch.cuda.Stream),
        "stream",
        lambda: f"must be a torch.cuda.Stream or None, got {type(stream).__name__}",
        ArgumentTypeError,
    )
    device = stream.device
    _prune_held()
    with torch.cuda.device(device):  # launches and events on the copy's device, whatever is current
        if after is None:
            stream.wait_stream(torch.cuda.current_stream(device))
        elif isinstance(after, torch.cuda.Stream):
            stream.wait_stream(after)
        elif isinstance(after, torch.cuda.Event):
            stream.wait_event(after)
        else:
            raise ArgumentTypeError(
                f"after: must be a torch.cuda.Event, a torch.cuda.Stream or None, got {type(after).__name__}"
            )
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            try:
                copy()
            except BaseException:
                # Part of the copy may be queued: hold its tensors (pinned staging too, which
                # record_stream does not cover) until what was queued has completed.
                end.record(stream)
                with _held_lock:
                    _held_after_error.append((end, kept))
                raise
            end.record(stream)
        for tensor in kept:
            if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                tensor.record_stream(stream)
    return CopyHandle.recorded(start, end, device, kept)


def gather_async(
    pool: KVPool,
    staging: torch.Tensor,
    slot_indices: torch.Tensor,
    host_page_ids: torch.Tensor,
    *,
    stream: "torch.cuda.Stream | None",
    after: "torch.cuda.Event | torch.cuda.Stream | None" = None,
    **options: object,
) -> CopyHandle:
    """:func:`kvstage.kernels.gather` on ``stream`` after the producer (see :func:`launch_after`).

    ``options`` are gather's keyword arguments (``page_size``, ``layout``, ``backend``,
    ``mode``, ...). With ``mode="kernel"`` the kernel writes pinned ``staging`` directly: do
    not read or reuse it before the handle completes (the handle keeps it alive until then).
    """
    return launch_after(
        lambda: gather(pool, staging, slot_indices, host_page_ids, **options),  # type: ignore[arg-type]
        stream=stream,
        after=after,
        keep_alive=(slot_indices, host_page_ids, staging),
    )


def scatter_async(
    staging: torch.Tensor,
    pool: KVPool,
    slot_indices: torch.Tensor,
    host_page_ids: torch.Tensor,
    *,
    stream: "torch.cuda.Stream | None",
    after: "torch.cuda.Event | torch.cuda.Stream | None" = None,
    **options: object,
) -> CopyHandle:
    """:func:`kvstage.kernels.scatter` on ``stream`` after the producer (see :func:`launch_after`).

    The consumer (the forward pass) must wait for the returned handle before reading the
    pool (``handle.wait()`` on its stream); ``staging`` must not change before it completes.
    """
    return launch_after(
        lambda: scatter(staging, pool, slot_indices, host_page_ids, **options),  # type: ignore[arg-type]
        stream=stream,
        after=after,
        keep_alive=(slot_indices, host_page_ids, staging),
    )
