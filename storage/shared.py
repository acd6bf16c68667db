"""One store object per URL and fingerprint in a process, for parties that must see one store.

An engine may build the scheduler's and the workers' sides of an integration separately in one
process (vLLM builds an offloading spec per connector role): with a ``memory`` store they would
otherwise hold two stores, and a store's events (evictions) would reach only the side that
wrote. :func:`open_shared_storage` hands every caller in the process the same store for the same
``(url, fingerprint)``; :func:`release_shared_storage` closes it when its last user lets go.
"""

from __future__ import annotations

import threading

from kvstage.storage.backend import StorageBackend
from kvstage.storage.fingerprint import LayoutFingerprint
from kvstage.storage.registry import open_storage

__all__ = ["open_shared_storage", "release_shared_storage"]

_lock = threading.Lock()
_open: dict[tuple[str, LayoutFingerprint], list] = {}  # (url, fingerprint) -> [store, users]


def open_shared_storage(url: str, fingerprint: LayoutFingerprint) -> StorageBackend:
    """The process's store for ``url`` and ``fingerprint``, opened by the first caller.

    Raises:
        As :func:`kvstage.storage.open_storage` (nothing is kept then).
    """
    with _lock:
        entry = _open.get((url, fingerprint))
        if entry is None:
            entry = _open[(url, fingerprint)] = [open_storage(url, fingerprint), 0]
        entry[1] += 1
        return entry[0]


def release_shared_storage(storage: StorageBackend) -> None:
    """One user is done with ``storage``; the last one closes it. Call it once per
    :func:`open_shared_storage` (each call counts one user off: a user must not release
    twice); a store not opened here is closed at once."""
    with _lock:
        for key, entry in _open.items():
            if entry[0] is storage:
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del _open[key]
                break
    storage.close()
