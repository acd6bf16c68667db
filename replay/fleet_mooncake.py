"""What a bounded Mooncake pool evicted during a fleet run, observed from the router's process.

Mooncake's master evicts (at its high-water mark, least recently leased first) without telling
any client. Two things show it: the router's store, opened with ``admin=HOST:PORT&watch=SECONDS``
(:mod:`kvstage.storage.mooncake.admin`), lists the key space on the master's admin server every
few seconds and announces each key one listing showed and the next did not (``evicted``), and
the master's ``/metrics`` counts every key it evicted (``master_evicted_key_count``). A fleet
counts a missing page *evicted* only when the watcher saw that key vanish, and only as many
vanished keys as the master's counter grew by over the run: a key that vanished for another
reason (a segment gone with its client, a removal) beyond that count is lost. A page stored and
evicted between two listings goes unseen and reads as lost too (the figures name how many of
the master's evictions the watcher did not see). The router's process never dies, so no kill
cuts this record short.
"""

from __future__ import annotations

import time
import urllib.request

from kvstage.errors import StorageError

EVICTED_KEYS_METRIC = "master_evicted_key_count"  # mooncake_master's /metrics (master_metric_manager.cpp)
SETTLE_ROUNDS = 2  # watcher listings after the last write: the last evictions are seen


def master_evicted_keys(admin_address: str, timeout_s: float = 10.0) -> int:
    """Keys the master at ``admin_address`` (``host:port`` of its admin server) evicted since it started.

    Raises:
        StorageError: the server did not answer, or its ``/metrics`` has no ``master_evicted_key_count``.
    """
    url = f"http://{admin_address}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            text = response.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise StorageError(f"mooncake: reading {url} failed ({error.__class__.__name__}: {error})") from None
    for line in text.split("\n"):  # Prometheus text format: NAME VALUE, one sample a line
        name, _, value = line.partition(" ")
        if name == EVICTED_KEYS_METRIC:
            return int(float(value))
    raise StorageError(f"mooncake: {url} has no {EVICTED_KEYS_METRIC}")


class PoolEvictions:
    """The evictions the router's Mooncake store (its watcher) saw, and the master's count.

    Use :meth:`of` (None unless the store is a watching Mooncake store), :meth:`poll` often
    during the run (the store's event queue is bounded), :meth:`settle` once every engine has
    stopped writing, then :attr:`keys` (no prefix) and :attr:`master_evicted`.
    """

    def __init__(self, store) -> None:
        self.store = store
        self.keys: set[str] = set()
        self.vanished = 0  # disappearances the watcher announced (a key stored, evicted and stored again counts twice)
        self.master_before = master_evicted_keys(store.config.admin_address)
        self.master_evicted: int | None = None
        self.keys_at_end: int | None = None  # keys of the key space the watcher's last listing showed

    @classmethod
    def of(cls, store) -> "PoolEvictions | None":
        """The evictions of ``store`` when it is a Mooncake store with a watcher (``watch=``),
        else None."""
        from kvstage.storage import MooncakeStore

        if not isinstance(store, MooncakeStore) or store.config.watch_s is None:
            return None
        return cls(store)

    def poll(self) -> None:
        """Take the store's events: keep the keys its watcher announced evicted."""
        keys = [event.key for event in self.store.take_events() if event.kind == "evicted"]
        self.vanished += len(keys)
        self.keys.update(keys)

    def settle(self) -> None:
        """Wait for :data:`SETTLE_ROUNDS` more listings (at most 30 s), take what they saw, read the master's count."""
        rounds = self.store.watch_rounds
        deadline = time.monotonic() + max(30.0, 4 * SETTLE_ROUNDS * self.store.config.watch_s)
        while self.store.watch_rounds < rounds + SETTLE_ROUNDS and time.monotonic() < deadline:
            time.sleep(self.store.config.watch_s / 4)
        self.poll()
        self.keys_at_end = len(self.store._seen)
        self.master_evicted = master_evicted_keys(self.store.config.admin_address) - self.master_before

    @property
    def unseen(self) -> int:
        """Evictions the master counted that the watcher did not see (stored and evicted between two listings)."""
        return max(0, (self.master_evicted or 0) - self.vanished)

    @property
    def unattributed(self) -> int:
        """Keys the watcher saw vanish beyond the master's eviction count (not evictions: lost)."""
        return max(0, self.vanished - (self.master_evicted or 0))
