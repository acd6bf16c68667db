"""``KVStageOffloadingManager``: the scheduler side of :class:`KVStageOffloadingSpec`.

It decides for vLLM's scheduler and never waits for the store: lookups answer from a
:class:`kvstage.offload.StoreIndex`, loads and stores are handed to the workers as
:class:`KVStageLoadStoreSpec` (the blocks' page keys); the blocks stored (as vLLM completes
their jobs) and lost (as the workers or this process's store report them) become vLLM's
``OffloadingEvent``s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterable
from typing import Any

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    get_offload_group_idx,
)

from kvstage.integrations.vllm.keys import lookup_result, page_keys, prior_page_keys
from kvstage.offload import StoreIndex, StoreWorkers
from kvstage.storage.shared import release_shared_storage

__all__ = ["KVStageLoadStoreSpec", "KVStageOffloadingManager"]

logger = logging.getLogger(__name__)


class KVStageLoadStoreSpec(LoadStoreSpec):
    """Where blocks live in kvstage: their page keys (hex ``OffloadKey``s), in block order, and
    for a store the page key of each block's predecessor in its request (None: unknown, or the
    request's first block), so pages stored in several jobs chain (see
    :func:`kvstage.offload.keyed_copies.chain_runs`)."""

    def __init__(self, page_keys: list[str], prior_keys: list[str | None] | None = None) -> None:
        self.page_keys = page_keys
        self.prior_keys = prior_keys

    def __repr__(self) -> str:
        return f"KVStageLoadStoreSpec({len(self.page_keys)} pages)"


class KVStageOffloadingManager(OffloadingManager):
    """Decides for vLLM's scheduler: what the store holds (cached, refreshed on a reader
    thread), which blocks to store, and what the store gained and lost as vLLM's events.

    Args:
        storage: the store (shared with the workers of this process, if any).
        miss_ttl_s: seconds a "not held" answer is trusted, and a key whose load failed is a
            miss (unless stored again meanwhile).
        hit_ttl_s: seconds after which a held key is checked again in the background.
        events: collect vLLM events (vLLM publishes KV events).
        unchained_groups: KV group ids whose pages link to no predecessor (a hybrid model's
            sliding-window and Mamba groups: vLLM stores only the chunks that can serve a hit,
            so the chunk before one is rightly absent).
        chunk_tokens: tokens of one chunk per KV group id (vLLM's partial tails, keys at a hash
            boundary inside a chunk, link to the chunk before them and are no chunk's
            predecessor: see :func:`kvstage.integrations.vllm.keys.prior_page_keys`).

    Events (``take_events``, medium ``STORAGE``): a block is announced stored once, when vLLM
    reports its store job done by every worker and no worker failed to write it (known when
    the workers report their stores: :attr:`workers_report_stores`, set by
    :class:`KVStageConnector`; otherwise only when this process's store reported it stored);
    an announced block is announced removed once, when any worker's store (or this process's)
    evicts or removes it, and every announced block when a cache reset's ``clear`` ran.
    vLLM's connector adds the token ids, parent and block size when
    ``self_describing_kv_events`` is set.

    A store's eviction of a page is seen at once when the workers report their stores (any
    process) or share this process's store object; otherwise within ``hit_ttl_s`` of the
    key's last check, or when a load of it fails (:meth:`loads_failed`, from
    :class:`KVStageConnector`; vLLM recomputes the blocks, and the page a load stopped at
    misses for ``miss_ttl_s``).
    """

    def __init__(
        self,
        storage: Any,
        *,
        miss_ttl_s: float = 1.0,
        hit_ttl_s: float | None = 10.0,
        events: bool = False,
        unchained_groups: frozenset[int] = frozenset(),
        chunk_tokens: dict[int, int] | None = None,
    ) -> None:
        self.storage = storage
        self._unchained_groups = unchained_groups
        self._chunk_tokens = dict(chunk_tokens or {})
        self._workers = StoreWorkers()
        try:
            self.index = StoreIndex(storage, self._workers, miss_ttl_s=miss_ttl_s, hit_ttl_s=hit_ttl_s)
        except BaseException:
            self._workers.close()  # the caller keeps the store: it is this manager's only once built
            raise
        self._closed = False
        self._events_enabled = events
        self._events: list[OffloadingEvent] = []
        self._storing: dict[str, int] = {}  # page keys of stores in flight -> order prepared (announced in it)
        self._stores_prepared = 0
        self._unwritten: set[str] = set()  # keys in _storing a worker did not write, or a store lost meanwhile
        self._announced: set[str] = set()  # page keys announced stored and not removed since (events only)
        self.workers_report_stores = False  # KVStageConnector sets it: stores_reported each step
        self._clear_pending = False  # a reset waits for the jobs in flight before clearing
        self._miss_ttl_s = miss_ttl_s
        self._clock = time.monotonic
        self._unreadable: dict[str, float] = {}  # key of a failed load -> when it failed (oldest first)
        self._lock = threading.Lock()

    @property
    def lock(self) -> threading.Lock:
        """Held by vLLM's scheduler around every call (the reader thread never takes it)."""
        return self._lock

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        """HIT / MISS from the index; RETRY while the store is being asked; MISS while a reset
        waits for its clear (the store still holds pre-reset pages)."""
        if self._clear_pending:
            return LookupResult.MISS
        return lookup_result(self.index, key)

    def prepare_load(self, keys: Collection[bytes], req_context: ReqContext) -> LoadStoreSpec:
        """The page keys to read (the store keeps no pins: a page evicted meanwhile fails the load)."""
        return KVStageLoadStoreSpec(page_keys(keys))

    def complete_load(self, keys: Collection[bytes], req_context: ReqContext) -> None:
        """The workers finished loading ``keys`` (read, or failed: :meth:`loads_failed` names
        the pages that were not); the store keeps no pins, so nothing to release."""

    def loads_failed(self, keys: Iterable[str]) -> None:
        """The workers' loads stopped at ``keys`` (page keys, from
        :meth:`KVStageWorker.take_unreadable_keys` via :class:`KVStageConnector`): each is a
        miss for ``miss_ttl_s``, a store of it meanwhile included; the pages before them
        in their loads were read and stay hits, so a request that vLLM looks up again (several
        KV groups) or another request hits the prefix still restorable. Not asked of the store
        again at once: a page that exists but cannot be read (EIO, a replica whose transfer
        fails) would be offered, fail and be offered again, and its request would never
        finish."""
        keys = list(keys)
        self.index.discard(keys)
        now = self._clock()
        for key in keys:
            self._unreadable.pop(key, None)  # to the end: the dict stays oldest first
            self._unreadable[key] = now

    def _prune_unreadable(self) -> None:
        """Forget failed loads older than ``miss_ttl_s`` (their keys may be asked again)."""
        oldest = self._clock() - self._miss_ttl_s
        while self._unreadable:
            key, failed_at = next(iter(self._unreadable.items()))
            if failed_at >= oldest:
                return
            del self._unreadable[key]

    def prepare_store(self, keys: Collection[bytes], req_context: ReqContext) -> PrepareStoreOutput | None:
        """Store the blocks the store does not hold and no store in flight is writing, each
        linked to its request's block before it; none while a reset waits for its clear (the
        clear would remove them)."""
        if self._clear_pending:
            return PrepareStoreOutput(keys_to_store=[], store_spec=KVStageLoadStoreSpec([]), evicted_keys=[])
        # holds, not lookup: a key about to be written needs no exists of its own
        keys = list(keys)
        wanted = [
            (key, page_key)
            for key, page_key in zip(keys, page_keys(keys))
            if not self.index.holds(page_key) and page_key not in self._storing
        ]
        wanted_page_keys = [page_key for _, page_key in wanted]
        for order, page_key in enumerate(wanted_page_keys, self._stores_prepared):
            self._storing[page_key] = order
        self._stores_prepared += len(wanted_page_keys)
        # Each block links to its request's block before it (stored by an earlier job, found in
        # the store, or in this job), so a prefix stored over several steps is one chain.
        priors = prior_page_keys(req_context, [key for key, _ in wanted], chunk_tokens=self._chunk_tokens)
        if self._unchained_groups:
            priors = [
                None if get_offload_group_idx(key) in self._unchained_groups else prior
                for (key, _), prior in zip(wanted, priors)
            ]
        return PrepareStoreOutput(
            keys_to_store=[key for key, _ in wanted],
            store_spec=KVStageLoadStoreSpec(wanted_page_keys, priors),
            evicted_keys=[],
        )

    def complete_store(self, keys: Collection[bytes], req_context: ReqContext, success: bool = True) -> None:
        """Every worker finished the store of ``keys``. A worker reports a store done even when
        the store could not write a page (vLLM's worker takes no failure). With
        :attr:`workers_report_stores` the keys no worker reported unwritten (nor a store lost
        since) are held and announced stored; otherwise only those the index learned are held
        (this process's store reported them stored), and the others are asked of the store at
        their next lookup (RETRY meanwhile). A key whose load failed stays a miss."""
        self._drain_store_events()  # while the keys are still in _storing
        # vLLM passes a job's keys as a set: back to the order they were prepared in (a parent first)
        completed = sorted(page_keys(keys), key=lambda key: self._storing.get(key, -1))
        for key in completed:
            self._storing.pop(key, None)
        # A key whose load failed stays a miss: a store of it that reported no write (the
        # store kept its unreadable page as "already held") must not make it a hit again.
        self._prune_unreadable()
        if self.workers_report_stores:
            held = [key for key in completed if key not in self._unwritten and key not in self._unreadable]
            self.index.add(held)
        else:
            held = [key for key in completed if self.index.holds(key) and key not in self._unreadable]
        self._unwritten.difference_update(completed)
        self.index.forget([key for key in completed if not self.index.holds(key) and key not in self._unreadable])
        if self._events_enabled:
            new = [key for key in held if key not in self._announced]
            if new:
                self._announced.update(new)
                # removal_expected: this manager announces the removals (vLLM's tracker keeps the payload for them)
                event = OffloadingEvent(
                    [bytes.fromhex(key) for key in new], Medium.STORAGE, False, removal_expected=True
                )
                self._events.append(event)

    def stores_reported(self, unwritten: Iterable[str], removed: Iterable[str]) -> None:
        """The workers' report of a step (:meth:`KVStageWorker.take_store_report`, from every
        worker, any process), before vLLM passes on the store jobs it completed:
        ``unwritten``, page keys a store job could not write; ``removed``, page keys their
        stores evicted or removed. Neither is held; an announced one is announced removed."""
        unwritten = [key for key in unwritten if key in self._storing]
        self._unwritten.update(unwritten)
        removed = list(removed)
        if removed:
            self.index.discard(removed)
            self._removed(removed)

    def _removed(self, keys: list[str]) -> None:
        """Pages a store evicted or removed (in order, maybe twice: one per worker)."""
        self._unwritten.update(key for key in keys if key in self._storing)  # lost before its job ended
        if not self._events_enabled:
            return
        gone = []
        for key in keys:
            if key in self._announced:
                self._announced.discard(key)
                gone.append(key)
        if gone:
            self._events.append(OffloadingEvent([bytes.fromhex(key) for key in gone], Medium.STORAGE, True))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """vLLM's per-request hook: kvstage keeps no per-request state here (keys are the
        blocks' own), so an empty context."""
        return RequestOffloadingContext()

    def on_schedule_end(self, context: Any) -> None:
        """Send queued lookups; keep the index current with the store's events."""
        self.index.poll()
        self._drain_store_events()

    def has_pending_work(self) -> bool:
        """Whether lookups wait for the store's answer (a refresh in flight or queued): vLLM
        keeps stepping until they are answered. Transfers are the workers' to report."""
        return self.index.refreshing

    def reset_cache(self) -> None:
        """vLLM's connector cache reset (e.g. after a weight update): forget every lookup
        answer and clear the store's key space once the workers' jobs in flight have ended
        (:meth:`on_reset_flushed`), so no page written before the reset lands after the clear.
        Until then lookups miss and nothing is stored."""
        self._clear_pending = True
        self.index.reset()
        self._storing.clear()  # vLLM reports no completion of jobs from before the reset
        self._unwritten.clear()
        self._unreadable.clear()  # the clear removes their pages

    def on_reset_flushed(self) -> None:
        """The workers finished every job in flight at the last :meth:`reset_cache`: clear
        the store now. Blocks this thread for the clear: a rare, operator-driven call. Stores
        in other processes (``memory``) are not reached.

        Raises:
            What the store's ``clear`` raised (logged); lookups and stores resume all the same.
        """
        if not self._clear_pending:
            return
        try:
            self.storage.clear()
        except BaseException as error:
            logger.error(
                "kvstage: the store's clear after a cache reset failed (%r); pages from before the reset may be found",
                error,
            )
            raise
        finally:
            self._clear_pending = False  # else every lookup would miss for good
            self.index.reset()
        self._removed(list(self._announced))  # the clear reached every rank's key space only here: all are gone
        self._drain_store_events()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Blocks announced stored and removed since the last call, as vLLM events (see the
        class doc), in order."""
        self._drain_store_events()
        events, self._events = self._events, []
        return events

    def _drain_store_events(self) -> None:
        """This process's store's events: the index follows them; its evictions and removals
        are announced (its stores are announced by :meth:`complete_store`)."""
        store_events = self.storage.take_events()
        if not store_events:
            return
        prefix = self.storage.prefix
        # Held answers come from this manager's own stores in flight: a page written before a
        # reset (no longer in _storing) is not taken as held; others are asked.
        self.index.apply_events(store_events, prefix, counts_stored=self._storing.__contains__)
        removed = [event.key for event in store_events if event.kind != "stored" and event.key_space == prefix]
        if removed:
            self._removed(removed)

    def shutdown(self) -> None:
        """Stop the reader thread and let go of the store (closed by its last user).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._workers.close()
        release_shared_storage(self.storage)
