"""Calling Mooncake's batch API for :class:`~kvstage.storage.mooncake.store.MooncakeStore`:
bounded calls, the master-suspect check, and reading the return codes into statuses.

A mixin: it uses the store's lock, config, counters and ``page_bytes``.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import Counter
from typing import Any

import torch

from kvstage.storage.backend import PutStatus
from kvstage.storage.mooncake.status import MASTER_DOWN_CODES, OBJECT_ALREADY_EXISTS, OBJECT_NOT_FOUND, describe_code

logger = logging.getLogger(__name__)


class CallsMixin:
    """Mooncake batch calls and their return codes."""

    def _call(
        self, name: str, count: int, function: Any, *args: Any, errors: list[BaseException] | None = None
    ) -> list[int]:
        """Run a batch call (not under ``self._lock``); an exception or a malformed answer
        becomes INTERNAL_ERROR for every key (the exception is appended to ``errors``, the
        calling put's, for its answer)."""
        try:
            codes = list(function(*args))
        except Exception as error:  # the binding raises on bad arguments or a broken client
            logger.warning("mooncake: %s raised %s: %s", name, error.__class__.__name__, error)
            if errors is not None:
                errors.append(error)
            return [-1] * count
        if len(codes) != count or not all(isinstance(code, int) for code in codes):
            logger.warning("mooncake: %s answered %d codes for %d keys", name, len(codes), count)
            return [-1] * count
        return codes

    def _note_master(self, codes: list[int]) -> bool:
        """Track whether the master answers; True when every code says it did not. Under ``self._lock``."""
        down = bool(codes) and all(code in MASTER_DOWN_CODES for code in codes)
        if down:
            self._master_suspect = True
        elif any(code not in MASTER_DOWN_CODES for code in codes):
            self._master_suspect = False
        return down

    def _master_reachable(self, operation: str, count: int) -> bool:
        """False (and the operation fails without calling Mooncake) when the master is suspect
        and its port refuses a connection. The probe runs outside ``self._lock``."""
        with self._lock:
            suspect = self._master_suspect
        if not suspect:
            return True
        try:
            socket.create_connection(self._master_host_port, timeout=min(self.config.connect_timeout_s, 0.5)).close()
            return True
        except OSError as error:
            with self._lock:
                self.calls_skipped += 1
                now = time.monotonic()
                log = now - self._last_skip_log > 5.0  # one line per 5 s, not one per call
                if log:
                    self._last_skip_log = now
            if log:
                logger.warning(
                    "mooncake: master %s:%d unreachable (%s); %s of %d pages fails without calling Mooncake",
                    *self._master_host_port,
                    error.__class__.__name__,
                    operation,
                    count,
                )
            return False

    def _apply_put_codes(self, indices: list[int], codes: list[int], statuses: list[PutStatus]) -> list[int]:
        failures = []
        for index, code in zip(indices, codes):
            if code == 0:
                statuses[index] = PutStatus.STORED
            elif code == OBJECT_ALREADY_EXISTS:  # another writer stored it between exist and put
                statuses[index] = PutStatus.DEDUPLICATED
            else:
                statuses[index] = PutStatus.FAILED
                failures.append(code)
        return failures

    def _get_ok(self, code: int, target: torch.Tensor | None, failures: list[int]) -> bool:
        if code == self.page_bytes:
            return True
        if code >= 0:
            # An object of another size: never a page of this layout. Its bytes may be in target.
            if target is not None:
                target.reshape(-1).view(torch.uint8).zero_()
            logger.warning("mooncake: get read %d bytes, a page has %d; counted as a miss", code, self.page_bytes)
        elif code != OBJECT_NOT_FOUND:
            failures.append(code)
        return False

    def _log_failures(self, operation: str, full_keys: list[str], codes: list[int]) -> None:
        if not codes:
            return
        summary = ", ".join(f"{describe_code(code)} x{count}" for code, count in Counter(codes).most_common())
        logger.warning("mooncake: %s failed for %d of %d pages: %s", operation, len(codes), len(full_keys), summary)


def batches(items: list[int], size: int) -> list[list[int]]:
    return [items[start : start + size] for start in range(0, len(items), size)]
