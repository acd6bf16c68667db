"""``ChainIndex``: the pages a store holds, their chain links and recency; picks what to evict.

A page's key chains from the key before it (:mod:`kvstage.hashing.chain`), and a lookup walks a
chain from its start, stopping at the first page a store lacks. A page whose predecessor is gone
can never be found again, so eviction works from a chain's tail: only a page with no stored
successor is a candidate, and among candidates the least recently used goes first. Evicting a
page may make its predecessor a candidate (once its last stored successor is gone). Chains branch
(two prompts sharing a prefix), so a page may have several successors.

Links come from the stores' ``put``: ``keys[i - 1]`` precedes ``keys[i]`` and ``prior_key``
precedes ``keys[0]`` (see :meth:`kvstage.storage.StorageBackend.put`).

Recency is a tick: nanoseconds since the epoch, strictly increasing within one index
(``max(time.time_ns(), last tick + 1)``), so a store can persist it (the file store as each page
file's modification time) and seed a reopened index with it.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Container, Generic, Hashable, Iterable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

__all__ = ["ADDED", "DEDUPLICATED", "MISSING_PRIOR", "NO_ROOM", "ChainIndex"]

# ChainIndex.admit's outcome for each key
ADDED, DEDUPLICATED, MISSING_PRIOR, NO_ROOM = range(4)


@dataclass(slots=True)  # one per stored page: less memory, quicker to make
class _Entry(Generic[K, V]):
    value: V
    prior: K | None
    tick: int


class ChainIndex(Generic[K, V]):
    """Stored pages by key (any hashable: the memory store's full keys, the file store's key
    digests), each with a value (the page's bytes, or its file's name and size), its
    predecessor's key and its last use.

    Not thread-safe: a store calls it under its own lock. Every operation is O(log n) amortized
    (a heap of candidates with stale entries skipped as they surface).
    """

    def __init__(self) -> None:
        self._entries: dict[K, _Entry[K, V]] = {}
        # The same keys as a set, for holds(): a set probe reads its table slot and the key, a
        # dict's its index, entry and key: one cache miss fewer a key in a large cold index.
        self._keys: set[K] = set()
        # predecessor key -> stored keys that follow it; kept while the predecessor is absent,
        # so a page written again (e.g. after a corrupt copy was dropped) knows its successors.
        self._successors: dict[K, set[K]] = {}
        self._candidates: list[tuple[int, K]] = []  # (tick, key): may hold stale entries
        self._clock = 0

    def __len__(self) -> int:
        """Pages stored."""
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def holds(self, keys: Iterable[K]) -> list[bool]:
        """Whether each of ``keys`` is stored, in order (one dict membership test a key, no
        Python call per key: a lookup's hot path)."""
        return list(map(self._keys.__contains__, keys))

    def keys(self) -> list[K]:
        """The stored keys (a copy), in no particular order."""
        return list(self._entries)

    def items(self) -> list[tuple[K, V]]:
        """``(key, value)`` of every stored page (a copy), in no particular order."""
        return [(key, entry.value) for key, entry in self._entries.items()]

    def value(self, key: K) -> V | None:
        """The value stored with ``key``, or None when ``key`` is not stored."""
        entry = self._entries.get(key)
        return None if entry is None else entry.value

    def values(self, keys: Iterable[K]) -> list[V | None]:
        """:meth:`value` of each of ``keys``, in order (one list for a batch: a get's pages)."""
        entries = self._entries
        return [None if (entry := entries.get(key)) is None else entry.value for key in keys]

    def set_value(self, key: K, value: V) -> None:
        """Replace the value of ``key`` (stored), its link and last use unchanged.

        Raises:
            KeyError: ``key`` is not stored.
        """
        self._entries[key].value = value

    def tick(self) -> int:
        """A new tick: ``max(time.time_ns(), last tick + 1)``."""
        self._clock = max(time.time_ns(), self._clock + 1)
        return self._clock

    def add(self, key: K, value: V, prior: K | None, tick: int | None = None) -> int:
        """Store ``key`` (not stored yet) after ``prior``, used at ``tick`` (None: now).

        ``prior`` need not be stored (a reopened store may hold a chain's later pages only).
        Returns the tick.
        """
        if tick is None:
            tick = self.tick()
        else:
            self._clock = max(self._clock, tick)
        self._entries[key] = _Entry(value, prior, tick)
        self._keys.add(key)
        if prior is not None:
            self._successors.setdefault(prior, set()).add(key)
        if not self._successors.get(key):
            heapq.heappush(self._candidates, (tick, key))
        self._compact()
        return tick

    def touch(self, key: K) -> int | None:
        """Mark ``key`` used now; the new tick, or None when ``key`` is not stored."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        entry.tick = self.tick()
        if not self._successors.get(key):
            heapq.heappush(self._candidates, (entry.tick, key))
            self._compact()
        return entry.tick

    def touch_all(self, keys: Iterable[K]) -> None:
        """Mark each of ``keys`` used, in order (each after the one before it), as :meth:`touch`
        on each in turn would: the same order of ticks, from one clock read, and one heap
        compaction check for them all (a store's queued lookup uses, many at once). Keys not
        stored are skipped; a key given twice takes the place of its last use."""
        entries, successors, candidates = self._entries, self._successors, self._candidates
        push = heapq.heappush
        tick = max(time.time_ns(), self._clock + 1) - 1  # the tick before the first key's
        for key in keys:
            entry = entries.get(key)
            if entry is None:
                continue
            tick += 1
            entry.tick = tick
            if not successors.get(key):
                push(candidates, (tick, key))
        self._clock = max(self._clock, tick)
        self._compact()

    def remove(self, key: K) -> V | None:
        """Forget ``key`` (evicted or found corrupt); its value, or None when it was not stored.

        Its predecessor becomes a candidate once no stored successor is left. Successors of
        ``key`` stay stored (and linked to it).
        """
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._keys.discard(key)
        prior = entry.prior
        if prior is not None:
            siblings = self._successors[prior]
            siblings.discard(key)
            if not siblings:
                del self._successors[prior]
                before = self._entries.get(prior)
                if before is not None:
                    heapq.heappush(self._candidates, (before.tick, prior))
        return entry.value

    def chains_after(self, keys) -> list[K]:
        """The stored keys among ``keys`` and every stored key that chains after one of them
        (successors of successors, through keys no longer stored too), each once, least
        recently used first (an order of the index's own history: the successor sets iterate in
        the keys' hash order, which differs between two stores keying the same pages apart;
        equal ticks, as a reopened file store's pages of one modification time may have, keep
        the walk's order)."""
        found: dict[K, None] = {}
        walk = list(keys)
        while walk:
            key = walk.pop()
            if key in found:
                continue
            found[key] = None
            walk.extend(self._successors.get(key, ()))
        entries = self._entries
        return sorted((key for key in found if key in entries), key=lambda key: entries[key].tick)

    def pop_victim(self, keep: Container[K] = ()) -> tuple[K, V] | None:
        """Remove and return ``(key, value)`` of the least recently used page with no stored
        successor, skipping keys in ``keep``; None when every candidate is kept (or none is stored)."""
        kept: list[tuple[int, K]] = []
        victim = None
        while self._candidates:
            tick, key = heapq.heappop(self._candidates)
            entry = self._entries.get(key)
            if entry is None or entry.tick != tick or self._successors.get(key):
                continue  # stale: gone, used since, or a successor was stored since
            if key in keep:
                kept.append((tick, key))
                continue
            victim = key
            break
        for item in kept:
            heapq.heappush(self._candidates, item)
        if victim is None:
            return None
        return victim, self.remove(victim)

    def admit(
        self, keys: list[K], prior: K | None, capacity: int, keep: Container[K]
    ) -> tuple[list[int], list[int], list[tuple[K, V]]]:
        """A put's run of one chain, as one call (a store's put, under its lock): for each of
        ``keys`` in order, ``prior`` before ``keys[0]`` and each key before the next, the same
        steps as :meth:`touch`, :meth:`pop_victim` and :meth:`add` one key at a time, with the
        ticks of one clock read and one heap compaction check at the end (``keep`` must hold
        every one of ``keys``: they become eviction candidates once the call is done):

        - stored already: touched (outcome :data:`DEDUPLICATED`);
        - its predecessor not stored: skipped (:data:`MISSING_PRIOR`);
        - the index at ``capacity`` pages and every candidate in ``keep``: skipped (:data:`NO_ROOM`);
        - else the least recently used page with no stored successor (not in ``keep``) is
          removed when the index is at ``capacity``, and the key added with value None
          (:data:`ADDED`; set its value with :meth:`set_values`).

        Returns ``(outcomes, added, victims)``: one outcome a key, the indices of the keys
        added, and ``(key, value)`` of each page removed, in the order removed.
        """
        entries, keyset, successors, candidates = self._entries, self._keys, self._successors, self._candidates
        push, pop = heapq.heappush, heapq.heappop
        tick = max(time.time_ns(), self._clock + 1) - 1  # the tick before the first step's
        outcomes: list[int] = []
        added: list[int] = []
        victims: list[tuple[K, V]] = []
        held: list[tuple[int, K]] = []  # kept candidates popped: never victims in this call
        before = prior
        for index, key in enumerate(keys):
            prior, before = before, key
            entry = entries.get(key)
            if entry is not None:  # touch
                tick += 1
                entry.tick = tick
                outcomes.append(DEDUPLICATED)
                continue
            if prior is not None and prior not in entries:
                outcomes.append(MISSING_PRIOR)
                continue
            if len(entries) >= capacity:  # pop_victim
                victim = None
                while candidates:
                    item = pop(candidates)
                    old = entries.get(item[1])
                    if old is None or old.tick != item[0] or successors.get(item[1]):
                        continue  # stale: gone, used since, or a successor was stored since
                    if item[1] in keep:
                        held.append(item)
                        continue
                    victim = item[1]
                    break
                if victim is None:
                    outcomes.append(NO_ROOM)
                    continue
                old = entries.pop(victim)  # remove
                keyset.discard(victim)
                if old.prior is not None:
                    siblings = successors[old.prior]
                    siblings.discard(victim)
                    if not siblings:
                        del successors[old.prior]
                        earlier = entries.get(old.prior)
                        if earlier is not None:
                            push(candidates, (earlier.tick, old.prior))
                victims.append((victim, old.value))
            tick += 1  # add
            entries[key] = _Entry(None, prior, tick)
            keyset.add(key)
            if prior is not None:
                successors.setdefault(prior, set()).add(key)
            outcomes.append(ADDED)
            added.append(index)
        for item in held:
            push(candidates, item)
        # The call's keys are candidates from now on (those still without a stored successor):
        # pushed once, at the end, as every one of them is kept during the call anyway.
        for key in keys:
            entry = entries.get(key)
            if entry is not None and not successors.get(key):
                push(candidates, (entry.tick, key))
        self._clock = max(self._clock, tick)
        self._compact()
        return outcomes, added, victims

    def set_values(self, keys: Iterable[K], values: Iterable[V]) -> None:
        """:meth:`set_value` for each key and value, pairwise.

        Raises:
            KeyError: a key is not stored.
        """
        entries = self._entries
        for key, value in zip(keys, values):
            entries[key].value = value

    def _compact(self) -> None:
        """Rebuild the candidate heap when stale entries outnumber the pages."""
        if len(self._candidates) <= 2 * len(self._entries) + 64:
            return
        self._candidates = [(entry.tick, key) for key, entry in self._entries.items() if not self._successors.get(key)]
        heapq.heapify(self._candidates)
