"""The prefetcher: lookups, and reads of stored prefixes into host pages on a worker thread.

It knows keys, host pages and the store; the manager ties its handles to requests (which
request may prefetch, what a load means for the request's chain). Every prefetch's host pages
come from the copier and go back to it: those a load takes when their copy completes, those
past the ready pages once the read has ended, the rest when the prefetch is loaded or
cancelled (:meth:`Prefetcher.poll`). A prefetch with ``min_pages`` waits for free host pages
instead of reading fewer pages than that.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import torch

from kvstage.errors import require
from kvstage.nvtx_ranges import nvtx_range
from kvstage.offload.copier import Copier
from kvstage.offload.load_path import PrefetchHandle, PrefixMatch
from kvstage.offload.metrics import OffloadMetrics
from kvstage.offload.request import request_namespace, request_tokens
from kvstage.offload.store_io import leading_hits, read_leading_pages_into

__all__ = ["Prefetcher"]

logger = logging.getLogger(__name__)


class Prefetcher:
    """Lookups and prefetches of one manager (see :class:`kvstage.offload.OffloadManager`).

    Args:
        copier: allocates and frees the host pages.
        storage: the store read from.
        hasher: page keys (:class:`kvstage.hashing.PageHasher`).
        workers: store workers; reads run on ``workers.read``.
        counters: the manager's counters, updated here for the load path.

    Not thread-safe but for the reader thread's writes into each handle's progress fields.
    """

    def __init__(
        self, copier: Copier, storage: Any, hasher: Any, workers: Any, counters: OffloadMetrics, hybrid: Any = None
    ) -> None:
        self.copier = copier
        self.hybrid = hybrid  # a hybrid model's components (kvstage.offload.hybrid.Hybrid): restorable lengths
        self.storage = storage
        self.hasher = hasher
        self.page_size = copier.page_size
        self._workers = workers
        self._counters = counters
        self.active: list[PrefetchHandle] = []  # not yet accounted: waiting, reading, or read and not dropped
        self._waiting: deque[PrefetchHandle] = deque()  # waiting for host pages (min_pages), oldest first

    def lookup_keys(
        self, req: Any = None, token_ids: Any = None, extra_key: str | None = None, cache_salt: str | None = None
    ) -> list[str]:
        """The keys of the whole pages to look up: every token of a request with KV, prompt and
        output (a resumed request's too), but the last, which the engine computes anyway; or
        ``token_ids`` in their namespace.

        Raises:
            InvalidArgumentError: neither or both of ``req`` and ``token_ids``; a placeholder
                (negative) id among the request's tokens (named with its rid and position).
            ArgumentTypeError: the request lacks ``extra_key`` or ``cache_salt``, or either
                is neither a str nor None (:func:`~kvstage.hashing.chain.request_namespace`).
        """
        require((req is None) != (token_ids is None), "req", "give a request or token_ids, not both or neither")
        if req is not None:
            usable = max(len(req.origin_input_ids) + len(req.output_ids) - 1, 0) // self.page_size * self.page_size
            extra_key, cache_salt = request_namespace(req)
            return self.hasher.prefill_keys(request_tokens(req, 0, usable), extra_key=extra_key, cache_salt=cache_salt)
        return self.hasher.prefill_keys(token_ids, extra_key=extra_key, cache_salt=cache_salt)

    def match(self, page_keys: list[str], num_tokens: int | None = None) -> PrefixMatch:
        """One batched lookup of ``page_keys`` on the caller's thread (see :func:`leading_hits`);
        a hybrid model's answers its restorable length of ``num_tokens`` tokens (default: one
        more than the keys' pages, as a request's lookup)."""
        with nvtx_range("lookup"):
            if self.hybrid is not None:
                tokens = len(page_keys) * self.page_size + 1 if num_tokens is None else num_tokens
                found = self.hybrid.match(page_keys, tokens)
                self._count_lookup(len(page_keys), found.num_pages)
                return found
            leading = leading_hits(self.storage, page_keys)
            self._count_lookup(len(page_keys), leading)
            return PrefixMatch(leading, page_keys[:leading], leading * self.page_size, len(page_keys))

    def start(
        self, req: Any, keys: list[str], policy: str, timeout_s: float | None, min_pages: int | None
    ) -> PrefetchHandle:
        """A prefetch of the request's lookup ``keys``: it takes as many host pages as are free
        and starts the read now, or with ``min_pages`` waits (in arrival order) until
        ``min(min_pages, len(keys))`` host pages are free (:meth:`poll` starts it)."""
        handle = PrefetchHandle(req, policy, timeout_s, keys, self.page_size)
        self.active.append(handle)
        self._counters.prefetches += 1
        needed = 0 if min_pages is None else min(min_pages, len(keys))
        if needed and (self._waiting or self.copier.free_pages < needed):
            handle.min_pages = needed
            self._waiting.append(handle)
        else:
            self._begin(handle)
        return handle

    def take(self, handle: PrefetchHandle, num_pages: int) -> list[int]:
        """The first ``num_pages`` ready host pages for a load (the caller frees them after the
        copy); the read stops and the handle's other host pages are freed once it has."""
        taken, handle.host_page_ids = handle.host_page_ids[:num_pages], handle.host_page_ids[num_pages:]
        handle.loaded = True
        self.cancel(handle)  # the read stops at its next batch
        return taken

    def cancel(self, handle: PrefetchHandle) -> None:
        """Stop the read (or the wait for host pages); its host pages are freed once the worker
        is done with them."""
        handle.cancelled = True
        if handle in self._waiting:
            self._waiting.remove(handle)
            handle.finished = True  # never started: no worker holds anything
        if handle.finished:
            self._drop(handle)

    def poll(self) -> None:
        """Start waiting prefetches whose host pages are free (oldest first), free the host
        pages a finished read will not use (past its ready pages), and account the stopped
        reads that have finished (never blocks)."""
        if not self.active:  # most polls
            return
        waiting = self._waiting
        while waiting and self.copier.free_pages >= waiting[0].min_pages:
            self._begin(waiting.popleft())
        for handle in [h for h in self.active if h.finished]:
            self._account_read(handle)
            if handle.cancelled:
                self._drop(handle)
            elif len(handle.host_page_ids) > handle.pages_ready:
                unused, handle.host_page_ids = (
                    handle.host_page_ids[handle.pages_ready :],
                    handle.host_page_ids[: handle.pages_ready],
                )
                self.copier.free(unused)

    @property
    def waiting(self) -> int:
        """Prefetches waiting for host pages."""
        return len(self._waiting)

    def wait(self) -> None:
        """Block until every started read has finished (shutdown and tests)."""
        for handle in list(self.active):
            handle.wait()

    def _begin(self, handle: PrefetchHandle) -> None:
        """Take host pages (up to the lookup, as many as are free) and submit the read."""
        keys = handle.page_keys
        host_page_ids = self.copier.alloc(min(len(keys), self.copier.free_pages)) or []
        handle.host_page_ids = host_page_ids
        handle.num_host_pages = len(host_page_ids)
        pages = [self.copier.host_pool.page(host_page_id) for host_page_id in host_page_ids]
        handle.future = self._workers.read(lambda: self._read(handle, pages))

    def _read(self, handle: PrefetchHandle, pages: list[torch.Tensor]) -> None:
        """On a reader thread: the lookup of every wanted page, then the leading hits that
        have host pages into them."""
        with nvtx_range("prefetch.read"):
            try:
                if self.hybrid is not None:
                    self.hybrid.read(handle, pages)
                    return
                keys = handle.page_keys
                leading = 0 if handle.cancelled else leading_hits(self.storage, keys)
                handle.pages_hit = leading

                def progress(count: int) -> None:
                    handle.pages_ready = count

                readable = min(leading, len(pages))
                outcome = read_leading_pages_into(
                    self.storage,
                    keys[:readable],
                    self.copier.host_pool,
                    handle.host_page_ids[:readable],
                    on_progress=progress,
                    cancelled=lambda: handle.cancelled,
                )
                handle.error, handle.hole = outcome.error, outcome.hole
            except Exception as error:  # a store that fails as a whole: nothing more is ready
                handle.error = error
            finally:
                handle.finished = True

    def _account_read(self, handle: PrefetchHandle) -> None:
        """Count a finished read once: its lookup, hits, pages read and truncated, failures."""
        if handle.accounted:
            return
        handle.accounted = True
        if handle.future is None:  # cancelled while it waited for host pages: nothing ran
            return
        hit = handle.pages_hit or 0
        self._count_lookup(handle.pages_wanted, hit)
        counters = self._counters
        counters.pages_prefetched += handle.pages_ready
        counters.pages_truncated += max(hit - handle.num_host_pages, 0)
        if handle.error is not None or handle.hole:
            counters.prefetch_failures += 1
            why = (
                repr(handle.error)
                if handle.error is not None
                else (
                    f"the store held page {handle.pages_ready} at the lookup but did not return it (missing or corrupt: "
                    "evicted, removed, or a failed checksum since)"
                )
            )
            logger.warning(
                "offload: prefetch of rid=%r ended at page %d of %s: %s",
                handle.req.rid,
                handle.pages_ready,
                handle.pages_hit,
                why,
            )

    def _count_lookup(self, pages_wanted: int, pages_hit: int) -> None:
        """Count one lookup (``match`` or a prefetch's): its pages asked and leading hits."""
        counters = self._counters
        counters.lookups += 1
        counters.pages_looked_up += pages_wanted
        counters.pages_hit += pages_hit

    def _drop(self, handle: PrefetchHandle) -> None:
        """Account a finished prefetch and free its host pages that no load took."""
        if handle not in self.active:
            return
        self.active.remove(handle)
        self._account_read(handle)
        if handle.entries is not None:  # a hybrid model's entries no load took
            self.hybrid.drop(handle)
        if handle.host_page_ids:
            self.copier.free(handle.host_page_ids)
            handle.host_page_ids = []
