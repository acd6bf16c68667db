"""Backup: a request's finished gathers become store writes, and their outcomes are counted.

The manager hands over each finished gather in launch order (so a request's pages reach the
store in chain order); this module counts it (offloaded, failed, discarded), computes its page
keys, submits the store write to a worker thread (:func:`~kvstage.offload.store_io.write_pages`),
and, when the write is done, frees the host pages, counts each page's outcome and reports
failures. Host pages stay allocated while their write runs: they are the write's source.
A page whose chain prior failed in this manager (its copy or its store write: the request's
:class:`~kvstage.offload.key_chain.RequestChain` remembers) is refused at once with a
:class:`~kvstage.offload.key_chain.PriorFailedError`, without asking the store or waiting for
``prior_wait_s``. The check runs on the writer thread, just before the write's store call: the
writes before it have ended by then (one writer, submission order), and the failures are
collected and reported in chain order like any write's.
Host pages of their own and a store that adopts (:func:`~kvstage.offload.store_io.adopts_from`):
a write hands the host pages themselves to the store (``put_adopting``, no copy), and once it
has ended each page the store kept gets the store's spare buffer (or a new one) in its place
(:meth:`HostPool.replace`) before it is freed.
Each request lifecycle's writes are tallied in a :class:`RequestWrites`, which the manager turns
into its ``on_stored`` signal once the lifecycle is released and its last write has ended.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import wait as wait_futures
from typing import Any, Callable

from kvstage.offload.copier import Copier, CopyResult
from kvstage.offload.key_chain import ChainRun, RequestChain
from kvstage.offload.metrics import OffloadMetrics
from kvstage.offload.prior_wait import PriorWaitingWrite
from kvstage.offload.request import request_namespace
from kvstage.offload.store_io import WriteOutcome, adopts_from, write_pages

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
        self,
        copier: Copier,
        storage: Any,
        hasher: Any,
        workers: Any,
        counters: OffloadMetrics,
        on_failure: FailureCallback | None,
        prior_wait_s: float = 0.0,
    ) -> None:
        self.copier = copier
        self.storage = storage
        self.hasher = hasher
        self._workers = workers
        self._counters = counters
        self._on_failure = on_failure
        self.prior_wait_s = prior_wait_s
        self._adopt = adopts_from(storage, copier.host_pool)  # writes hand the host pages over (module doc)
        self._stopping = False  # stop_waiting(): writes made now attempt once
        # (tally, host pages, future, the PriorWaitingWrite or None), in submission order
        self._writes: deque[tuple[RequestWrites, list[int], Any, PriorWaitingWrite | None]] = deque()
        self.ended: list[RequestWrites] = []  # released lifecycles whose last write has ended (take_ended)
        self.reports_pending = 0  # released lifecycles not reported yet (end() to report_stored())
        self.announcer: Any = None  # a kvstage.events.KVEventAnnouncer: told each write's pages and tokens

    @property
    def writes_pending(self) -> int:
        """Store writes submitted and not yet collected by :meth:`poll` (parked ones too)."""
        return len(self._writes)

    @property
    def writes_parked(self) -> int:
        """Store writes waiting for their prior page (no thread runs them now)."""
        return sum(1 for _, _, future, job in self._writes if job is not None and job.parked and not future.done())

    def settle(
        self, writes: RequestWrites, chain: RequestChain, run: ChainRun, result: CopyResult, *, discard: bool
    ) -> None:
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
                keys = self._keys_or_empty(chain, run)
                chain.failed(keys, result.error, "device-to-host copy")  # its successors are refused at once
                self.report_failure(req, keys, result.error)
                return
            counters.pages_offloaded += pages
            counters.bytes_offloaded += result.bytes
            counters.copy_seconds += result.seconds
            if discard:
                counters.pages_discarded += pages
                return
            tokens = run.tokens  # keys_of drops them
            try:
                keys = chain.keys_of(run, self.hasher)
            except Exception as error:  # e.g. a token id the hash scheme cannot encode
                counters.pages_failed += pages
                writes.pages_failed += pages
                logger.error("offload: page keys of %d pages of rid=%r failed: %r", pages, req.rid, error)
                self.report_failure(req, [], error)
                return
            host_pages = [self.copier.host_pool.page(host_page_id) for host_page_id in result.host_page_ids]
            announce = None if self.announcer is None or tokens is None else (tokens, request_namespace(req))
            put = self._put(chain, keys, host_pages, run.prior_key, announce)
            job = None
            if self.prior_wait_s > 0 and not self._stopping:
                job = PriorWaitingWrite(self._workers.write, put, keys, self.prior_wait_s, chain.record_write)
                job.start()
                write = job.future
            else:
                write = self._workers.write(lambda: chain.record_write(put()))
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
        self.reports_pending += 1
        if writes.writes_pending == 0:
            self.ended.append(writes)

    def take_ended(self) -> list[RequestWrites]:
        """The released lifecycles whose last write has ended since the last call, in the
        order they ended."""
        ended, self.ended = self.ended, []
        return ended

    def wait(self) -> None:
        """Block until every submitted write has ended, parked ones too (each up to its
        ``prior_wait_s``): drain, flush, close."""
        wait_futures([future for _, _, future, _ in list(self._writes)])

    def stop_waiting(self, stopping: bool) -> None:
        """``True``: parked writes end now with their refusal, and writes made until
        ``stop_waiting(False)`` attempt once (a flush: no page of the old weights may land
        after ``clear``)."""
        self._stopping = stopping
        if stopping:
            for _, _, _, job in list(self._writes):
                if job is not None:
                    job.stop()

    def report_stored(self, on_stored: Callable[[Any, int, int], None] | None, writes: RequestWrites) -> None:
        """Call ``on_stored(req, pages_stored, pages_failed)`` for an ended lifecycle (the
        manager's callback, or None); an exception it raises is counted and logged."""
        self.reports_pending -= 1
        if on_stored is None:
            return
        try:
            on_stored(writes.req, writes.pages_stored, writes.pages_failed)
        except Exception:
            self._counters.callback_errors += 1
            logger.exception("offload: on_stored callback raised for rid=%r", writes.req.rid)

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

    def _put(
        self, chain: RequestChain, keys: list[str], pages: list[Any], prior_key: str | None, announce: Any = None
    ) -> Callable[[], WriteOutcome]:
        """One attempt of a write, for the writer thread: refused without a store call when
        its prior failed in this manager (a copy, or a write that ran before it). ``announce``:
        ``(tokens, namespace)`` for the announcer, told the outcome."""

        def put() -> WriteOutcome:
            refusal = chain.refusal(prior_key)
            if refusal is not None:
                return WriteOutcome(failed_keys=list(keys), error=refusal)
            storage = self.storage
            adopt = self._adopt and all(map(storage.adoptable, pages))  # (a page can hold a lent-in one: not)
            outcome = write_pages(storage, keys, pages, prior_key=prior_key, adopt=adopt)
            if announce is not None:
                self.announcer.written(keys, announce[0], prior_key, announce[1], outcome.failed_keys)
            return outcome

        return put

    def _written(self, writes: RequestWrites, host_page_ids: list[int], future: Any) -> None:
        outcome = future.result()
        if any(outcome.adopted):  # the store keeps those pages' buffers: its spares take their place
            spares, host_pool = list(outcome.spares), self.copier.host_pool
            for host_page_id, adopted in zip(host_page_ids, outcome.adopted):
                if adopted:
                    host_pool.replace(host_page_id, spares.pop() if spares else None)
        self.copier.free(host_page_ids)
        self._counters.pages_in_flight -= len(host_page_ids)
        writes.writes_pending -= 1
        if writes.released and writes.writes_pending == 0:
            self.ended.append(writes)
        self._account(writes, len(host_page_ids), outcome)

    def _account(self, writes: RequestWrites, pages: int, outcome: WriteOutcome) -> None:
        """Count a write's outcome (``pages`` host pages) and report its failed pages."""
        req = writes.req
        counters = self._counters
        counters.pages_stored += outcome.stored
        counters.pages_deduplicated += outcome.deduplicated
        writes.pages_stored += outcome.stored + outcome.deduplicated
        writes.pages_failed += len(outcome.failed_keys)
        if outcome.failed_keys:
            counters.pages_failed += len(outcome.failed_keys)
            counters.storage_failures += 1
            logger.warning(
                "offload: storage write failed for %d of %d pages of rid=%r%s",
                len(outcome.failed_keys),
                pages,
                req.rid,
                f": {outcome.error!r}" if outcome.error is not None else "",
            )
            self.report_failure(req, outcome.failed_keys, outcome.error)
