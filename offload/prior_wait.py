"""A store write that waits for its chain's prior page, for a manager whose prompt pages another
process writes (``store_prompt=False``, sglang's disaggregated decode side).

A chain-aware store refuses a page whose predecessor is not stored
(:class:`~kvstage.storage.MissingPriorError`). The decode side's first decode page continues the
prefill side's last prompt page, whose write may still be queued in the other process: the
refusal then means "not yet", not "never". :class:`PriorWaitingWrite` puts the pages again after
a growing pause (10 ms doubling up to 200 ms) until the prior is stored or ``prior_wait_s`` has
passed. Between attempts it is *parked*: no thread runs it (a :class:`threading.Timer` resubmits
it to the writer thread), so other writes go on and the engine's ``poll`` never waits for it
(``drain`` and ``close`` do). A refusal that cannot change (a
:class:`~kvstage.offload.key_chain.PriorFailedError`: the prior failed in this manager) is final
at once.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Sequence

from kvstage.offload.key_chain import PriorFailedError
from kvstage.offload.store_io import WriteOutcome
from kvstage.storage import MissingPriorError

__all__ = ["PriorWaitingWrite"]

FIRST_PAUSE_S = 0.01
LONGEST_PAUSE_S = 0.2


class PriorWaitingWrite:
    """One run's store write, put again while the store answers that its prior is missing.

    Args:
        submit: ``submit(call)`` runs ``call()`` on the writer thread (``StoreWorkers.write``).
        put: ``put()`` -> :class:`~kvstage.offload.store_io.WriteOutcome`: one attempt (the
            run's pages, in host pages held until :attr:`future` is done, with its prior key).
        page_keys: the run's keys, in chain order.
        prior_wait_s: seconds from the first refusal after which a refusal is final.
        on_end: ``on_end(outcome)``, called once with the final outcome before :attr:`future`
            completes (on the thread that ends it).

    Attributes:
        future: completes with the last attempt's :class:`~kvstage.offload.store_io.WriteOutcome`;
            a final refusal's ``error`` is a ``MissingPriorError`` naming the key and the wait,
            or the attempt's ``PriorFailedError`` (the prior failed in this manager: no wait).
        parked: waiting for the next attempt (no thread runs it now).
    """

    def __init__(
        self,
        submit: Callable[[Callable[[], Any]], Any],
        put: Callable[[], WriteOutcome],
        page_keys: Sequence[str],
        prior_wait_s: float,
        on_end: Callable[[WriteOutcome], Any],
    ) -> None:
        self.future: Future = Future()
        self.parked = False
        self._submit, self._put, self._keys = submit, put, page_keys
        self._wait_s, self._on_end = prior_wait_s, on_end
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
        """On the writer thread: put the pages; park on a refusal for a missing prior that
        another process may still write."""
        try:
            outcome = self._put()
        except Exception as error:  # put never raises; this keeps the future from hanging
            outcome = WriteOutcome(failed_keys=list(self._keys), error=error)
        error = outcome.error
        if not isinstance(error, MissingPriorError) or isinstance(error, PriorFailedError) or outcome.stored:
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
        if self.future.done():
            return
        outcome = outcome if outcome is not None else WriteOutcome(failed_keys=list(self._keys))
        try:
            self._on_end(outcome)
        finally:
            self.future.set_result(outcome)
