"""The key space side of :class:`~kvstage.storage.mooncake.store.MooncakeStore`: ``clear``,
``remove``, the watcher's listings and the ``evicted`` / ``removed`` events they give.

A mixin: it uses the store's lock, gate, ``_known`` / ``_seen`` sets and Mooncake client
(:class:`~kvstage.storage.mooncake.store.MooncakeStore` documents them).
"""

from __future__ import annotations

import logging
from typing import Any

from kvstage.errors import StorageError
from kvstage.storage.mooncake.admin import list_keys
from kvstage.storage.mooncake.removal import remove_named
from kvstage.storage.mooncake.status import MASTER_DOWN_CODES, OBJECT_NOT_FOUND, MooncakeCodeError

logger = logging.getLogger(__name__)

KNOWN_KEYS_LIMIT = 1 << 20  # keys this client stored and remembers, for its evicted/removed events
_REGEX_SYNTAX = frozenset("\\^$.|?*+()[]{}")  # ECMAScript's syntax characters (std::regex's default)


def _regex_literal(text: str) -> str:
    """``text`` as a literal in an ECMAScript regular expression (Mooncake's ``std::regex``):
    only syntax characters escaped (escaping others is an error in some ``std::regex``s)."""
    return "".join("\\" + c if c in _REGEX_SYNTAX else c for c in text)


class KeySpaceMixin:
    """``clear``, ``remove``, the watcher round and the eviction record of a Mooncake store."""

    def _clear(self) -> int:
        """Remove every object under this store's prefix.

        With ``admin_address``: the keys listed on the master's admin server (and those this
        client stored) are removed by name (``batch_remove``, forced), so each removed page is
        announced, whoever stored it; a page another client puts after the listing lands after
        the clear. Without one, or when the listing fails: ``remove_by_regex`` on the prefix
        (forced), announcing only this client's pages. Forced: an object read within its lease
        is removed too.

        Holds the store alone (its gate): puts, gets and lookups in flight finish first, and
        those that arrive wait until it is done.

        Raises:
            StorageError: the store is closed, or Mooncake answered an error (nothing is
                known removed then; this client's pages are still reported as before).
        """
        with self._gate.exclusive():
            store = self._require_open()
            listed = self._list_key_space() if self.config.admin_address else None
            with self._lock:
                known = list(self._known)
            present = self._call("batch_is_exist", len(known), store.batch_is_exist, known) if known else []
            if listed is None:
                removed = self._remove_by_regex(store)
                with self._lock:
                    self._known.clear()
                    self._seen.clear()  # all gone: the watcher must not announce them again
                    self._record("evicted", [key for key, code in zip(known, present) if code == 0])
                    self._record("removed", [key for key, code in zip(known, present) if code == 1])
                return removed
            names = list(dict.fromkeys(listed + [key for key, code in zip(known, present) if code == 1]))
            codes = self._call("batch_remove", len(names), store.batch_remove, names, True) if names else []
            if codes and all(code in MASTER_DOWN_CODES for code in codes):
                raise MooncakeCodeError("batch_remove", codes[0])
            gone = [key for key, code in zip(known, present) if code == 0]
            gone += [key for key, code in zip(names, codes) if code == OBJECT_NOT_FOUND]  # evicted meanwhile
            failed = [code for code in codes if code not in (0, OBJECT_NOT_FOUND)]
            swept = self._remove_by_regex(store) if failed else 0  # what batch_remove left, unnamed
            named = [key for key, code in zip(names, codes) if code == 0]
            with self._lock:
                for key in named:
                    self._known.pop(key, None)
                    self._seen.discard(key)
                self._note_gone(gone)
                self._record("removed", named)
        if failed:
            self._log_failures("clear's batch_remove", names, failed)
            logger.warning("mooncake: clear swept %d more pages by regex, unnamed in its events", swept)
        return len(named) + swept

    def _remove(self, full_keys: list[str]) -> int:
        return remove_named(self, full_keys)  # only the keys named: the master keeps no chains

    def _remove_by_regex(self, store: Any) -> int:
        """``remove_by_regex`` (forced) of every key under this store's prefix; how many went.

        Raises:
            StorageError: the binding raised, or Mooncake answered an error code.
        """
        try:
            removed = store.remove_by_regex("^" + _regex_literal(self.prefix), True)
        except Exception as error:  # the binding raises on a broken client
            raise StorageError(f"mooncake: remove_by_regex raised {error.__class__.__name__}: {error}") from error
        if removed < 0:
            raise MooncakeCodeError("remove_by_regex", removed)
        return removed

    def _list_key_space(self) -> list[str] | None:
        """Full keys of this key space on the master's admin server, for ``clear``; None
        (logged) when it does not answer. Not under ``self._lock``."""
        try:
            return list_keys(self.config.admin_address, self.prefix)
        except StorageError as error:
            logger.warning("mooncake: clear: %s; announcing only this client's pages", error)
            return None

    def _watch_once(self) -> None:
        """One watcher round: list the key space and announce as ``evicted`` the keys of the
        last listing that are gone. Holds the gate shared, so no ``clear`` of this client
        runs between the listing and the comparison."""
        with self._gate.shared():
            if self._store is None:
                return
            try:
                listed = list_keys(self.config.admin_address, self.prefix)
            except StorageError as error:
                if not self._watch_failing:  # once per outage, not once per round
                    logger.warning("mooncake: watch: %s; evictions are announced once it answers again", error)
                self._watch_failing = True
                return
            if self._watch_failing:
                logger.info("mooncake: watch: the admin server %s answers again", self.config.admin_address)
                self._watch_failing = False
            now = set(listed)
            with self._lock:
                gone = sorted(self._seen - now)
                self._seen = now
                for key in gone:
                    self._known.pop(key, None)  # announced here: not again when this client asks
                self._record("evicted", gone)
                self.watch_rounds += 1
        self._tell_changes()  # the evictions it noticed, to the change listeners (off the store's locks)

    def _remember(self, full_keys: list[str]) -> None:
        """Remember keys this client stored (for their evicted/removed events), at most
        KNOWN_KEYS_LIMIT, forgetting the oldest first. Under ``self._lock``."""
        known = self._known
        for key in full_keys:
            known[key] = None
        while len(known) > KNOWN_KEYS_LIMIT:
            del known[next(iter(known))]

    def _note_gone(self, full_keys: list[str]) -> None:
        """Keys Mooncake answered absent: those this client stored or its watcher saw listed
        were evicted by the master (an ``evicted`` event each, once). Under ``self._lock``."""
        gone = []
        for key in full_keys:
            stored = self._known.pop(key, 0) is None
            if stored or key in self._seen:
                self._seen.discard(key)  # announced here: not again by the watcher
                gone.append(key)
        self._record("evicted", gone)
