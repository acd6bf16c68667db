"""An engine's own host-memory tier in front of a store that many engines share.

With one store under every engine, every stored page is every engine's hit: which engine a
router picks changes nothing about *whether* a prefix is found, only *where* it is read from.
What an engine holds that the others do not is what it keeps in its own memory. A
:class:`LocalTier` keeps the pages this engine stored or read most recently (an LRU of page
copies, bounded in pages) and serves a lookup or a read from them before asking the shared
store, as an engine's CPU tier (sglang's host pool, vLLM's CPU offload) sits in front of L3.
Its changes are what the engine announces with medium ``CPU``; a router that sends a request
where its prefix is in that tier saves the store read, not the prefill.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstage.errors import InvalidArgumentError, is_int
from kvstage.storage import PutStatus, PutStatuses, StorageBackend
from kvstage.storage.events import DEFAULT_EVENT_CAPACITY


@dataclass
class LocalTierStats:
    """Pages :meth:`LocalTier.get` served from the tier (``local_reads``) and from the shared
    store (``store_reads``); ``admitted`` / ``dropped``: pages that entered / left the tier."""

    local_reads: int = 0
    store_reads: int = 0
    admitted: int = 0
    dropped: int = 0


class LocalTier(StorageBackend):
    """A store that keeps up to ``capacity_pages`` recently used pages in this process's memory
    and passes everything else to ``inner`` (the shared store).

    Args:
        inner: the shared store (its fingerprint is this store's).
        capacity_pages: pages kept (>= 0; 0: nothing kept, every call goes to ``inner``).
        on_evicted: called with the keys (no prefix) of pages ``inner`` evicted (a bounded shared
            store), right after the page whose put evicted them (or at the next call, for
            evictions at open); given, puts reach ``inner`` one page at a time, so that a process
            killed mid-put has passed on every eviction but those of the page being written.
        on_put: with ``on_evicted``: ``on_put(key, False)`` before a page's put and
            ``on_put(key, True)`` once its evictions were passed on (a put begun and never
            ended marks where a kill may have cut an eviction's report).

    Pages enter on a put that ``inner`` answered STORED or DEDUPLICATED (the page is in the
    shared store either way) and on a read from ``inner``; the least recently used leaves.
    :meth:`take_changes` returns ``("stored" | "removed", key)`` for each entry and exit, in
    order; :meth:`take_events` hands on ``inner``'s, which the tier takes after each put so that
    ``on_evicted`` hears of an eviction at once: a fleet explains a page missing from the store at
    the end only by an eviction an engine reported.
    ``exists`` is true for a kept page without asking ``inner``; ``clear`` empties both.
    Thread-safe (the manager reads and writes from its worker threads).

    Raises:
        InvalidArgumentError: ``capacity_pages`` is not an int >= 0.
    """

    tier = "local"

    def __init__(
        self,
        inner: StorageBackend,
        capacity_pages: int,
        on_evicted: Callable[[list[str]], None] | None = None,
        on_put: Callable[[str, bool], None] | None = None,
    ) -> None:
        if not is_int(capacity_pages) or capacity_pages < 0:
            raise InvalidArgumentError(f"capacity_pages: must be an int >= 0, got {capacity_pages!r}")
        super().__init__(inner.fingerprint, event_capacity=0)
        self.inner = inner
        self.capacity_pages = int(capacity_pages)
        self.on_evicted, self.on_put = on_evicted, on_put
        self.tier_stats = LocalTierStats()
        self._pages: OrderedDict[str, torch.Tensor] = OrderedDict()  # key (no prefix) -> page bytes
        self._changes: list[tuple[str, str]] = []
        self._events: deque = deque(maxlen=DEFAULT_EVENT_CAPACITY)  # inner's events, until take_events
        self._lock = threading.Lock()

    def _key(self, full_key: str) -> str:
        return full_key[len(self.prefix) :]

    def _keep(self, key: str, page: torch.Tensor) -> None:
        """Copy ``page`` into the tier (the caller holds no lock); drops the oldest beyond capacity."""
        if self.capacity_pages == 0:
            return
        copy = page.contiguous().view(torch.uint8).reshape(-1).clone()
        with self._lock:
            if key in self._pages:
                self._pages.move_to_end(key)
                return
            self._pages[key] = copy
            self._changes.append(("stored", key))
            self.tier_stats.admitted += 1
            while len(self._pages) > self.capacity_pages:
                old, _ = self._pages.popitem(last=False)
                self._changes.append(("removed", old))
                self.tier_stats.dropped += 1

    def take_changes(self) -> list[tuple[str, str]]:
        """The tier's entries and exits since the last call, oldest first: ``(kind, key)``."""
        with self._lock:
            changes, self._changes = self._changes, []
        return changes

    def _exists(self, full_keys: list[str]) -> list[bool]:
        with self._lock:
            here = [self._key(k) in self._pages for k in full_keys]
            for k, held in zip(full_keys, here):
                if held:
                    self._pages.move_to_end(self._key(k))
        rest = [self._key(k) for k, held in zip(full_keys, here) if not held]
        found = iter(self.inner.exists(rest) if rest else [])
        return [True if held else next(found) for held in here]

    def _put(self, full_keys: list[str], pages: list[torch.Tensor], full_prior_key: str | None = None) -> PutStatuses:
        keys = [self._key(k) for k in full_keys]
        prior = self._key(full_prior_key) if full_prior_key else None
        if self.on_evicted is None:
            statuses = self.inner.put(keys, pages, prior_key=prior)
        else:  # page by page: each eviction is passed on right after the page that made it
            statuses = PutStatuses()
            for key, page in zip(keys, pages):
                if self.on_put is not None:
                    self.on_put(key, False)
                answer = self.inner.put([key], [page], prior_key=prior)
                self._drain()
                if self.on_put is not None:
                    self.on_put(key, True)
                statuses.append(answer[0])
                if statuses.error is None:
                    statuses.error = answer.error
                prior = key
        for key, page, status in zip(keys, pages, statuses):
            if status is not PutStatus.FAILED:
                self._keep(key, page)
        return statuses

    def _get(self, full_keys: list[str], into: list[torch.Tensor]) -> list[bool]:
        keys = [self._key(k) for k in full_keys]
        hits = [False] * len(keys)
        with self._lock:
            for i, key in enumerate(keys):
                page = self._pages.get(key)
                if page is not None:
                    into[i].view(torch.uint8).reshape(-1).copy_(page)
                    self._pages.move_to_end(key)
                    hits[i] = True
        rest = [i for i, hit in enumerate(hits) if not hit]
        self.tier_stats.local_reads += len(keys) - len(rest)
        if rest:
            found = self.inner.get([keys[i] for i in rest], [into[i] for i in rest])
            for i, ok in zip(rest, found):
                if ok:
                    hits[i] = True
                    self.tier_stats.store_reads += 1
                    self._keep(keys[i], into[i])
        return hits

    def _clear(self) -> int:
        with self._lock:
            self._changes.extend(("removed", key) for key in self._pages)
            self._pages.clear()
        return self.inner.clear()

    def _drain(self) -> None:
        """Take ``inner``'s events now (right after a put evicted) and pass the evicted keys on."""
        events = self.inner.take_events()
        if not events:
            return
        with self._lock:
            self._events.extend(events)
        evicted = [event.key for event in events if event.kind == "evicted"]
        if evicted and self.on_evicted is not None:
            self.on_evicted(evicted)

    def take_events(self, max_events: int | None = None):
        """The shared store's events (what this engine's writes stored, what it saw evicted or
        removed), oldest first: the tier's own changes are :meth:`take_changes`."""
        self._drain()
        with self._lock:
            count = len(self._events) if max_events is None else min(max_events, len(self._events))
            return [self._events.popleft() for _ in range(count)]

    def register_host_buffers(self, buffers) -> None:
        """Passed to the shared store (a zero-copy store registers the host pool)."""
        self.inner.register_host_buffers(buffers)

    def close(self) -> None:
        """Close the shared store; the tier's pages are dropped."""
        with self._lock:
            self._pages.clear()
        self.inner.close()
