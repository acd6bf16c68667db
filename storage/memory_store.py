"""``MemoryStore``: the default storage backend, pages kept in this process's memory, bounded.

Each stored page is a private copy (a ``uint8`` CPU tensor), so the host pool page it came from
can be freed and reused right after ``put`` returns.

Speed: a page moves with torch's ``copy_`` (``put`` into the store, ``get`` out of it), which
splits a megabyte copy over torch's intra-op threads: on the 2-core CI machine 0.90 / 0.92 of a
same-size copy for put / get, against 0.65 / 0.72 for one single-threaded ``memmove`` measured
in the same state (``bench/bench_storage.py``). On a machine loaded by other work a split copy
waits for its slowest thread (0.4-1.5 GB/s per 8 MiB page was seen once); an engine that wants
its intra-op threads for itself can set ``torch.set_num_threads``. A store at its capacity (the steady state)
writes each new page into the memory of the page it evicts, so it never touches fresh memory:
a new allocation costs a page fault and a kernel zero-fill per 4 KiB on first touch, which
halves a copy's speed (``bench/bench_storage.py``: ``memory`` against ``memory-growing``).
A put's new pages take rows of one ``[n, page_bytes]`` allocation, or the evicted pages' buffers
in address order, so pages adjacent in a host pool land in evenly spaced rows and a call moves
each such run in one ``copy_`` both ways (:mod:`kvstage.storage.page_runs`: one wait for torch's
slowest thread a run, not a page). A removed page's memory is kept for the next page stored (the
store never holds more than its capacity in pages); ``clear`` and ``close`` let it go.

One hop (:meth:`MemoryStore.put_adopting`, :meth:`MemoryStore.lend`): a caller that owns a
whole page buffer (a hybrid model's staging buffer) may hand it over instead of having it copied,
and takes back the buffers of the pages the put evicted, so neither side allocates; a reader may
borrow the stored pages themselves instead of a copy (a :class:`PageLoan`), and a page on loan is
never evicted (nor its memory handed on) until the loan ends.

Eviction is chain-aware (:mod:`kvstage.storage.chain_index`): when a new page would exceed the
capacity, only pages with no stored successor are candidates, least recently used first, so a
chain shrinks from its tail and no page outlives its predecessor by eviction. ``get``, a
deduplicated ``put`` and an ``exists`` that finds the key count as a use (shared prefixes are
found and deduplicated through them, and those are the pages most worth keeping).
A put never evicts a page of the same call nor its ``prior_key`` page: a page that fits only
that way is ``FAILED``, and so is a page whose predecessor (``prior_key``, or the call's
previous key) is not stored, since no lookup could reach it (the answer's ``error`` is then a
:class:`~kvstage.storage.backend.MissingPriorError` naming that key).

Store events (:mod:`kvstage.storage.events`, tier ``"memory"``): ``stored`` for each page a
put stored, ``evicted`` for each page its eviction dropped, ``removed`` for each page
:meth:`MemoryStore.clear` or ``remove`` dropped (``remove`` takes the later pages of the
chains too).

URL form for :func:`open_storage`: ``memory`` (capacity :data:`DEFAULT_CAPACITY_BYTES`) or
``memory:CAPACITY`` (a size: bytes, or a number with a unit, :mod:`kvstage.storage.sizes`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from itertools import compress
from typing import Sequence

import torch

from kvstage.errors import InvalidArgumentError, StorageError, is_int
from kvstage.storage.backend import MissingPriorError, PutStatus, PutStatuses, StorageBackend, _checked_keys
from kvstage.storage.chain_index import ADDED, DEDUPLICATED, MISSING_PRIOR, NO_ROOM, ChainIndex
from kvstage.storage.events import DEFAULT_EVENT_CAPACITY
from kvstage.storage.fingerprint import LayoutFingerprint
from kvstage.storage.page_runs import copy_pages
from kvstage.storage.sizes import parse_size

DEFAULT_CAPACITY_BYTES = 1 << 30  # 1 GiB
_MAX_QUEUED_USES = 1 << 16  # uses exists() queues before it applies them itself (bounds the queue)


# ChainIndex.admit's outcome -> the put's status (a missing predecessor and no room both fail)
_STATUSES = {
    ADDED: PutStatus.STORED,
    DEDUPLICATED: PutStatus.DEDUPLICATED,
    MISSING_PRIOR: PutStatus.FAILED,
    NO_ROOM: PutStatus.FAILED,
}


class _Kept(set):
    """The keys a put never evicts: its own and its prior, and every page on loan now (looked up
    when eviction asks, under the store's lock, so a loan made before the lock is seen)."""

    def __init__(self, keys: list[str], lent: Counter) -> None:
        super().__init__(keys)
        self.lent = lent

    def __contains__(self, key: object) -> bool:
        return set.__contains__(self, key) or key in self.lent


class MemoryStore(StorageBackend):
    """Pages in host memory, at most ``capacity_pages`` of them, evicted from chains' tails.

    Args:
        fingerprint: the KV layout (key prefix and page size in bytes).
        capacity_bytes: bound in bytes; the store holds ``capacity_bytes // page_bytes`` pages.
        capacity_pages: bound in pages (give one of the two; neither: 1 GiB of pages).
        event_capacity: store events kept until ``take_events`` (see :class:`StorageBackend`).

    Raises:
        InvalidArgumentError: both bounds given, a bound is negative, or event_capacity is not
            an int >= 0.

    Thread-safe (one lock around every call). Takes strided page views (:attr:`strided_pages`):
    a host pool page in another byte order moves with one copy. Keyed by page keys alone
    (:attr:`prefixed_hook_keys` False: its hooks take them so): the store object is its own key
    space, so a lookup builds no prefixed string per key.
    """

    strided_pages = True
    prefixed_hook_keys = False

    tier = "memory"

    def __init__(
        self,
        fingerprint: LayoutFingerprint,
        *,
        capacity_bytes: int | None = None,
        capacity_pages: int | None = None,
        event_capacity: int = DEFAULT_EVENT_CAPACITY,
    ) -> None:
        super().__init__(fingerprint, event_capacity=event_capacity)
        if capacity_bytes is not None and capacity_pages is not None:
            raise InvalidArgumentError("capacity_pages: give capacity_bytes or capacity_pages, not both")
        if capacity_pages is None:
            capacity_bytes = DEFAULT_CAPACITY_BYTES if capacity_bytes is None else capacity_bytes
            if not is_int(capacity_bytes) or capacity_bytes < 0:
                raise InvalidArgumentError(f"capacity_bytes: must be a non-negative int, got {capacity_bytes!r}")
            capacity_pages = capacity_bytes // self.page_bytes
        elif not is_int(capacity_pages) or capacity_pages < 0:
            raise InvalidArgumentError(f"capacity_pages: must be a non-negative int, got {capacity_pages!r}")
        self.capacity_pages = capacity_pages
        self._pages: ChainIndex[str, torch.Tensor] = ChainIndex()  # by page key (no prefix)
        self._uses: list[str] = []  # keys exists() found, not yet touched (see _exists)
        self._lock = threading.Lock()
        self._spare: list[torch.Tensor] = []  # buffers of removed pages, taken before new memory
        self.buffers_allocated = 0  # pages of memory allocated; an evicting put reuses the victim's
        self.pages_adopted = 0  # pages put_adopting kept without a copy
        self.pages_lent = 0  # pages lend handed out without a copy
        self._lent: Counter[str] = Counter()  # full key -> loans out (never evicted while > 0)
        self._lent_buffers: Counter[int] = Counter()  # data_ptr of each buffer on loan

    def __len__(self) -> int:
        """Pages stored now."""
        return len(self._pages)

    @property
    def used_bytes(self) -> int:
        """Bytes of the pages stored now."""
        return len(self._pages) * self.page_bytes

    def _exists(self, keys: list[str]) -> list[bool]:
        # A key found counts as a use: lookups find shared prefixes through exists(), and
        # those are the pages most worth keeping. The uses are queued and applied in order
        # before the next call that reads or changes recency (put, get), so the eviction order
        # is the same as touching each key here, and a lookup pays a membership test only.
        with self._lock:
            found = self._pages.holds(keys)
            self._uses.extend(compress(keys, found))
            if len(self._uses) > _MAX_QUEUED_USES:
                self._apply_uses()
            return found

    def _apply_uses(self) -> None:
        """Touch the keys ``exists`` found since the last call, in order (under the lock)."""
        if self._uses:
            # Only a key's last use decides its place: touch each once, in the order of last uses.
            self._pages.touch_all(reversed(dict.fromkeys(reversed(self._uses))))
            self._uses.clear()

    def _admit(
        self, keys: list[str], prior_key: str | None, statuses: PutStatuses, evicted: list
    ) -> tuple[list[int], list]:
        """A put's chain rules, under the lock: each key's status appended to ``statuses`` (a key
        stored already is deduplicated; one whose prior is not stored fails; one that finds no
        room fails), the victims' keys appended to ``evicted``. Each admitted key is added to the
        index with no value yet. Returns the admitted keys' indices and the victims' buffers."""
        # never evicted for a page of this call, nor one on loan (a plain set when none is: C lookups)
        keep = _Kept(keys, self._lent) if self._lent else set(keys)
        if prior_key is not None:
            keep.add(prior_key)
        outcomes, admitted, victims = self._pages.admit(keys, prior_key, self.capacity_pages, keep)
        statuses.extend(map(_STATUSES.__getitem__, outcomes))
        if statuses.error is None and prior_key is not None and outcomes and outcomes[0] == MISSING_PRIOR:
            # (a later key's missing predecessor is one the call refused, for room: no error)
            statuses.error = MissingPriorError(prior_key[len(self._hook_prefix) :])
        self.stats.pages_evicted += len(victims)
        evicted.extend(victim[0] for victim in victims)
        return admitted, [victim[1] for victim in victims]  # their memory is already faulted in

    def _put(self, keys: list[str], pages: list[torch.Tensor], prior_key: str | None = None) -> PutStatuses:
        statuses = PutStatuses()
        evicted = []
        with self._lock:
            self._apply_uses()
            stored = self._pages
            admitted, reused = self._admit(keys, prior_key, statuses, evicted)
            placed, held = [keys[i] for i in admitted], [pages[i] for i in admitted]
            # A put fills the store before it evicts, so its first pages take fresh buffers and
            # the rest the evicted ones; each set in address order, so that pages adjacent in the
            # host pool land in adjacent rows and move in one copy (page_runs).
            buffers = sorted(reused, key=torch.Tensor.data_ptr)
            try:  # an allocation that fails (no memory) undoes the admission as a failed copy does
                buffers = self._fresh(len(placed) - len(reused)) + buffers
                stored.set_values(placed, buffers)
                copy_pages(held, buffers, into_buffers=True)
            except BaseException:
                for key in placed:  # no page of unknown bytes stays readable
                    stored.remove(key)
                self._spare += buffers
                raise
            finally:
                self._record("evicted", evicted)
            self._record("stored", placed)
        return statuses

    def _fresh(self, count: int) -> list[torch.Tensor]:
        """``count`` buffers for pages that evict nothing: removed pages' first, then rows of one
        new ``[n, page_bytes]`` allocation (under the lock)."""
        spare = self._spare
        more = count - min(count, len(spare))
        new = torch.empty((more, self.page_bytes), dtype=torch.uint8).unbind() if more else ()
        # taken from the spares only once the allocation succeeded: a failed one loses none
        taken = sorted((spare.pop() for _ in range(count - more)), key=torch.Tensor.data_ptr)
        self.buffers_allocated += more
        return taken + list(new)

    def _get(self, keys: list[str], into: list[torch.Tensor]) -> list[bool]:
        with self._lock:
            self._apply_uses()
            stored = self._pages
            pages = stored.values(keys)
            hits = [page is not None for page in pages]
            stored.touch_all(compress(keys, hits))  # in the keys' order, as one touch a key would
            targets, buffers = list(compress(into, hits)), list(compress(pages, hits))
            copy_pages(targets, buffers, into_buffers=False)  # under the lock: a put may reuse them
        return hits

    def _clear(self) -> int:
        # One lock around every call: a put runs wholly before or after.
        with self._lock:
            keys = self._pages.keys()
            self._pages = ChainIndex()
            self._uses.clear()
            self._spare = []
            self._record("removed", keys)
        return len(keys)

    def _remove(self, keys: list[str]) -> int:
        with self._lock:
            self._apply_uses()  # the removal events come least recently used first
            stored = self._pages
            removed = stored.chains_after(keys)
            for key in removed:
                buffer = stored.remove(key)
                if buffer.data_ptr() not in self._lent_buffers:  # a page on loan is still read: never reused
                    self._spare.append(buffer)  # its memory, for the next page stored
            self._record("removed", removed)
        return len(removed)

    def close(self) -> None:
        """Drop every page (no events: the store is done). Idempotent. Pages on loan stay
        readable by their borrowers (the store just forgets them)."""
        with self._lock:
            self._lent.clear()
            self._lent_buffers.clear()
            self._pages = ChainIndex()
            self._uses.clear()
            self._spare = []

    # -- one hop: adopted buffers and loans --------------------------------------------------

    @property
    def adopts(self) -> bool:
        """Whether :meth:`put_adopting` runs this store's own writes: False for a subclass that
        overrides ``_put`` and not ``_adopt`` (a put with checks of its own, which adoption would
        skip: callers then use :meth:`put`)."""
        cls = type(self)
        return cls._put is MemoryStore._put or cls._adopt is not MemoryStore._adopt

    @property
    def lends(self) -> bool:
        """Whether :meth:`lend` reads as this store's ``get`` does: False for a subclass that
        overrides ``_get`` and not ``_lend`` (callers then use :meth:`get`)."""
        cls = type(self)
        return cls._get is MemoryStore._get or cls._lend is not MemoryStore._lend

    def adoptable(self, page: object) -> bool:
        """Whether :meth:`put_adopting` can keep ``page`` itself: a contiguous CPU tensor that is
        the whole of its storage (exactly ``page_bytes`` bytes from offset 0, so the store never
        holds part of a buffer someone else uses), no lazy conjugate or negative view, no grad."""
        return (
            isinstance(page, torch.Tensor)
            and page.device.type == "cpu"
            and page.is_contiguous()
            and page.storage_offset() == 0
            and page.numel() * page.element_size() == self.page_bytes
            and page.untyped_storage().nbytes() == self.page_bytes
            and not (page.is_conj() or page.is_neg() or page.requires_grad)
        )

    def put_adopting(
        self, keys: Sequence[str], pages: Sequence[torch.Tensor], *, prior_key: str | None = None
    ) -> tuple[PutStatuses, list[torch.Tensor]]:
        """:meth:`put` that keeps each stored page's tensor instead of copying it.

        Args:
            keys, prior_key: as :meth:`put`.
            pages: tensors :meth:`adoptable` accepts, distinct buffers, none on loan from this store.

        Returns:
            ``(statuses, spares)``: ``statuses`` as :meth:`put`. A ``STORED`` page's tensor is the
            store's from then on: the caller must never write it again nor hand it on (its bytes
            are the stored page). A ``DEDUPLICATED`` or ``FAILED`` page stays the caller's.
            ``spares``: the buffers of the pages this put evicted, or of pages removed before
            (flat ``uint8 [page_bytes]``, no longer held by the store, never on loan), for the
            caller to reuse in place of those it gave, one per page stored while there are any
            (fewer while the store grows into new memory).

        Raises:
            InvalidArgumentError: a page is not adoptable, two pages share a buffer, a page is
                on loan from this store (naming ``pages[i]``), or as :meth:`put`; nothing is
                stored then.
            AdoptedPagesError: something raised (its cause) after pages were kept: its
                ``statuses`` and ``spares`` are what the call would have returned.
        """
        seen: set[int] = set()
        for index, page in enumerate(pages):
            if not self.adoptable(page):
                raise InvalidArgumentError(
                    f"pages[{index}]: must be a contiguous CPU tensor that is the whole of its {self.page_bytes}-byte "
                    "storage (no view into a larger buffer), without grad"
                )
            pointer = page.data_ptr()
            if pointer in seen or pointer in self._lent_buffers:
                raise InvalidArgumentError(
                    f"pages[{index}]: its buffer is another page's of this call or on loan from this store"
                )
            seen.add(pointer)
        spares: list[torch.Tensor] = []
        kept: list[PutStatuses] = []  # the statuses once the pages are kept

        def adopt(full_keys: list[str], given: list[torch.Tensor], prior: str | None) -> PutStatuses:
            kept.append(self._adopt(full_keys, given, prior, spares))
            return kept[0]

        try:
            statuses = self._run_put(keys, pages, prior_key, adopt)
        except Exception as error:
            if kept and any(status is PutStatus.STORED for status in kept[0]):
                # Raised after pages were kept (a change or timing listener): which tensors are
                # the store's now must reach the caller, or it would reuse them.
                raise AdoptedPagesError(kept[0], spares) from error
            raise
        return statuses, spares

    def _adopt(self, keys: list[str], pages: list[torch.Tensor], prior_key: str | None, spares: list) -> PutStatuses:
        """:meth:`_put` keeping the pages' tensors; the victims' buffers go to ``spares``, and a
        removed page's memory in place of each page kept that evicted nothing."""
        statuses = PutStatuses()
        evicted = []
        with self._lock:
            self._apply_uses()
            admitted, reused = self._admit(keys, prior_key, statuses, evicted)
            for index in admitted:
                self._pages.set_value(keys[index], pages[index].view(torch.uint8).view(-1))
            self.pages_adopted += len(admitted)
            spares += reused
            for _ in range(min(len(admitted) - len(reused), len(self._spare))):
                spares.append(self._spare.pop())
            self._record("evicted", evicted)
            self._record("stored", [keys[index] for index in admitted])
        return statuses

    def lend(self, keys: Sequence[str]) -> "PageLoan":
        """Lend the stored pages of ``keys`` themselves (no copy), as :meth:`get` reads them: a
        use of each page found, counted in ``stats.pages_read`` / ``pages_missed``.

        Each page lent is never evicted, nor its memory handed to a put, until the loan ends
        (:meth:`PageLoan.end`); a ``clear`` or ``remove`` still drops it from the store, and the
        borrower keeps reading the same bytes. The pages are read-only to the borrower.

        Returns:
            A :class:`PageLoan`: ``pages[i]`` is ``keys[i]``'s page (flat ``uint8 [page_bytes]``)
            or None (not stored).

        Raises:
            InvalidArgumentError: a key is not a non-empty str.
        """
        prefix = self._hook_prefix
        hook_keys = [prefix + key for key in _checked_keys(keys)]
        started = time.perf_counter()
        with self._lock:
            self._apply_uses()
            pages = self._lend(hook_keys)
            for key, page in zip(hook_keys, pages):
                if page is not None:
                    self._pages.touch(key)
                    self._lent[key] += 1
                    self._lent_buffers[page.data_ptr()] += 1
        seconds = time.perf_counter() - started
        found = sum(page is not None for page in pages)
        self.pages_lent += found
        self.stats.pages_read += found
        self.stats.pages_missed += len(pages) - found
        self.stats.bytes_got += found * self.page_bytes
        self.stats.get_seconds += seconds
        loan = PageLoan(self, hook_keys, pages)
        try:
            for listener in self._timing_listeners:
                listener("get", len(hook_keys), seconds)
        except BaseException:
            loan.end()  # no caller would hold it: the pages would stay on loan for good
            raise
        return loan

    def _lend(self, hook_keys: list[str]) -> list[torch.Tensor | None]:
        """The stored buffers of ``hook_keys`` (None: not stored), under the lock."""
        value = self._pages.value
        return [value(key) for key in hook_keys]

    def _end_loan(self, hook_keys: list[str], pages: list) -> None:
        with self._lock:
            for key, page in zip(hook_keys, pages):
                if page is None:
                    continue
                for counter, item in ((self._lent, key), (self._lent_buffers, page.data_ptr())):
                    if counter[item] > 1:
                        counter[item] -= 1
                    else:
                        counter.pop(item, None)  # (close() forgot every loan)

    @property
    def pages_on_loan(self) -> int:
        """Loans of pages not ended yet (a page lent twice counts twice)."""
        return sum(self._lent.values())


class AdoptedPagesError(StorageError):
    """:meth:`MemoryStore.put_adopting` raised (the cause) after it kept pages.

    Attributes:
        statuses: one :class:`~kvstage.storage.backend.PutStatus` a key: a ``STORED`` page's
            tensor is the store's, as if the call had returned.
        spares: the buffers handed back, as the call's return value.
    """

    def __init__(self, statuses: PutStatuses, spares: list[torch.Tensor]) -> None:
        super().__init__(f"put_adopting: kept {sum(s is PutStatus.STORED for s in statuses)} pages, then failed")
        self.statuses, self.spares = statuses, spares


class PageLoan:
    """Pages a :class:`MemoryStore` lent (:meth:`MemoryStore.lend`).

    Attributes:
        pages: ``pages[i]``: the ``i``-th key's stored page, a flat ``uint8 [page_bytes]``
            tensor (read it, never write it), or None when that key was not stored.
        ended: :meth:`end` was called.
    """

    __slots__ = ("pages", "ended", "_store", "_keys")

    def __init__(self, store: MemoryStore, hook_keys: list[str], pages: list) -> None:
        self.pages, self.ended, self._store, self._keys = pages, False, store, hook_keys

    def end(self) -> None:
        """No copy reads the pages any more: they may be evicted again. Idempotent."""
        if not self.ended:
            self.ended = True
            self._store._end_loan(self._keys, self.pages)


def open_memory_store(rest: str, fingerprint: LayoutFingerprint) -> MemoryStore:
    """The ``memory`` / ``memory:CAPACITY`` URL (see :func:`kvstage.storage.open_storage`); the
    capacity is a size (:mod:`kvstage.storage.sizes`: ``memory:8589934592``, ``memory:8GB``,
    ``memory:8GiB``).

    Raises:
        InvalidArgumentError: a capacity that is not a size, or below one page
            (``fingerprint.page_bytes``); names ``storage`` and the URL.
    """
    if not rest:
        return MemoryStore(fingerprint)
    capacity = parse_size(rest, f"storage: 'memory:{rest}' capacity")
    if capacity < fingerprint.page_bytes:
        # A store that cannot hold one page would fail every write.
        raise InvalidArgumentError(
            f"storage: 'memory:{rest}' holds no page: the capacity must be at least one page, {fingerprint.page_bytes} bytes"
        )
    return MemoryStore(fingerprint, capacity_bytes=capacity)
