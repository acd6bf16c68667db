"""The fleet router's policies: which engine gets a request.

- ``round-robin``: engines in turn (a dead one skipped);
- ``random``: uniformly among live engines (seeded);
- ``kv``: the live engine with the longest prefix of the request's pages in its own memory
  (medium GPU/CPU, :class:`kvstage.replay.prefix_index.PrefixIndex`); ties, and requests no
  engine holds any of, go to the engine with the fewest unfinished requests. An engine with
  ``load_cap`` or more unfinished requests is passed over while another is below it (a prefix
  is not worth a queue). Pages in the shared store count for no engine: every engine reads
  them alike.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvstage.errors import InvalidArgumentError
from kvstage.replay.prefix_index import PrefixIndex

POLICIES = ("kv", "round-robin", "random")


class Router:
    """Picks an engine for each request.

    Args:
        policy: one of :data:`POLICIES`.
        num_engines: engines 0 .. N-1.
        seed: seeds ``random``.
        load_cap: ``kv``: unfinished requests beyond which an engine is passed over (>= 1).

    Attributes:
        index: the :class:`PrefixIndex` (fed by the fleet's subscribers; used by ``kv``).

    Raises:
        InvalidArgumentError: an unknown policy (names ``--router``) or ``load_cap`` < 1.
    """

    def __init__(self, policy: str, num_engines: int, *, seed: int = 0, load_cap: int = 64) -> None:
        if policy not in POLICIES:
            raise InvalidArgumentError(f"--router: unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        if load_cap < 1:
            raise InvalidArgumentError(f"load_cap: must be >= 1, got {load_cap}")
        self.policy = policy
        self.index = PrefixIndex(num_engines)
        self.load_cap = load_cap
        self._rng = np.random.default_rng([seed, 0x2047])
        self._next = 0

    def pick(self, hashes: Sequence[int], live: Sequence[int], unfinished: Sequence[int]) -> int:
        """The engine for a request whose page chain is ``hashes``.

        Args:
            hashes: the request's block hashes, in chain order.
            live: engines that take requests now (non-empty).
            unfinished: unfinished requests per engine (indexed by engine).
        """
        if self.policy == "round-robin":
            n = len(unfinished)
            for step in range(n):
                engine = (self._next + step) % n
                if engine in live:
                    self._next = engine + 1
                    return engine
        if self.policy == "random":
            return int(live[int(self._rng.integers(len(live)))])
        under = [e for e in live if unfinished[e] < self.load_cap] or list(live)
        return max(under, key=lambda e: (self.index.local_match(e, hashes), -unfinished[e], -e))
