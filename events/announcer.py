"""``KVEventAnnouncer``: what a manager stored (with its token ids) and what its store evicted
or removed, as one ordered KV event stream on a :class:`~kvstage.events.KVEventPublisher`.

The join: a store knows keys and bytes only; the manager knows, for every page it writes, the
chain run it belongs to (token ids, the page before it, the request's namespace). After each
store write the writer thread calls :meth:`KVEventAnnouncer.written`, which takes the store's
events (:meth:`~kvstage.storage.StorageBackend.take_events`) and publishes, in the store's
order, a self-describing ``BlockStored`` for the run's pages that reached the store (written or
already held) and a ``BlockRemoved`` for each eviction or removal; :meth:`KVEventAnnouncer.poll`
(the manager's ``poll``) publishes the removals that happen between writes (``clear``, a corrupt
page dropped on a read). The announcer is then the store's only event consumer.

A page's stored event may be taken by another call before its write is told (the engine's
poll, another writer thread's write, between a put and its :meth:`~KVEventAnnouncer.written`):
the announcer remembers such pages, and one removed before its write is told is not announced
by that write as held already (the store no longer holds it). Another writer's pages are
remembered so too and never claimed (up to 65536 of each, the oldest forgotten); a write pays
for them only where its own pages are among them (one C set test a write otherwise).

Only the events of the store's own key space (its fingerprint prefix) are announced: a page of
another key space that ``FileStore.evict_key_space`` removed is no page of this stream, even
where its page key is the same.

Lost store events: a store's queue full drops its oldest events (``stats.events_dropped``), and
a router that missed a removal would claim a page that is gone. When a take finds the counter
grown, the announcer announces that call's events, then one ``BlockRemoved`` of every page live
on its stream (``resyncs``): it keeps no token ids to announce them again, so the router holds
none of them until writes store or find them again, from a chain's root on. A
``BlockRemoved`` rather than ``AllBlocksCleared``: it retracts only this announcer's pages, at
its medium, not the engine's own on a shared stream. A store with events off
(``event_capacity=0``) is refused; a wrapper's ``take_events`` cannot tell of a drop.

One announcer a stream: two announcers (two managers, two stores) on one publisher share its
topic and medium, so a router cannot tell their pages apart, and one store's eviction of a page
retracts the other's page of the same hash. Give each store its own publisher (or topic).

What it does not announce, counted instead: pages whose chain parent is not live on this stream
(``pages_unanchored``: a run continuing a loaded prefix, or the prefill side's prompt pages with
``store_prompt=False``, which this stream never announced; routers drop a block with an unknown
parent), and pages a store reports stored without a manager write (``pages_without_tokens``:
another writer of the same store object; a router cannot index a block without token ids).
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from typing import Any, Sequence

from kvstage.errors import ArgumentTypeError, InvalidArgumentError, is_int, require
from kvstage.events.publisher import KVEventPublisher
from kvstage.events.wire import VLLM_FORMAT, EventBatcher
from kvstage.storage.backend import StorageBackend

__all__ = ["KVEventAnnouncer", "announcer_for"]

logger = logging.getLogger(__name__)


class KVEventAnnouncer:
    """Publishes one store's pages as a manager writes them, and their removals.

    Args:
        publisher: where the events go (a :class:`KVEventPublisher`).
        storage: the store whose events are taken (``take_events()``).
        block_size: tokens per page (the host pool's page size), >= 1.
        medium: the events' tier (default: the publisher's ``event_format.medium``, ``"STORAGE"``
            for vLLM's).
        owns_publisher: :meth:`close` closes ``publisher`` too.

    Block hashes: the publisher's ``event_format.block_hash`` of each page key. A store's events
    are taken as ``(kind, keys)`` chunks (:meth:`~kvstage.storage.StorageBackend.take_event_chunks`)
    where its class keeps :class:`~kvstage.storage.StorageBackend`'s ``take_events``, else from
    ``take_events()`` (a wrapper's own), one chunk a :class:`~kvstage.storage.StoreEvent`.

    Attributes:
        pages_announced, pages_removed: pages published as stored / removed.
        pages_unanchored, pages_without_tokens: pages not announced (see the module).
        errors: announcements that raised (logged; the write or poll is unaffected).
        resyncs: times the store's event queue had dropped events (``stats.events_dropped``
            grew) and the stream started over (see the module).

    Raises:
        ArgumentTypeError: ``publisher`` is no :class:`KVEventPublisher`, ``storage`` has no
            ``take_events()``.
        InvalidArgumentError: ``block_size`` is not an int >= 1, ``medium`` not None or a str,
            or ``storage`` keeps no store events (``event_capacity=0``).

    Thread-safe: :meth:`written` runs on the store's writer thread, :meth:`poll` on the engine's.
    """

    def __init__(
        self,
        publisher: KVEventPublisher,
        storage: Any,
        *,
        block_size: int,
        medium: str | None = None,
        owns_publisher: bool = False,
    ) -> None:
        require(
            isinstance(publisher, KVEventPublisher),
            "publisher",
            lambda: f"must be a KVEventPublisher, got {type(publisher).__name__}",
            ArgumentTypeError,
        )
        require(
            callable(getattr(storage, "take_events", None)),
            "storage",
            lambda: f"must be a store with take_events(), got {type(storage).__name__}",
            ArgumentTypeError,
        )
        require(
            is_int(block_size) and block_size >= 1, "block_size", lambda: f"must be an int >= 1, got {block_size!r}"
        )
        require(medium is None or isinstance(medium, str), "medium", lambda: f"must be None or a str, got {medium!r}")
        self.publisher = publisher
        self.storage = storage
        self.block_size = block_size
        event_format = getattr(publisher, "event_format", VLLM_FORMAT)
        self.medium = event_format.medium if medium is None else medium
        self._hash = event_format.block_hash
        self._hashes = event_format.many_block_hashes or event_format.hashes
        self.owns_publisher = owns_publisher
        self.pages_announced = self.pages_removed = self.pages_unanchored = self.pages_without_tokens = 0
        self.errors = self.resyncs = 0
        self._live: set[int] = set()  # hashes announced stored on this stream and not removed since
        # Pages a store reported stored before their write was told (another call took the
        # event: a poll, another writer thread's write), oldest first; and those of them removed
        # since, whose write must then not announce them as held already. Bounded (_UNTOLD_MAX).
        self._untold: dict[int, None] = {}
        self._gone_untold: dict[int, None] = {}
        self._last_key: str | None = None  # the last page key hashed, and its hash: a chain's next
        self._last_hash: int | None = None  # write names it as its prior key
        self._lock = threading.Lock()  # one taker of store events at a time: the stream keeps their order
        self._key_space = getattr(storage, "prefix", None)  # only its events are announced
        self._stats = None  # the store's counters, where its own queue is read: events_dropped
        if getattr(type(storage), "take_events", None) is StorageBackend.take_events:
            require(
                storage.event_capacity >= 1,
                "storage",
                lambda: "its event_capacity must be >= 1 (store events on): without them no removal is ever announced",
            )
            self._take = functools.partial(storage.take_event_chunks, self._key_space)  # no StoreEvent a key
            self._stats = storage.stats
            self._dropped_seen = storage.stats.events_dropped
        else:
            self._take = self._chunks_of_events
        # written()'s and poll()'s calls, (keys, tokens, prior_key, namespace, failed_keys, store
        # events as (kind, keys) chunks), oldest first, until the sending thread's _drain takes them
        self._calls: collections.deque[tuple] = collections.deque()
        self._scheduled = False  # a _drain is queued on the publisher and has not started

    def written(
        self,
        keys: Sequence[str],
        tokens: Sequence[int],
        prior_key: str | None,
        namespace: tuple[str | None, str | None],
        failed_keys: Sequence[str],
    ) -> None:
        """One store write of a chain run ended: announce its pages that reached the store.

        Args:
            keys: the run's page keys, chain order. tokens: its token ids (``block_size`` per
                key, or empty).
            prior_key: the stored page before the run (None: the run starts the chain).
            namespace: ``(extra_key, cache_salt)`` of the request.
            failed_keys: the keys the write did not store; the run is announced up to the first.

        Only the store's events are taken here, in the store's order, and the call queued (one
        publish call for the writes that arrive before the sending thread gets to them); the rest
        (hashes, which pages are new on the stream, the events) runs on the publisher's sending
        thread, so ``keys``, ``tokens`` and ``failed_keys`` must not change after the call. The
        announcer's events keep their order; a list another caller publishes on the same publisher
        meanwhile may go out after writes announced later. Never raises (it runs inside the store
        write): an error is logged and counted in ``errors``; only a caller's bug is raised.

        Raises:
            InvalidArgumentError: ``tokens`` is neither empty (no token ids known: sglang's) nor
                ``block_size`` per key (checked before the store's events are taken).
        """
        if len(tokens) != len(keys) * self.block_size and len(tokens):
            raise InvalidArgumentError(
                f"tokens: must be empty or block_size ({self.block_size}) per key, "
                f"{len(keys) * self.block_size}, got {len(tokens)}"
            )
        lock = self._lock
        try:
            lock.acquire()  # the store's events and the queue in one order
            try:
                self._queue(keys, tokens, prior_key, namespace, failed_keys)
            finally:
                lock.release()
        except Exception:
            self.errors += 1
            logger.exception("kv events: announcing a write of %d pages failed", len(keys))

    def poll(self) -> None:
        """Publish the store's events since the last call (removals between writes). Never
        raises (it runs in the manager's ``poll``): an error is logged and counted."""
        try:
            with self._lock:
                self._queue((), (), None, (None, None), ())
        except Exception:
            self.errors += 1
            logger.exception("kv events: announcing the store's removals failed")

    def _queue(self, keys, tokens, prior_key, namespace, failed_keys) -> None:
        """Take the store's events and queue the call for :meth:`_drain`, which a publish call
        runs on the sending thread; one queued already (not started) takes this call too.
        Beyond the publisher's ``max_pending`` calls waiting, the call is dropped (a seq gap)."""
        store_events = self._take()
        stats = self._stats
        if stats is not None and stats.events_dropped != self._dropped_seen:  # the store's queue overflowed
            self._dropped_seen = stats.events_dropped
            store_events = [*store_events, _LOST]
        if not keys and not store_events:
            return
        calls = self._calls
        publisher = self.publisher
        if len(calls) >= publisher.max_pending:
            publisher.dropped_elsewhere()
            return
        calls.append((keys, tokens, prior_key, namespace, failed_keys, store_events))
        if not self._scheduled:
            self._scheduled = True  # before publishing: the drain clears it when it starts
            try:
                # dropped (the publisher's queue full: a gap): the calls stay queued, and the next
                # call publishes a drain again, else none would ever run
                if publisher.publish(self._drain) is False:
                    self._scheduled = False
            except BaseException:
                self._scheduled = False
                raise

    def _drain(self, batcher: EventBatcher) -> None:
        """On the sending thread: the events of every queued call into ``batcher``, in order."""
        self._scheduled = False  # a call queued from now on publishes another drain
        calls = self._calls
        announce = self._announce
        while calls:
            call = calls.popleft()
            if not calls or not self._plain(call):
                announce(*call, batcher)
                continue
            group = [call]  # the chain's next writes queued behind it: announced as one run
            while calls and calls[0][2] == group[-1][0][-1] and calls[0][3] == call[3] and self._plain(calls[0]):
                group.append(calls.popleft())
            if len(group) == 1:
                announce(*call, batcher)
                continue
            self._announce_run(group, batcher)

    def _announce_run(self, group: list[tuple], batcher: EventBatcher) -> None:
        """A chain's consecutive plain writes (:meth:`_plain`) into ``batcher`` as one run, its
        keys hashed once; each write on its own where a page inside the run is live."""
        try:
            keys = [key for part in group for key in part[0]]
            hashes, live = self._hashes(keys), self._live
            start = 0
            while start < len(hashes) and hashes[start] in live:
                start += 1
            gone = self._gone_untold  # (a page of the run in it: which page is stored is per write)
            if not live.isdisjoint(hashes[start:]) or (gone and not gone.keys().isdisjoint(hashes)):
                for part in group:
                    self._announce(*part, batcher)
                return
            tokens: list = []
            for part in group:
                tokens += part[1] if type(part[1]) is list else _token_list(part[1])
            stored = self._stored(keys, tokens, group[0][2], group[0][3], hashes)
        except Exception:
            self.errors += 1
            logger.exception("kv events: announcing a run of %d writes failed", len(group))
            return
        if stored is not None:
            batcher.stored(*stored)

    def _plain(self, call: tuple) -> bool:
        """Whether a queued call is a write with no failed key, a token id per position, and no
        store event but its own pages' stores: one a chain's run may join."""
        keys, tokens, _, _, failed_keys, store_events = call
        return (
            bool(keys)
            and not failed_keys
            and len(tokens) == len(keys) * self.block_size
            and (not store_events or _own_stores(store_events, keys))
        )

    def _chunks_of_events(self) -> list[tuple[str, list[str]]]:
        """The storage's ``take_events()`` as ``(kind, [key])`` chunks (a store wrapper's
        events), those of another key space left out."""
        space = self._key_space
        return [
            (event.kind, [event.key])
            for event in self.storage.take_events()
            if space is None or getattr(event, "key_space", space) == space
        ]

    def _announce(self, keys, tokens, prior_key, namespace, failed_keys, store_events, batcher: EventBatcher) -> None:
        """The events of one :meth:`written` (or :meth:`poll`: no keys) into the sending
        thread's ``batcher`` (that thread is the only one that reads or changes the stream's
        state). What it adds is worked out first and added last, so an error adds nothing."""
        try:
            if failed_keys:
                failed = set(failed_keys)
                keys = keys[: next((index for index, key in enumerate(keys) if key in failed), len(keys))]
            if not store_events or _own_stores(store_events, keys):  # the common write's
                stored = self._stored(keys, tokens, prior_key, namespace, None, _ALL if store_events else ())
                if stored is not None:
                    batcher.stored(*stored)
                return
            out = self._in_store_order(keys, tokens, prior_key, namespace, store_events)
            medium = self.medium
            for is_stored, item in out:
                if not is_stored:
                    batcher.removed(item, medium)
                elif item is not None:
                    batcher.stored(*item)
        except Exception:
            self.errors += 1
            logger.exception("kv events: announcing a write of %d pages failed", len(keys))

    def _in_store_order(self, keys, tokens, prior_key, namespace, store_events) -> list:
        """A write's pages and the store's events, as ``(True, stored fields or None)`` and
        ``(False, a removed page's hash)`` in the store's order: the run's pages are placed up
        to each of its own pages' events (a page held already goes with the next page's
        event, or at the end), so a page of the run removed then stored again in this call (a
        corrupt page rewritten) ends stored, and the pages after one removed and not stored
        again are not announced (their parent is gone)."""
        out: list = []
        keys = keys if type(keys) is list else list(keys)
        tokens = tokens if type(tokens) is list else _token_list(tokens)
        size = self.block_size
        where = {key: index for index, key in enumerate(keys)}
        stored_here = {key for kind, run in store_events if kind == "stored" for key in run if key in where}
        placed = 0  # the run's pages before this index are placed (announced, or removed)
        removed: set[int] = set()  # indices of the run's pages removed in this call, not stored since

        def place(first: int, end: int) -> None:
            prior = prior_key if first == 0 else keys[first - 1]
            fields = self._stored(
                keys[first:end], tokens[first * size : end * size], prior, namespace, None, stored_here
            )
            out.append((True, fields))

        for kind, run in store_events:
            if kind == _LOST[0]:
                if placed < len(keys):
                    place(placed, len(keys))
                    placed = len(keys)
                out += [(False, value) for value in self._retract_all()]
                continue
            for key in run:
                index = where.get(key)
                if kind == "stored":
                    if index is None:  # another writer's page (or a write not told yet)
                        self.pages_without_tokens += 1
                        value = self._hash(key)
                        self._gone_untold.pop(value, None)  # stored again
                        _remember(self._untold, value)
                    elif index >= placed:
                        place(placed, index + 1)
                        placed = index + 1
                    elif index in removed:  # removed earlier in this call, stored again
                        removed.discard(index)
                        place(index, index + 1)
                    continue
                if index is not None:
                    if index > placed:
                        place(placed, index)  # the pages before it first
                    placed = max(placed, index + 1)
                    removed.add(index)
                value = self._hash(key)
                self._live.discard(value)
                if self._untold.pop(value, 0) is None:  # stored, its write not told yet
                    _remember(self._gone_untold, value)
                self.pages_removed += 1
                out.append((False, value))
        if placed < len(keys):  # held already: after the last event
            place(placed, len(keys))
        return out

    def _retract_all(self) -> list[int]:
        """Every page live on this stream, sorted, now removed from it: the stream starts over
        after store events were lost (``resyncs``)."""
        retracted = sorted(self._live)
        self._live.clear()
        self.pages_removed += len(retracted)
        self.resyncs += 1
        return retracted

    def _claim(self, keys: Sequence[str], hashes: list[int], stored_here: Any) -> int:
        """A write's pages whose store events another call took (:attr:`_untold`) are its own
        now; returns how many of ``hashes`` lead up to the first of them removed since (that
        page is not stored: it and the pages after it are not announced), unless this call's
        own events stored it again (its key in ``stored_here``)."""
        untold, gone = self._untold, self._gone_untold
        count = len(hashes)
        for index, value in enumerate(hashes):
            if untold.pop(value, 0) is None:
                self.pages_without_tokens -= 1  # it had a write after all
            elif gone.pop(value, 0) is None:
                self.pages_without_tokens -= 1
                if stored_here is not _ALL and keys[index] not in stored_here:
                    count = min(count, index)
        if count < len(hashes):
            self.pages_unanchored += len(hashes) - count - 1  # after a page that is gone
        return count

    def close(self) -> None:
        """Publish what is left (:meth:`poll`), then close the publisher if owned."""
        self.poll()
        if self.owns_publisher:
            self.publisher.close()

    def _stored(
        self,
        keys: Sequence[str],
        tokens: Sequence[int],
        prior_key,
        namespace,
        hashes: list[int] | None = None,
        stored_here: Any = (),
    ) -> tuple | None:
        """The ``BlockStored`` fields (:meth:`EventBatcher.stored`'s arguments) of a run's pages
        that are new on this stream, the stream's state updated; None: nothing to announce.
        ``hashes``: the keys' block hashes where the caller has them already. ``stored_here``:
        the keys this call's own store events stored (``_ALL``: every one)."""
        if not keys:
            return None
        if hashes is None:
            hashes = self._hashes(keys)
        count = len(hashes)
        if prior_key is None:
            parent = None
        elif prior_key == self._last_key:  # a chain's next write: its prior key was hashed already
            parent = self._last_hash
        else:
            parent = self._hash(prior_key)
        self._last_key, self._last_hash = keys[count - 1], hashes[-1]
        untold, gone = self._untold, self._gone_untold  # another writer's pages stay there: look for the run's
        if (untold and not untold.keys().isdisjoint(hashes)) or (gone and not gone.keys().isdisjoint(hashes)):
            count = self._claim(keys, hashes, stored_here)
        live = self._live
        start = 0
        while start < count and hashes[start] in live:  # announced already: continue after them
            parent = hashes[start]
            start += 1
        if start == count:
            return None
        if parent is not None and parent not in live:
            self.pages_unanchored += count - start
            return None
        if start or count < len(hashes):
            hashes = hashes[start:count]
        size = self.block_size
        if type(tokens) is not list:
            tokens = _token_list(tokens)
        if start or len(tokens) != count * size:
            tokens = tokens[start * size : count * size]
        extra_key, cache_salt = namespace
        extra = None
        if extra_key is not None or cache_salt is not None:
            extra = [tuple(value for value in (extra_key, cache_salt) if value is not None)] * (count - start)
        live.update(hashes)
        self.pages_announced += count - start
        return hashes, parent, tokens, size, extra_key, self.medium, extra, cache_salt


_LOST = ("lost", [])  # a store-event chunk of the announcer's own: events were dropped before here
_ALL = object()  # _stored's stored_here: every page of the run was stored by the call's own events
_UNTOLD_MAX = 65536  # pages remembered as stored before their write was told (a store's event queue's default)


def _remember(pages: dict[int, None], value: int) -> None:
    """Add ``value`` to an insertion-ordered set of hashes, the oldest dropped beyond ``_UNTOLD_MAX``."""
    pages[value] = None
    if len(pages) > _UNTOLD_MAX:
        del pages[next(iter(pages))]


def _own_stores(store_events: list, keys: Sequence[str]) -> bool:
    """Whether a write's store events (``(kind, keys)`` chunks) are its own pages' stores, in
    order, and nothing else (one run, the usual: a list comparison, no loop a key)."""
    keys = keys if type(keys) is list else list(keys)
    if len(store_events) == 1:
        kind, run = store_events[0]
        return kind == "stored" and run == keys
    return all(kind == "stored" for kind, _ in store_events) and [key for _, run in store_events for key in run] == keys


def _token_list(tokens: Sequence[int]) -> list[int]:
    """``tokens`` (a list, tuple, tensor or array of ints) as a list of Python ints."""
    return tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)


def announcer_for(kv_events: Any, storage: Any, block_size: int) -> KVEventAnnouncer | None:
    """The announcer for a manager's ``kv_events`` argument: None (off), a
    :class:`KVEventPublisher`, or an endpoint str (a publisher bound there, without replay,
    closed with the manager).

    Raises:
        ArgumentTypeError: ``kv_events`` is none of these.
        InvalidArgumentError: the endpoint cannot be bound.
    """
    if kv_events is None:
        return None
    require(
        isinstance(kv_events, (KVEventPublisher, str)),
        "kv_events",
        lambda: f"must be None, a KVEventPublisher or an endpoint str, got {type(kv_events).__name__}",
        ArgumentTypeError,
    )
    if isinstance(kv_events, KVEventPublisher):
        return KVEventAnnouncer(kv_events, storage, block_size=block_size)
    return KVEventAnnouncer(KVEventPublisher(kv_events), storage, block_size=block_size, owns_publisher=True)
