"""Copy streams: where the offload manager's D2H copies run, and the events that say when.

:class:`CopyStream` has two modes with one interface:

- CUDA: a side stream. Each copy first waits for the producer (compute) stream, so it reads KV
  the forward pass has written, then runs on the side stream between two timing events; the
  end event is the copy's completion event.
- CPU: one worker thread that runs copies in submission order and completes their events, so
  the manager's lifecycle is asynchronous on CPU as well (``query()`` is False until the
  worker has run the copy).

:class:`ManualCopyStream` holds every copy until a test (or a benchmark) completes it, in any
order, optionally without running it.

Every event has ``query() -> bool`` (never blocks), ``synchronize()`` (blocks),
``error`` (the exception the copy raised, or None; CPU and manual modes) and ``seconds``
(the copy's duration once complete, else None). Submission keeps the tensors passed as
``keep`` alive until the event is dropped, so index tensors outlive the copy that reads them.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Sequence

import torch

from kvstage.errors import InvalidArgumentError

Copy = Callable[[], None]


class _ThreadEvent:
    """Completion of one copy run by a :class:`CopyStream`'s worker thread."""

    __slots__ = ("_done", "error", "seconds", "keep")

    def __init__(self, keep: Any) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.seconds: float | None = None
        self.keep = keep

    def query(self) -> bool:
        """True once the copy has run (successfully or not: see ``error``); never blocks."""
        return self._done.is_set()

    def synchronize(self) -> None:
        """Block until the copy has run."""
        self._done.wait()


class _CudaEvent:
    """Completion of one copy on a CUDA side stream (timing events around it)."""

    __slots__ = ("start", "end", "error", "_seconds", "keep")

    def __init__(self, keep: Any) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.error: BaseException | None = None  # CUDA reports launch errors at submit
        self._seconds: float | None = None
        self.keep = keep

    def query(self) -> bool:
        """True once the copy has completed on the side stream; never blocks."""
        return self.end.query()

    def synchronize(self) -> None:
        """Block the host until the copy has completed."""
        self.end.synchronize()

    @property
    def seconds(self) -> float | None:
        """GPU time of the copy in seconds (CUDA timing events), or None until it completes."""
        if self._seconds is None and self.end.query():
            self._seconds = self.start.elapsed_time(self.end) / 1e3
        return self._seconds


class CopyStream:
    """Runs copies asynchronously, in submission order, and hands back completion events.

    Args:
        device: the device the KV pool lives on. CUDA: a side stream on it. CPU: a worker thread.

    Attributes:
        in_order: True: events complete in submission order (one stream, one worker), so a
            poller may stop at the first unfinished event.
    """

    in_order = True

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._side = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._queue: queue.SimpleQueue | None = None
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, copy: Copy, *, keep: Sequence[Any] = (), after: Any = None):
        """Run ``copy()`` on the stream after what the producer has queued so far.

        Args:
            copy: launches the copy (a kernel launch on CUDA; the copy itself on CPU).
            keep: objects (index tensors) kept alive by the event until it is dropped.
            after: CUDA only: a ``torch.cuda.Event`` recorded on the producer stream to wait
                for; None waits for the whole current stream of ``device``.

        Returns:
            The copy's completion event.

        Raises:
            Whatever ``copy()`` raises at launch on CUDA; on CPU the error is kept on the event
            (``event.error``) and the event completes.
        """
        if self.cuda:
            event = _CudaEvent(keep)
            if after is None:
                self._side.wait_stream(torch.cuda.current_stream(self.device))
            else:
                self._side.wait_event(after)
            with torch.cuda.stream(self._side):
                event.start.record(self._side)
                copy()
                event.end.record(self._side)
            return event
        event = _ThreadEvent(keep)
        if self._worker is None:
            self._start_worker()
        self._queue.put((copy, event))
        return event

    def synchronize(self) -> None:
        """Block until every submitted copy has completed."""
        if self.cuda:
            self._side.synchronize()
        elif self._worker is not None:
            marker = _ThreadEvent(None)
            self._queue.put((_no_copy, marker))
            marker.synchronize()

    def close(self) -> None:
        """Let queued copies finish and stop the worker thread (CPU). Idempotent."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            self._queue.put(None)
            worker.join()

    def _start_worker(self) -> None:
        with self._lock:
            if self._worker is not None:
                return
            self._queue = queue.SimpleQueue()
            self._worker = threading.Thread(target=_run_copies, args=(self._queue,), name="kvstage-copy", daemon=True)
            self._worker.start()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def _no_copy() -> None:
    pass


def _run_copies(work: queue.SimpleQueue) -> None:
    while True:
        item = work.get()
        if item is None:
            return
        copy, event = item
        started = time.perf_counter()
        try:
            copy()
        except BaseException as error:  # kept on the event; the manager counts a failed copy
            event.error = error
        event.seconds = time.perf_counter() - started
        event._done.set()


class _ManualEvent:
    """Completion of one copy held by a :class:`ManualCopyStream`."""

    __slots__ = ("stream", "copy", "done", "error", "seconds", "keep")

    def __init__(self, stream: "ManualCopyStream", copy: Copy, keep: Any) -> None:
        self.stream = stream
        self.copy = copy
        self.done = False
        self.error: BaseException | None = None
        self.seconds: float | None = None
        self.keep = keep

    def query(self) -> bool:
        """True once the test has completed this copy; never blocks."""
        return self.done

    def synchronize(self) -> None:
        """Complete this copy now (runs it when the stream runs copies)."""
        if not self.done:
            self.stream.complete(self)


class ManualCopyStream:
    """A copy stream for tests and benchmarks: copies wait until :meth:`complete` runs them.

    Args:
        run_copies: False: completing a copy does not run it (a no-op copy, for measuring
            the manager's own CPU time).
        in_order: what the stream tells its poller. False (default): events may complete in
            any order, so a poller checks each. True: the caller promises to complete them
            oldest first (as a real stream does), so a poller may stop at the first unfinished.

    Attributes:
        pending: the events not completed yet, in submission order.
    """

    def __init__(self, run_copies: bool = True, in_order: bool = False) -> None:
        self.run_copies = run_copies
        self.in_order = in_order
        self.pending: list[_ManualEvent] = []
        self.submitted = 0

    def submit(self, copy: Copy, *, keep: Sequence[Any] = (), after: Any = None) -> _ManualEvent:
        """Hold ``copy`` until completed; returns its event (see :class:`CopyStream.submit`)."""
        event = _ManualEvent(self, copy, keep)
        self.pending.append(event)
        self.submitted += 1
        return event

    def complete(self, which: int | _ManualEvent = 0, *, error: BaseException | None = None) -> _ManualEvent:
        """Complete one pending copy: by index into :attr:`pending` or by event.

        Args:
            which: the pending index (0: the oldest) or the event itself.
            error: complete it as failed with this error, without running the copy.

        Raises:
            InvalidArgumentError: no such pending copy.
        """
        if isinstance(which, _ManualEvent):
            if which not in self.pending:
                raise InvalidArgumentError("which: not a pending event of this stream")
            self.pending.remove(which)
            event = which
        else:
            if not -len(self.pending) <= which < len(self.pending):
                raise InvalidArgumentError(f"which: no pending copy {which}; {len(self.pending)} pending")
            event = self.pending.pop(which)
        started = time.perf_counter()
        if error is not None:
            event.error = error
        elif self.run_copies:
            try:
                event.copy()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()  # a kernel the copy launched is done when complete() returns
            except BaseException as raised:
                event.error = raised
        event.seconds = time.perf_counter() - started
        event.done = True
        event.copy = _no_copy
        return event

    def complete_all(self) -> None:
        """Complete every pending copy, oldest first."""
        while self.pending:
            self.complete(0)

    def synchronize(self) -> None:
        """Same as :meth:`complete_all`."""
        self.complete_all()

    def close(self) -> None:
        """Nothing to release."""
