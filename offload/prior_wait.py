"""A store write that waits for its chain's prior page, for a manager whose prompt pages another
process writes (``store_prompt=False``, sglang's disaggregated decode side).

A chain-aware store refuses a page whose predecessor is not stored
(:class:`~kvstage.storage.MissingPriorError`). The decode side's first decode page continues the
prefill side's last prompt page, whose write may still be queued in the other process: the
refusal then means "not yet", not "never". :class:`PriorWaitingWrite` puts the pages again after
a growing pause (10 ms doubling up to 200 ms) until the prior is stored or ``prior_wait_s`` has
passed. Between attempts it is *parked*: no thread runs it (a :class:`threading.Timer` resubmits
it to the writer thread), so other writes go on and the engine's thread never waits for it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import torch

from kvstage.offload.store_io import WriteOutcome, write_pages
from kvstage.storage import MissingPriorError

__all__ = ["PriorWaitingWrite"]

FIRST_PAUSE_S = 0.01
LONGEST_PAUSE_S = 0.2


class PriorWaitingWrite:
    """One run's store write, put again while the store answers that its prior is missing.

    Args:
        submit: ``submit(call)`` runs ``call()`` on the writer thread (``StoreWorkers.write``).
        storage: the store.
        page_keys: the run's keys, in chain order.
        pages: the host pages holding them (held until :attr:`future` is done).
        prior_key: the chain key before ``page_keys[0]`` (None: no prior).
        prior_wait_s: seconds from the first refusal after which a refusal is final.
        on_change: called (from any thread) whenever the write parks or ends.

    Attributes:
        future: completes with the last attempt's :class:`~kvstage.offload.store_io.WriteOutcome`;
            a final refusal's ``error`` is a ``MissingPriorError`` naming the key and the wait.
        parked: waiting for the next attempt (no thread runs it now).
    """

    def __init__(
        self, submit: Callable[[Callable[[], Any]], Any], storage: Any, page_keys: Sequence[str],
        pages: Sequence[torch.Tensor], prior_key: str | None, prior_wait_s: float, on_change: Callable[[], None],
    ) -> None:
        self.future: Future = Future()
        self.parked = False
        self._submit, self._storage = submit, storage
        self._keys, self._pages, self._prior_key = page_keys, pages, prior_key
        self._wait_s, self._on_change = prior_wait_s, on_change
        self._first_refusal: float | None = None
        self._pause = FIRST_PAUSE_S
        self._stopped = False
        self._lock = threading.Lock()
        self._last: WriteOutcome | None = None

    def start(self) -> None:
        """Submit the first attempt."""
        self._submit(self._attempt)

    def stop(self) -> None:
        """Attempt no more: a parked write ends now with its last refusal (flush)."""
        with self._lock:
            self._stopped = True
            if not self.parked:
                return  # running or queued: it ends after this attempt
            self.parked = False
        self._end(self._last)

    def _attempt(self) -> None:
        """On the writer thread: put the pages; park on a refusal for a missing prior."""
        try:
            outcome = write_pages(self._storage, self._keys, self._pages, prior_key=self._prior_key)
        except Exception as error:  # write_pages never raises; this keeps the future from hanging
            outcome = WriteOutcome(failed_keys=list(self._keys), error=error)
        error = outcome.error
        if not isinstance(error, MissingPriorError) or outcome.stored:
            self._end(outcome)
            return
        now = time.monotonic()
        if self._first_refusal is None:
            self._first_refusal = now
        waited = now - self._first_refusal
        if waited + self._pause > self._wait_s:
            outcome.error = MissingPriorError(
                error.prior_key,
                f"prior_key: {error.prior_key!r} was still not stored {waited:.2f} s after the first refusal "
                f"(prior_wait_s={self._wait_s}); a page after a missing one is unreachable, so it is refused",
            )
            self._end(outcome)
            return
        with self._lock:
            stopped = self._stopped
            if not stopped:
                self._last, self.parked = outcome, True
        if stopped:
            self._end(outcome)
            return
        timer = threading.Timer(self._pause, self._resubmit)
        timer.daemon = True  # a process exiting without close() does not wait for it
        self._pause = min(self._pause * 2, LONGEST_PAUSE_S)
        self._on_change()
        timer.start()

    def _resubmit(self) -> None:
        """On the timer's thread: queue the next attempt (unless stopped meanwhile)."""
        with self._lock:
            if not self.parked:
                return  # stopped, and ended by stop()
            self.parked = False
        try:
            self._submit(self._attempt)
        except RuntimeError:  # the writer thread has stopped (interpreter exit without close())
            self._end(self._last)

    def _end(self, outcome: WriteOutcome | None) -> None:
        if not self.future.done():
            self.future.set_result(outcome if outcome is not None else WriteOutcome(failed_keys=list(self._keys)))
        self._on_change()
