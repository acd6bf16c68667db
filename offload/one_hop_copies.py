"""OneHopCopies: keyed stores and loads that copy each byte once, between blocks in host memory
and a store that adopts and lends pages.

:class:`kvstage.offload.KeyedCopies` moves a page twice on the way to a store (a gather into a
host page, then the store's ``put`` copies it into its own buffer) and twice back (``get`` into
a host page, then a scatter): on a CPU both are memory copies, so a store or load runs at about
half of one ``copy_`` of the same bytes (``bench/bench_vllm.py``). Where the blocks live in host
memory (vLLM's canonical block tensors on a CPU) and the store keeps the caller's page tensors
and lends its own (:func:`kvstage.storage.backend.adopts_pages`, ``lends_pages``), one copy
each way is enough:

    store:  copy each block's rows into a spare page buffer (writer thread) -> ``put_adopting``
            (the store keeps the buffers it stores and hands back its victims' as spares)
    load:   ``lend`` the pages (reader thread) -> copy them into the blocks' rows -> end the loan

A page's bytes are its block's rows, layer after layer: the host page of ``KeyedCopies`` over
the same blocks (``KVPool.mla`` of the layers, ``page_size=1``), so either path reads what the
other wrote. A part's row copies run in :class:`kvstage.offload.row_copies.RowCopies` (split between
the worker thread and helper threads: torch's ``copy_`` of many rows is slow on a worker thread).
Jobs move in parts of at most ``part_pages`` pages (the buffers a store job holds
at once, the pages a load holds on loan). Same calls and :class:`KeyedResult` as
``KeyedCopies``; not thread-safe (one thread submits and polls).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvstage.errors import InvalidArgumentError, StorageError, is_int, require
from kvstage.offload.keyed_copies import KeyedResult, chain_runs, checked_keys
from kvstage.offload.row_copies import RowCopies
from kvstage.storage import PutStatus
from kvstage.storage.backend import adopts_pages, lends_pages

__all__ = ["OneHopCopies"]


@dataclass
class _Job:
    job: Any
    is_store: bool
    keys: list[str]
    future: Future
    started: float

    @property
    def num_pages(self) -> int:
        return len(self.keys)


class OneHopCopies:
    """Stores and loads of keyed pages, one copy of each byte, on :class:`StoreWorkers` threads.

    Args:
        layers: each layer's blocks, ``uint8 [num_blocks, row_bytes]`` contiguous CPU tensors
            with the same ``num_blocks``; a page is one block's rows in layer order.
        storage: a store of ``sum(row_bytes)``-byte pages that adopts and lends pages.
        workers: a :class:`kvstage.offload.StoreWorkers` (stores on its writer, loads on a reader).
        part_pages: pages moved together (>= 1); also the spare buffers kept at most.
        copy_threads: threads that copy a part's rows (:class:`RowCopies`; None: as many as
            one ``copy_`` uses).

    Raises:
        InvalidArgumentError: a layer is not such a tensor, the store's page size is not the
            rows' bytes, the store does not adopt and lend pages, ``part_pages`` < 1, or
            ``copy_threads`` < 1.
    """

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        storage: Any,
        workers: Any,
        *,
        part_pages: int,
        copy_threads: int | None = None,
    ) -> None:
        layers = list(layers)
        require(layers, "layers", "must hold at least one layer")
        for index, rows in enumerate(layers):
            require(
                isinstance(rows, torch.Tensor)
                and rows.device.type == "cpu"
                and rows.dtype == torch.uint8
                and rows.dim() == 2
                and rows.is_contiguous()
                and rows.shape[0] == layers[0].shape[0],
                f"layers[{index}]",
                lambda: (
                    "must be a contiguous uint8 CPU tensor [num_blocks, row_bytes] like layers[0], got "
                    + (
                        f"{rows.dtype} {tuple(rows.shape)} on {rows.device}"
                        if isinstance(rows, torch.Tensor)
                        else type(rows).__name__
                    )
                ),
            )
        page_bytes = sum(rows.shape[1] for rows in layers)
        require(
            storage.page_bytes == page_bytes,
            "storage",
            lambda: f"holds pages of {storage.page_bytes} bytes, a block's rows are {page_bytes}",
        )
        require(
            adopts_pages(storage) and lends_pages(storage),
            "storage",
            lambda: f"{type(storage).__name__} does not adopt and lend pages (put_adopting, lend)",
        )
        require(
            is_int(part_pages) and part_pages >= 1, "part_pages", lambda: f"must be an int >= 1, got {part_pages!r}"
        )
        require(
            copy_threads is None or (is_int(copy_threads) and copy_threads >= 1),
            "copy_threads",
            lambda: f"must be an int >= 1 or None, got {copy_threads!r}",
        )
        self._rows = RowCopies(copy_threads)  # last check: nothing to stop when a check above fails
        self.storage = storage
        self.workers = workers
        self.part_pages = part_pages
        self.num_blocks = layers[0].shape[0]
        self.page_bytes = page_bytes
        self._layers, start = [], 0
        for rows in layers:
            self._layers.append((rows, start, start + rows.shape[1]))
            start += rows.shape[1]
        self._spares: list[torch.Tensor] = []  # page buffers to fill next (taken and given on writer threads)
        self.buffers_allocated = 0  # page buffers allocated (a store at capacity hands back its victims')
        self._running: list[_Job] = []
        self._finished: list[KeyedResult] = []
        # seconds in each step, summed over jobs (gather / put on the writer thread, get / scatter on the reader)
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
        """Copy the blocks ``slot_indices`` into page buffers and hand them to the store under
        ``page_keys``, one ``put_adopting`` per run of one chain (:func:`chain_runs`) and part;
        the blocks must keep their KV until the job ends.

        Args:
            job: the caller's token.
            slot_indices: 1-D int32/int64 CPU tensor of block ids, one per key.
            page_keys: the pages' keys, in chain order.
            after: must be None (a CPU producer is done when the job is submitted).
            prior_keys: as :meth:`KeyedCopies.store`.

        Raises:
            InvalidArgumentError: as :meth:`KeyedCopies.store`, a block id out of range, or
                ``after`` given; nothing started.
        """
        require(after is None, "after", "must be None: one-hop copies run on CPU blocks, written when submitted")
        keys = checked_keys(page_keys, slot_indices, 1)
        runs = chain_runs(keys, prior_keys)
        blocks = self._blocks(slot_indices, distinct=False)
        self._submit(job, True, keys, self.workers.write, self._store, keys, blocks, runs)

    def load(self, job: Any, page_keys: Sequence[str], slot_indices: torch.Tensor) -> None:
        """Read ``page_keys`` (on loan) into the blocks ``slot_indices``. The job fails at the
        first page not stored; the pages before it land (:attr:`KeyedResult.loaded_pages`),
        the blocks from it on are untouched.

        Raises:
            InvalidArgumentError: as :meth:`store`, or a block appears twice; nothing started.
        """
        keys = checked_keys(page_keys, slot_indices, 1)
        blocks = self._blocks(slot_indices, distinct=True)
        self._submit(job, False, keys, self.workers.read, self._load, keys, blocks)

    def _submit(self, job: Any, is_store: bool, keys: list[str], run: Any, call: Any, *args: Any) -> None:
        started = time.perf_counter()
        num_pages = len(keys)
        if not num_pages:
            self._finished.append(KeyedResult(job, is_store, True, 0, 0, 0.0))
            return
        try:
            future = run(lambda: call(*args))
        except BaseException as failure:  # e.g. the workers were closed: the job ends, nothing moved
            self._finished.append(
                KeyedResult(
                    job, is_store, False, num_pages, 0, 0.0, failure, failed_keys=tuple(keys) if is_store else ()
                )
            )
            return
        self._running.append(_Job(job, is_store, keys, future, started))

    def _blocks(self, slot_indices: torch.Tensor, *, distinct: bool) -> list[int]:
        if slot_indices.dtype not in (torch.int32, torch.int64) or slot_indices.device.type != "cpu":
            raise InvalidArgumentError(
                f"slot_indices: must be an int32/int64 CPU tensor of block ids, got {slot_indices.dtype} on {slot_indices.device}"
            )
        blocks = slot_indices.tolist()
        if blocks and (min(blocks) < 0 or max(blocks) >= self.num_blocks):
            bad = min(blocks) if min(blocks) < 0 else max(blocks)
            raise InvalidArgumentError(f"slot_indices: every block must be in [0, {self.num_blocks}), got {bad}")
        if distinct and len(set(blocks)) != len(blocks):
            raise InvalidArgumentError("slot_indices: a block repeats (two pages would be written into one block)")
        return blocks

    # -- on the worker threads ----------------------------------------------------------------

    def _store(self, keys: list[str], blocks: list[int], runs: list) -> tuple[list[str], BaseException | None]:
        """Every part's put (writer thread): the keys not stored (in job order) and the first error."""
        failed: list[str] = []
        error = None
        steps = self.step_seconds
        for run_start, run_stop, prior in runs:
            for start in range(run_start, run_stop, self.part_pages):
                stop = min(start + self.part_pages, run_stop)
                part_keys = keys[start:stop]
                pages = [self._buffer() for _ in part_keys]
                try:
                    started = time.perf_counter()
                    self._rows.copy(
                        [
                            (page[low:high], rows[block])
                            for page, block in zip(pages, blocks[start:stop])
                            for rows, low, high in self._layers
                        ]
                    )
                    copied = time.perf_counter()
                    steps["gather"] += copied - started
                    answer, spares = self.storage.put_adopting(
                        part_keys, pages, prior_key=prior if start == run_start else keys[start - 1]
                    )
                    steps["put"] += time.perf_counter() - copied
                    statuses = list(answer)
                    if len(statuses) != len(part_keys):
                        raise StorageError(f"storage: put_adopting() answered {len(statuses)} keys of {len(part_keys)}")
                except Exception as raised:  # the part failed as a whole; its buffers are dropped (never reused)
                    failed.extend(part_keys)
                    error = error or raised
                    continue
                error = error or getattr(answer, "error", None)
                for key, page, status in zip(part_keys, pages, statuses):
                    if status is PutStatus.STORED:
                        continue  # the store's buffer now: never written again
                    if status is not PutStatus.DEDUPLICATED:
                        failed.append(key)
                    self._keep_spare(page)
                for spare in spares:
                    self._keep_spare(spare)
        return failed, error

    def _load(self, keys: list[str], blocks: list[int]) -> tuple[int, BaseException | None]:
        """Every part's loan and copies (reader thread): the leading pages landed and the error."""
        landed = 0
        steps = self.step_seconds
        try:
            for start in range(0, len(keys), self.part_pages):
                started = time.perf_counter()
                loan = self.storage.lend(keys[start : start + self.part_pages])
                lent = time.perf_counter()
                steps["get"] += lent - started
                try:
                    pages = list(loan.pages)
                    if len(pages) != len(keys[start : start + self.part_pages]):
                        raise StorageError(f"storage: lend() answered {len(pages)} pages")
                    stored = next((index for index, page in enumerate(pages) if page is None), len(pages))
                    self._rows.copy(
                        [
                            (rows[block], page[low:high])
                            for page, block in zip(pages[:stored], blocks[start:])
                            for rows, low, high in self._layers
                        ]
                    )
                    landed += stored
                    if stored < len(pages):
                        return landed, None  # not stored: the job ends here, later blocks untouched
                finally:
                    loan.end()
                    steps["scatter"] += time.perf_counter() - lent
        except Exception as raised:
            return landed, raised
        return landed, None

    def _buffer(self) -> torch.Tensor:
        """A spare page buffer, else a new one (list.pop is atomic: several writer threads may share the spares)."""
        try:
            return self._spares.pop()
        except IndexError:
            self.buffers_allocated += 1
            return torch.empty(self.page_bytes, dtype=torch.uint8)

    def _keep_spare(self, buffer: torch.Tensor) -> None:
        if len(self._spares) < self.part_pages and self.storage.adoptable(buffer):
            self._spares.append(buffer)

    # -- progress ---------------------------------------------------------------------------

    def poll(self) -> list[KeyedResult]:
        """Jobs that finished since the last call; never blocks."""
        running = []
        for record in self._running:
            if record.future.done():
                self._finished.append(self._result(record))
            else:
                running.append(record)
        self._running = running
        finished, self._finished = self._finished, []
        return finished

    def _result(self, record: _Job) -> KeyedResult:
        seconds = time.perf_counter() - record.started
        raised = record.future.exception()  # only a BaseException escapes the thread's call
        if record.is_store:
            failed, error = (list(record.keys), raised) if raised is not None else record.future.result()
            written = record.num_pages - len(failed)
            return KeyedResult(
                record.job,
                True,
                not failed,
                record.num_pages,
                written * self.page_bytes,
                seconds,
                error,
                failed_keys=tuple(failed),
            )
        landed, error = (0, raised) if raised is not None else record.future.result()
        return KeyedResult(
            record.job,
            False,
            landed == record.num_pages,
            record.num_pages,
            landed * self.page_bytes,
            seconds,
            error,
            loaded_pages=landed,
        )

    def wait(self, jobs: Sequence[Any] | None = None, *, timeout: float | None = None) -> bool:
        """Block until the given jobs (None: every job) finished, or ``timeout`` seconds passed;
        their results stay for :meth:`poll`. Returns whether every given job finished."""
        wanted = None if jobs is None else list(jobs)
        futures = [
            record.future
            for record in self._running
            if wanted is None or any(record.job is job or record.job == job for job in wanted)
        ]
        _, pending = wait(futures, timeout=timeout)
        return not pending

    def close(self) -> None:
        """Stop the row-copy threads; call after the jobs ended (:meth:`wait`). Idempotent."""
        self._rows.close()

    @property
    def jobs_in_flight(self) -> int:
        """Jobs submitted and not yet finished."""
        return sum(not record.future.done() for record in self._running)
