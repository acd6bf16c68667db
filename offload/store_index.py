"""StoreIndex: what a store holds, answered on the engine's thread without a store round trip.

A scheduler looks keys up one at a time and must never wait for a store (a file store's
``stat``, a Mooncake master's RPC). The index answers from what it knows: keys written through
it (:meth:`StoreIndex.add`), keys known gone (:meth:`StoreIndex.discard`: an eviction event, a
failed read), and earlier answers of the store; :meth:`StoreIndex.forget` drops what it knows
of a key. A key it does not know answers None at once and
is asked of the store with one batched ``exists`` on a :class:`StoreWorkers` reader thread;
:meth:`StoreIndex.poll` collects the answer. A miss is cached for ``miss_ttl_s`` only, since
another process sharing the store may store the key later; with ``hit_ttl_s``, a held key whose
answer is older is still answered True at once and asked again in the background, since another
process's store may have evicted it unseen.

Not thread-safe: one thread (the engine's scheduler) calls every method; only ``exists`` runs on
the reader thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future, wait
from typing import Any, Callable, Iterable

from kvstage.errors import is_int, require, require_seconds

__all__ = ["StoreIndex"]

logger = logging.getLogger(__name__)


class StoreIndex:
    """Cached answers to "does the store hold this key?", refreshed on a worker thread.

    Args:
        storage: a :class:`kvstage.storage.StorageBackend` (its ``exists`` is the only call).
        workers: a :class:`kvstage.offload.StoreWorkers`; refreshes run on its reader threads.
        miss_ttl_s: seconds a "not held" answer is trusted (>= 0); after that the key is asked
            again.
        hit_ttl_s: seconds after which a held key is checked again in the background (>= 0),
            still answering True meanwhile; None: held keys stay held until discarded.
        batch_keys: most keys in one ``exists`` call (>= 1).
        clock: monotonic seconds (tests pass a fake one).

    Raises:
        InvalidArgumentError: ``miss_ttl_s`` or ``hit_ttl_s`` is negative or not a number,
            ``batch_keys`` not an int >= 1.
    """

    def __init__(
        self,
        storage: Any,
        workers: Any,
        *,
        miss_ttl_s: float = 1.0,
        hit_ttl_s: float | None = None,
        batch_keys: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (("miss_ttl_s", miss_ttl_s), ("hit_ttl_s", 0 if hit_ttl_s is None else hit_ttl_s)):
            require_seconds(value, name)
        require(
            is_int(batch_keys) and batch_keys >= 1, "batch_keys", lambda: f"must be an int >= 1, got {batch_keys!r}"
        )
        self._storage = storage
        self._workers = workers
        self._miss_ttl_s = float(miss_ttl_s)
        self._hit_ttl_s = None if hit_ttl_s is None else float(hit_ttl_s)
        self._batch_keys = batch_keys
        self._clock = clock
        self._held: dict[str, float] = {}  # key -> when it was last known held
        self._missing: dict[str, float] = {}  # key -> when it was found missing
        self._queued: dict[str, None] = {}  # keys to ask, in order (a dict: ordered and unique)
        self._asking: list[str] = []  # the keys of the refresh in flight
        self._refresh: Future | None = None
        self._changed_while_asking: set[str] = set()  # added or discarded since the refresh left
        self._failing = False  # the last refresh raised (logged once until one succeeds)
        self.refreshes_failed = 0  # refreshes whose exists raised

    def __len__(self) -> int:
        """Keys known held."""
        return len(self._held)

    def lookup(self, key: str) -> bool | None:
        """True: held; False: not held (an answer younger than ``miss_ttl_s``, or discarded);
        None: not known yet, the store is being asked (call :meth:`poll` later). Never blocks."""
        held_since = self._held.get(key)
        if held_since is not None:
            if self._hit_ttl_s is not None and self._clock() - held_since > self._hit_ttl_s:
                self._ask(key)
            return True
        found_missing = self._missing.get(key)
        if found_missing is not None:
            if self._clock() - found_missing <= self._miss_ttl_s:
                return False
            del self._missing[key]
        self._ask(key)
        return None

    def _ask(self, key: str) -> None:
        """Queue ``key`` for the next refresh unless it is queued, or being asked by a refresh
        whose answer about it will count (not changed since it left)."""
        if key in self._queued:
            return
        if self._refresh is not None and key in self._asking and key not in self._changed_while_asking:
            return
        self._queued[key] = None
        if self._refresh is None:
            self._submit()

    def add(self, keys: Iterable[str]) -> None:
        """The store holds ``keys`` now (they were written through this process)."""
        keys = list(keys)
        now = self._clock()
        for key in keys:
            self._held[key] = now
            self._missing.pop(key, None)
        self._note_changed(keys)

    def discard(self, keys: Iterable[str]) -> None:
        """``keys`` are gone (evicted, removed, unreadable): they answer False for ``miss_ttl_s``."""
        keys = list(keys)
        now = self._clock()
        for key in keys:
            self._held.pop(key, None)
            self._set_missing(key, now)
        self._note_changed(keys)

    def apply_events(
        self, events: Iterable[Any], key_space: str, *, counts_stored: Callable[[str], bool] | None = None
    ) -> None:
        """Keep the index in step with the store's events (:class:`kvstage.storage.StoreEvent`
        s, from ``take_events``), in their order: a page stored then evicted ends up not held.

        Args:
            events: the store's events; those of another key space are skipped.
            key_space: the store's ``prefix`` (the key space this index answers for).
            counts_stored: whether a ``stored`` event of a key makes it held (e.g. only keys
                this caller is writing); None: every one does. Other kinds always discard.
        """
        stored, keys = True, []
        for event in events:  # runs of one kind, applied in order
            if event.key_space != key_space:
                continue
            is_stored = event.kind == "stored"
            if is_stored and counts_stored is not None and not counts_stored(event.key):
                continue
            if is_stored is not stored:
                (self.add if stored else self.discard)(keys)
                stored, keys = is_stored, []
            keys.append(event.key)
        (self.add if stored else self.discard)(keys)

    def holds(self, key: str) -> bool:
        """Whether ``key`` is known held now (no refresh is queued, unlike :meth:`lookup`)."""
        return key in self._held

    def forget(self, keys: Iterable[str]) -> None:
        """Drop what is known of ``keys``: their next lookup asks the store (e.g. keys another
        process wrote, whose outcome this one does not know); an answer in flight is ignored."""
        keys = list(keys)
        for key in keys:
            self._held.pop(key, None)
            self._missing.pop(key, None)
        self._note_changed(keys)

    def reset(self) -> None:
        """Forget every answer (e.g. after the store was cleared): every key is asked again;
        the answer of a refresh in flight is ignored."""
        self._held.clear()
        self._missing.clear()
        self._queued.clear()
        self._changed_while_asking.update(self._asking)

    def _note_changed(self, keys: Iterable[str]) -> None:
        """Keys changed by this process: a refresh in flight must not overwrite them (nothing
        to note while none is)."""
        if self._refresh is not None:
            self._changed_while_asking.update(keys)

    def _set_missing(self, key: str, now: float) -> None:
        """``_missing`` stays in the order of its times (oldest first) so expired answers are
        pruned from its front."""
        self._missing.pop(key, None)
        self._missing[key] = now

    def _prune_missing(self) -> None:
        """Drop misses older than ``miss_ttl_s`` (their keys are asked again anyway)."""
        oldest = self._clock() - self._miss_ttl_s
        while self._missing:
            key, found = next(iter(self._missing.items()))
            if found >= oldest:
                return
            del self._missing[key]

    def poll(self) -> int:
        """Take the finished refresh's answers and send the queued keys, and forget misses
        older than ``miss_ttl_s``; never blocks.

        Returns:
            Keys answered by the store in this call. A refresh that raised is counted in
            :attr:`refreshes_failed`, logged (once until a refresh succeeds), and its keys
            answer False for ``miss_ttl_s``.
        """
        self._prune_missing()
        if self._refresh is None or not self._refresh.done():
            return 0
        refresh, keys = self._refresh, self._asking
        self._refresh, self._asking = None, []
        answered = 0
        now = self._clock()
        error = refresh.exception()
        if error is None:
            self._failing = False
            for key, held in zip(keys, refresh.result()):
                if key in self._changed_while_asking:
                    continue  # what this process did since the question left is newer
                answered += 1
                if held:
                    self._held[key] = now
                else:
                    self._held.pop(key, None)
                    self._set_missing(key, now)
        else:
            # A store that cannot answer: its keys miss for miss_ttl_s, so lookups do not
            # send one failing exists after another.
            self.refreshes_failed += 1
            if not self._failing:
                logger.warning(
                    "kvstage: the store's exists failed (%r); its %d keys miss for %.1f s",
                    error,
                    len(keys),
                    self._miss_ttl_s,
                )
            self._failing = True
            for key in keys:
                if key not in self._changed_while_asking:
                    self._set_missing(key, now)
        self._changed_while_asking.clear()
        if self._queued:
            self._submit()
        return answered

    def wait(self, timeout: float | None = None) -> None:
        """Block until the refresh in flight (if any) has its answer (tests, shutdown)."""
        if self._refresh is not None:
            wait([self._refresh], timeout=timeout)

    @property
    def refreshing(self) -> bool:
        """Whether a refresh is in flight or keys are queued for one."""
        return self._refresh is not None or bool(self._queued)

    def _submit(self) -> None:
        keys = list(itertools.islice(self._queued, self._batch_keys))  # not a copy of every queued key
        for key in keys:
            del self._queued[key]
        self._asking = keys
        self._changed_while_asking.clear()
        storage = self._storage
        self._refresh = self._workers.read(lambda: list(storage.exists(keys)))
