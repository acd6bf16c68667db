"""The store and load of a hybrid model's components beside its full-attention pages (the
manager's collaborator; the manager moves the full pages as for a plain model).

Key rule (:mod:`kvstage.offload.restorable`): every component's entry for page ``i`` is stored
under the page's key ``h_i`` in the component's own store; a state snapshot after ``k`` pages
under ``h_{k-1}``. Entries of other components are put as chain starts (``prior_key=None``):
their key spaces have no chain of their own, and a chain-aware store refuses a put whose prior
is missing.

- Store: with every run of full pages the manager launches, each sidecar's pages of the same
  slots and each sliding window's pages that :func:`swa_store_mask` allows for a resume at the
  run's end or at one of the request's snapshot lengths (:mod:`~kvstage.offload.snapshot_windows`)
  are gathered (one launch per component, on the copy stream after the same producer) into
  host memory; once the run's keys are known and the copy is done, they are put on the writer
  thread, after the run's full pages.
- Snapshots (:meth:`Hybrid.snapshot`): the request's state slot is gathered in one launch
  (every state layer) on the copy stream after ``after``, with the window pages before its
  length that runs already launched left out; its put waits until the request's pages
  ``0 .. k-1`` were handed to the writer (or loaded), and on the writer thread it is put only
  when the full store holds ``h_{k-1}``. A request's ``on_stored`` waits until every one of
  its component writes has ended (:meth:`Hybrid.writes_ended`).
- Host staging of every component copy comes from a :class:`StagingPool` and goes back once
  its write or load ended: a steady state allocates none.
- One hop (a store that ``adopts`` / ``lends``: :class:`~kvstage.storage.MemoryStore`), for
  entries of one row (a snapshot; a run of one page): the put hands the filled staging buffer
  itself to the store, which gives back the buffer of the entry it evicted (into the staging
  pool, on the manager's thread once the write ended), and a load scatters straight from the
  store's page, lent (never evicted) until the scatter is done; no copy between staging and
  store. Other stores, and entries of several rows, copy as ``put`` / ``get`` do.
- Lookup and prefetch: every store is asked for the keys; the answer is the restorable length
  (:func:`restorable_lengths`). A prefetch reads the full pages and every component's entries
  for the largest restorable length it has host pages for; an entry that cannot be read
  (evicted, corrupt) drops it to the next restorable length below, never to a length that
  cannot be resumed.
- Load: sidecar pages into the full slots, window pages into the sliding window's slots, the
  snapshot into the request's state slot, one launch per component (layer by layer: one per
  component layer); a layer's wait covers every component of that layer.
"""

from __future__ import annotations

import logging
from itertools import compress, count
from operator import not_
from typing import Any, Mapping

import torch

from kvstage.errors import ArgumentTypeError, is_int, require
from kvstage.hashing.chain import request_namespace
from kvstage.kernels import gather, scatter
from kvstage.kernels.state_copy import gather_state, scatter_state
from kvstage.kernels.streams import CopyHandle
from kvstage.offload.components import ComponentPools
from kvstage.offload.host_rows import kv_rows, state_rows
from kvstage.offload.hybrid_entries import Entries, EntryStaging
from kvstage.offload.hybrid_load_handle import HybridLoadHandle
from kvstage.offload.linked_stores import LinkedStores
from kvstage.offload.load_path import LoadHandle, PrefixMatch
from kvstage.offload.plain_model import PlainModel
from kvstage.offload.request import as_int, request_tokens
from kvstage.offload.restorable import lengths_unchecked, pages_to_load, restorable_lengths, snapshot_key_index
from kvstage.offload.slot_indices import check_slots
from kvstage.offload.snapshot_windows import SnapshotWindows, window_slots
from kvstage.offload.staging_pool import StagingPool
from kvstage.offload.store_io import WriteOutcome, read_leading_pages_into, write_pages
from kvstage.storage import MissingPriorError

__all__ = ["Hybrid", "HybridLoadHandle", "PlainModel", "split_storage"]

logger = logging.getLogger(__name__)


def split_storage(storage: Any, components: ComponentPools | None, kv_pool: Any, page_size: int) -> tuple[Any, Any]:
    """``(full store, Hybrid or PlainModel)`` from the manager's ``storage`` and ``components``:
    a store and no components is a plain model; a mapping of stores needs ``components``.

    Raises:
        InvalidArgumentError / ArgumentTypeError: components without a mapping of stores (or
            the reverse), a pool that does not fit its component, a store of another layout.
    """
    if not isinstance(storage, Mapping):
        require(components is None, "components", "needs storage={component name: store}, one per component")
        return storage, PlainModel()
    require(
        isinstance(components, ComponentPools),
        "components",
        lambda: (
            f"must be a kvstage.offload.ComponentPools for storage={{name: store}}, got {type(components).__name__}"
        ),
        ArgumentTypeError,
    )
    components.check(kv_pool, page_size)
    components.layout.require_matches(
        {name: getattr(store, "fingerprint", None) for name, store in storage.items()}, page_size
    )
    return storage[components.full.name], Hybrid(components, dict(storage), page_size)


class Hybrid:
    """The components of one manager's hybrid model (module doc); built by :func:`split_storage`."""

    def __init__(self, components: ComponentPools, stores: dict[str, Any], page_size: int) -> None:
        self.layout = components.layout
        self.components = components
        self.stores = stores
        self.page_size = page_size
        self.full = components.full
        self.others = [c for c in self.layout.components if c.kind != "full"]
        self.state = next(iter(self.layout.of_kind("state")), None)
        self.stored = {c.name: 0 for c in self.layout.components}  # entries put (stored or deduplicated)
        self.failed = {c.name: 0 for c in self.layout.components}
        self._copies: list[Entries] = []  # gathers whose copy or keys are pending
        self._writes: list[tuple[Entries, Any]] = []
        self._loads: list[tuple[Any, CopyHandle]] = []  # component scatters: (request state, handle)
        self.lookup = self  # what the prefetcher reads through
        # An entry leaves with what it depends on (chain-aware eviction across the stores);
        # stores without change listeners (not a kvstage StorageBackend) are left unlinked.
        linkable = all(callable(getattr(store, "add_change_listener", None)) for store in stores.values())
        self.linked = LinkedStores(self.layout, stores, page_size) if linkable else None
        self._keyed: dict[int, tuple[Any, int, str]] = {}  # id(req) -> (req, length, key) of its last snapshot
        self._held: list[tuple[list[CopyHandle], list[Entries]]] = []  # loads' staging, free once copied
        self._windows = SnapshotWindows(self.layout, page_size)
        self._parked: list[Any] = []  # lifecycles whose full-page writes ended before their components'

    def attach(
        self,
        copy_stream: Any,
        workers: Any,
        hasher: Any,
        backend: str,
        pinned: bool,
        host_pool: Any = None,
        row_copies: Any = None,
    ) -> None:
        """The manager's copy stream, store workers, hasher, kernel backend, host pinning, host
        pool and the copier's :class:`~kvstage.offload.row_copies.RowCopies` (None: the pools are
        not in host memory), which copies a component in host memory by rows."""
        self.copy_stream, self.workers, self.hasher, self.backend, self.pinned = (
            copy_stream,
            workers,
            hasher,
            backend,
            pinned,
        )
        self.host_pool, self.row_copies = host_pool, row_copies
        self.staging = StagingPool(pinned)
        self.entry_staging = EntryStaging(self.staging, self.page_size)
        self._kv_rows = {}  # id(pool) -> its KVRows or StateRows (None: not by rows)
        if row_copies is not None:
            for pool in self.components.pools.values():
                is_state = hasattr(pool, "snapshot_bytes")
                self._kv_rows[id(pool)] = state_rows(pool) if is_state else kv_rows(pool, self.page_size)

    # -- store path -----------------------------------------------------------------------

    def check_runs(self, state: Any, runs: list, kv_length: int) -> None:
        """Check each sliding window's slots for the planned runs (launched at a call with
        ``kv_length``) before anything is launched.

        Raises:
            InvalidArgumentError: ``slots_of[name](req)`` is no 1-D int tensor on the pool's
                device with a slot for every position of the runs; on CPU (where reading them
                costs no device sync), a slot of a window page to gather outside the pool (a
                freed position no copy reads may hold anything).
        """
        if not runs:
            return
        page_size, req = self.page_size, state.req
        end = state.offloaded_length + sum(slots.shape[0] for _, slots in runs)
        for component in self.layout.of_kind("swa"):
            table = self.components.slots_of[component.name](req)
            pool = self.components.pools[component.name]
            device = pool.device
            require(
                isinstance(table, torch.Tensor)
                and table.dim() == 1
                and table.dtype in (torch.int32, torch.int64)
                and table.device == device
                and table.shape[0] >= end,
                f"slots_of[{component.name!r}]",
                lambda table=table, device=device: (
                    f"must give a 1-D int32/int64 tensor on {device} with a slot for each of the {end} positions, got "
                    f"{tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__}"
                ),
            )
            if table.device.type != "cpu":
                continue
            kept = self.components.first_kept_page(component.name, page_size, kv_length)
            start = state.offloaded_length
            for _, slots in runs:
                first, stop = start // page_size, (start + slots.shape[0]) // page_size
                indices = self._windows.run_pages(component, req, first, stop, kept, record=False)
                if indices:
                    check_slots(
                        window_slots(table, page_size, indices),
                        f"slots_of[{component.name!r}](rid={req.rid!r})",
                        device=torch.device(device),
                        num_slots=pool.num_slots,
                        page_size=page_size,
                    )
                start += slots.shape[0]

    def gather_pages(self, state: Any, run: Any, start: int, slots: torch.Tensor, after: Any, kv_length: int) -> None:
        """Launch the gathers of a full run's sidecar pages and the window pages worth storing
        (``run`` covers tokens ``[start, start + len(slots))``, launched at a call with
        ``kv_length``: no window page the engine may have freed then,
        :meth:`ComponentPools.first_kept_page`); one launch per component."""
        page_size = self.page_size
        first, end = start // page_size, (start + slots.shape[0]) // page_size
        for component in self.others:
            if component.kind == "sidecar":
                indices, device_slots = list(range(first, end)), slots
            elif component.kind == "swa":
                kept = self.components.first_kept_page(component.name, page_size, kv_length)
                indices = self._windows.run_pages(component, state.req, first, end, kept)
                if not indices:
                    continue
                table = self.components.slots_of[component.name](state.req)
                device_slots = window_slots(table, page_size, indices)
            else:
                continue
            pool = self.components.pools[component.name]
            entries = self.entry_staging.take(
                component.name, state, pool, len(indices), self._own_rows(component, pool)
            )
            entries.indices, entries.run, entries.first = indices, run, first
            entries.handle = self._submit_pages(gather, pool, entries.staging, device_slots, after)
            state.copies_in_flight += 1
            self._copies.append(entries)

    def start_over(self, req: Any) -> None:
        """``req`` was retracted without its progress: its window pages in flight are discarded,
        so a later snapshot gathers them again."""
        self._windows.forget(req)

    def settled(self, segment: Any) -> None:
        """The manager settled ``segment``: its run's keys are known; its pages' entries are put
        only when its full copy succeeded and the request keeps its progress."""
        run = segment.run
        keep = segment.result.ok and run.keys is not None and segment.state.retract_keep is not False
        for entries in self._copies:
            if entries.run is run and entries.keys is None:  # no keys: never put (counted failed)
                entries.keys = [run.keys[i - entries.first] for i in entries.indices] if keep else []

    def snapshot(self, req: Any, state: Any, length: int, state_slot: Any, num_tokens: int, after: Any) -> CopyHandle:
        """Launch the gather of ``req``'s state slot (the state after exactly ``length`` tokens)
        into host memory; its put follows (module doc). Every check runs before the launch.

        Raises:
            InvalidArgumentError: no state component; ``length`` not a positive multiple of the
                page size or past ``num_tokens``; ``state_slot`` not an int in the pool's range.
        """
        require(self.state is not None, "snapshot", "the layout has no request-state component")
        index = snapshot_key_index(length, self.page_size, num_tokens)
        pool = self.components.pools[self.state.name]
        require(
            is_int(state_slot) and 0 <= state_slot < pool.num_slots,
            "state_slot",
            lambda: f"must be an int in [0, {pool.num_slots}) (a slot of the state pool), got {state_slot!r}",
        )
        launched = state.offloaded_length // self.page_size if state is not None else 0
        windows = self._windows.snapshot_pages(  # the slots checked here
            req,
            length,
            launched,
            self.components.slots_of,
            lambda name: self.components.first_kept_page(name, self.page_size, num_tokens),
        )
        key = self._snapshot_key(req, length, index)
        for component, indices in windows:
            self._gather_window(req, state, component, indices, length, after)
        entries = self.entry_staging.take(self.state.name, state, pool, 1)
        entries.keys, entries.req, entries.length, entries.indices = [key], req, length, [index]
        staging, backend, slot = entries.staging, self.backend, int(state_slot)
        entries.handle = self.copy_stream.submit(
            lambda: (
                self._copy_state(pool, staging, slot, True, None)
                or gather_state(pool, [slot], staging, backend=backend)
            ),
            keep=[staging],
            after=after,
        )
        if state is not None:
            state.copies_in_flight += 1
        self._copies.append(entries)
        return entries.handle

    def _gather_window(self, req: Any, state: Any, component: Any, indices: list[int], length: int, after: Any) -> None:
        """Launch the gather of a window's pages ``indices`` before a snapshot at ``length``;
        their keys are the request's (hashed here: the runs that held them are keyed already)."""
        extra_key, cache_salt = request_namespace(req)
        keys = self.hasher.prefill_keys(request_tokens(req, 0, length), extra_key=extra_key, cache_salt=cache_salt)
        pool = self.components.pools[component.name]
        entries = self.entry_staging.take(component.name, state, pool, len(indices), self._own_rows(component, pool))
        entries.indices, entries.keys, entries.req = indices, [keys[i] for i in indices], req
        device_slots = window_slots(self.components.slots_of[component.name](req), self.page_size, indices)
        entries.handle = self._submit_pages(gather, pool, entries.staging, device_slots, after)
        if state is not None:
            state.copies_in_flight += 1
        self._windows.gathered(req, component, indices)
        self._copies.append(entries)

    def _snapshot_key(self, req: Any, length: int, index: int) -> str:
        """``h_{index}`` of ``req``'s tokens, hashed on from the request's last snapshot's key
        (a decode snapshot every few pages does not hash the whole prefix again)."""
        cached = self._keyed.get(id(req))
        if cached is not None and cached[0] is req and cached[1] <= length:
            keys = self.hasher.continue_keys(request_tokens(req, cached[1], length), cached[2])
            key = keys[-1] if keys else cached[2]
        else:
            extra_key, cache_salt = request_namespace(req)
            tokens = request_tokens(req, 0, length)
            key = self.hasher.prefill_keys(tokens, extra_key=extra_key, cache_salt=cache_salt)[index]
        self._keyed[id(req)] = (req, length, key)
        return key

    def poll(self, states: Mapping[int, Any]) -> list[Any]:
        """Hand finished gathers to the writer (a snapshot once its pages are settled), collect
        finished writes; returns the request states whose copies ended (for their release)."""
        if len(self._keyed) > len(states) + 64:  # forget the keys of requests no longer tracked
            self._keyed = {i: cached for i, cached in self._keyed.items() if i in states}
        self._windows.forget_untracked(states)
        ended, waiting = [], []
        for entries in self._copies:
            done = entries.handle.query()
            if done and not entries.counted:
                entries.counted = True
                if entries.state is not None:
                    entries.state.copies_in_flight -= 1
                    ended.append(entries.state)
            if not done or entries.keys is None or not self._ready(entries, states):
                waiting.append(entries)
                continue
            if entries.handle.error is not None or not entries.keys:
                if entries.handle.error is not None:
                    logger.warning("offload: the copy of %s entries failed: %r", entries.name, entries.handle.error)
                self.failed[entries.name] += len(entries.indices)
                self.entry_staging.give_back(entries)
                continue
            self._writes.append((entries, self.workers.write(lambda e=entries: self._put(e))))
        self._copies = waiting
        for state, handle in [load for load in self._loads if load[1].query()]:
            self._loads.remove((state, handle))
            state.copies_in_flight -= 1
            ended.append(state)
        held = []
        for copies, read in self._held:
            if all(copy.query() for copy in copies):
                for entries in read:
                    self.entry_staging.give_back(entries)
            else:
                held.append((copies, read))
        self._held = held
        pending = []
        for entries, future in self._writes:
            if not future.done():
                pending.append((entries, future))
                continue
            outcome = future.result()
            if any(outcome.adopted):  # the store keeps the buffers; its victims' take their place
                self.entry_staging.swap_in(entries, outcome.spares, outcome.adopted)
            self.entry_staging.give_back(entries)
            self.failed[entries.name] += len(outcome.failed_keys)
            self.stored[entries.name] += outcome.stored + outcome.deduplicated
            if outcome.failed_keys:
                logger.warning("offload: %s entries failed: %r", entries.name, outcome.error)
        self._writes = pending
        return ended

    def writes_ended(self, ended: list) -> list:
        """Of the lifecycles whose full-page writes ended (``ended``, their :class:`RequestWrites`,
        and those held back before), the ones with no component copy or write left; the others
        wait for a later call (``on_stored`` follows every write of the lifecycle)."""
        waiting = self._parked + ended
        if not waiting:
            return waiting
        pending = [*self._copies, *(entries for entries, _ in self._writes)]
        busy = {id(e.state.writes) for e in pending if e.state is not None}
        self._parked = [writes for writes in waiting if id(writes) in busy]
        return [writes for writes in waiting if id(writes) not in busy]

    def _ready(self, entries: Entries, states: Mapping[int, Any]) -> bool:
        """A snapshot waits until its request's pages before it were handed to the writer."""
        if entries.name != getattr(self.state, "name", None):
            return True
        state = entries.state
        if state is None or states.get(id(entries.req)) is not state:
            return True  # ended: the put's check of the full page decides
        unsettled = sum(
            len(segment.run.tokens) if segment.run.tokens is not None else len(segment.run.keys) * self.page_size
            for segment in state.unsettled
        )
        return state.offloaded_length - unsettled >= entries.length

    def _put(self, entries: Entries) -> Any:
        """On the writer thread: put the entries; a snapshot only when its full page is stored.
        Entries on buffers of their own (one row, or ``own_rows``) go to a store that adopts
        them without a copy."""
        pages = [entries.staging[i] for i in range(len(entries.keys))]
        if entries.name == getattr(self.state, "name", None):
            key = entries.keys[0]
            if not self.stores[self.full.name].exists([key])[0]:
                return WriteOutcome(failed_keys=[key], error=MissingPriorError(key))
        store = self.stores[entries.name]
        if getattr(store, "adopts", False):
            own = entries.buffers[: len(pages)] if entries.buffers is not None else [entries.buffer]
            if len(own) == len(pages) and all(map(store.adoptable, own)):
                return write_pages(store, entries.keys, own, prior_key=None, adopt=True)
        return write_pages(store, entries.keys, pages, prior_key=None)

    def _own_rows(self, component: Any, pool: Any) -> bool:
        """Whether ``component``'s page entries take a buffer a row: copied by rows, to a store
        that adopts (its put keeps every row: one hop)."""
        store = self.stores[component.name]
        return self._kv_rows.get(id(pool)) is not None and getattr(store, "adopts", False)

    def wait_loads(self, state: Any, aborted: bool) -> None:
        """An abort (``aborted``): block until ``state``'s component scatters are done, counted ended."""
        for load in [load for load in self._loads if aborted and load[0] is state]:
            load[1].synchronize()
            self._loads.remove(load)
            state.copies_in_flight -= 1

    def wait(self) -> None:
        """Block until every gather and write of the components has ended (drain)."""
        for entries in self._copies:
            entries.handle.synchronize()
        for _, future in self._writes:
            future.result()
        for _, handle in self._loads:
            handle.synchronize()

    @property
    def in_flight(self) -> int:
        """Copies not done and writes not collected (a snapshot whose copy is done and whose
        pages are not stored yet waits outside: a drain does not wait for pages that may never
        come)."""
        return sum(not e.handle.query() for e in self._copies) + len(self._writes) + len(self._loads)

    def clear(self) -> int:
        """Empty every component's store (linked: the full one too, dependents first; else all but
        the full one, which the manager clears) and drop the snapshots still waiting for their
        pages (counted failed: they hold the old weights' state); entries removed."""
        for entries in self._copies:
            self.failed[entries.name] += len(entries.indices)
        self._copies = []
        if self.linked is not None:  # every store, dependents first (the full one then holds none)
            return self.linked.clear()
        return sum(store.clear() for name, store in self.stores.items() if name != self.full.name)

    def close(self) -> None:
        """Unlink the stores (they stay open). Idempotent."""
        if self.linked is not None:
            self.linked.close()

    # -- load path ------------------------------------------------------------------------

    def present(self, keys: list[str]) -> dict[str, list[bool]]:
        """Per component, which of ``keys`` its store holds (state: the snapshot at ``h_i``);
        the others are asked only for the keys before the full store's first miss."""
        stores = self.stores
        full = list(stores[self.full.name].exists(keys)) if keys else []
        asked = keys[: next(compress(count(), map(not_, full)), len(full))]  # up to the first miss
        present = {self.full.name: full}
        for component in self.others:
            present[component.name] = list(stores[component.name].exists(asked)) if asked else []
        return present

    def match(self, keys: list[str], num_tokens: int) -> PrefixMatch:
        """The lookup's answer: the restorable length and every restorable length."""
        lengths = lengths_unchecked(self.layout, self.page_size, num_tokens, self.present(keys))
        pages = lengths[-1] // self.page_size if lengths else 0
        return PrefixMatch(pages, keys[:pages], pages * self.page_size, len(keys), lengths)

    def read(self, handle: Any, pages: list[torch.Tensor]) -> None:
        """On a reader thread: the lookup, then the full pages and every component's entries of
        the largest restorable length that fits the host pages and reads whole (module doc)."""
        keys, page_size = handle.page_keys, self.page_size
        found = restorable_lengths(self.layout, page_size, len(keys) * page_size + 1, self.present(keys))
        handle.lengths = found.lengths
        handle.pages_hit = found.num_pages
        fits = [length for length in found.lengths if length // page_size <= len(pages)]
        if not fits or handle.cancelled:
            return
        count = fits[-1] // page_size
        outcome = read_leading_pages_into(
            self.stores[self.full.name], keys[:count], self.host_pool, handle.host_page_ids
        )
        handle.error = outcome.error
        for length in reversed(fits):
            if length // page_size <= outcome.pages_read:
                entries = self._read_entries(keys, length)
                if entries is not None:  # its staging is given back once loaded (or dropped with the handle)
                    handle.entries = entries
                    handle.pages_ready = length // page_size
                    break
        handle.hole = handle.pages_ready < count and handle.error is None  # too few host pages is no hole

    def _read_entries(self, keys: list[str], length: int) -> dict[str, Entries] | None:
        """Every component's entries for a resume at ``length``, or None when one is not read whole."""
        plan, read = pages_to_load(self.layout, self.page_size, length), {}
        for component in self.others:
            indices = list(plan[component.name])
            store, pool = self.stores[component.name], self.components.pools[component.name]
            entries_keys, entries = [keys[i] for i in indices], None
            try:
                by_rows = self._kv_rows.get(id(pool)) is not None and component.kind != "state"
                entries = self.entry_staging.borrow(component.name, store, pool, entries_keys, by_rows)
                if entries is None:
                    entries = self.entry_staging.take(component.name, None, pool, len(indices))
                    into = [entries.staging[i] for i in range(len(indices))]
                    hits = list(store.get(entries_keys, into)) if indices else []
                else:
                    hits = [entries.staging is not None]
            except Exception:  # a store that fails: this length cannot be resumed
                logger.exception("offload: read of %s entries failed", component.name)
                hits = [False]
            if entries is not None:
                entries.indices, entries.keys, entries.length = indices, entries_keys, length
                read[component.name] = entries
            if not all(hits):
                for unused in read.values():
                    self.entry_staging.give_back(unused)
                return None
        return read

    def check_load(self, handle: Any, num_pages: int, component_slots: Any, state_slot: Any) -> dict[str, torch.Tensor]:
        """Every check of :meth:`load` before anything is copied; the window slots by component.

        Raises:
            InvalidArgumentError: ``num_pages`` pages is no restorable length of the handle; a
                window's slots not its window's pages, outside its pool or repeated (the rule
                of the full pages' slots: :func:`~kvstage.offload.slot_indices.check_slots`);
                ``state_slot`` not an int in the state pool's range.
            ArgumentTypeError, DeviceMismatchError: a window's slots missing, not a 1-D int
                tensor, or on another device than its pool.
        """
        windows = [component.name for component in self.layout.of_kind("swa")]
        require(
            component_slots is None or isinstance(component_slots, Mapping),
            "component_slots",
            lambda: f"must map sliding-window component names to slots, got {type(component_slots).__name__}",
        )
        for name in component_slots or {}:
            require(
                name in windows,
                "component_slots",
                lambda name=name: f"names {name!r}; the layout's sliding-window components are {windows}",
            )
        require(
            state_slot is None or self.state is not None,
            "state_slot",
            "the layout has no request-state component (give None)",
        )
        length = num_pages * self.page_size
        if num_pages == 0:
            return {}
        require(
            length in handle.lengths and handle.entries is not None and length == handle.pages_ready * self.page_size,
            "slot_indices",
            lambda: (
                f"{length} tokens is not the prefetched restorable length {handle.pages_ready * self.page_size} "
                f"(restorable: {handle.lengths}); load all of it or nothing"
            ),
        )
        slots = {}
        for component in self.layout.of_kind("swa"):
            want = len(handle.entries[component.name].indices)
            given = (component_slots or {}).get(component.name)
            pool = self.components.pools[component.name]
            if want == 0 and given is None:  # a window of one token: nothing before the length
                given = torch.empty(0, dtype=torch.int64, device=pool.device)
            argument = f"component_slots[{component.name!r}]"
            given_pages = check_slots(
                given,
                argument,
                device=torch.device(pool.device),
                num_slots=pool.num_slots,
                page_size=self.page_size,
                distinct=True,
            )
            require(
                given_pages == want,
                argument,
                lambda given_pages=given_pages, want=want: (
                    f"must hold the window's {want} pages before the length ({want * self.page_size} slots), "
                    f"got {given_pages} pages"
                ),
            )
            slots[component.name] = given
        if self.state is not None:
            pool = self.components.pools[self.state.name]
            state_slot = as_int(state_slot)
            require(
                is_int(state_slot) and 0 <= state_slot < pool.num_slots,
                "state_slot",
                lambda: f"must be an int in [0, {pool.num_slots}) (the request's state slot), got {state_slot!r}",
            )
        return slots

    def load(
        self,
        state: Any,
        handle: Any,
        num_pages: int,
        slot_indices: torch.Tensor,
        window_slots: dict,
        state_slot: Any,
        after: Any,
        layer_by_layer: bool = False,
    ) -> dict[str, list[CopyHandle]]:
        """Launch every component's scatter (checked by :meth:`check_load`): one launch per
        component (the state of every state layer in one), or with ``layer_by_layer`` one per
        component layer (the state layer's tensors alone, ``scatter_state(tensors=...)``);
        the handles by component, in its layers' order."""
        if num_pages == 0:
            return {}
        launched = {}
        for component in self.others:
            entries = handle.entries[component.name]
            pool = self.components.pools[component.name]
            layers = list(range(component.num_layers)) if layer_by_layer else [None]
            if component.kind == "state":
                staging, backend, slot = entries.staging, self.backend, int(state_slot)
                launched[component.name] = [
                    self.copy_stream.submit(
                        lambda pool=pool, tensors=(None if j is None else pool.layers[j]): (
                            self._copy_state(pool, staging, slot, False, tensors)
                            or scatter_state(staging, pool, [slot], backend=backend, tensors=tensors)
                        ),
                        keep=[staging],
                        after=after,
                    )
                    for j in layers
                ]
            else:
                slots = (
                    slot_indices[: num_pages * self.page_size]
                    if component.kind == "sidecar"
                    else window_slots[component.name]
                )
                launched[component.name] = [
                    self._submit_pages(scatter, pool, entries.staging, slots, after, layer=j) for j in layers
                ]
        for copies in launched.values():
            for copy in copies:
                state.copies_in_flight += 1
                self._loads.append((state, copy))
        self._held.append(([copy for copies in launched.values() for copy in copies], list(handle.entries.values())))
        handle.entries = None  # the load holds them now (drop() must not give them back)
        return launched

    def load_handle(self, base: LoadHandle, launched: dict[str, list[CopyHandle]]) -> LoadHandle:
        """The engine's handle: its layers are the model's."""
        return HybridLoadHandle(base, self.layout, launched)

    # -- internals ------------------------------------------------------------------------

    def drop(self, handle: Any) -> None:
        """A prefetch no load took (cancelled, or its host pages freed): its entries' staging goes
        back and their loans end (the reader thread is done with them)."""
        entries, handle.entries = handle.entries, None
        for unused in (entries or {}).values():
            self.entry_staging.give_back(unused)

    def _copy_state(self, pool: Any, staging: torch.Tensor, slot: int, to_host: bool, tensors: Any) -> bool:
        """A state slot to (``to_host``) or from ``staging[0]`` by rows; False: not in host memory
        (the kernels copy it)."""
        rows = self._kv_rows.get(id(pool))
        if rows is None:
            return False
        self.row_copies.copy_plan(rows.plan(staging[0], slot, to_host=to_host, tensors=tensors))
        return True

    def _submit_pages(
        self, copy: Any, pool: Any, staging: torch.Tensor, slots: torch.Tensor, after: Any, layer: int | None = None
    ) -> CopyHandle:
        page_size, backend = self.page_size, self.backend
        rows = self._kv_rows.get(id(pool))
        if rows is not None and slots.device.type == "cpu":  # host memory: by rows (the copier's RowCopies)
            row_copies, to_host = self.row_copies, copy is gather

            def by_rows() -> None:
                row_copies.copy_plan(rows.plan(list(staging), slots, to_host=to_host, layer=layer))

            return self.copy_stream.submit(by_rows, keep=[staging, slots], after=after)
        local = torch.arange(staging.shape[0], dtype=torch.int64)
        if copy is gather:

            def run() -> None:
                gather(pool, staging, slots, local, page_size=page_size, backend=backend, check_bounds=False)
        else:

            def run() -> None:
                scatter(
                    staging, pool, slots, local, page_size=page_size, layer=layer, backend=backend, check_bounds=False
                )

        return self.copy_stream.submit(run, keep=[staging, slots, local], after=after)
