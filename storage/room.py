"""Room accounting of a store with a byte capacity: which pages it holds, their bytes, the room
held for writes in flight, and which page to evict next.

The lifecycle of one page's room (as sglang's file-storage evictor keeps it apart from the
key/value store): :meth:`Room.reserve` before the page is written (evicting chain tails first,
the caller removing each victim), then :meth:`Room.commit` when it lands (the held bytes become
the page's) or :meth:`Room.abort` when it will not; :meth:`Room.touch` on a use;
:meth:`Room.pin` and :meth:`Room.unpin` around a put, so the pages it works on and the page
before them are never evicted meanwhile. Eviction is chain-aware (:class:`ChainIndex`): only a
page with no stored successor is a candidate, least recently used first.

Invariant: ``used + held <= capacity_bytes`` after every granted :meth:`Room.reserve`; only
pages indexed without a reservation (:meth:`Room.add`: found at open, or written by another
process) can take ``used`` past it, until the next :meth:`Room.reserve` evicts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Generic, TypeVar

from kvstage.storage.chain_index import ChainIndex

K = TypeVar("K")
V = TypeVar("V")


class Room(Generic[K, V]):
    """Pages by key (any hashable), each with a value (what the store needs to find or remove
    it, e.g. a file name) and a size in bytes, against ``capacity_bytes``.

    Not thread-safe: a store calls it under its own lock (and removes a victim's data under that
    lock too, so no reader finds a page the index no longer holds).

    Args:
        capacity_bytes: bound on ``used + held``, in bytes (an int >= 0; the store checks it).
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._index: ChainIndex[K, tuple[V, int]] = ChainIndex()
        self._pinned: Counter[K] = Counter()  # pages of puts in flight (and their priors)
        self._used = 0
        self._held = 0  # bytes reserved for pages being written, not committed yet

    @property
    def used(self) -> int:
        """Bytes of the pages indexed."""
        return self._used

    @property
    def held(self) -> int:
        """Bytes reserved (:meth:`reserve`) and neither committed nor aborted yet."""
        return self._held

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def values(self) -> list[V]:
        """The value of every indexed page (a copy), in no particular order."""
        return [value for _, (value, _) in self._index.items()]

    def tick(self) -> int:
        """A new tick of the index's clock (nanoseconds, strictly increasing)."""
        return self._index.tick()

    def reserve(self, size: int) -> bool:
        """Hold ``size`` more bytes for a page about to be written, if they fit beside the pages
        and the room already held; whether they did. When they do not, :meth:`evict` one page
        and try again (or give up when it returns None)."""
        if self._used + self._held + size <= self.capacity_bytes:
            self._held += size
            return True
        return False

    def evict(self) -> tuple[K, V] | None:
        """Forget the least recently used page with no stored successor that is not pinned;
        ``(key, value)`` of it (the caller removes its data), or None when no page is left to
        evict."""
        victim = self._index.pop_victim(self._pinned)
        if victim is None:
            return None
        key, (value, size) = victim
        self._used -= size
        return key, value

    def commit(self, key: K, value: V, size: int, prior: K | None, *, held: int, tick: int | None = None) -> V | None:
        """A page written with ``held`` bytes reserved has landed: index it after ``prior``
        (``size`` bytes, used at ``tick``; None: now), replacing any entry of ``key`` (indexed
        meanwhile, e.g. adopted from another process's file). The replaced value, or None."""
        self._held -= held
        replaced = self.remove(key)
        self._index.add(key, (value, size), prior, tick=tick)
        self._used += size
        return replaced

    def abort(self, held: int) -> None:
        """Give back ``held`` reserved bytes of a page that will not land."""
        self._held -= held

    def add(self, key: K, value: V, size: int, prior: K | None, tick: int | None = None) -> None:
        """Index a page that is already there (found at open, written by another process),
        without a reservation; ``key`` must not be indexed."""
        self._index.add(key, (value, size), prior, tick=tick)
        self._used += size

    def remove(self, key: K) -> V | None:
        """Forget ``key`` (found corrupt, replaced); its value, or None when it was not indexed."""
        removed = self._index.remove(key)
        if removed is None:
            return None
        self._used -= removed[1]
        return removed[0]

    def chains_after(self, keys: Iterable[K]) -> list[K]:
        """The indexed keys among ``keys`` and after them in their chains (:meth:`ChainIndex.chains_after`)."""
        return self._index.chains_after(keys)

    def touch(self, key: K) -> int | None:
        """Mark ``key`` used now; the new tick, or None when ``key`` is not indexed."""
        return self._index.touch(key)

    def pin(self, keys: Iterable[K]) -> None:
        """Never evict ``keys`` until as many :meth:`unpin` calls (pins count per key)."""
        self._pinned.update(keys)

    def unpin(self, keys: Iterable[K]) -> None:
        """Undo one :meth:`pin` of ``keys``."""
        keys = list(keys)
        self._pinned.subtract(keys)
        for key in set(keys):
            if self._pinned[key] <= 0:
                del self._pinned[key]

    def clear(self) -> None:
        """Forget every page (their data removed by the caller); room held stays held."""
        self._index = ChainIndex()
        self._used = 0
