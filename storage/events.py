"""Store events: what a store stored, evicted and removed, for an engine (or a KV-aware router)
to drain without blocking.

Every store (memory, file, Mooncake) records a :class:`StoreEvent` for each page it stores
(``put`` answered ``STORED``), evicts by its own eviction, and removes (``clear``, a corrupt page
dropped, ``FileStore.evict_key_space``) in a bounded :class:`EventQueue`; the engine takes them
with ``store.take_events()``. The queue never blocks a write: when it is full the oldest event
is dropped (a consumer that fell behind sees the newest state) and counted in
``store.stats.events_dropped``.

The kinds follow vLLM's KV events (``BlockStored`` / ``BlockRemoved`` with a storage tier),
with eviction told apart from removal.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Literal

from kvstage.errors import is_int, require
from kvstage.storage.fingerprint import prefix_fields

__all__ = ["DEFAULT_EVENT_CAPACITY", "EVENT_KINDS", "EventQueue", "StoreEvent"]

DEFAULT_EVENT_CAPACITY = 65536  # events a store keeps for a consumer that has not taken them yet
EVENT_KINDS = ("stored", "evicted", "removed")
_COUNTERS = {kind: f"events_{kind}" for kind in EVENT_KINDS}  # the StorageStats field of each kind


@dataclass(frozen=True, slots=True)
class StoreEvent:
    """One page stored, evicted or removed by a store.

    Attributes:
        key: the page key as engines pass it to ``put`` (hex page hash, no fingerprint prefix).
        kind: ``"stored"`` (a ``put`` wrote it), ``"evicted"`` (the store's own eviction made
            room) or ``"removed"`` (``clear``, a corrupt page dropped, a key space evicted).
        tier: the store's name: ``"memory"``, ``"file"`` or ``"mooncake"``.
        time_s: ``time.monotonic()`` when it happened, in seconds.
        page_bytes: the page's size in bytes (payload, without a file header).
        key_space: the fingerprint prefix the key lives under; the store's own, except for
            pages of another key space that ``FileStore.evict_key_space`` removed.
        component: the hybrid model's component that key space holds (its prefix's marker,
            ``{model}@{component}-{digest}@...``: ``"full"``, ``"swa"``, ``"state"``, ...), or
            ``""`` for a plain model's (or an opaque format's) key space.
    """

    key: str
    kind: Literal["stored", "evicted", "removed"]
    tier: str
    time_s: float
    page_bytes: int
    key_space: str
    component: str = ""


class EventQueue:
    """A bounded, thread-safe queue of :class:`StoreEvent`; full, it drops the oldest.

    Args:
        stats: the store's :class:`kvstage.storage.StorageStats`; its ``events_stored``,
            ``events_evicted``, ``events_removed`` (every event recorded, taken or not) and
            ``events_dropped`` counters are kept here, under this queue's lock.
        tier: the store's name, written into every event.
        key_space: the store's fingerprint prefix.
        page_bytes: the store's page size in bytes.
        capacity: events kept at most (0: events off: none is built or kept, every one is
            counted, and counted dropped).
        on_record: called as ``on_record(kind, keys, key_space)`` (``key_space`` None: the
            store's own) for every :meth:`record`, events on or
            off, on the recording thread (often under the store's lock: it must only note them).

    Raises:
        InvalidArgumentError: capacity is not an int >= 0.
    """

    def __init__(
        self,
        stats,
        *,
        tier: str,
        key_space: str,
        page_bytes: int,
        capacity: int = DEFAULT_EVENT_CAPACITY,
        on_record=None,
    ) -> None:
        require(is_int(capacity) and capacity >= 0, "event_capacity", lambda: f"must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self._stats = stats
        self._tier = tier
        self._key_space = key_space
        self._page_bytes = page_bytes
        self._component = component_of(key_space)
        self._on_record = on_record
        self._chunks: collections.deque[list] = collections.deque()  # one a record call, oldest first
        self._count = 0  # events kept in them
        self._lock = threading.Lock()

    def record(self, kind: str, keys, *, key_space: str | None = None) -> None:
        """Record one event of ``kind`` per page key in ``keys`` (a list, no prefix), now."""
        if not keys:
            return
        if self._on_record is not None:
            self._on_record(kind, keys, key_space)
        counter = _COUNTERS[kind]
        if self.capacity == 0:  # events off: counted as dropped, never built
            with self._lock:
                setattr(self._stats, counter, getattr(self._stats, counter) + len(keys))
                self._stats.events_dropped += len(keys)
            return
        now = time.monotonic()
        space, component = (
            (self._key_space, self._component) if key_space is None else (key_space, component_of(key_space))
        )
        # One chunk a call: its events are built by take (on the consumer's thread), not here.
        chunk = [list(keys), 0, kind, now, space, component]  # [keys, first kept, ...]
        with self._lock:
            stats = self._stats
            setattr(stats, counter, getattr(stats, counter) + len(chunk[0]))
            self._chunks.append(chunk)
            self._count += len(chunk[0])
            over = self._count - self.capacity
            if over > 0:
                stats.events_dropped += over
                self._count -= over
                chunks = self._chunks
                while over:  # the oldest go
                    first = chunks[0]
                    left = len(first[0]) - first[1]
                    if left <= over:
                        chunks.popleft()
                        over -= left
                    else:
                        first[1] += over
                        over = 0

    def take(self, max_events: int | None = None) -> list[StoreEvent]:
        """Remove and return up to ``max_events`` of the oldest events (None: all), oldest first.

        Never blocks on a writer for longer than a list swap.

        Raises:
            InvalidArgumentError: max_events is not None or an int >= 0.
        """
        if max_events is None:  # the common call (an announcer's per write): no check, no lock when empty
            if not self._chunks:
                return []
            with self._lock:
                taken, self._chunks, self._count = self._chunks, collections.deque(), 0
            return self._built(taken)
        require(
            is_int(max_events) and max_events >= 0,
            "max_events",
            lambda: f"must be None or an int >= 0, got {max_events!r}",
        )
        with self._lock:
            if max_events >= self._count:
                taken, self._chunks, self._count = self._chunks, collections.deque(), 0
                return self._built(taken)
            taken = []
            want = max_events
            chunks = self._chunks
            while want:
                first = chunks[0]
                left = len(first[0]) - first[1]
                if left <= want:
                    taken.append(chunks.popleft())
                    want -= left
                else:
                    taken.append([first[0][first[1] : first[1] + want], 0, *first[2:]])
                    first[1] += want
                    want = 0
            self._count -= max_events
        return self._built(taken)

    def take_chunks(self, key_space: str | None = None) -> list[tuple[str, list[str]]]:
        """Remove and return every event kept, oldest first, as ``(kind, keys)`` chunks (one a
        record call; ``keys`` a list): what :meth:`take` returns, without a
        :class:`StoreEvent` built per key, for a consumer that needs kinds and keys only (an
        announcer). ``key_space``: only that key space's events are returned (the others are
        taken too); None: every one. Never blocks on a writer for longer than a list swap."""
        if not self._chunks:
            return []
        with self._lock:
            taken, self._chunks, self._count = self._chunks, collections.deque(), 0
        return [
            (kind, keys[first:] if first else keys)
            for keys, first, kind, _, space, _ in taken
            if key_space is None or space == key_space
        ]

    def _built(self, chunks) -> list[StoreEvent]:
        """The :class:`StoreEvent` of each key kept in ``chunks``, oldest first."""
        tier, page_bytes = self._tier, self._page_bytes
        return [
            StoreEvent(key, kind, tier, now, page_bytes, space, component)
            for keys, first, kind, now, space, component in chunks
            for key in (keys[first:] if first else keys)
        ]


def component_of(key_space: str) -> str:
    """The component a key space's prefix names (``{model}@{component}-{digest}@...``), or ``""``."""
    fields = prefix_fields(key_space)
    return "" if fields is None else fields.get("component", "")
