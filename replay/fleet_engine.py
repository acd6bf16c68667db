"""One engine process of a replay fleet (``kvstage replay --engines N``).

The process builds a :class:`~kvstage.replay.engine.ReplayEngine` over the whole trace (so that
every engine makes the same tokens, namespaces and page keys for a request) with a
:class:`~kvstage.replay.local_tier.LocalTier` in front of the shared store, and runs its loop on
the requests the router assigns (a :class:`~kvstage.replay.replay_request.RequestFeed` over a pipe).

Pipe messages, router to engine: ``("assign", [orders])``, ``("stop",)`` (no more requests:
finish, store, report, exit). Engine to router: ``("ready",)``; ``("done", order, time_s,
prompt_tokens, loaded_tokens, counters)`` per request finished with every store write ended, with
the engine's cumulative counters (so a killed engine's figures survive it); ``("final",
counters)``; ``("error", text)``. ``counters`` includes ``storage_failure_keys``: the keys
whose store write failed since the previous message.

A bounded shared store (``file:DIR?capacity_bytes=...``) evicts: the keys it evicted for this
engine go to ``evicted_log`` (:class:`EvictionLog`: appended right after the page whose put
evicted them, and each page's put marked begun and ended, so that the router knows how many
puts a SIGKILL cut off, each of which may have evicted a page it did not log).

KV events (vLLM's wire format, :class:`kvstage.events.KVEventPublisher` with a replay socket,
topic ``engine-<index>``): medium ``STORAGE`` from the manager itself
(``OffloadManager(kv_events=...)``: what its writes stored, and the shared store's evictions and
removals it saw), and medium ``CPU`` from here as pages enter and leave the engine's local tier;
each ``BlockStored`` carries the page's token ids and parent hash, the request's ``extra_key``
as ``lora_name`` and ``(extra_key, cache_salt)`` in ``extra_keys``, as the manager's do.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from collections import Counter, OrderedDict
from typing import Any

from kvstage.events import BlockRemoved, BlockStored, KVEventPublisher, block_hash

NO_AVAILABLE_HANDLE = -200  # Mooncake's ErrorCode for a put the pool has no room for
MEDIUM_CPU = "CPU"  # vLLM's name of a host-memory tier
START = "#start"  # an eviction log's line where an engine process began appending


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What an engine process needs (pickled to it).

    Attributes:
        index: the engine's number (its events' topic is ``engine-<index>``).
        config: the :class:`~kvstage.replay.engine.ReplayConfig` (its ``storage`` the engine's URL).
        requests: the whole trace.
        endpoint: where its KV event publisher binds; ``replay_endpoint``: its replay socket.
        local_pages: its local tier's capacity in pages.
        evicted_log: the file the keys the shared store evicted for it are appended to.
    """

    index: int
    config: Any
    requests: list
    endpoint: str
    replay_endpoint: str
    local_pages: int
    evicted_log: str


class EvictionLog:
    """An engine's log of the shared store's evictions (for :class:`LocalTier`'s ``on_evicted``
    and ``on_put``): :data:`START` on a line of its own when a process opens it (each incarnation
    of an engine appends to one file), a line per evicted key, ``+KEY`` before a page's put,
    ``-KEY`` after its evictions were logged. Each line is one ``write`` with ``O_APPEND``: it is in the file at
    once, so it survives a SIGKILL of this process right after."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(self._fd, f"\n{START}\n".encode())  # ends a line a killed predecessor left cut short

    def evicted(self, keys: list[str]) -> None:
        """Log ``keys`` (page keys) as evicted by the store."""
        os.write(self._fd, "".join(f"{key}\n" for key in keys).encode())

    def put(self, key: str, done: bool) -> None:
        """Log the put of ``key`` begun (``done`` False) or ended."""
        os.write(self._fd, f"{'-' if done else '+'}{key}\n".encode())


def read_eviction_log(path: str) -> tuple[set[str], int]:
    """What :class:`EvictionLog` wrote to ``path``: the evicted keys, and the page puts begun and
    never ended (a killed engine's: each may have evicted a page whose key it did not log). A
    line cut short by a kill is left out."""
    try:
        with open(path, encoding="ascii") as handle:
            lines = handle.read().split("\n")[:-1]  # the last element is "" or a line cut short
    except FileNotFoundError:
        return set(), 0
    complete: list[str] = []
    for line in lines:
        if line == START:
            if complete and complete[-1]:
                complete.pop()  # the predecessor's line the kill cut short (ended by START's newline)
            continue
        complete.append(line)
    open_puts: Counter[str] = Counter()
    evicted: set[str] = set()
    for line in complete:
        if line.startswith("+"):
            open_puts[line[1:]] += 1
        elif line.startswith("-"):
            open_puts[line[1:]] -= 1
        elif line:
            evicted.add(line)
    return evicted, sum(count for count in open_puts.values() if count > 0)


class _Announcer:
    """Turns the local tier's changes into KV events with token ids (medium ``CPU``)."""

    def __init__(self, engine, tier, publisher: KVEventPublisher) -> None:
        self.engine, self.tier, self.publisher = engine, tier, publisher
        self.where: dict[str, tuple[int, int]] = {}  # page key -> (order, position in its chain)
        self._tokens: OrderedDict[int, Any] = OrderedDict()  # order -> its tokens with KV (a few kept)

    def learn(self, orders: list[int]) -> None:
        for order in orders:
            for position, key in enumerate(self.engine.request_keys[order]):
                self.where.setdefault(key, (order, position))

    def _page_tokens(self, order: int, position: int) -> list[int]:
        from kvstage.replay.replay_request import ReplayRequest

        tokens = self._tokens.get(order)
        if tokens is None:
            engine = self.engine
            trace = engine.trace[order]
            extra, salt = engine.namespaces[order]
            tokens = ReplayRequest(trace, engine.tokens.prompt(trace), engine.tokens.output(trace), extra, salt)
            tokens = self._tokens[order] = tokens.kv_tokens
            while len(self._tokens) > 16:
                self._tokens.popitem(last=False)
        ps = self.engine.page_size
        return list(tokens[position * ps : (position + 1) * ps])

    def _stored(self, key: str) -> BlockStored | None:
        found = self.where.get(key)
        if found is None:
            return None
        order, position = found
        chain = self.engine.request_keys[order]
        extra, salt = self.engine.namespaces[order]
        namespace = tuple(value for value in (extra, salt) if value is not None)
        return BlockStored(
            [block_hash(key)],
            block_hash(chain[position - 1]) if position else None,
            self._page_tokens(order, position),
            self.engine.page_size,
            extra,
            MEDIUM_CPU,
            [namespace] if namespace else None,
        )

    def publish(self) -> None:
        events: list = []
        for kind, key in self.tier.take_changes():
            event = self._stored(key) if kind == "stored" else BlockRemoved([block_hash(key)], MEDIUM_CPU)
            if event is not None:
                events.append(event)
        if events:
            self.publisher.publish(events)


class _PipeFeed:
    """The engine loop's :class:`~kvstage.replay.replay_request.RequestFeed` over the router's pipe."""

    def __init__(self, conn, engine, tier, announcer: _Announcer) -> None:
        self.conn, self.engine, self.tier, self.announcer = conn, engine, tier, announcer
        self.exhausted = False
        self._failures_sent = 0

    def take(self, wait: bool) -> list[int]:
        self.announcer.publish()
        orders: list[int] = []
        timeout = 0.01 if wait else 0.0
        while self.conn.poll(timeout):
            message = self.conn.recv()
            if message[0] == "assign":
                orders.extend(message[1])
            elif message[0] == "stop":
                self.exhausted = True
            timeout = 0.0
        return orders

    def counters(self) -> dict[str, Any]:
        engine = self.engine
        metrics = engine.manager.metrics
        failures = engine.stats.storage_failure_keys
        new_failures, self._failures_sent = failures[self._failures_sent :], len(failures)
        return {
            "pages_looked_up": metrics.pages_looked_up,
            "pages_hit": metrics.pages_hit,
            "pages_stored": metrics.pages_stored,
            "pages_deduplicated": metrics.pages_deduplicated,
            "pages_failed": metrics.pages_failed,
            "pages_refused": engine.pages_refused,
            "pages_dropped": metrics.pages_dropped,
            "load_mismatches": engine.stats.load_mismatches,
            "local_reads": self.tier.tier_stats.local_reads,
            "store_reads": self.tier.tier_stats.store_reads,
            "storage_failure_keys": list(new_failures),
        }

    def admitted(self, req) -> None:
        # Its prompt pages are stored (and announced) before it finishes.
        self.announcer.learn([req.order])

    def stored(self, req) -> None:
        loaded = req.loaded_pages * self.engine.page_size
        self.conn.send(("done", req.order, time.time(), len(req.origin_input_ids), loaded, self.counters()))


def refused_for_room(error: BaseException | None) -> bool:
    """Whether a failed store write was refused for want of room: no error given (the store
    found no page it could evict), a ``MissingPriorError`` (the page before it was evicted, or
    refused itself), or a ``PriorFailedError`` whose cause is one of those. An ``OSError`` or
    any other error is a real failure. Mooncake's ``NO_AVAILABLE_HANDLE`` (no room in the pool's
    segments: the master had not evicted yet) is refused for room too."""
    from kvstage.offload.key_chain import PriorFailedError
    from kvstage.storage import MissingPriorError
    from kvstage.storage.mooncake.status import MooncakeCodeError

    if isinstance(error, PriorFailedError):
        return refused_for_room(error.cause)
    if isinstance(error, MooncakeCodeError):
        return error.code == NO_AVAILABLE_HANDLE
    return error is None or isinstance(error, MissingPriorError)


def open_engine_store(url: str, fingerprint):
    """The shared store as an engine opens it: ``url`` itself, except that a Mooncake engine
    brings no memory to the pool (``global_segment_size`` 0, which Mooncake accepts: its pages
    then live in the other clients' segments, the router process's here). In Mooncake's
    embedded mode each object lives in one client's segment, so a killed engine that brought
    memory would take the pages placed there with it, other engines' pages included, and
    until the master drops its segment every put placed there fails (seen: TRANSFER_FAIL).
    Engines run no key-space watcher (``watch``): the router's store watches for the fleet.
    """
    from kvstage.storage import MooncakeStore, open_storage
    from kvstage.storage.mooncake.config import parse_mooncake_url

    if not url.startswith("mooncake://"):
        return open_storage(url, fingerprint)
    return MooncakeStore(fingerprint, dataclasses.replace(parse_mooncake_url(url), global_segment_size=0, watch_s=None))


def engine_main(spec: EngineSpec, conn) -> None:
    """The engine process: build, say ready, run the router's requests, report, exit."""
    try:
        import torch

        from kvstage.replay.engine import ReplayEngine
        from kvstage.replay.local_tier import LocalTier

        class FleetReplayEngine(ReplayEngine):
            """Counts the failed writes a bounded store refused (:func:`refused_for_room`)."""

            pages_refused = 0

            def _storage_failed(self, req: Any, keys: list[str], error: BaseException | None) -> None:
                super()._storage_failed(req, keys, error)
                if refused_for_room(error):
                    self.pages_refused += len(keys)

        torch.set_num_threads(1)
        publisher = KVEventPublisher(spec.endpoint, replay_endpoint=spec.replay_endpoint, topic=f"engine-{spec.index}")
        # A file store's evictions are events (Mooncake's master evicts without telling).
        log = EvictionLog(spec.evicted_log) if spec.config.storage.startswith("file:") else None
        engine = FleetReplayEngine(
            spec.config,
            spec.requests,
            open_store=lambda url, fp: LocalTier(
                open_engine_store(url, fp),
                spec.local_pages,
                on_evicted=log.evicted if log else None,
                on_put=log.put if log else None,
            ),
            kv_events=publisher,  # the manager announces what it stores (medium STORAGE)
        )
        tier = engine.storage
        announcer = _Announcer(engine, tier, publisher)
        feed = _PipeFeed(conn, engine, tier, announcer)
        conn.send(("ready",))
        engine.run(feed)
        announcer.publish()
        counters = feed.counters()
        engine.close()  # the manager's announcer publishes what is left
        publisher.close()
        conn.send(("final", counters))
    except BaseException:  # reported to the router, which fails the run naming the engine
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass


def main(argv: list[str] | None = None) -> None:
    """``python -m kvstage.replay.fleet_engine FD``: FD is the router's pipe; the spec comes first on it."""
    import sys
    from multiprocessing.connection import Connection

    conn = Connection(int((argv or sys.argv[1:])[0]))
    engine_main(conn.recv(), conn)


if __name__ == "__main__":
    main()
