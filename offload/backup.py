"""Backup: a request's finished gathers become store writes, and their outcomes are counted.

The manager hands over each finished gather in launch order (so a request's pages reach the
store in chain order); this module counts it (offloaded, failed, discarded), computes its page
keys, submits the store write to a worker thread (:func:`~kvstage.offload.store_io.write_pages`),
and, when the write is done, frees the host pages, counts each page's outcome and reports
failures. Host pages stay allocated while their write runs: they are the write's source.
Each request lifecycle's writes are tallied in a :class:`RequestWrites`, which the manager turns
into its ``on_stored`` signal once the lifecycle is released and its last write has ended.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Callable

from kvstage.offload.copier import Copier, CopyResult
from kvstage.offload.key_chain import ChainRun, RequestChain
from kvstage.offload.metrics import OffloadMetrics
from kvstage.offload.prior_wait import PriorWaitingWrite
from kvstage.offload.store_io import write_pages

__all__ = ["Backup", "RequestWrites"]

logger = logging.getLogger(__name__)

FailureCallback = Callable[[Any, list[str], "BaseException | None"], None]


class RequestWrites:
    """The store writes of one request lifecycle (from its first call to its release).

    Attributes:
        req: the request object.
        pages_stored: pages that reached the store, deduplicated ones included (the store holds
            them either way).
        pages_failed: pages whose copy, keys or store write failed.
        writes_pending: store writes submitted and not collected yet.
        released: the lifecycle was released (no more writes will be added).
    """

    __slots__ = ("req", "pages_stored", "pages_failed", "writes_pending", "released")

    def __init__(self, req: Any) -> None:
        self.req = req
        self.pages_stored = 0
        self.pages_failed = 0
        self.writes_pending = 0
        self.released = False


class Backup:
    """Store writes of finished gathers, and their accounting.

    Args:
        copier: frees the host pages.
        storage: the store written to.
        hasher: page keys (:class:`kvstage.hashing.PageHasher`).
        workers: store workers; writes run on ``workers.write`` in submission order.
        counters: the manager's counters, updated here for the store path.
        on_failure: ``on_failure(req, failed_keys, error)`` or None (the manager's
            ``on_storage_failure``); its exceptions are counted and logged, never raised.
        prior_wait_s: seconds a write refused for a missing prior page is put again
            (:class:`~kvstage.offload.prior_wait.PriorWaitingWrite`); 0: never.
    """

    def __init__(
        self, copier: Copier, storage: Any, hasher: Any, workers: Any, counters: OffloadMetrics,
        on_failure: FailureCallback | None, prior_wait_s: float = 0.0,
    ) -> None:
        self.copier = copier
        self.storage = storage
        self.hasher = hasher
        self._workers = workers
        self._counters = counters
        self._on_failure = on_failure
        self.prior_wait_s = prior_wait_s
        self._stopping = False  # stop_waiting(): writes made now attempt once
        # (tally, host pages, future, the PriorWaitingWrite or None), in submission order
        self._writes: deque[tuple[RequestWrites, list[int], Any, PriorWaitingWrite | None]] = deque()
        self._changed = threading.Condition()  # a PriorWaitingWrite parked or ended
        self.ended: list[RequestWrites] = []  # released lifecycles whose last write has ended (take_ended)

    @property
    def writes_pending(self) -> int:
        """Store writes submitted and not yet collected by :meth:`poll` (parked ones too)."""
        return len(self._writes)

    @property
    def writes_parked(self) -> int:
        """Store writes waiting for their prior page (no thread runs them now)."""
        return sum(1 for _, _, future, job in self._writes if job is not None and job.parked and not future.done())

    @property
    def writes_running(self) -> int:
        """Store writes not done and not parked waiting for their prior page."""
        return sum(1 for _, _, future, job in self._writes if not future.done() and not (job is not None and job.parked))

    def settle(self, writes: RequestWrites, chain: RequestChain, run: ChainRun, result: CopyResult, *, discard: bool) -> None:
        """Count one finished gather of ``writes.req`` and hand its pages to a store write (or
        free them: a failed copy, pages whose keys cannot be made, or ``discard`` for a request
        retracted without keeping its offload progress)."""
        req = writes.req
        counters = self._counters
        pages = len(result.host_page_ids)
        write = None
        try:
            if not result.ok:
                counters.copy_failures += 1
                counters.pages_failed += pages
                writes.pages_failed += pages
                logger.error("offload: D2H copy of %d pages of rid=%r failed: %r", pages, req.rid, result.error)
                self.report_failure(req, self._keys_or_empty(chain, run), result.error)
                return
            counters.pages_offloaded += pages
            counters.bytes_offloaded += result.bytes
            counters.copy_seconds += result.seconds
            if discard:
                counters.pages_discarded += pages
                return
            try:
                keys = chain.keys_of(run, self.hasher)
            except Exception as error:  # e.g. a token id the hash scheme cannot encode
                counters.pages_failed += pages
                writes.pages_failed += pages
                logger.error("offload: page keys of %d pages of rid=%r failed: %r", pages, req.rid, error)
                self.report_failure(req, [], error)
                return
            host_pages = [self.copier.host_pool.page(host_page_id) for host_page_id in result.host_page_ids]
            job = None
            if self.prior_wait_s > 0 and not self._stopping:
                job = PriorWaitingWrite(self._workers.write, self.storage, keys, host_pages, run.prior_key, self.prior_wait_s, self._notify)
                job.start()
                write = job.future
            else:
                write = self._workers.write(lambda: write_pages(self.storage, keys, host_pages, prior_key=run.prior_key))
            self._writes.append((writes, result.host_page_ids, write, job))
            writes.writes_pending += 1
        finally:
            if write is None:
                counters.pages_in_flight -= pages
                self.copier.free(result.host_page_ids)

    def poll(self) -> None:
        """Collect the finished writes, oldest first, past any still running or parked (never
        blocks)."""
        writes = self._writes
        while writes and writes[0][2].done():
            self._written(*writes.popleft()[:3])
        # One writer thread ends writes in order; only a parked write lets later ones pass it.
        if not writes or writes[0][3] is None or not any(entry[2].done() for entry in writes):
            return
        pending: deque = deque()
        for entry in writes:
            if entry[2].done():
                self._written(*entry[:3])
            else:
                pending.append(entry)
        self._writes = pending

    def end(self, writes: RequestWrites) -> None:
        """``writes``' lifecycle was released: it is ended once its last write has."""
        writes.released = True
        if writes.writes_pending == 0:
            self.ended.append(writes)

    def take_ended(self) -> list[RequestWrites]:
        """The released lifecycles whose last write has ended since the last call, in the
        order they ended."""
        ended, self.ended = self.ended, []
        return ended

    def wait(self, *, parked: bool = False) -> None:
        """Block until every submitted write has finished or, unless ``parked``, is parked
        waiting for its prior page (shutdown and tests)."""
        for _, _, future, job in list(self._writes):
            if job is None:
                future.result()
                continue
            with self._changed:
                while not future.done() and (parked or not job.parked):
                    self._changed.wait(0.1)

    def stop_waiting(self, stopping: bool) -> None:
        """``True``: parked writes end now with their refusal, and writes made until
        ``stop_waiting(False)`` attempt once (a flush: no page of the old weights may land
        after ``clear``)."""
        self._stopping = stopping
        if stopping:
            for _, _, _, job in list(self._writes):
                if job is not None:
                    job.stop()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def report_failure(self, req: Any, keys: list[str], error: BaseException | None) -> None:
        """Call ``on_failure``; an exception it raises is counted and logged."""
        if self._on_failure is None:
            return
        try:
            self._on_failure(req, keys, error)
        except Exception:
            self._counters.callback_errors += 1
            logger.exception("offload: on_storage_failure callback raised for rid=%r", req.rid)

    def _keys_or_empty(self, chain: RequestChain, run: ChainRun) -> list[str]:
        try:
            return list(chain.keys_of(run, self.hasher))
        except Exception:
            return []

    def _written(self, writes: RequestWrites, host_page_ids: list[int], future: Any) -> None:
        req = writes.req
        outcome = future.result()
        self.copier.free(host_page_ids)
        counters = self._counters
        counters.pages_in_flight -= len(host_page_ids)
        counters.pages_stored += outcome.stored
        counters.pages_deduplicated += outcome.deduplicated
        writes.pages_stored += outcome.stored + outcome.deduplicated
        writes.pages_failed += len(outcome.failed_keys)
        writes.writes_pending -= 1
        if writes.released and writes.writes_pending == 0:
            self.ended.append(writes)
        if outcome.failed_keys:
            counters.pages_failed += len(outcome.failed_keys)
            counters.storage_failures += 1
            logger.warning(
                "offload: storage write failed for %d of %d pages of rid=%r%s", len(outcome.failed_keys),
                len(host_page_ids), req.rid, f": {outcome.error!r}" if outcome.error is not None else "",
            )
            self.report_failure(req, outcome.failed_keys, outcome.error)
