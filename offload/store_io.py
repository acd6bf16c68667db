"""Store I/O for the manager: the one function that writes pages to a store, the one that
reads a chain's leading pages back, and the worker threads they run on.

Every path that stores pages (decode strides, prompt pages, the replay) goes through
:func:`write_pages`, so outcomes are counted one way: each page ends ``STORED``,
``DEDUPLICATED`` or failed. Deduplication is asked once per page: the store's ``put`` skips a
key it holds (no separate ``exists`` round trip). Reads go through :func:`read_leading_pages`,
which ends a hit at the first page that cannot be read, so nothing after a hole is used;
:func:`read_pages` reads pages that must all be there (``KeyedCopies``' loads).

:class:`StoreWorkers` runs these calls off the engine's thread (``concurrent.futures``; one
writer and one reader thread by default, so a long backup queue never delays a prefetch).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from kvstage.errors import StorageError, is_int, require
from kvstage.nvtx_ranges import nvtx_range
from kvstage.storage import AdoptedPagesError, PutStatus
from kvstage.storage.backend import adopts_pages, lends_pages

__all__ = [
    "ReadOutcome",
    "StoreWorkers",
    "WriteOutcome",
    "adopts_from",
    "leading_hits",
    "lends_into",
    "read_failure_cause",
    "read_leading_pages",
    "read_leading_pages_into",
    "read_pages",
    "write_failure_cause",
    "write_pages",
]


@dataclass
class WriteOutcome:
    """How one batch of pages ended.

    Attributes:
        stored: pages written now.
        deduplicated: pages the store already held (or repeated earlier in the batch).
        failed_keys: keys not written (the store answered FAILED, or it failed as a whole).
        error: why pages failed: the exception the store raised (the whole batch failed), or
            the one its answer carries (:class:`kvstage.storage.PutStatuses` ``.error``, e.g. an
            ``OSError`` with errno ``EROFS`` or ``ENOSPC``, or a
            :class:`~kvstage.storage.MissingPriorError` naming the chain page the store lacks);
            None when no page failed because of an error (a page refused for room).
        adopted: a write with ``adopt``: per page given, whether the store kept its tensor
            (the caller must never touch it again); empty otherwise.
        spares: a write with ``adopt``: buffers the store gave back for those it kept (the
            evicted pages' memory, flat ``uint8``), the caller's to reuse.
    """

    stored: int = 0
    deduplicated: int = 0
    failed_keys: list[str] = field(default_factory=list)
    error: BaseException | None = None
    adopted: list[bool] = field(default_factory=list)
    spares: list[torch.Tensor] = field(default_factory=list)


def write_failure_cause(error: BaseException | None) -> str:
    """Why pages of a write failed, for a log line: the error (:attr:`WriteOutcome.error`), or,
    with none, what a store's FAILED without an error means (it had no room it may free)."""
    return "the store had no room for them (capacity full of pages it may not evict)" if error is None else repr(error)


def read_failure_cause(error: BaseException | None) -> str:
    """Why a read of pages failed, for a log line: the error the store or a copy raised, or,
    with none, the store's miss (a ``get`` answers False for a page absent or failing its checksum)."""
    return "page missing or corrupt in the store" if error is None else repr(error)


def _answer(answer: Any, expected: int, call: str) -> list:
    """A store's per-key answer as a list, or StorageError when it does not answer every key
    (zip would silently drop pages from the accounting)."""
    answer = list(answer)
    if len(answer) != expected:
        raise StorageError(f"storage: {call}() answered {len(answer)} keys of {expected}")
    return answer


def write_pages(
    storage: Any,
    page_keys: Sequence[str],
    pages: Sequence[torch.Tensor],
    *,
    prior_key: str | None = None,
    adopt: bool = False,
) -> WriteOutcome:
    """Write pages to a store under their keys and count each page's outcome; never raises.

    Args:
        storage: a :class:`kvstage.storage.StorageBackend`.
        page_keys: the pages' keys, one run of a hash chain in order.
        pages: CPU tensors of the store's page bytes (host pool pages).
        prior_key: the chain key before ``page_keys[0]`` (None: the chain starts here), so the
            store can evict chains from their tails.
        adopt: the store keeps the page tensors it stores instead of copying them
            (:meth:`MemoryStore.put_adopting <kvstage.storage.memory_store.MemoryStore.put_adopting>`;
            the store must have it): see :attr:`WriteOutcome.adopted` and ``spares``.

    Returns:
        A :class:`WriteOutcome`; a store that raises or answers the wrong number of statuses
        fails every page not known to be deduplicated.

    Runs inside the NVTX range ``backup``.
    """
    with nvtx_range("backup"):
        return _write_pages(storage, page_keys, pages, prior_key, adopt)


def _write_pages(
    storage: Any, page_keys: Sequence[str], pages: Sequence[torch.Tensor], prior_key: str | None, adopt: bool = False
) -> WriteOutcome:
    outcome = WriteOutcome(adopted=[False] * len(pages) if adopt else [])
    unique: dict[str, int] = {}
    for index, key in enumerate(page_keys):
        if key in unique:
            outcome.deduplicated += 1
        else:
            unique[key] = index
    keys = list(unique)
    try:
        given = [pages[unique[key]] for key in keys]
        if adopt:
            answer = ()
            try:
                answer, outcome.spares = storage.put_adopting(keys, given, prior_key=prior_key)
            except AdoptedPagesError as error:  # pages kept, then it failed: those are the store's
                answer, outcome.spares = error.statuses, error.spares
                raise  # the write failed (counted below), yet the kept pages' buffers are replaced
            finally:
                for key, status in zip(keys, answer):
                    outcome.adopted[unique[key]] = status is PutStatus.STORED
        else:
            answer = storage.put(keys, given, prior_key=prior_key)
        statuses = _answer(answer, len(keys), "put")
    except Exception as error:  # the store failed as a whole: no page of the batch counts as written
        outcome.error = error
        outcome.failed_keys = keys
        return outcome
    outcome.error = getattr(answer, "error", None)  # a PutStatuses' cause of its failed pages
    for key, status in zip(keys, statuses):
        if status is PutStatus.STORED:
            outcome.stored += 1
        elif status is PutStatus.DEDUPLICATED:
            outcome.deduplicated += 1
        else:
            outcome.failed_keys.append(key)
    return outcome


def leading_hits(storage: Any, page_keys: Sequence[str]) -> int:
    """Lookup: how many leading ``page_keys`` the store holds (one batched ``exists`` call).

    Raises:
        StorageError: the store answered a different number of keys than asked.
        Whatever the store's ``exists`` raises.
    """
    if not page_keys:
        return 0
    hits = _answer(storage.exists(list(page_keys)), len(page_keys), "exists")
    return next((index for index, hit in enumerate(hits) if not hit), len(hits))


def read_pages(storage: Any, page_keys: Sequence[str], pages: Sequence[torch.Tensor]) -> int:
    """Read every page (one ``get`` call); how many leading pages were read intact (all of
    them: ``len(page_keys)``; the first page missing or corrupt ends them).

    Raises:
        StorageError: the store answered a different number of keys than asked.
        Whatever the store's ``get`` raises.
    """
    keys = list(page_keys)
    hits = _answer(storage.get(keys, list(pages)), len(keys), "get")
    return next((index for index, hit in enumerate(hits) if not hit), len(hits))


@dataclass
class ReadOutcome:
    """How a read of a chain's leading pages ended.

    Attributes:
        pages_read: the leading pages now in the host pages (a hole ends them).
        hole: a page was asked and not read (the store missed it although asked for it).
        error: what the store raised, or None.
    """

    pages_read: int = 0
    hole: bool = False
    error: BaseException | None = None


def read_leading_pages(
    storage: Any,
    page_keys: Sequence[str],
    pages: Sequence[torch.Tensor],
    *,
    batch_pages: int = 16,
    on_progress: Callable[[int], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> ReadOutcome:
    """Read a chain's leading pages into host pages, stopping at the first page not read.

    Args:
        storage: a :class:`kvstage.storage.StorageBackend`.
        page_keys: the chain's keys from its first page to read, in order.
        pages: host pool pages to read into, one per key.
        batch_pages: pages per ``get`` call (progress is reported after each).
        on_progress: called with the leading pages read so far after each batch.
        cancelled: polled before each batch; True stops the read.

    Returns:
        A :class:`ReadOutcome`; never raises (a store error ends the read at the pages before).
    """
    outcome = ReadOutcome()
    for start in range(0, len(page_keys), batch_pages):
        if cancelled is not None and cancelled():
            break
        keys = list(page_keys[start : start + batch_pages])
        try:
            hits = _answer(storage.get(keys, list(pages[start : start + len(keys)])), len(keys), "get")
        except Exception as error:
            outcome.error = error
            break
        leading = next((index for index, hit in enumerate(hits) if not hit), len(hits))
        outcome.pages_read += leading
        if on_progress is not None:
            on_progress(outcome.pages_read)
        if leading < len(keys):
            outcome.hole = True
            break
    return outcome


class StoreWorkers:
    """Threads that run store calls off the engine's thread: writes on one pool, reads on another.

    Args:
        write_threads: threads for writes (>= 1). More than one lets a request's writes land
            out of chain order, which a chain-aware store refuses: keep one unless the store
            ignores chain links (Mooncake).
        read_threads: threads for reads (>= 1).

    Raises:
        InvalidArgumentError: a thread count is not an int >= 1.
    """

    def __init__(self, *, write_threads: int = 1, read_threads: int = 1) -> None:
        for name, value in (("write_threads", write_threads), ("read_threads", read_threads)):
            require(is_int(value) and value >= 1, name, lambda: f"must be an int >= 1, got {value!r}")
        self._writes = ThreadPoolExecutor(max_workers=write_threads, thread_name_prefix="kvstage-store-write")
        self._reads = ThreadPoolExecutor(max_workers=read_threads, thread_name_prefix="kvstage-store-read")

    def write(self, call: Callable[[], Any]) -> Future:
        """Run ``call()`` on a writer thread; its future."""
        return self._writes.submit(call)

    def read(self, call: Callable[[], Any]) -> Future:
        """Run ``call()`` on a reader thread; its future."""
        return self._reads.submit(call)

    def close(self) -> None:
        """Finish queued calls and stop the threads. Idempotent."""
        self._writes.shutdown(wait=True)
        self._reads.shutdown(wait=True)


def adopts_from(storage: Any, host_pool: Any) -> bool:
    """Whether writes of ``host_pool``'s pages hand the pages themselves to ``storage`` (one
    page a buffer, a store that adopts: :meth:`HostPool.replace` takes the spares)."""
    return bool(host_pool.own_pages and adopts_pages(storage))


def lends_into(storage: Any, host_pool: Any) -> bool:
    """Whether reads into ``host_pool``'s pages borrow ``storage``'s pages instead of copying
    them (one page a buffer, a store that lends: :meth:`HostPool.lend_in`)."""
    return bool(host_pool.own_pages and lends_pages(storage))


def read_leading_pages_into(
    storage: Any,
    page_keys: Sequence[str],
    host_pool: Any,
    host_page_ids: Sequence[int],
    *,
    batch_pages: int = 16,
    on_progress: Callable[[int], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> ReadOutcome:
    """:func:`read_leading_pages` into host pages ``host_page_ids`` of ``host_pool``; where
    :func:`lends_into`, each batch is lent instead (``lend``, no copy) and its leading pages lent
    in (:meth:`HostPool.lend_in`: read until freed, the loan ending with the last of them); a
    batch whose pages are not the host pool's kind of memory (pinned or not) is read as ``get``
    does. Never raises."""
    if not lends_into(storage, host_pool):
        pages = [host_pool.page(page_id) for page_id in host_page_ids[: len(page_keys)]]
        return read_leading_pages(
            storage, page_keys, pages, batch_pages=batch_pages, on_progress=on_progress, cancelled=cancelled
        )
    outcome = ReadOutcome()
    for start in range(0, len(page_keys), batch_pages):
        if cancelled is not None and cancelled():
            break
        keys = list(page_keys[start : start + batch_pages])
        ids = list(host_page_ids[start : start + len(keys)])
        try:
            loan = storage.lend(keys)
            try:
                lent = _answer(loan.pages, len(keys), "lend")
                leading = next((index for index, page in enumerate(lent) if page is None), len(lent))
                if any(page.is_pinned() != host_pool.pinned for page in lent[:leading]):
                    loan.end()  # memory the host pool's copies cannot take: copy it as get does
                    hits = _answer(storage.get(keys, [host_pool.page(i) for i in ids]), len(keys), "get")
                    leading = next((index for index, hit in enumerate(hits) if not hit), len(hits))
                else:
                    host_pool.lend_in(ids[:leading], lent[:leading], loan)  # the loan ends with the last free
            except BaseException:
                loan.end()
                raise
        except Exception as error:
            outcome.error = error
            break
        outcome.pages_read += leading
        if on_progress is not None:
            on_progress(outcome.pages_read)
        if leading < len(keys):
            outcome.hole = True
            break
    return outcome
