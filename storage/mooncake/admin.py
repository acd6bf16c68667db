"""The Mooncake master's admin HTTP server, for what no client call tells: every key it holds.

``mooncake_master`` serves ``GET /get_all_keys`` (one key a line, ``text/plain``) on its admin
server (``-metrics_host``, ``-metrics_port``, 9003 by default; ``master_admin_service.cpp``).
The store lists its key space there before a ``clear`` (so it can announce other clients' pages
it removes) and, with a watcher, every few seconds (so it can announce pages the master evicted).
The master's own event publisher (``-enable_kv_events``) would say this without polling, but the
0.3.13 wheels are built without it (``ENABLE_KV_EVENTS`` off: the flag is accepted, nothing binds).
"""

from __future__ import annotations

import logging
import threading
import urllib.error
import urllib.request
from typing import Callable

from kvstage.errors import InvalidArgumentError, StorageError

logger = logging.getLogger(__name__)

ADMIN_TIMEOUT_S = 10.0  # one listing at most; it names every key of the master, all key spaces


def list_keys(address: str, prefix: str, timeout_s: float = ADMIN_TIMEOUT_S) -> list[str]:
    """Every key the master at ``address`` holds that starts with ``prefix``, in its order.

    Args:
        address: ``host:port`` of the master's admin HTTP server.
        prefix: the key prefix (a store's fingerprint prefix); ``""``: every key.
        timeout_s: seconds for the whole request.

    Raises:
        StorageError: the server did not answer, answered an HTTP error, or not UTF-8 text.
    """
    url = f"http://{address}/get_all_keys"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = response.read()
        text = body.decode("utf-8")
    except (OSError, UnicodeDecodeError) as error:  # URLError and HTTPError are OSErrors
        raise StorageError(
            f"mooncake: listing the keys at {url} failed ({error.__class__.__name__}: {error}); admin_address "
            "must be the master's admin server (-metrics_host:-metrics_port, 9003 by default)"
        ) from None
    return [key for key in text.split("\n") if key and key.startswith(prefix)]


class PeriodicThread:
    """Calls ``function()`` every ``interval_s`` seconds on a daemon thread until :meth:`stop`.

    An exception from ``function`` is logged and the next round runs as planned.

    Raises:
        InvalidArgumentError: interval_s is not positive.
    """

    def __init__(self, interval_s: float, function: Callable[[], None], name: str) -> None:
        if not interval_s > 0:
            raise InvalidArgumentError(f"interval_s: must be positive seconds, got {interval_s!r}")
        self.interval_s = interval_s
        self._function = function
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "PeriodicThread":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop and wait for a round in progress to end; idempotent. Not from ``function`` itself."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            try:
                self._function()
            except Exception:  # a round that failed must not end the watching
                logger.exception("mooncake: %s failed", self._thread.name)
