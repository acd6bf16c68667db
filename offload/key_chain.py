"""One request's page-key chain, keyed in launch order whatever order its copies finish in.

A request's pages form one hash chain from its namespace seed. Keys depend only on token ids,
so a copy that finishes before the one launched before it still gets the right keys: asking
for a run's keys first keys every earlier run of the chain, oldest first. The chain starts at
the namespace seed (not a stored page), at a key the prefill side stored, or at the last key of
a loaded prefix; :attr:`ChainRun.prior_key` is the stored page before a run, or None.

The chain also remembers which of its pages this manager will never store (a failed copy, a
failed store write): a later page whose prior is one of them is refused at once
(:class:`PriorFailedError`) instead of asking the store, or waiting for a prior that cannot come.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from kvstage.storage import MissingPriorError

__all__ = ["ChainRun", "PriorFailedError", "RequestChain"]


class PriorFailedError(MissingPriorError):
    """Pages refused without asking the store: the chain page before them failed in this
    manager (its device-to-host copy or its store write), so it will never be stored and no
    lookup could reach them.

    Attributes:
        prior_key: the page before the refused ones (as :class:`~kvstage.storage.MissingPriorError`).
        failed_key: the chain page that failed: ``prior_key`` itself, or an earlier page whose
            failure refused the pages up to ``prior_key``.
        cause: the error that failed ``failed_key`` (also ``__cause__``); None when the store
            answered FAILED without one (no room).
        how: what failed: ``"device-to-host copy"`` or ``"store write"``.
    """

    def __init__(self, prior_key: str, failed_key: str, cause: BaseException | None, how: str) -> None:
        why = "no error given (no room)" if cause is None else repr(cause)
        if failed_key == prior_key:
            reason = f"its {how} failed in this manager: {why}"
        else:
            reason = f"it follows chain page {failed_key!r}, whose {how} failed in this manager: {why}"
        super().__init__(
            prior_key,
            f"prior_key: {prior_key!r} will never be stored ({reason}); a page after a missing one is unreachable, so it is refused",
        )
        self.failed_key, self.cause, self.how = failed_key, cause, how
        self.__cause__ = cause


class ChainRun:
    """A run of whole pages of one chain: their token ids until keyed, then their keys."""

    __slots__ = ("tokens", "keys", "prior_key")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens: list[int] | None = tokens
        self.keys: list[str] | None = None
        self.prior_key: str | None = None  # the stored page's key before this run (None: none)


class RequestChain:
    """The keys of a request's launched runs, in chain order.

    Args:
        last_key: the key the next run continues from (a hex key, or None: no prior).
        last_key_stored: whether ``last_key`` is a stored page's key (not a namespace seed).

    The failures (:meth:`failed`, :meth:`record_write`) are written from the engine's thread
    and the writer thread, one dict item at a time.
    """

    __slots__ = ("last_key", "last_key_stored", "_unkeyed", "_unwritten")

    def __init__(self, last_key: str | None, last_key_stored: bool) -> None:
        self.last_key = last_key
        self.last_key_stored = last_key_stored
        self._unkeyed: deque[ChainRun] = deque()
        # key of a page of this chain that this manager will not store -> (failed_key, cause, how)
        self._unwritten: dict[str, tuple[str, BaseException | None, str]] = {}

    def failed(self, keys: list[str], cause: BaseException | None, how: str) -> None:
        """These pages of the chain will not be stored: ``how`` (``"device-to-host copy"``,
        ``"store write"``) failed with ``cause``."""
        for key in keys:
            self._unwritten[key] = (key, cause, how)

    def record_write(self, outcome: Any) -> Any:
        """Remember the failed keys of a store write's final
        :class:`~kvstage.offload.store_io.WriteOutcome`; returns ``outcome``."""
        error = outcome.error
        for key in outcome.failed_keys:
            if isinstance(error, PriorFailedError):  # refused for an earlier failure: name that one
                self._unwritten[key] = (error.failed_key, error.cause, error.how)
            else:
                self._unwritten[key] = (key, error, "store write")
        return outcome

    def refusal(self, prior_key: str | None) -> PriorFailedError | None:
        """The error refusing a run whose prior is ``prior_key``, when this manager will never
        store that page; else None."""
        failed = None if prior_key is None else self._unwritten.get(prior_key)
        return None if failed is None else PriorFailedError(prior_key, *failed)

    def add(self, run: ChainRun) -> None:
        """Append the next run of the chain (launched after every run added before it)."""
        self._unkeyed.append(run)

    def keys_of(self, run: ChainRun, hasher: Any) -> list[str]:
        """``run``'s page keys, keying the chain's earlier runs first (oldest first).

        Raises:
            Whatever ``hasher.continue_keys`` raises (e.g. a token id the scheme cannot hash);
            the run stays unkeyed then.
        """
        while run.keys is None:
            earliest = self._unkeyed[0]
            keys = hasher.continue_keys(earliest.tokens, self.last_key)
            self._unkeyed.popleft()
            earliest.prior_key = self.last_key if self.last_key_stored else None  # a seed is no page
            earliest.keys, earliest.tokens = keys, None
            self.last_key, self.last_key_stored = keys[-1], True
        return run.keys
