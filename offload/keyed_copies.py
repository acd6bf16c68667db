"""KeyedCopies: store and load pages whose keys the engine names, between a KV pool and a store.

The offload manager derives keys from a request's tokens; an engine that keys pages itself
(vLLM's offloading worker gets block hashes from its scheduler) needs only the two moves:

    store:  gather the pages' slots into host pages (copy stream) -> write them under the
            given keys (writer thread) -> free the host pages
    load:   read the keys into host pages (reader thread; a page not read fails the job)
            -> scatter them into the slots (copy stream) -> free the host pages

Each job is the caller's token; :meth:`KeyedCopies.poll` moves jobs along and returns the
finished ones, never blocking. Host pages are allocated when a job is submitted; a job that
finds too few free is refused (``False``) and nothing changes.

Not thread-safe: one thread submits and polls; only store calls run on the worker threads.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Sequence

import torch

from kvstage.errors import InvalidArgumentError, require
from kvstage.offload.copier import GATHER, Copier
from kvstage.offload.store_io import write_pages

__all__ = ["KeyedCopies", "KeyedResult"]


@dataclass(frozen=True)
class KeyedResult:
    """How one job ended.

    Attributes:
        job: the caller's token.
        is_store: True for a store, False for a load.
        ok: every page moved (a store: written or already held; a load: read and scattered).
        num_pages: pages of the job.
        bytes: bytes moved to or from the store (0 when the job failed before moving).
        seconds: wall time from submission to the end.
        error: what a copy or the store raised, or None.
    """

    job: Any
    is_store: bool
    ok: bool
    num_pages: int
    bytes: int
    seconds: float
    error: BaseException | None = None


@dataclass
class _Job:
    job: Any
    is_store: bool
    page_keys: list[str]
    slot_indices: torch.Tensor
    host_page_ids: list[int]
    started: float = field(default_factory=time.perf_counter)
    future: Future | None = None


class KeyedCopies:
    """Stores and loads of keyed pages through a :class:`Copier` and :class:`StoreWorkers`.

    Args:
        copier: moves pages between the KV pool and its host pool.
        storage: a :class:`kvstage.storage.StorageBackend` of the host pool's page size.
        workers: a :class:`kvstage.offload.StoreWorkers` (writes on its writer, reads on a reader).

    Raises:
        InvalidArgumentError: the store's page size differs from the host pool's.
    """

    def __init__(self, copier: Copier, storage: Any, workers: Any) -> None:
        page_bytes = copier.host_pool.page_bytes
        require(
            storage.page_bytes == page_bytes, "storage",
            lambda: f"holds pages of {storage.page_bytes} bytes, the host pool's are {page_bytes}",
        )
        self.copier = copier
        self.storage = storage
        self.workers = workers
        self._gathering: dict[int, _Job] = {}  # id(job token) -> job, while its gather runs
        self._scattering: dict[int, _Job] = {}
        self._in_store: list[_Job] = []  # writes and reads running on the worker threads
        self._finished: list[KeyedResult] = []

    # -- submission -------------------------------------------------------------------------

    def store(self, job: Any, slot_indices: torch.Tensor, page_keys: Sequence[str], *, after: Any = None) -> bool:
        """Copy the pages at ``slot_indices`` out and write them under ``page_keys``.

        Args:
            job: the caller's token (distinct objects for jobs in flight together).
            slot_indices: 1-D int tensor of ``len(page_keys) * page_size`` slots, page by page,
                on the KV pool's device.
            page_keys: the pages' keys, one run of a hash chain in order.
            after: the producer the copy waits for (see :meth:`CopyStream.submit`; CUDA: None
                is the stream current now, e.g. the engine's forward stream).

        Returns:
            False when the host pool has too few free pages (nothing started).

        Raises:
            InvalidArgumentError: the slots are not ``len(page_keys)`` whole pages, or as
                :meth:`Copier.gather`; nothing started.
        """
        keys = self._checked_keys(page_keys, slot_indices)
        record = _Job(job, True, keys, slot_indices, [])
        host_page_ids = self.copier.gather(record, slot_indices, after=after)
        if host_page_ids is None:
            return False
        record.host_page_ids = host_page_ids
        self._gathering[id(record)] = record
        return True

    def load(self, job: Any, page_keys: Sequence[str], slot_indices: torch.Tensor) -> bool:
        """Read ``page_keys`` and copy them into ``slot_indices`` (all or the job fails).

        Returns:
            False when the host pool has too few free pages (nothing started).

        Raises:
            InvalidArgumentError: as :meth:`store`.
        """
        keys = self._checked_keys(page_keys, slot_indices)
        self.copier.check_slot_indices(slot_indices, "slot_indices", distinct=True)
        host_page_ids = self.copier.alloc(len(keys))
        if host_page_ids is None:
            return False
        record = _Job(job, False, keys, slot_indices, host_page_ids)
        pages = [self.copier.host_pool.page(page) for page in host_page_ids]
        storage = self.storage
        record.future = self.workers.read(lambda: list(storage.get(keys, pages)))
        self._in_store.append(record)
        return True

    # -- progress ---------------------------------------------------------------------------

    def poll(self) -> list[KeyedResult]:
        """Move jobs along and return those that finished since the last call; never blocks."""
        self._progress()
        finished, self._finished = self._finished, []
        return finished

    def _progress(self) -> None:
        for result in self.copier.poll():
            record: _Job = result.job
            if result.direction == GATHER:
                del self._gathering[id(record)]
                if not result.ok:
                    self._finish(record, ok=False, moved=0, error=result.error)
                    continue
                pages = [self.copier.host_pool.page(page) for page in record.host_page_ids]
                # partial binds this job's keys and pages now (a lambda here would see the last job's)
                record.future = self.workers.write(partial(write_pages, self.storage, record.page_keys, pages))
                self._in_store.append(record)
            else:
                del self._scattering[id(record)]
                self._finish(record, ok=result.ok, moved=result.bytes if result.ok else 0, error=result.error)
        waiting = []
        for record in self._in_store:
            if not record.future.done():
                waiting.append(record)
            elif record.is_store:
                self._written(record)
            else:
                self._read(record)
        self._in_store = waiting

    def wait(self, jobs: Sequence[Any] | None = None) -> None:
        """Block until the given jobs (None: every job) finished; their results stay for
        :meth:`poll`."""
        wanted = None if jobs is None else list(jobs)

        def pending() -> list[_Job]:
            records = [*self._gathering.values(), *self._scattering.values(), *self._in_store]
            return [r for r in records if wanted is None or any(r.job is job or r.job == job for job in wanted)]

        while pending():
            self._progress()
            running = [r.future for r in pending() if r.future is not None and not r.future.done()]
            if running:
                wait(running, timeout=0.01)
            else:
                self.copier.synchronize()

    @property
    def jobs_in_flight(self) -> int:
        """Jobs submitted and not yet returned by :meth:`poll` as finished."""
        return len(self._gathering) + len(self._scattering) + len(self._in_store)

    # -- internals --------------------------------------------------------------------------

    def _written(self, record: _Job) -> None:
        error = record.future.exception()
        outcome = None if error is not None else record.future.result()
        failed = len(record.page_keys) if outcome is None else len(outcome.failed_keys)
        error = error if outcome is None else outcome.error
        self._finish(record, ok=failed == 0, moved=(len(record.page_keys) - failed) * self.storage.page_bytes, error=error)

    def _read(self, record: _Job) -> None:
        error = record.future.exception()
        hits = [] if error is not None else record.future.result()
        if error is not None or not all(hits) or len(hits) != len(record.page_keys):
            self._finish(record, ok=False, moved=0, error=error)
            return
        self._scattering[id(record)] = record
        try:
            self.copier.scatter(record, record.host_page_ids, record.slot_indices)
        except BaseException as failure:
            del self._scattering[id(record)]
            self._finish(record, ok=False, moved=0, error=failure)

    def _finish(self, record: _Job, *, ok: bool, moved: int, error: BaseException | None) -> None:
        self.copier.free(record.host_page_ids)
        self._finished.append(
            KeyedResult(record.job, record.is_store, ok, len(record.page_keys), moved, time.perf_counter() - record.started, error)
        )

    def _checked_keys(self, page_keys: Sequence[str], slot_indices: torch.Tensor) -> list[str]:
        keys = list(page_keys)
        page_size = self.copier.page_size
        if not isinstance(slot_indices, torch.Tensor) or slot_indices.dim() != 1 or slot_indices.numel() != len(keys) * page_size:
            shape = tuple(slot_indices.shape) if isinstance(slot_indices, torch.Tensor) else type(slot_indices).__name__
            raise InvalidArgumentError(
                f"slot_indices: must be a 1-D tensor of {len(keys)} pages x {page_size} slots for the page_keys, got {shape}"
            )
        if len(set(keys)) != len(keys):
            raise InvalidArgumentError("page_keys: a key appears twice in one job")
        return keys
