"""The kv router's index: which pages each engine announced, from its KV events.

Keyed by block hash (:func:`kvstage.events.block_hash` of a page key), which is a
chain hash: a hash fixes every page before it, so "the longest prefix an engine holds" is the
count of a request's leading block hashes found in that engine's set. Two kinds of holdings:

- *local* (medium ``GPU`` or ``CPU``): pages in an engine's own memory; only that engine reads
  them without the store. Dropped whole when the engine restarts (its publisher's sequence
  starts again at 0, or the router saw it die): a dead engine's memory is gone.
- *routed* (no event: the router's own record): the pages of requests routed to an engine and
  not finished yet, which that engine is computing and will hold (as Dynamo's router counts the
  blocks of the requests it routed before any event says so).
- *stored* (medium ``STORAGE``): pages in the shared store, readable by every engine, so one
  fleet-wide set: added by whichever engine wrote, removed by whichever engine announces the
  removal. An engine's restart leaves them.

Events are :mod:`kvstage.events` records (or vLLM's tagged maps, dicts with the same field
names); batches :class:`kvstage.events.KVEventBatch` (or ``(ts, events, rank)`` tuples).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

LOCAL_MEDIA = ("GPU", "CPU")


def _field(record: Any, name: str, default: Any = None) -> Any:
    if isinstance(record, dict):
        return record.get(name, default)
    return getattr(record, name, default)


def _event_type(event: Any) -> str:
    kind = _field(event, "type")
    return kind if kind is not None else type(event).__name__


class PrefixIndex:
    """Per engine, the block hashes announced in its local tiers; fleet-wide, those stored.

    Args:
        num_engines: engines 0 .. N-1.

    Attributes:
        lags_s: for each batch applied, seconds from its publish time (``ts``) to the index
            update (``time.time()``; one machine's clock).
        gaps: sequence numbers skipped (batches lost), per engine.
        resets: restarts seen (a sequence that went back), per engine.
    """

    def __init__(self, num_engines: int) -> None:
        self.local: list[set[int]] = [set() for _ in range(num_engines)]
        self.routed: list[dict[int, int]] = [{} for _ in range(num_engines)]  # hash -> requests routed with it
        self.stored: set[int] = set()
        self.lags_s: list[float] = []
        self.gaps = [0] * num_engines
        self.resets = [0] * num_engines
        self._last_seq: list[int | None] = [None] * num_engines

    def forget_local(self, engine: int) -> None:
        """Drop what ``engine`` held in its own memory or was computing (it died or restarted)."""
        self.local[engine].clear()
        self.routed[engine].clear()
        self._last_seq[engine] = None

    def route(self, engine: int, hashes: Sequence[int]) -> None:
        """A request with these page hashes was routed to ``engine``."""
        routed = self.routed[engine]
        for h in hashes:
            routed[h] = routed.get(h, 0) + 1

    def finish(self, engine: int, hashes: Sequence[int]) -> None:
        """A request routed to ``engine`` finished (its pages are announced by events now)."""
        routed = self.routed[engine]
        for h in hashes:
            left = routed.get(h, 0) - 1
            if left > 0:
                routed[h] = left
            else:
                routed.pop(h, None)

    def apply(self, engine: int, seq: int, batch: Any) -> None:
        """Apply one batch of ``engine``'s events (as a subscriber's ``poll`` returns it)."""
        last = self._last_seq[engine]
        if last is not None and seq <= last:
            self.resets[engine] += 1
            self.local[engine].clear()
        elif last is not None and seq > last + 1:
            self.gaps[engine] += seq - last - 1
        self._last_seq[engine] = seq
        ts, events = (batch[0], batch[1]) if isinstance(batch, (tuple, list)) else (batch.ts, batch.events)
        local = self.local[engine]
        for event in events:
            kind = _event_type(event)
            if kind == "AllBlocksCleared":
                local.clear()
                continue
            hashes = _field(event, "block_hashes", ())
            held = self.stored if _field(event, "medium", "GPU") not in LOCAL_MEDIA else local
            if kind == "BlockStored":
                held.update(hashes)
            elif kind == "BlockRemoved":
                held.difference_update(hashes)
        self.lags_s.append(time.time() - ts)

    def local_match(self, engine: int, hashes: Sequence[int]) -> int:
        """Leading ``hashes`` (a request's page chain) held in ``engine``'s own memory, or
        being computed there by a request routed to it."""
        held, routed = self.local[engine], self.routed[engine]
        n = 0
        for h in hashes:
            if h not in held and h not in routed:
                break
            n += 1
        return n

    def routed_match(self, engine: int, hashes: Sequence[int]) -> int:
        """Leading ``hashes`` of the requests routed to ``engine`` and not finished."""
        routed = self.routed[engine]
        n = 0
        for h in hashes:
            if h not in routed:
                break
            n += 1
        return n

    def stored_match(self, hashes: Sequence[int]) -> int:
        """Leading ``hashes`` the shared store holds (any engine may load them)."""
        n = 0
        for h in hashes:
            if h not in self.stored:
                break
            n += 1
        return n
