"""One request's page-key chain, keyed in launch order whatever order its copies finish in.

A request's pages form one hash chain from its namespace seed. Keys depend only on token ids,
so a copy that finishes before the one launched before it still gets the right keys: asking
for a run's keys first keys every earlier run of the chain, oldest first. The chain starts at
the namespace seed (not a stored page), at a key the prefill side stored, or at the last key of
a loaded prefix; :attr:`ChainRun.prior_key` is the stored page before a run, or None.
"""

from __future__ import annotations

from collections import deque
from typing import Any

__all__ = ["ChainRun", "RequestChain"]


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
    """

    __slots__ = ("last_key", "last_key_stored", "_unkeyed")

    def __init__(self, last_key: str | None, last_key_stored: bool) -> None:
        self.last_key = last_key
        self.last_key_stored = last_key_stored
        self._unkeyed: deque[ChainRun] = deque()

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
