"""Removing named pages from a :class:`~kvstage.storage.mooncake.store.MooncakeStore`
(``StorageBackend.remove``): Mooncake's ``batch_remove``, forced.

The master keeps no chain links (it evicts on its own), so only the keys named go; a caller
that removes a chain's page names the later ones too (:mod:`kvstage.offload.linked_stores`
does). Forced: an object read within its lease is removed too, as ``clear`` removes it.
"""

from __future__ import annotations

from typing import Any

from kvstage.storage.mooncake.status import MASTER_DOWN_CODES, OBJECT_NOT_FOUND, MooncakeCodeError

__all__ = ["remove_named"]


def remove_named(store: Any, full_keys: list[str]) -> int:
    """Remove ``full_keys`` (distinct, prefix included) from the Mooncake cluster of ``store``;
    the number removed. A key already gone that this client stored (or its watcher listed) is
    announced ``evicted`` (the master evicted it); each key removed is announced ``removed``.
    Runs with the store's gate shared: a ``clear`` runs wholly before or after it.

    Raises:
        StorageError: the store is closed.
        MooncakeCodeError: every key's answer said the master is down (nothing removed).
    """
    with store._gate.shared():
        client = store._require_open()
        codes = store._call("batch_remove", len(full_keys), client.batch_remove, full_keys, True)
        if codes and all(code in MASTER_DOWN_CODES for code in codes):
            raise MooncakeCodeError("batch_remove", codes[0])
        removed = [key for key, code in zip(full_keys, codes) if code == 0]
        gone = [key for key, code in zip(full_keys, codes) if code == OBJECT_NOT_FOUND]
        with store._lock:
            for key in removed:
                store._known.pop(key, None)
                store._seen.discard(key)
            store._note_gone(gone)
            store._record("removed", removed)
    store._log_failures(
        "remove's batch_remove", full_keys, [code for code in codes if code not in (0, OBJECT_NOT_FOUND)]
    )
    return len(removed)
