"""Chain-aware eviction across a hybrid model's component stores: :class:`LinkedStores`.

Each component of a :class:`~kvstage.model_layout.ModelLayout` has its own store (key space);
each store evicts on its own. An entry is useless without what it depends on (the key rule of
:mod:`kvstage.offload.restorable`: every length ``k * page_size`` needs the full and sidecar
pages ``0 .. k-1``, the window's sliding-window pages and the snapshot keyed ``h_{k-1}``). So
when a store drops an entry (evicted, removed, a corrupt page), its dependents go with it:

- a full-attention or sidecar page ``h_j``: every component's entries keyed ``h_j`` and after
  it in the chain (sidecar, sliding-window and full pages, snapshots): no length past ``j``
  can be restored without it;
- a sliding-window page ``h_j``: the snapshots keyed ``h_j`` .. ``h_{j+w-1}`` (``w`` its
  :meth:`~kvstage.model_layout.SlidingWindow.window_pages`), the lengths whose window held it;
  full pages stay (other lengths use them);
- a snapshot: nothing depends on it.

An entry of another component stored under a key the full store does not hold is removed at
once (no lookup reaches it: a lookup asks the others only up to the full store's first miss).
Chain links come from the full store's puts (``prior_key`` and the run's order), kept here for
the keys the full store holds.

Where this runs: as each store's change listener
(:meth:`~kvstage.storage.StorageBackend.add_change_listener`), on the thread whose call evicted,
right after the evicting store released its lock and before that call returns; dependents are
removed in the order state, sliding window, sidecar, full. Not strictly before the evicted
entry: a store picks its victim under its own lock and reuses the room at once, and removing
other stores' entries there would take their locks under it (a full page's eviction removes
sidecar entries, a sidecar's removes full pages: a lock cycle). No lookup advertises a
dependent meanwhile: :func:`~kvstage.offload.restorable.restorable_lengths` counts an entry only
when everything it depends on is stored at the time it asks, so only a lookup racing the
eviction can see one, and its load then reads fewer pages and falls to the next restorable
length (:mod:`kvstage.offload.hybrid`). A Mooncake store learns of the master's evictions when a
lookup, read or its watcher finds a page gone; the dependents go then (a lookup asks the full
store first, so before it asks the others). An entry put on one thread while another thread's
cascade removes its key may land just after that removal: it stays, never advertised (its full
page is gone), until its own store evicts it.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Mapping
from typing import Any

from kvstage.errors import ArgumentTypeError, StorageError, is_int, require
from kvstage.model_layout import ModelLayout

__all__ = ["LinkedStores"]

logger = logging.getLogger(__name__)

_ORDER = {"state": 0, "swa": 1, "sidecar": 2, "full": 3}  # dependents first


class LinkedStores:
    """Links a layout's component stores so that an entry's dependents leave with it (module doc).

    Args:
        layout: the model's layout (exactly one full-attention component).
        stores: one store per component name (:func:`~kvstage.offload.components.component_stores`),
            each a :class:`~kvstage.storage.StorageBackend`.
        page_size: tokens per page (a sliding window's pages before a length).
        max_links: full keys whose chain link is kept at most (the oldest are forgotten first:
            a Mooncake store tells an eviction only when a page is asked for again).

    Attributes:
        dependents_removed: per component name, entries removed as dependents (or as stored
            without their full page).

    Raises:
        ArgumentTypeError: ``layout`` is not a ModelLayout, or a store has no change listeners.
        InvalidArgumentError: ``stores`` names other components than the layout's, or the layout
            has not exactly one full-attention component.

    Thread-safe. :meth:`close` unlinks the stores (they stay open).
    """

    def __init__(
        self, layout: ModelLayout, stores: Mapping[str, Any], page_size: int, *, max_links: int = 1 << 20
    ) -> None:
        require(
            isinstance(layout, ModelLayout),
            "layout",
            lambda: f"must be a kvstage.model_layout.ModelLayout, got {type(layout).__name__}",
            ArgumentTypeError,
        )
        names = sorted(component.name for component in layout.components)
        require(
            isinstance(stores, Mapping) and sorted(stores) == names,
            "stores",
            lambda: f"must map every component of the layout ({names}) to its store, got {sorted(stores)}",
        )
        fulls = layout.of_kind("full")
        require(len(fulls) == 1, "layout", lambda: f"must have exactly one full-attention component, got {len(fulls)}")
        for name, store in stores.items():
            require(
                callable(getattr(store, "add_change_listener", None)),
                f"stores[{name!r}]",
                "must be a kvstage.storage.StorageBackend (it has no add_change_listener)",
                ArgumentTypeError,
            )
        require(is_int(max_links) and max_links >= 1, "max_links", lambda: f"must be an int >= 1, got {max_links!r}")
        self.layout = layout
        self.max_links = max_links
        self.stores = dict(stores)
        self._full = fulls[0].name
        self._kinds = {component.name: component.kind for component in layout.components}
        self._windows = {c.name: c.window_pages(page_size) for c in layout.components if c.kind == "swa"}
        self._by_order = sorted(self.stores, key=lambda name: (_ORDER[self._kinds[name]], name))
        self._prior: dict[str, str | None] = {}  # full key -> the key before it in its chain
        self._next: dict[str, set[str]] = {}  # full key -> the full keys after it
        self._lock = threading.Lock()  # around the links and counters
        self._local = threading.local()  # this thread's cascade: (component, keys) still to follow
        self.dependents_removed: Counter[str] = Counter()
        self._listeners = {name: self._listener(name) for name in self.stores}
        for name, store in self.stores.items():
            store.add_change_listener(self._listeners[name])

    def clear(self) -> int:
        """Clear every component's store, dependents first (state, sliding window, sidecar,
        full); the entries removed. Raises what a store's ``clear`` raises."""
        self._local.clearing = True  # every entry goes: no dependents to follow
        try:
            removed = sum(self.stores[name].clear() for name in self._by_order)
        finally:
            self._local.clearing = False
        with self._lock:
            self._prior.clear()
            self._next.clear()
        return removed

    def close(self) -> None:
        """Stop following the stores' changes. Idempotent."""
        for name, listener in self._listeners.items():
            self.stores[name].remove_change_listener(listener)

    # -- the stores' change listener ----------------------------------------------------------

    def _listener(self, name: str):
        def changed(store: Any, kind: str, keys: list[str], priors: list | None) -> None:
            if kind == "stored":
                self._stored(name, keys, priors)
            else:
                self._follow(name, keys, forget=name == self._full)

        return changed

    def _stored(self, name: str, keys: list[str], priors: list) -> None:
        if name == self._full:
            with self._lock:
                for key, prior in zip(keys, priors):
                    self._prior[key] = prior
                    if prior is not None:
                        self._next.setdefault(prior, set()).add(key)
                while len(self._prior) > self.max_links:
                    self._forget([next(iter(self._prior))])
            return
        with self._lock:
            unknown = [key for key in keys if key not in self._prior]
        if unknown:  # not put here (another process's, a reopened store's): ask the full store
            held = self.stores[self._full].exists(unknown)
            orphans = [key for key, there in zip(unknown, held) if not there]
            if orphans:
                self._remove(name, orphans)

    def _follow(self, name: str, keys: list[str], *, forget: bool) -> None:
        """Remove the dependents of ``keys``, gone from component ``name``'s store; on this
        thread's cascade, the removals they cause are followed in turn, each key once."""
        if getattr(self._local, "clearing", False):
            return
        cascade = getattr(self._local, "cascade", None)
        if cascade is not None:  # a removal of this cascade: followed by its loop
            cascade.append((name, keys, forget))
            return
        self._local.cascade = cascade = [(name, keys, forget)]
        asked: dict[str, set[str]] = {store: set() for store in self.stores}
        try:
            while cascade:
                name, keys, forget = cascade.pop(0)
                for target, dependents in self._dependents(name, keys, forget):
                    fresh = [key for key in dependents if key not in asked[target]]
                    asked[target].update(fresh)
                    if fresh:
                        self._remove(target, fresh)
        finally:
            self._local.cascade = None

    def _dependents(self, name: str, keys: list[str], forget: bool) -> list[tuple[str, list[str]]]:
        """``(component, keys)`` to remove, dependents first, for ``keys`` gone from ``name``'s store."""
        kind = self._kinds[name]
        with self._lock:
            if kind == "state":
                after = []
            elif kind == "swa":
                after = self._chain(keys, self._windows[name] - 1)
            else:
                after = self._chain(keys, None)
            if forget:
                self._forget(keys)
        if kind == "state":
            return []
        if kind == "swa":
            return [(target, after) for target in self._by_order if self._kinds[target] == "state"]
        later = after[len(keys) :]  # (found lists ``keys`` first) the store's own keys are gone already
        return [(target, later if target == name else after) for target in self._by_order]

    def _chain(self, keys: list[str], depth: int | None) -> list[str]:
        """``keys`` and the full keys after them, at most ``depth`` links on (None: all). Under the lock."""
        found = dict.fromkeys(keys)
        level = list(keys)
        steps = 0
        while level and (depth is None or steps < depth):
            level = [after for key in level for after in self._next.get(key, ()) if after not in found]
            found.update(dict.fromkeys(level))
            steps += 1
        return list(found)

    def _forget(self, keys: list[str]) -> None:
        """Drop the links of full keys no longer stored. Under the lock."""
        for key in keys:
            prior = self._prior.pop(key, None)
            siblings = self._next.get(prior) if prior is not None else None
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._next[prior]
            self._next.pop(key, None)

    def _remove(self, name: str, keys: list[str]) -> None:
        try:
            removed = self.stores[name].remove(keys)
        except StorageError as error:  # the eviction that caused it stands; lookups still check every store
            logger.warning("linked stores: removing %d dependents from %s failed: %s", len(keys), name, error)
            return
        with self._lock:
            self.dependents_removed[name] += removed
