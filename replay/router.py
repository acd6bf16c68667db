"""The fleet router's policies: which engine gets a request.

- ``round-robin``: engines in turn (a dead one skipped);
- ``random``: uniformly among live engines (seeded);
- ``kv``: the live engine with the longest prefix of the request's pages in its own memory
  (medium GPU/CPU) or being computed there by a request routed to it
  (:class:`kvstage.replay.prefix_index.PrefixIndex`); ties, and requests no engine holds any
  of, go to the engine with the fewest unfinished requests. An engine with ``load_slack`` or
  more unfinished requests than the least loaded one is passed over (a prefix is worth a
  short queue, not a long one). Pages in the shared store count for no engine: every engine
  reads them alike.
- ``dynamo``: as ``kv``, with Dynamo's standalone KV indexer as the index of what engines hold
  (:class:`kvstage.replay.dynamo_index.DynamoIndex`: the fleet passes its per-engine answer as
  ``held``); an engine's score is the longer of Dynamo's prefix and the prefix of the requests
  routed to it and not finished (the router's own record: Dynamo's indexer has only events).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvstage.errors import InvalidArgumentError
from kvstage.replay.prefix_index import PrefixIndex

POLICIES = ("kv", "round-robin", "random", "dynamo")


class Router:
    """Picks an engine for each request.

    Args:
        policy: one of :data:`POLICIES`.
        num_engines: engines 0 .. N-1.
        seed: seeds ``random``.
        load_slack: ``kv``: unfinished requests above the least loaded engine's at which an
            engine is passed over (>= 1).

    Attributes:
        index: the :class:`PrefixIndex` (fed by the fleet's subscribers; used by ``kv``).

    Raises:
        InvalidArgumentError: an unknown policy (names ``--router``) or ``load_slack`` < 1.
    """

    def __init__(self, policy: str, num_engines: int, *, seed: int = 0, load_slack: int = 8) -> None:
        if policy not in POLICIES:
            raise InvalidArgumentError(f"--router: unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        if load_slack < 1:
            raise InvalidArgumentError(f"load_slack: must be >= 1, got {load_slack}")
        self.policy = policy
        self.index = PrefixIndex(num_engines)
        self.load_slack = load_slack
        self._rng = np.random.default_rng([seed, 0x2047])
        self._next = 0

    def pick(
        self,
        hashes: Sequence[int],
        live: Sequence[int],
        unfinished: Sequence[int],
        held: dict[int, int] | None = None,
    ) -> int:
        """The engine for a request whose page chain is ``hashes``.

        Args:
            hashes: the request's block hashes, in chain order.
            live: engines that take requests now (non-empty).
            unfinished: unfinished requests per engine (indexed by engine).
            held: ``dynamo``: leading pages each engine holds in its own memory, per Dynamo's
                indexer (an engine left out holds none).
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
        least = min(unfinished[e] for e in live)
        near = [e for e in live if unfinished[e] < least + self.load_slack]
        if self.policy == "dynamo":
            held = held or {}
            score = {e: max(held.get(e, 0), self.index.routed_match(e, hashes)) for e in near}
        else:
            score = {e: self.index.local_match(e, hashes) for e in near}
        return max(near, key=lambda e: (score[e], -unfinished[e], -e))
