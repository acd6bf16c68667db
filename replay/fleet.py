"""``kvstage replay --engines N``: N engine processes on one store, a router, an engine killed.

The calling process is the router and the verifier. It starts N engine processes
(:mod:`kvstage.replay.fleet_engine`, ``python -m`` subprocesses: each a full ``OffloadManager``
on its own device and host pools, with its own local tier in front of the shared store), and a
KV event subscriber per engine feeding the router's index. Requests leave in timestamp order
while fewer than ``N * (max_running + 1)`` are unfinished; each goes to the engine its policy
picks (:mod:`kvstage.replay.router`). Arrival times order requests but are not waited for.

``kill_at`` (``--kill-engine-at K``, a request count): right after the K-th request is routed,
the engine with the most unfinished requests is sent SIGKILL, mid-request and mid-write; its
unfinished requests go back to the head of the queue and are routed to the survivors; the
router drops what that engine held in memory from its index (its stored pages stay); a fresh
process takes its place and receives requests once it is ready.

At the end every whole page of every request is loaded back from the shared store in this
process through the single-engine verify (:func:`kvstage.replay.verify.verify_pages`): pages
another engine stored, and pages the killed engine was writing (absent and rewritten by a
survivor, or whole: a torn page would be deduplicated by the survivor's put and fail the byte
comparison here). With a bounded store (``file:DIR?capacity_bytes=...``) a missing page is
explained only by an eviction an engine logged (:mod:`kvstage.replay.fleet_engine`); with a
bounded Mooncake pool (a small ``segment``, ``admin=`` and ``watch=``) only by an eviction the
router's own store saw on the master (:mod:`kvstage.replay.fleet_mooncake`). Writes the store
refused for want of room are counted apart from failed ones.

``dynamo``: Dynamo's standalone KV indexer is started first (:mod:`kvstage.replay.dynamo_index`)
and the engines publish on ``tcp://127.0.0.1`` ports it is told of.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Sequence

import numpy as np

from kvstage.errors import InvalidArgumentError, KvstageError
from kvstage.events import KVEventSubscriber, block_hash
from kvstage.replay.fleet_engine import EngineSpec, read_eviction_log
from kvstage.replay.fleet_mooncake import PoolEvictions
from kvstage.replay.router import Router

READY_TIMEOUT_S = 300.0  # an engine process imports torch and builds its pools (slow on a busy CPU)
DEFAULT_LOCAL_PAGES = 4096


class FleetError(KvstageError):
    """An engine process failed (its traceback is in the message) or never became ready."""


@dataclass(frozen=True)
class FleetConfig:
    """The fleet's settings (the ``--engines``, ``--router``, ``--kill-engine-at`` options).

    Attributes:
        engines: engine processes (>= 1).
        policy: ``kv``, ``round-robin``, ``random`` or ``dynamo`` (:mod:`kvstage.replay.router`).
        kill_at: SIGKILL one engine right after this many requests were routed (>= 1), and
            restart it; None: no kill.
        local_pages: each engine's local tier, in pages (>= 0).

    The router process opens the replay's ``storage`` too (to verify); with Mooncake its client
    brings the URL's segment, and the engines bring none
    (:func:`kvstage.replay.fleet_engine.open_engine_store`).
    """

    engines: int = 2
    policy: str = "round-robin"
    kill_at: int | None = None
    local_pages: int = DEFAULT_LOCAL_PAGES


@dataclass
class _Engine:
    process: Any
    conn: Any
    ready: bool = False
    unfinished: set = field(default_factory=set)
    counters: dict = field(default_factory=dict)  # its current incarnation's last counters
    final: bool = False


def _check(fleet: FleetConfig, num_requests: int) -> None:
    if fleet.engines < 1:
        raise InvalidArgumentError(f"--engines: must be >= 1, got {fleet.engines}")
    if fleet.kill_at is not None and not 1 <= fleet.kill_at < num_requests:
        raise InvalidArgumentError(
            f"--kill-engine-at: must be a request count in [1, {num_requests - 1}] (requests routed before the kill), "
            f"got {fleet.kill_at}"
        )
    if fleet.kill_at is not None and fleet.engines < 2:
        raise InvalidArgumentError(
            "--kill-engine-at: needs --engines >= 2 (survivors take the killed engine's requests)"
        )
    if fleet.local_pages < 0:
        raise InvalidArgumentError(f"--local-pages: must be >= 0, got {fleet.local_pages}")


def _percentile_ms(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, q)) if len(values) else 0.0


class Fleet:
    """One fleet run; see the module docstring. Use :meth:`run`, then :attr:`report`.

    Args:
        config: the replay's :class:`~kvstage.replay.engine.ReplayConfig` (``storage``: the
            shared store).
        requests: the trace.
        fleet: the :class:`FleetConfig`.
        on_progress: ``on_progress(completed, total)`` about every 0.1 s.

    Raises:
        InvalidArgumentError: a fleet option out of range (names the option).
    """

    def __init__(
        self,
        config,
        requests: Sequence,
        fleet: FleetConfig,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        _check(fleet, len(requests))
        self.config, self.requests, self.fleet = config, list(requests), fleet
        self.on_progress = on_progress
        self.router = Router(fleet.policy, fleet.engines, seed=config.seed, load_slack=config.max_running)
        self.completions: list[tuple[float, int, int, int, int]] = []  # (t_s, order, engine, prompt, loaded tokens)
        self.kill: dict[str, Any] | None = None
        self.report: dict[str, Any] = {}
        self._retired: list[dict] = []  # counters of engine incarnations that ended (killed or finished)
        self._failure_keys: list[str] = []
        self._evicted_keys: set[str] = set()  # from the engines' eviction logs, at the end
        self._cut_puts = 0  # page puts the kill cut off (each may have evicted a page unlogged)
        self._done_before_kill: set[int] = set()

    # -- processes ----------------------------------------------------------------------------

    def _start(self, index: int, endpoint: str, replay_endpoint: str) -> _Engine:
        """Start engine ``index``: ``python -m kvstage.replay.fleet_engine FD``, its pipe a socket pair."""
        parent, child = socket.socketpair()
        spec = EngineSpec(
            index,
            self.config,
            self.requests,
            endpoint,
            replay_endpoint,
            self.fleet.local_pages,
            self._evicted_log(index),
        )
        process = subprocess.Popen(
            [sys.executable, "-m", "kvstage.replay.fleet_engine", str(child.fileno())], pass_fds=(child.fileno(),)
        )
        child.close()
        conn = Connection(parent.detach())
        conn.send(spec)
        return _Engine(process, conn)

    def _evicted_log(self, index: int) -> str:
        """Engine ``index``'s eviction log (each incarnation appends to it)."""
        return os.path.join(self._workdir, f"engine-{index}.evicted")

    def _receive(self, index: int, engine: _Engine, started: float) -> None:
        """Handle every message waiting on ``engine``'s pipe."""
        while True:
            try:
                if not engine.conn.poll():
                    return
                message = engine.conn.recv()
            except (EOFError, OSError):
                return
            kind = message[0]
            if kind == "ready":
                engine.ready = True
                if self._dynamo is not None:  # its publisher is bound: Dynamo's indexer connects once, now
                    self._dynamo.register(index, *self._endpoints[index])
            elif kind == "done":
                _, order, when, prompt, loaded, counters = message
                self._counters(engine, counters)
                if order in engine.unfinished:
                    engine.unfinished.discard(order)
                    self.router.index.finish(index, self._hashes[order])
                if order not in self._done:
                    self._done.add(order)
                    self.completions.append((when - started, order, index, prompt, loaded))
            elif kind == "final":
                self._counters(engine, message[1])
                engine.final = True
            elif kind == "error":
                raise FleetError(f"engine {index} failed:\n{message[1]}")

    def _counters(self, engine: _Engine, counters: dict) -> None:
        self._failure_keys.extend(counters.pop("storage_failure_keys"))
        engine.counters = counters

    # -- the run ------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Run the fleet, verify the shared store, and return the report (also :attr:`report`).

        Raises:
            FleetError: an engine process failed or did not start.
            BackendUnavailableError: ``dynamo`` without ``ai-dynamo-runtime`` (before anything
                is written), or its indexer did not start.
        """
        from kvstage.replay.engine import ReplayEngine

        wall = time.perf_counter()
        self._dynamo = None
        if self.fleet.policy == "dynamo":  # first: without the package nothing is written
            from kvstage.replay.dynamo_index import DynamoIndex, free_ports

            self._dynamo = DynamoIndex(self.config.page_size)
        checker = ReplayEngine(self.config, self.requests)  # the router's hasher, then the verifier
        self._pool = PoolEvictions.of(checker.storage)  # a watching Mooncake store: the master's evictions
        n = len(checker.trace)
        hashes: list[list[int] | None] = [None] * n
        self._hashes = hashes
        self._done: set[int] = set()
        workdir = self._workdir = tempfile.mkdtemp(prefix="kvstage-fleet-")
        if self._dynamo is not None:  # Dynamo's indexer subscribes over TCP (it binds 0.0.0.0)
            ports = iter(free_ports(2 * self.fleet.engines))  # distinct: each engine's publisher and replay
            endpoints = [
                (f"tcp://127.0.0.1:{next(ports)}", f"tcp://127.0.0.1:{next(ports)}") for _ in range(self.fleet.engines)
            ]
        else:
            endpoints = [
                (f"ipc://{workdir}/engine-{i}.ipc", f"ipc://{workdir}/engine-{i}-replay.ipc")
                for i in range(self.fleet.engines)
            ]
        self._endpoints = endpoints
        subscribers = [KVEventSubscriber(e, replay_endpoint=r) for e, r in endpoints]
        engines = [self._start(i, e, r) for i, (e, r) in enumerate(endpoints)]
        try:
            self._await_ready(engines, time.perf_counter())
            started = time.time()
            self.ready_s = time.perf_counter() - wall
            queue: deque[int] = deque()
            next_order, routed = 0, 0
            window = self.fleet.engines * (self.config.max_running + 1)
            last_progress = 0.0
            while len(self._done) < n:
                for i, subscriber in enumerate(subscribers):
                    for seq, batch in subscriber.poll(0):
                        self.router.index.apply(i, seq, batch)
                live = [i for i, e in enumerate(engines) if e.ready]
                unfinished = [len(e.unfinished) for e in engines]
                while live and (queue or next_order < n) and sum(unfinished) < window:
                    if queue:
                        order = queue.popleft()
                    else:
                        order, next_order = next_order, next_order + 1
                    if hashes[order] is None:
                        hashes[order] = [block_hash(k) for k in checker.expect(order)]
                    held = (
                        None if self._dynamo is None else self._dynamo.local_blocks(self._prompt_pages(checker, order))
                    )
                    index = self.router.pick(hashes[order], live, unfinished, held)
                    engines[index].conn.send(("assign", [order]))
                    self.router.index.route(index, hashes[order])
                    engines[index].unfinished.add(order)
                    unfinished[index] += 1
                    routed += 1
                    if self.fleet.kill_at is not None and self.kill is None and routed >= self.fleet.kill_at:
                        victim = self._kill(engines, endpoints, queue, started)
                        live.remove(victim)
                        unfinished[victim] = 0
                wait([e.conn for e in engines], timeout=0.005)
                for i, engine in enumerate(engines):
                    self._receive(i, engine, started)
                    if engine.process.poll() is not None:
                        self._receive(i, engine, started)
                        raise FleetError(f"engine {i} exited (code {engine.process.returncode}) mid-run")
                if time.perf_counter() - last_progress > 0.1:
                    last_progress = time.perf_counter()
                    if self._pool is not None:
                        self._pool.poll()
                    if self.on_progress is not None:
                        self.on_progress(len(self._done), n)
            run_s = time.time() - started
            for engine in engines:
                engine.conn.send(("stop",))
            deadline = time.perf_counter() + READY_TIMEOUT_S
            while not all(e.final for e in engines) and time.perf_counter() < deadline:
                for i, engine in enumerate(engines):
                    self._receive(i, engine, started)
                for i, subscriber in enumerate(subscribers):
                    for seq, batch in subscriber.poll(0.005):
                        self.router.index.apply(i, seq, batch)
            for engine in engines:
                engine.process.wait(timeout=60)
            for i, subscriber in enumerate(subscribers):
                for seq, batch in subscriber.poll(0.05):
                    self.router.index.apply(i, seq, batch)
            drain_s = time.time() - started - run_s
            self._retired.extend(e.counters for e in engines)
            logs = [read_eviction_log(self._evicted_log(i)) for i in range(self.fleet.engines)]
            self._evicted_keys = set().union(*(keys for keys, _ in logs))
            self._cut_puts = sum(cut for _, cut in logs)
            if self._pool is not None:  # every write has ended: the watcher's last listings, the master's count
                self._pool.settle()
                self._evicted_keys |= self._pool.keys
            self.report = self._verify_and_report(checker, run_s, drain_s, time.perf_counter() - wall)
        finally:
            for engine in engines:
                if engine.process.poll() is None:
                    engine.process.kill()
                    engine.process.wait()
            for subscriber in subscribers:
                subscriber.close()
            if self._dynamo is not None:
                self._dynamo.close()
            checker.close()
            for name in os.listdir(workdir):
                os.unlink(os.path.join(workdir, name))
            os.rmdir(workdir)
        if self.on_progress is not None:
            self.on_progress(len(self._done), n)
        return self.report

    def _prompt_pages(self, checker, order: int) -> list[int]:
        """The token ids of request ``order``'s whole pages (what Dynamo's indexer hashes)."""
        from kvstage.replay.replay_request import ReplayRequest

        trace = checker.trace[order]
        extra, salt = checker.namespaces[order]
        tokens = ReplayRequest(trace, checker.tokens.prompt(trace), checker.tokens.output(trace), extra, salt)
        return list(tokens.kv_tokens[: len(self._hashes[order]) * checker.page_size])

    def _await_ready(self, engines: list[_Engine], since: float) -> None:
        while not all(e.ready for e in engines):
            if time.perf_counter() - since > READY_TIMEOUT_S:
                raise FleetError(f"engines not ready after {READY_TIMEOUT_S:.0f} s")
            for i, engine in enumerate(engines):
                self._receive(i, engine, time.time())
                if not engine.ready and engine.process.poll() is not None:
                    self._receive(i, engine, time.time())
                    raise FleetError(f"engine {i} exited (code {engine.process.returncode}) before it was ready")
            time.sleep(0.01)

    def _kill(self, engines: list[_Engine], endpoints: list[tuple[str, str]], queue: deque, started: float) -> int:
        """SIGKILL the engine with the most unfinished requests, requeue them, start its successor."""
        for i, running in enumerate(engines):
            self._receive(i, running, started)  # count what has finished, so the victim is really busy
        victim = max(range(len(engines)), key=lambda i: (len(engines[i].unfinished), -i))
        engine = engines[victim]
        when = time.time() - started
        os.kill(engine.process.pid, signal.SIGKILL)
        engine.process.wait()
        self._receive(victim, engine, started)  # what it sent before it died still counts
        orphans = sorted(engine.unfinished)
        self._done_before_kill = set(self._done)  # their pages were stored before the kill
        queue.extendleft(reversed(orphans))
        self._retired.append(engine.counters)
        self.router.index.forget_local(victim)
        if self._dynamo is not None:  # Dynamo drops what the dead engine held; its successor, once ready, is registered
            self._dynamo.unregister(victim)
        engine.conn.close()
        engines[victim] = self._start(victim, *endpoints[victim])
        self.kill = {
            "engine": victim,
            "time_s": when,
            "after_requests": self.fleet.kill_at,
            "rerouted": len(orphans),
            "rerouted_orders": orphans,
        }
        return victim

    # -- verification and figures ---------------------------------------------------------------

    def _verify_and_report(self, checker, run_s: float, drain_s: float, wall_s: float) -> dict[str, Any]:
        from kvstage.replay.verify import verify_pages

        counters: dict[str, int] = {}
        for incarnation in self._retired:
            for name, value in incarnation.items():
                counters[name] = counters.get(name, 0) + value
        # The engines' failures and drops explain missing pages, as a single engine's do.
        checker.stats.storage_failure_keys = list(self._failure_keys)
        checker.run_metrics = dataclasses.replace(
            checker.manager.metrics, pages_dropped=counters.get("pages_dropped", 0)
        )
        result = verify_pages(checker, seed=self.config.seed)
        # Pages of the requests the killed engine had not finished may be absent (never whole
        # ones torn: those fail the comparison). A store can leave such a page unwritable for a
        # while (Mooncake: a put started by a dead client blocks the key until the master
        # discards it), so the survivor that re-ran the request could not store it again.
        orphans = self.kill["rerouted_orders"] if self.kill else []
        durable = {key for order in self._done_before_kill for key in checker.request_keys[order]}
        killed_writes = {key for order in orphans for key in checker.request_keys[order]} - durable
        # A bounded store (``capacity_bytes``) evicts: a missing page some engine reported evicted
        # is explained, and so are the pages behind it in its chain (unreachable).
        evicted, failed = self._evicted_keys, set(self._failure_keys)
        pool = self._pool
        unattributed = 0 if pool is None else pool.unattributed
        missing_evicted = sum(key in evicted for key in result.missing_keys)
        absent_killed = sum(key in killed_writes and key not in evicted for key in result.missing_keys)
        explained = evicted | killed_writes | failed
        unexplained = sum(key not in explained for key in result.missing_keys)
        done = sorted(self.completions)
        prompt = sum(c[3] for c in done)
        saved = sum(c[4] for c in done)
        # A re-routed request reloads the pages the killed engine stored for it: savings of the
        # kill, not of the policy, so the policies compare on the other requests.
        rerouted = set(self.kill["rerouted_orders"]) if self.kill else set()
        kept = [c for c in done if c[1] not in rerouted]
        kept_prompt, kept_saved = sum(c[3] for c in kept), sum(c[4] for c in kept)
        local_reads, store_reads = counters.get("local_reads", 0), counters.get("store_reads", 0)
        lags = self.router.index.lags_s
        return {
            "policy": self.fleet.policy,
            "engines": self.fleet.engines,
            "storage": self.config.storage,
            "requests": len(self.requests),
            "requests_completed": len(done),
            "prompt_tokens": prompt,
            "prefill_tokens_saved": saved,
            "fleet_hit_rate": saved / prompt if prompt else 0.0,
            "hit_rate_not_rerouted": kept_saved / kept_prompt if kept_prompt else 0.0,
            "rerouted_tokens_saved": saved - kept_saved,
            "local_pages_read": local_reads,
            "store_pages_read": store_reads,
            "local_read_share": local_reads / (local_reads + store_reads) if local_reads + store_reads else 0.0,
            "pages_stored": result.pages_matched,
            "engine_pages_stored": counters.get("pages_stored", 0),
            "pages_deduplicated": counters.get("pages_deduplicated", 0),
            # Writes a bounded store refused for want of room (its eviction's consequence, the
            # pages explained at verification) apart from real failures.
            "pages_failed": max(0, counters.get("pages_failed", 0) - counters.get("pages_refused", 0)),
            "pages_refused": counters.get("pages_refused", 0),
            "load_mismatches": counters.get("load_mismatches", 0),
            "verify_pages_checked": result.pages_checked,
            "mismatched": result.mismatches + counters.get("load_mismatches", 0),
            # A page put the kill cut off may have evicted one page without logging it: at most
            # that many missing pages are put down to it (counted apart), never more.
            # Keys a Mooncake watcher saw vanish beyond the master's eviction count were not evicted.
            "lost": max(0, unexplained - counters.get("pages_dropped", 0) - self._cut_puts) + unattributed,
            "missing_cut_evictions": min(max(0, unexplained - counters.get("pages_dropped", 0)), self._cut_puts),
            "puts_cut_by_kill": self._cut_puts,
            "absent_killed_writes": absent_killed,
            "missing": len(result.missing_keys),
            "missing_evicted": missing_evicted,
            "store_pages_evicted": len(evicted),
            "master_evicted_keys": None if pool is None else pool.master_evicted,
            "evictions_unattributed": unattributed,
            "evictions_unseen": 0 if pool is None else pool.unseen,
            "evictions_vanished": None if pool is None else pool.vanished,
            "pool_keys_at_end": None if pool is None else pool.keys_at_end,
            "unreachable": result.unreachable,
            "router_lag_p50_ms": _percentile_ms(lags, 50),
            "router_lag_p99_ms": _percentile_ms(lags, 99),
            "event_batches": len(lags),
            "event_gaps": sum(self.router.index.gaps),
            "dynamo_queries": self._dynamo.queries if self._dynamo else 0,
            "dynamo_prefix_answers": self._dynamo.prefix_answers if self._dynamo else 0,
            "dynamo_query_ms": 1e3 * self._dynamo.query_s / self._dynamo.queries
            if self._dynamo and self._dynamo.queries
            else 0.0,
            "index_stored_pages": len(self.router.index.stored),
            "index_local_pages": sum(len(held) for held in self.router.index.local),
            "kill": self.kill,
            "run_s": run_s,
            "drain_s": drain_s,
            "verify_s": result.seconds,
            "ready_s": self.ready_s,
            "wall_s": wall_s,
            # Per request, in completion order: [seconds, order, engine, prompt tokens, tokens loaded].
            "timeline": [[round(c[0], 4), c[1], c[2], c[3], c[4]] for c in done],
        }
