"""A store's own I/O threads: a thread pool that starts on first use, restarts after a close or
in a forked child, and never leaves work undone when it cannot take it.

Why threads of a store's own: reading or writing the page cache is a memory copy, and an NVMe
drive needs more than one request in flight to reach its bandwidth; a store's calls of many
pages hand their page files to these threads (:class:`kvstage.storage.file_store.FileStore`).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait


class IoThreads:
    """Up to ``threads`` threads named ``name``-N, started by the first :meth:`submit`.

    Args:
        threads: the pool's threads (an int >= 1; the store checks it).
        name: their name prefix (``threading.Thread.name``).

    Thread-safe.
    """

    def __init__(self, threads: int, name: str) -> None:
        self.threads = threads
        self.name = name
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def submit(self, function, *args) -> Future:
        """Run ``function(*args)`` once, on these threads (started if needed); a future of its
        result or exception. Under the lock :meth:`close` takes, so a close racing a call never
        shuts the threads between the call finding them and handing them work (the call's later
        work starts them again). When the threads refuse it (``RuntimeError``: while the
        interpreter exits concurrent.futures takes no new work, though a write queued on another
        pool still runs then; or a thread could not start, the work queued all the same), the
        calling thread runs it unless a pool thread took it first."""
        done: Future = Future()
        taken = threading.Lock()

        def run() -> None:
            if not taken.acquire(blocking=False):
                return  # the other runner has it
            try:
                done.set_result(function(*args))
            except BaseException as error:  # raised to the caller by the future, as from a thread
                done.set_exception(error)

        with self._lock:
            # A forked child has the pool object but not its threads: it starts its own.
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=self.name)
                self._pid = os.getpid()
            try:
                self._pool.submit(run)
                return done
            except RuntimeError:
                pass
        run()
        return done

    def map(self, function, *iterables) -> list[Future]:
        """``function`` over ``zip(*iterables)`` on these threads, returned once every call
        ended (none still writes into a caller's buffer or leaves a file behind afterwards);
        their futures in order."""
        futures = [self.submit(function, *args) for args in zip(*iterables)]
        wait(futures)
        return futures

    def close(self) -> None:
        """Stop the threads (after the work in flight); a later :meth:`submit`, or one in flight
        on another thread, starts them again. Idempotent."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
