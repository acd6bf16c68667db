"""The storage interface: :class:`StorageBackend`, :class:`PutStatus`, :class:`PutStatuses`,
:class:`StorageStats`.

A backend stores whole pages (the page-first bytes of one page across every layer and KV part)
under string keys. Callers pass the page hash (hex) as the key; the backend prefixes it with the
:class:`LayoutFingerprint` of the KV layout, so pages of one model, dtype, layout, page size or
tensor-parallel rank are never read as another's.

Backends: ``MemoryStore`` (default), ``FileStore`` (one file a page), ``MooncakeStore``
(the Mooncake distributed store, optional); :func:`kvstage.storage.open_storage` builds one
from a URL.
"""

from __future__ import annotations

import abc
import collections
import enum
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError, StorageError
from kvstage.storage.events import DEFAULT_EVENT_CAPACITY, EventQueue, StoreEvent
from kvstage.storage.fingerprint import LayoutFingerprint


class PutStatus(enum.Enum):
    """The outcome of storing one page."""

    STORED = "stored"  # written now, readable from now on
    DEDUPLICATED = "deduplicated"  # the key was already there; nothing written
    FAILED = "failed"  # not written; the key is not visible


class MissingPriorError(StorageError):
    """Why a chain-aware store (memory, file) refused pages: the chain's page before them is not
    stored, so no lookup could reach them (:meth:`StorageBackend.put`'s ``prior_key``, or the
    call's previous key when that one was refused). A put of the same pages once the prior is
    stored succeeds (e.g. a decode side's page that reached the store before the prefill side's
    last prompt page).

    Attributes:
        prior_key: the missing page's key (the store's key, without the fingerprint prefix).
    """

    def __init__(self, prior_key: str, message: str | None = None) -> None:
        super().__init__(
            message
            or f"prior_key: {prior_key!r} is not stored; a page after a missing one is unreachable, so it is refused"
        )
        self.prior_key = prior_key


class PutStatuses(list):
    """What :meth:`StorageBackend.put` answers: a list of one :class:`PutStatus` per key, and
    :attr:`error`, the exception that failed pages of the call (e.g. ``OSError`` with errno
    ``EROFS``, ``EACCES`` or ``ENOSPC`` from a file store, a
    :class:`kvstage.storage.mooncake.status.MooncakeCodeError` with the Mooncake return code, a
    :class:`MissingPriorError` naming the chain page a chain-aware store found missing), or None
    when no page failed because of an error (a page refused for room is ``FAILED`` with no
    error). When several pages failed with different errors, the first one.

    A list subclass, so callers that compare or iterate statuses keep working.
    """

    def __init__(self, statuses=(), error: BaseException | None = None) -> None:
        super().__init__(statuses)
        self.error = error


@dataclass
class StorageStats:
    """Counters a backend keeps; seconds are wall-clock time spent inside put/get."""

    pages_stored: int = 0
    pages_deduplicated: int = 0
    pages_failed: int = 0
    bytes_put: int = 0
    put_seconds: float = 0.0
    pages_read: int = 0
    pages_missed: int = 0
    bytes_got: int = 0
    get_seconds: float = 0.0
    pages_evicted: int = 0  # by the store's own eviction
    pages_removed: int = 0  # by clear(), remove(), a corrupt page dropped, FileStore.evict_key_space
    events_stored: int = 0  # store events recorded, by kind (taken or not)
    events_evicted: int = 0
    events_removed: int = 0
    events_dropped: int = 0  # events dropped from a full event queue (the oldest go)

    def put_gbps(self) -> float:
        """Stored bytes per second of put time, in GB/s (1e9 bytes)."""
        return self.bytes_put / self.put_seconds / 1e9 if self.put_seconds > 0 else 0.0

    def get_gbps(self) -> float:
        """Read bytes per second of get time, in GB/s (1e9 bytes)."""
        return self.bytes_got / self.get_seconds / 1e9 if self.get_seconds > 0 else 0.0


class StorageBackend(abc.ABC):
    """A key-value store of whole KV pages.

    Subclasses implement :meth:`_exists`, :meth:`_put`, :meth:`_get`, :meth:`_clear` (and, to
    support :meth:`remove`, :meth:`_remove`) on full keys (prefix included; page keys alone in
    a store with :attr:`prefixed_hook_keys` False); this class checks arguments, adds the
    prefix, counts and times. Subclasses record a :class:`StoreEvent` for each page stored, evicted and removed,
    under the lock that orders their index changes, so a consumer sees events in the order of
    the changes (a page stored after a ``clear`` is never reported before its removal).

    Args:
        fingerprint: the KV layout; its :meth:`LayoutFingerprint.prefix` starts every key and
            its :attr:`LayoutFingerprint.page_bytes` is the size every page must have.
        event_capacity: store events kept until :meth:`take_events` takes them (0: none).

    Raises:
        InvalidArgumentError: event_capacity is not an int >= 0.
    """

    tier = "store"  # the store's name in its events: "memory", "file", "mooncake"
    # True: put/get also take non-contiguous CPU tensors (strided views, e.g. a host pool page
    # permuted into kvstage's page order) and move them with one copy; a view's bytes are its
    # elements in row-major order. False: pages must be contiguous.
    strided_pages = False
    # Called after each timed put and get (see add_timing_listener); a tuple, replaced whole,
    # so threads iterate it without a lock.
    _timing_listeners: tuple = ()
    _change_listeners: tuple = ()  # see add_change_listener; replaced whole, as _timing_listeners
    # True: the hooks (_exists, _put, _get, _remove, _record) take full keys, the fingerprint
    # prefix before each page key (a key space shared with others: a directory, a cluster).
    # False: page keys alone, for a store whose index is its own key space (MemoryStore: one
    # object, one fingerprint), so a lookup builds no prefixed string per key.
    prefixed_hook_keys = True

    def __init__(self, fingerprint: LayoutFingerprint, *, event_capacity: int = DEFAULT_EVENT_CAPACITY) -> None:
        self.fingerprint = fingerprint
        self.prefix = fingerprint.prefix()
        self._hook_prefix = self.prefix if self.prefixed_hook_keys else ""  # put before each key given a hook
        self.page_bytes = fingerprint.page_bytes
        self.stats = StorageStats()
        self._untold_changes: collections.deque = collections.deque()  # evictions and removals not told yet
        self._events = EventQueue(
            self.stats,
            tier=self.tier,
            key_space=self.prefix,
            page_bytes=self.page_bytes,
            capacity=event_capacity,
            on_record=self._note_change,
        )

    # -- the public interface -------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each page key (hex page hash, no prefix) is stored and readable, in order.

        "Readable" as far as a store can tell cheaply (the file store checks the size, not the
        checksum; see each store). A key found counts as a use for the store's eviction.
        """
        prefix, keys = self._hook_prefix, _checked_keys(keys)
        try:
            return self._exists([prefix + key for key in keys] if prefix else keys)
        finally:
            self._tell_changes()

    def put(self, keys: Sequence[str], pages: Sequence[torch.Tensor], *, prior_key: str | None = None) -> PutStatuses:
        """Store ``pages[i]`` under ``keys[i]``; a key already stored is left as it is.

        A put's keys are one run of one chain, in order: ``keys[i - 1]`` is the page right
        before ``keys[i]`` (the offload manager always writes a request's segment that way), and
        ``prior_key`` is the page right before ``keys[0]``. Stores that evict by themselves use
        these links to evict a chain from its tail (a page whose predecessor is gone can never
        be found by a lookup, which walks a chain from its start); see each store.

        Args:
            keys: page hashes (hex), no prefix; no key twice in one call. One run of a hash
                chain, in order.
            pages: CPU tensors, each contiguous with exactly ``page_bytes`` bytes (any dtype;
                the bytes are stored). Typically views of host pool pages. A store with
                :attr:`strided_pages` also takes non-contiguous views (their elements in
                row-major order are the page's bytes).
            prior_key: the storage key (page hash, no prefix) of the chain's page right before
                ``keys[0]``, e.g. the previous segment's last key when a decode segment is
                written; the hashing side calls the same key ``prior_hash``. None or ``""``:
                ``keys[0]`` starts a chain (a namespace seed is not a stored page, so it is
                never passed here).

        Returns:
            :class:`PutStatuses`: one :class:`PutStatus` per key (a ``FAILED`` key is not
            visible afterwards) and ``.error``, the exception that failed pages, if any.
            Each ``STORED`` page records a ``stored`` :class:`StoreEvent`.

        Raises:
            InvalidArgumentError: lengths differ, a key repeats, a page is not a contiguous
                CPU tensor of ``page_bytes`` bytes or is a lazy conjugate or negative view, or
                ``prior_key`` is one of ``keys``. Nothing is written then.
            ArgumentTypeError: ``prior_key`` is not a str or None.
        """
        return self._run_put(keys, pages, prior_key, self._put)

    def _run_put(
        self,
        keys: Sequence[str],
        pages: Sequence[torch.Tensor],
        prior_key: str | None,
        put: Callable[[list[str], list[torch.Tensor], "str | None"], list[PutStatus]],
    ) -> PutStatuses:
        """:meth:`put`'s checks, counters, events and listeners around ``put`` (a ``_put`` on
        full keys; :meth:`MemoryStore.put_adopting <kvstage.storage.memory_store.MemoryStore.put_adopting>`
        passes its own)."""
        keys = _checked_keys(keys)
        self._check_pages("pages", keys, pages)
        if len(set(keys)) != len(keys):
            raise InvalidArgumentError("keys: a key appears twice in one put")
        if prior_key is not None and not isinstance(prior_key, str):
            raise ArgumentTypeError(f"prior_key: must be a str key or None, got {type(prior_key).__name__}")
        if prior_key in keys:
            raise InvalidArgumentError(
                f"prior_key: must not be one of keys (keys[{keys.index(prior_key)}]): it precedes keys[0]"
            )
        prefix = self._hook_prefix
        full_keys = [prefix + key for key in keys] if prefix else list(keys)
        started = time.perf_counter()
        try:
            answer = put(full_keys, list(pages), prefix + prior_key if prior_key else None)
        finally:
            self._tell_changes()
        seconds = time.perf_counter() - started
        self.stats.put_seconds += seconds
        for listener in self._timing_listeners:
            listener("put", len(keys), seconds)
        statuses = PutStatuses(answer, getattr(answer, "error", None))
        for status in statuses:
            if status is PutStatus.STORED:
                self.stats.pages_stored += 1
                self.stats.bytes_put += self.page_bytes
            elif status is PutStatus.DEDUPLICATED:
                self.stats.pages_deduplicated += 1
            else:
                self.stats.pages_failed += 1
        if self._change_listeners:
            links = [prior_key or None, *keys[:-1]]
            held = [(key, prior) for key, prior, status in zip(keys, links, statuses) if status is not PutStatus.FAILED]
            if held:
                self._tell("stored", [key for key, _ in held], [prior for _, prior in held])
        return statuses

    def get(self, keys: Sequence[str], into: Sequence[torch.Tensor]) -> list[bool]:
        """Copy the page stored under ``keys[i]`` into ``into[i]``.

        Args:
            keys: page hashes (hex), no prefix.
            into: CPU tensors, each contiguous with exactly ``page_bytes`` bytes (with
                :attr:`strided_pages`, also non-contiguous views, as for :meth:`put`).

        Returns:
            One bool per key: True when the page was found intact and copied; on False,
            ``into[i]`` holds no bytes of a wrong page (it may be untouched).

        Raises:
            InvalidArgumentError: lengths differ or a target is not a contiguous CPU tensor
                of ``page_bytes`` bytes, is a lazy conjugate or negative view, or requires
                grad. No target is written then.
        """
        keys = _checked_keys(keys)
        self._check_pages("into", keys, into, targets=True)
        started = time.perf_counter()
        try:
            prefix = self._hook_prefix
            hits = self._get([prefix + key for key in keys] if prefix else keys, list(into))
        finally:
            self._tell_changes()
        seconds = time.perf_counter() - started
        self.stats.get_seconds += seconds
        for listener in self._timing_listeners:
            listener("get", len(keys), seconds)
        found = sum(hits)
        self.stats.pages_read += found
        self.stats.pages_missed += len(hits) - found
        self.stats.bytes_got += found * self.page_bytes
        return hits

    def add_timing_listener(self, listener: Callable[[str, int, float], None]) -> None:
        """Call ``listener(op, num_pages, seconds)`` after each :meth:`put` (``op`` ``"put"``)
        and :meth:`get` (``"get"``) that returned: ``num_pages`` keys asked, ``seconds`` the
        wall-clock time inside the store, the same figure added to ``stats.put_seconds`` /
        ``stats.get_seconds``. Called on the thread of the put or get (the offload manager's
        writer or reader thread); it must be thread-safe and must not raise (an exception
        propagates out of the put or get).

        Raises:
            InvalidArgumentError: ``listener`` is not callable.
        """
        if not callable(listener):
            raise InvalidArgumentError("listener: must be callable")
        self._timing_listeners = (*self._timing_listeners, listener)

    def remove_timing_listener(self, listener: Callable[[str, int, float], None]) -> None:
        """Stop calling ``listener`` (added by :meth:`add_timing_listener`); absent: nothing (a bound method matches an equal one)."""
        self._timing_listeners = tuple(added for added in self._timing_listeners if added != listener)

    def clear(self) -> int:
        """Remove every page of this store's key space (its fingerprint prefix); pages of other
        key spaces (in a shared directory or Mooncake cluster) stay. Use it after a weight
        update, when stored KV no longer matches the model.

        Safe while other threads put and get: a put racing a clear lands after it, whole, or
        not at all; a get racing it reads a page whole or misses. Each page removed records a
        ``removed`` :class:`StoreEvent` and counts in ``stats.pages_removed``. What each store
        can see: see each store's ``_clear``.

        Returns:
            The number of pages removed.

        Raises:
            StorageError: the store could not clear (Mooncake: the client is closed, or the
                master answered an error code, :class:`~kvstage.storage.mooncake.status.MooncakeCodeError`);
                ``stats.pages_removed`` is not changed then.
        """
        try:
            removed = self._clear()
        finally:
            self._tell_changes()
        self.stats.pages_removed += removed
        return removed

    def remove(self, keys: Sequence[str]) -> int:
        """Remove the pages stored under ``keys`` and, in a chain-aware store (memory, file),
        every page of this store that chains after one of them (a lookup, which walks a chain
        from its start, could never reach those again). Keys not stored are skipped.

        Each page removed records a ``removed`` :class:`StoreEvent` (and tells the change
        listeners) and counts in ``stats.pages_removed``. A put racing a remove of its prior
        page may land its page after it (unreachable, as any page after a missing one).

        Args:
            keys: page hashes (hex), no prefix.

        Returns:
            The number of pages removed (later pages of the chains included).

        Raises:
            InvalidArgumentError: a key is not a non-empty str (nothing is removed then).
            StorageError: the store cannot remove (Mooncake: the client is closed, or every
                key's answer said the master is down; a store without removal).
        """
        prefix = self._hook_prefix
        full_keys = list(dict.fromkeys(prefix + key for key in _checked_keys(keys)))
        if not full_keys:
            return 0
        try:
            removed = self._remove(full_keys)
        finally:
            self._tell_changes()
        self.stats.pages_removed += removed
        return removed

    def add_change_listener(self, listener: Callable[["StorageBackend", str, list[str], list], None]) -> None:
        """Call ``listener(store, kind, keys, priors)`` when this store's pages change: ``kind``
        ``"stored"`` after a put, with the keys it stored or found there (no prefix) and
        ``priors[i]``, the key before ``keys[i]`` in its chain (None at a chain's start);
        ``"evicted"`` / ``"removed"`` (``priors`` None) for pages this store's eviction dropped
        or that were removed (``clear``, ``remove``, a corrupt page; for Mooncake, evictions
        when the client notices them). Called on the thread of the call that changed them,
        after the store released its locks and before that call returns (so the listener may
        call stores, this one included); a listener must be thread-safe and should not raise
        (an exception propagates out of that call).

        Raises:
            InvalidArgumentError: ``listener`` is not callable.
        """
        if not callable(listener):
            raise InvalidArgumentError("listener: must be callable")
        self._change_listeners = (*self._change_listeners, listener)

    def remove_change_listener(self, listener: Callable[["StorageBackend", str, list[str], list], None]) -> None:
        """Stop calling ``listener`` (added by :meth:`add_change_listener`); absent: nothing."""
        self._change_listeners = tuple(added for added in self._change_listeners if added != listener)

    def take_events(self, max_events: int | None = None) -> list[StoreEvent]:
        """Take the oldest store events not taken yet (None: all), oldest first; never blocks.

        A full queue (``event_capacity``) drops its oldest events, counted in
        ``stats.events_dropped``; see :mod:`kvstage.storage.events`.

        Raises:
            InvalidArgumentError: max_events is not None or an int >= 0.
        """
        return self._events.take(max_events)

    @property
    def event_capacity(self) -> int:
        """Store events kept until taken (0: events off); see :meth:`take_events`."""
        return self._events.capacity

    def take_event_chunks(self, key_space: str | None = None) -> list[tuple[str, list[str]]]:
        """Take every store event not taken yet, oldest first, as ``(kind, keys)`` chunks (one a
        recording; the same events as :meth:`take_events`, no per-key object): what an
        announcer reads. ``key_space``: only the events of that fingerprint prefix are
        returned (the rest are taken and dropped); None: every one. Never blocks."""
        return self._events.take_chunks(key_space)

    def register_host_buffers(self, buffers: Sequence[torch.Tensor]) -> None:  # noqa: B027 (optional hook)
        """Tell a zero-copy backend which host memory pages will come from (default: no-op)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what the backend holds (default: no-op). Idempotent."""

    def __enter__(self) -> "StorageBackend":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- what a backend implements, on full keys --------------------------------------------

    @abc.abstractmethod
    def _exists(self, full_keys: list[str]) -> list[bool]: ...

    @abc.abstractmethod
    def _put(
        self, full_keys: list[str], pages: list[torch.Tensor], full_prior_key: str | None = None
    ) -> list[PutStatus]:
        """Store a run of one chain (see :meth:`put`); ``full_prior_key`` (prefix included)
        precedes ``full_keys[0]``, None at a chain's start. A :class:`PutStatuses` answer
        passes its ``error`` on. Records a ``stored`` event for each page it stored."""

    @abc.abstractmethod
    def _get(self, full_keys: list[str], into: list[torch.Tensor]) -> list[bool]: ...

    @abc.abstractmethod
    def _clear(self) -> int:
        """Remove every page under this store's prefix, recording a ``removed`` event for
        each; the number removed."""

    def _remove(self, full_keys: list[str]) -> int:
        """Remove ``full_keys`` (distinct, prefix included) as :meth:`remove` says, recording a
        ``removed`` event for each page removed; the number removed. A store that cannot
        remove raises :class:`StorageError`."""
        raise StorageError(f"{self.tier}: this store cannot remove pages")

    def _note_change(self, kind: str, keys: list[str], key_space: str | None) -> None:
        """The event queue's hook: note this store's evictions and removals for the change
        listeners (told by :meth:`_tell_changes`, outside the store's locks)."""
        if kind != "stored" and key_space is None and self._change_listeners:
            self._untold_changes.append((kind, list(keys)))

    def _tell_changes(self) -> None:
        """Tell the change listeners what this store evicted and removed so far, on any thread
        (a corrupt page an I/O thread dropped is told by the call that waited for it)."""
        changes = self._untold_changes
        while changes:
            try:
                kind, keys = changes.popleft()
            except IndexError:  # another thread took the last one
                return
            self._tell(kind, keys, None)

    def _tell(self, kind: str, keys: list[str], priors: list | None) -> None:
        for listener in self._change_listeners:
            listener(self, kind, keys, priors)

    def _record(self, kind: str, full_keys) -> None:
        """Record a store event of ``kind`` for each key of this store as its hooks take them
        (full keys, or page keys where :attr:`prefixed_hook_keys` is False)."""
        start = len(self._hook_prefix)
        self._events.record(kind, [key[start:] for key in full_keys] if start else list(full_keys))

    # -- helpers ----------------------------------------------------------------------------

    def _check_pages(
        self, argument: str, keys: list[str], pages: Sequence[torch.Tensor], *, targets: bool = False
    ) -> None:
        """Refuse, naming ``argument[i]``, pages a put or get cannot use whole (``targets``: a get's, written in place)."""
        if len(pages) != len(keys):
            raise InvalidArgumentError(f"{argument}: {len(pages)} pages for {len(keys)} keys")
        for index, page in enumerate(pages):
            if (
                not isinstance(page, torch.Tensor)
                or not page.is_cpu
                or not (self.strided_pages or page.is_contiguous())
            ):
                kind = "CPU tensor" if self.strided_pages else "contiguous CPU tensor"
                raise InvalidArgumentError(f"{argument}[{index}]: must be a {kind}")
            size = page.nbytes  # is_cpu and nbytes: a fifth the cost of device.type and numel() a page
            if size != self.page_bytes:
                raise InvalidArgumentError(
                    f"{argument}[{index}]: {size} bytes, the layout's page has {self.page_bytes}"
                )
            if page.is_conj() or page.is_neg():  # their bytes are not the values they show
                raise InvalidArgumentError(
                    f"{argument}[{index}]: a lazy conjugate or negative view; pass page.resolve_conj().resolve_neg()"
                )
            if targets and page.requires_grad:  # an in-place copy into it would raise midway
                raise InvalidArgumentError(f"{argument}[{index}]: must not require grad (pass a detached tensor)")


def page_as_bytes(page: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    return memoryview(page.view(torch.uint8).numpy()).cast("B")


def _checked_keys(keys: Sequence[str]) -> list[str]:
    keys = list(keys)
    try:  # every key a str (subclasses too) and none empty, without a Python step per key
        "".join(keys)
    except TypeError:
        pass
    else:
        if "" not in keys:
            return keys
    for index, key in enumerate(keys):
        if not isinstance(key, str) or not key:
            raise InvalidArgumentError(f"keys[{index}]: must be a non-empty str, got {key!r}")
    return keys


# -- one hop: stores that keep the caller's page tensors and lend their own ------------------
#
# A store may offer two calls that save a copy of every byte (the memory store does):
#
# * ``adoptable(page) -> bool`` and ``put_adopting(keys, pages, *, prior_key=None) ->
#   (PutStatuses, spares)``: :meth:`StorageBackend.put` that keeps each ``STORED`` page's tensor
#   itself (the caller never writes it again); ``DEDUPLICATED`` and ``FAILED`` pages stay the
#   caller's; ``spares`` are buffers of pages the put evicted (flat ``uint8 [page_bytes]``), the
#   caller's to fill next. An adoptable page is a contiguous CPU tensor that is the whole of its
#   ``page_bytes``-byte storage.
# * ``lend(keys) -> loan``: the stored pages themselves, ``loan.pages[i]`` a flat ``uint8
#   [page_bytes]`` tensor to read (never write) or None (not stored); none is evicted, nor its
#   memory handed on, until ``loan.end()``.


def adopts_pages(storage: object) -> bool:
    """Whether ``storage`` offers ``adoptable`` and ``put_adopting`` (see the note above), and
    its ``adopts`` (where it has one) says adoption runs its own writes (a ``MemoryStore``
    subclass with a ``_put`` of its own: False)."""
    return (
        callable(getattr(storage, "put_adopting", None))
        and callable(getattr(storage, "adoptable", None))
        and bool(getattr(storage, "adopts", True))
    )


def lends_pages(storage: object) -> bool:
    """Whether ``storage`` offers ``lend`` (see the note above), and its ``lends`` (where it has
    one) says a loan reads as its ``get`` does."""
    return callable(getattr(storage, "lend", None)) and bool(getattr(storage, "lends", True))
