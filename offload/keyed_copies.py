"""KeyedCopies: store and load pages whose keys the engine names, between a KV pool and a store.

The offload manager derives keys from a request's tokens; an engine that keys pages itself
(vLLM's offloading worker gets block hashes from its scheduler) needs only the two moves:

    store:  gather the pages' slots into host pages (copy stream) -> write them under the
            given keys (writer thread) -> free the host pages
    load:   read the keys into host pages (reader thread; a page not read fails the job, the
            pages before it still land) -> scatter them into the slots (copy stream) -> free
            the host pages

Each job is the caller's token; :meth:`KeyedCopies.poll` moves jobs along and returns the
finished ones, never blocking. A job is never refused for want of host pages: it moves in parts
of at most the host pool's pages, and a part that finds too few free waits, in submission order,
until earlier parts free theirs (the engine keeps the job's device slots until it finishes).

Not thread-safe: one thread submits and polls; only store calls run on the worker threads.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Sequence

import torch

from kvstage.errors import InvalidArgumentError, require
from kvstage.offload.copier import GATHER, Copier
from kvstage.offload.store_io import read_pages, write_pages

__all__ = ["KeyedCopies", "KeyedResult", "chain_runs", "checked_keys", "timed"]


def chain_runs(
    page_keys: Sequence[str], prior_keys: Sequence[str | None] | None = None
) -> list[tuple[int, int, str | None]]:
    """Split pages into runs of one chain each, for stores' ``put`` (one run a call).

    Args:
        page_keys: the pages' keys, in order.
        prior_keys: the key of the page before each page in its chain, one per page; None at
            ``i``: ``page_keys[i - 1]`` (or, at 0, the chain starts there). None: one run, a
            chain start.

    Returns:
        ``(start, stop, prior_key)`` of each run, in order: ``page_keys[start:stop]`` with
        ``prior_key`` the page before ``page_keys[start]`` (None: a chain start).

    Raises:
        InvalidArgumentError: ``prior_keys`` does not give one entry per page.
    """
    if prior_keys is None:
        return [(0, len(page_keys), None)] if page_keys else []
    if len(prior_keys) != len(page_keys):
        raise InvalidArgumentError(
            f"prior_keys: must give one entry per page key, got {len(prior_keys)} for {len(page_keys)} keys"
        )
    runs, start = [], 0
    for index in range(1, len(page_keys) + 1):
        if index == len(page_keys) or (prior_keys[index] is not None and prior_keys[index] != page_keys[index - 1]):
            runs.append((start, index, prior_keys[start]))
            start = index
    return runs


def checked_keys(page_keys: Sequence[str], slot_indices: Any, page_size: int) -> list[str]:
    """``page_keys`` as a list, checked against a job's slots: ``slot_indices`` a 1-D tensor of
    ``len(page_keys) * page_size`` slots, no key twice.

    Raises:
        InvalidArgumentError: naming ``slot_indices`` or ``page_keys``.
    """
    keys = list(page_keys)
    if (
        not isinstance(slot_indices, torch.Tensor)
        or slot_indices.dim() != 1
        or slot_indices.numel() != len(keys) * page_size
    ):
        shape = tuple(slot_indices.shape) if isinstance(slot_indices, torch.Tensor) else type(slot_indices).__name__
        raise InvalidArgumentError(
            f"slot_indices: must be a 1-D tensor of {len(keys)} pages x {page_size} slots for the page_keys, got {shape}"
        )
    if len(set(keys)) != len(keys):
        raise InvalidArgumentError("page_keys: a key appears twice in one job")
    return keys


def timed(seconds: dict[str, float], step: str, call: Any, *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``, its wall time added to ``seconds[step]`` (also when it raises)."""
    started = time.perf_counter()
    try:
        return call(*args, **kwargs)
    finally:
        seconds[step] += time.perf_counter() - started


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
        error: what a copy or the store raised, or None (a load that failed with None: a page
            missing or corrupt in the store).
        loaded_pages: a load: how many of its leading pages landed in their slots (scatter
            done), all of them when ``ok``; the page at this index is the first one that did not
            (the slots from it on are untouched or stale). A store: 0.
        failed_keys: a store: the keys not written (the store refused or failed them, or the
            write raised), in job order; empty when ``ok``. A load: empty.
    """

    job: Any
    is_store: bool
    ok: bool
    num_pages: int
    bytes: int
    seconds: float
    error: BaseException | None = None
    loaded_pages: int = 0
    failed_keys: tuple[str, ...] = ()


@dataclass
class _Job:
    """One submitted job: its parts' outcomes add up here."""

    job: Any
    is_store: bool
    num_pages: int
    parts_left: int
    after: Any = None
    moved: int = 0
    ok: bool = True
    error: BaseException | None = None
    first_failed: int | None = None  # a load: the lowest page index that did not land
    failed_keys: list[tuple[int, list[str]]] = field(default_factory=list)  # a store: (part start, keys not written)
    started: float = field(default_factory=time.perf_counter)

    def skips(self, part: "_Part") -> bool:
        """A load's part after a page that did not land is neither read nor scattered."""
        return self.first_failed is not None and part.start >= self.first_failed


@dataclass
class _Part:
    """At most the host pool's pages of one job, moved together."""

    owner: _Job
    page_keys: list[str]
    slot_indices: torch.Tensor
    prior_key: str | None = None  # the stored page before page_keys[0] (None: a chain start)
    start: int = 0  # index of page_keys[0] in the job
    landed: int = 0  # a load: leading pages being scattered
    host_page_ids: list[int] = field(default_factory=list)
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
            storage.page_bytes == page_bytes,
            "storage",
            lambda: f"holds pages of {storage.page_bytes} bytes, the host pool's are {page_bytes}",
        )
        self.copier = copier
        self.storage = storage
        self.workers = workers
        self._waiting: deque[_Part] = deque()  # parts waiting for host pages, in submission order
        self._copying: dict[int, _Part] = {}  # id(part) -> part, while its gather or scatter runs
        self._in_store: list[_Part] = []  # writes and reads running on the worker threads
        self._finished: list[KeyedResult] = []
        # seconds spent in each step, summed over jobs (gather / scatter: the copies' own time;
        # put / get: the store calls on the worker threads, each step added by one thread)
        self.step_seconds = {"gather": 0.0, "put": 0.0, "get": 0.0, "scatter": 0.0}

    # -- submission -------------------------------------------------------------------------

    def store(
        self,
        job: Any,
        slot_indices: torch.Tensor,
        page_keys: Sequence[str],
        *,
        after: Any = None,
        prior_keys: Sequence[str | None] | None = None,
    ) -> None:
        """Copy the pages at ``slot_indices`` out and write them under ``page_keys``; the
        copies start as host pages are free (the slots must keep their KV until the job ends).
        Pages are written in order, one ``put`` per run of one chain (see :func:`chain_runs`),
        each with the page before it as ``prior_key``, so a chain stored in several jobs stays
        one chain for the store's eviction.

        Args:
            job: the caller's token (distinct objects for jobs in flight together).
            slot_indices: 1-D int tensor of ``len(page_keys) * page_size`` slots, page by page,
                on the KV pool's device.
            page_keys: the pages' keys, in chain order.
            after: the producer the copy waits for (see :meth:`CopyStream.submit`; CUDA: None
                is the stream current when a part's copy starts, e.g. the engine's forward
                stream).
            prior_keys: the key before each page in its chain (as :func:`chain_runs`); None:
                the pages are one run starting a chain.

        Raises:
            InvalidArgumentError: the slots are not ``len(page_keys)`` whole pages, a key
                repeats, ``prior_keys`` is not one entry per key, or as
                :meth:`Copier.check_slot_indices`; nothing started.
        """
        keys = checked_keys(page_keys, slot_indices, self.copier.page_size)
        runs = chain_runs(keys, prior_keys)
        self.copier.check_slot_indices(slot_indices, "slot_indices")
        self._queue(_Job(job, True, len(keys), 0, after=after), keys, slot_indices, runs)

    def load(self, job: Any, page_keys: Sequence[str], slot_indices: torch.Tensor) -> None:
        """Read ``page_keys`` and copy them into ``slot_indices``. The job fails when a page
        cannot be read (missing, corrupt); the pages before it still land (the job ends after
        their scatter) and :attr:`KeyedResult.loaded_pages` counts them; parts after it not
        yet read are skipped, their slots untouched.

        Args:
            job: the caller's token (distinct objects for jobs in flight together).
            page_keys: the pages' keys, in slot order.
            slot_indices: 1-D int tensor (int64 or int32) of ``len(page_keys) * page_size``
                distinct slots, page by page, on the KV pool's device.

        Raises:
            InvalidArgumentError: as :meth:`store`, or a slot appears twice; nothing started.
        """
        keys = checked_keys(page_keys, slot_indices, self.copier.page_size)
        self.copier.check_slot_indices(slot_indices, "slot_indices", distinct=True)
        self._queue(_Job(job, False, len(keys), 0), keys, slot_indices)

    def _queue(
        self,
        record: _Job,
        keys: list[str],
        slot_indices: torch.Tensor,
        runs: list[tuple[int, int, str | None]] | None = None,
    ) -> None:
        per_part = self.copier.host_pool.capacity
        page_size = self.copier.page_size
        # parts of at most the host pool's pages, never across runs of different chains
        bounds = [
            (start, min(start + per_part, stop), prior if start == run_start else keys[start - 1])
            for run_start, stop, prior in (runs if runs is not None else chain_runs(keys))
            for start in range(run_start, stop, per_part)
        ]
        record.parts_left = len(bounds)
        if not bounds:
            self._finished.append(KeyedResult(record.job, record.is_store, True, 0, 0, 0.0))
            return
        for start, stop, prior in bounds:
            self._waiting.append(
                _Part(
                    record,
                    keys[start:stop],
                    slot_indices[start * page_size : stop * page_size],
                    prior_key=prior,
                    start=start,
                )
            )
        self._start_waiting()

    def _start_waiting(self) -> None:
        """Start waiting parts, oldest first, while their host pages are free."""
        while self._waiting:
            part = self._waiting[0]
            if part.owner.is_store:
                host_page_ids = self.copier.gather(part, part.slot_indices, after=part.owner.after, checked=True)
                if host_page_ids is None:
                    return
                part.host_page_ids = host_page_ids
                self._copying[id(part)] = part
            elif part.owner.skips(part):  # an earlier page did not land: the job fails whatever this part reads
                self._waiting.popleft()
                self._end_part(part, moved=0, error=None, ok=False)
                continue
            else:
                host_page_ids = self.copier.alloc(len(part.page_keys))
                if host_page_ids is None:
                    return
                part.host_page_ids = host_page_ids
                pages = [self.copier.host_pool.page(page) for page in host_page_ids]
                try:
                    part.future = self.workers.read(
                        partial(timed, self.step_seconds, "get", read_pages, self.storage, part.page_keys, pages)
                    )
                except BaseException as failure:  # e.g. the workers were closed: the part ends, its pages go back
                    self._waiting.popleft()
                    self._end_part(part, moved=0, error=failure, ok=False)
                    continue
                self._in_store.append(part)
            self._waiting.popleft()

    # -- progress ---------------------------------------------------------------------------

    def poll(self) -> list[KeyedResult]:
        """Move jobs along and return those that finished since the last call; never blocks."""
        self._progress()
        finished, self._finished = self._finished, []
        return finished

    def _progress(self) -> None:
        for result in self.copier.poll():
            part: _Part = result.job
            del self._copying[id(part)]
            self.step_seconds[result.direction] += result.seconds
            if result.direction == GATHER:
                if not result.ok:
                    self._end_part(part, moved=0, error=result.error, ok=False)
                    continue
                pages = [self.copier.host_pool.page(page) for page in part.host_page_ids]
                # partial binds this part's keys and pages now (a lambda here would see the last part's)
                part.future = self.workers.write(
                    partial(
                        timed,
                        self.step_seconds,
                        "put",
                        write_pages,
                        self.storage,
                        part.page_keys,
                        pages,
                        prior_key=part.prior_key,
                    )
                )
                self._in_store.append(part)
            else:
                landed = part.landed if result.ok else 0
                self._end_part(
                    part,
                    moved=result.bytes if result.ok else 0,
                    error=result.error,
                    ok=landed == len(part.page_keys),
                    landed=landed,
                )
        waiting = []
        for part in self._in_store:
            if not part.future.done():
                waiting.append(part)
            elif part.owner.is_store:
                self._written(part)
            else:
                self._read(part)
        self._in_store = waiting
        self._start_waiting()

    def wait(self, jobs: Sequence[Any] | None = None, *, timeout: float | None = None) -> bool:
        """Block until the given jobs (None: every job) finished, or ``timeout`` seconds
        passed (None: no limit); their results stay for :meth:`poll`.

        Returns:
            Whether every given job finished.
        """
        wanted = None if jobs is None else list(jobs)
        deadline = None if timeout is None else time.monotonic() + timeout

        def pending() -> list[_Part]:
            parts = [*self._waiting, *self._copying.values(), *self._in_store]
            return [
                p for p in parts if wanted is None or any(p.owner.job is job or p.owner.job == job for job in wanted)
            ]

        while pending():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self._progress()
            running = [part.future for part in self._in_store if not part.future.done()]
            if running:
                wait(running, timeout=0.01)
            else:
                self.copier.synchronize()
        return True

    @property
    def jobs_in_flight(self) -> int:
        """Jobs submitted and not yet finished (waiting for host pages, copying, or in the
        store)."""
        parts = [*self._waiting, *self._copying.values(), *self._in_store]
        return len({id(part.owner) for part in parts})

    # -- internals --------------------------------------------------------------------------

    def _written(self, part: _Part) -> None:
        error = part.future.exception()
        outcome = None if error is not None else part.future.result()
        failed = list(part.page_keys) if outcome is None else list(outcome.failed_keys)
        error = error if outcome is None else outcome.error
        moved = (len(part.page_keys) - len(failed)) * self.storage.page_bytes
        self._end_part(part, moved=moved, error=error, ok=not failed, failed_keys=failed)

    def _read(self, part: _Part) -> None:
        error = part.future.exception()
        part.landed = 0 if error is not None or part.owner.skips(part) else part.future.result()
        if part.landed == 0:
            self._end_part(
                part, moved=0, error=error, ok=False, landed=0
            )  # never scatter past a page that did not land
            return
        self._copying[id(part)] = part
        page_size = self.copier.page_size
        try:  # the leading pages read; the rest of the part's slots stay untouched
            self.copier.scatter(part, part.host_page_ids[: part.landed], part.slot_indices[: part.landed * page_size])
        except BaseException as failure:
            del self._copying[id(part)]
            self._end_part(part, moved=0, error=failure, ok=False, landed=0)

    def _end_part(
        self,
        part: _Part,
        *,
        moved: int,
        error: BaseException | None,
        ok: bool,
        landed: int = 0,
        failed_keys: list[str] | None = None,
    ) -> None:
        """``failed_keys``: a store part's keys not written (None: all of them unless ``ok``)."""
        self.copier.free(part.host_page_ids)
        record = part.owner
        if record.is_store and not ok:
            record.failed_keys.append((part.start, list(part.page_keys) if failed_keys is None else failed_keys))
        record.moved += moved
        record.ok = record.ok and ok
        record.error = record.error or error
        if not record.is_store and landed < len(part.page_keys):
            failed = part.start + landed
            record.first_failed = failed if record.first_failed is None else min(record.first_failed, failed)
        record.parts_left -= 1
        if record.parts_left == 0:
            loaded = (
                0 if record.is_store else (record.num_pages if record.first_failed is None else record.first_failed)
            )
            self._finished.append(
                KeyedResult(
                    record.job,
                    record.is_store,
                    record.ok,
                    record.num_pages,
                    record.moved,
                    time.perf_counter() - record.started,
                    record.error,
                    loaded_pages=loaded,
                    failed_keys=tuple(key for _, keys in sorted(record.failed_keys) for key in keys),
                )
            )
