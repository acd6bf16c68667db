"""Copy streams: where the copier's gathers and scatters run, each handing back a
:class:`kvstage.kernels.CopyHandle`.

:class:`CopyStream` has two modes with one interface:

- CUDA: a side stream on the KV pool's device (:func:`kvstage.kernels.launch_after`). Each copy
  first waits for the producer (an event or stream the engine passes, else the current stream),
  so it reads KV the forward pass has written, and records timing events around itself.
- CPU: one worker thread that runs copies in submission order and completes their handles, so
  the lifecycle is asynchronous on CPU as well (``query()`` is False until the worker has run
  the copy). At interpreter exit the worker finishes its queue and stops, also when nobody
  called :meth:`CopyStream.close`. A producer given as ``after`` is waited on (``after.synchronize()``) by the worker
  before the copy runs, as the side stream would wait on an event.

:class:`ManualCopyStream` holds every copy until a test (or a benchmark) completes it, in any
order, optionally without running it.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import torch

from kvstage.errors import InvalidArgumentError
from kvstage.kernels.streams import CopyHandle, launch_after

Copy = Callable[[], None]


class CopyStream:
    """Runs copies asynchronously, in submission order, and hands back their handles.

    Args:
        device: the device the KV pool lives on. CUDA: a side stream on it. CPU: a worker thread.

    Attributes:
        in_order: True: handles complete in submission order (one stream, one worker), so a
            poller may stop at the first unfinished one.
    """

    in_order = True

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._side = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._queue: queue.SimpleQueue | None = None
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, copy: Copy, *, keep: Sequence[Any] = (), after: Any = None) -> CopyHandle:
        """Run ``copy()`` on the stream after the producer.

        Args:
            copy: launches the copy (a kernel launch on CUDA; the copy itself on CPU).
            keep: objects (index tensors, staging) kept alive until the copy has completed.
            after: the producer to wait for: CUDA, a ``torch.cuda.Event`` or ``Stream`` (None:
                the device's current stream); CPU, anything with ``synchronize()`` (None: nothing
                to wait for), waited on by the worker thread.

        Returns:
            The copy's :class:`CopyHandle`.

        Raises:
            Whatever ``copy()`` raises at launch on CUDA; on CPU the error is kept on the handle
            (``handle.error``) and the handle completes.
        """
        if self.cuda:
            return launch_after(copy, stream=self._side, after=after, keep_alive=keep)
        handle = CopyHandle(keep)
        if self._worker is None:
            self._start_worker()
        self._queue.put((copy, after, handle))
        return handle

    def synchronize(self) -> None:
        """Block until every submitted copy has completed."""
        if self.cuda:
            self._side.synchronize()
        elif self._worker is not None:
            marker = CopyHandle()
            self._queue.put((_no_copy, None, marker))
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
            _WITH_WORKERS.add(self)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def _no_copy() -> None:
    pass


# CPU streams whose worker runs. A daemon thread still inside torch when the interpreter
# finalizes aborts the process ("terminate called without an active exception"), so a
# process that exits without closing its manager stops these workers first.
_WITH_WORKERS: "weakref.WeakSet[CopyStream]" = weakref.WeakSet()


@atexit.register
def _close_workers_at_exit() -> None:
    for stream in list(_WITH_WORKERS):
        stream.close()


def _run_copies(work: queue.SimpleQueue) -> None:
    while True:
        item = work.get()
        if item is None:
            return
        copy, after, handle = item
        started = time.perf_counter()
        try:
            if after is not None:
                after.synchronize()
            copy()
        except BaseException as error:  # kept on the handle; the copier reports a failed copy
            handle.complete(error=error, seconds=time.perf_counter() - started)
        else:
            handle.complete(seconds=time.perf_counter() - started)


class ManualCopyStream:
    """A copy stream for tests and benchmarks: copies wait until :meth:`complete` runs them.

    Args:
        run_copies: False: completing a copy does not run it (a no-op copy, for measuring
            the manager's own CPU time).
        in_order: what the stream tells its poller. False (default): handles may complete in
            any order, so a poller checks each. True: the caller promises to complete them
            oldest first (as a real stream does), so a poller may stop at the first unfinished.

    Attributes:
        pending: the handles not completed yet, in submission order.
        submitted: copies submitted so far.
        afters: the ``after`` argument of each submission, in order.
    """

    def __init__(self, run_copies: bool = True, in_order: bool = False) -> None:
        self.run_copies = run_copies
        self.in_order = in_order
        self.pending: list[CopyHandle] = []
        self._copies: dict[int, Copy] = {}
        self.submitted = 0
        self.afters: list[Any] = []

    def submit(self, copy: Copy, *, keep: Sequence[Any] = (), after: Any = None) -> CopyHandle:
        """Hold ``copy`` until completed; returns its handle (see :meth:`CopyStream.submit`);
        ``handle.synchronize()`` completes it."""
        handle = CopyHandle(keep, on_wait=self.complete)
        self.pending.append(handle)
        self._copies[id(handle)] = copy
        self.submitted += 1
        self.afters.append(after)
        return handle

    def complete(self, which: int | CopyHandle = 0, *, error: BaseException | None = None) -> CopyHandle:
        """Complete one pending copy: by index into :attr:`pending` or by handle.

        Args:
            which: the pending index (0: the oldest) or the handle itself.
            error: complete it as failed with this error, without running the copy.

        Raises:
            InvalidArgumentError: no such pending copy.
        """
        if isinstance(which, CopyHandle):
            if which not in self.pending:
                raise InvalidArgumentError("which: not a pending handle of this stream")
            self.pending.remove(which)
            handle = which
        else:
            if not -len(self.pending) <= which < len(self.pending):
                raise InvalidArgumentError(f"which: no pending copy {which}; {len(self.pending)} pending")
            handle = self.pending.pop(which)
        copy = self._copies.pop(id(handle))
        started = time.perf_counter()
        if error is None and self.run_copies:
            try:
                copy()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()  # a kernel the copy launched is done when complete() returns
            except BaseException as raised:
                error = raised
        handle.complete(error=error, seconds=time.perf_counter() - started)
        return handle

    def complete_all(self) -> None:
        """Complete every pending copy, oldest first."""
        while self.pending:
            self.complete(0)

    def synchronize(self) -> None:
        """Same as :meth:`complete_all`."""
        self.complete_all()

    def close(self) -> None:
        """Nothing to release."""
