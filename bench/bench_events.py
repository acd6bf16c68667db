"""Benchmark: what router-facing KV events cost a store write, and how many one publisher sends.

* ``cost per page``: the writer thread's time per stored page of
  :func:`~kvstage.offload.store_io.write_pages` into a :class:`~kvstage.storage.MemoryStore`
  followed by :meth:`KVEventAnnouncer.written <kvstage.events.KVEventAnnouncer.written>` (what
  a manager with ``kv_events=`` runs after each write: the store's events taken and the write
  queued for a :class:`~kvstage.events.KVEventPublisher`, whose thread builds the
  self-describing ``BlockStored``, encodes and sends it), minus the same writes without an announcer, in the same
  round. Writes of 1 page (a decode stride) and 16 pages (a prompt), page size 16, chains of 8
  writes; a subscriber in another process receives everything. The figure (``publishing``): the
  publisher's own CPU per page, measured where it is spent: the writing thread's CPU inside
  ``written`` (``time.thread_time``, less the clock's own cost per reading) plus the sending
  thread's CPU until every event is sent (its ``pthread_getcpuclockid`` clock: building,
  joining, encoding, sending), the median over rounds.
  Beside it, paired per round against the put alone (medians of the per-round differences):
  the writing thread's CPU plus the sender's, this process's CPU (``time.process_time``), and
  the writing loop's wall time.
* ``events per second``: ``BlockStored`` events (of 1 or 16 pages) one publisher sends as fast
  as ``publish`` is called, until every one is sent, with a subscriber in another process:
  one message per call (``max_batch=1``, as vLLM sends one batch per step) and the default
  (calls queued meanwhile join one batch); pages/s and messages/s beside it.

Target (issue 28): < 2 us per stored page on top of the store's put.

Run: ``python bench/bench_events.py [--quick] [--json PATH]``; ``run(quick) -> dict`` is the entry
point of ``python -m bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

PAGE_SIZE = 16
WRITE_PAGES = (1, 16)
CHAIN_WRITES = 8
TARGET_US = 2.0

# A SUB socket that counts messages until it has the number the parent writes to its stdin (or
# 10 s passed without a message after that), then prints the count.
_SUBSCRIBER = """
import sys, zmq
sock = zmq.Context.instance().socket(zmq.SUB)
sock.setsockopt(zmq.SUBSCRIBE, b"")
sock.setsockopt(zmq.RCVHWM, 0)
sock.connect(sys.argv[1])
poller = zmq.Poller()
poller.register(sock, zmq.POLLIN)
poller.register(sys.stdin, zmq.POLLIN)
print("ready", flush=True)
count, expected = 0, None
while expected is None or count < expected:
    ready = dict(poller.poll(10000 if expected is not None else None))
    if not ready:
        break
    if sock in ready:
        sock.recv_multipart()
        count += 1
    if expected is None and any(key is not sock for key in ready):
        expected = int(sys.stdin.readline())
        poller.unregister(sys.stdin)  # at its end it would stay readable
print(count, flush=True)
"""


class Subscriber:
    """:data:`_SUBSCRIBER` in a child process, so its receiving takes no time from this one."""

    def __init__(self, endpoint: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SUBSCRIBER, endpoint], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # its SUB socket connects (a message sent before is lost to it)

    def count(self, expected: int) -> int:
        """Messages received, once ``expected`` came or 10 s passed without one."""
        out, _ = self.process.communicate(f"{expected}\n", timeout=300)
        return int(out.strip().splitlines()[-1])


def _store(num_pages: int):
    import torch

    from kvstage.kv_layout import KVLayout
    from kvstage.storage import LayoutFingerprint, MemoryStore

    fingerprint = LayoutFingerprint("bench-events", KVLayout(1, 2, 1, 8, "float16"), PAGE_SIZE)
    store = MemoryStore(fingerprint, capacity_pages=num_pages + 16)
    page = torch.zeros((1, 2, PAGE_SIZE, 1, 8), dtype=torch.float16)
    return store, page


def _writes(
    round_index: int, write_pages: int, writes: int, salt: int
) -> list[tuple[list[str], list[int], str | None]]:
    """``writes`` chain runs: (keys, tokens, prior key), unique keys per round and salt."""
    out = []
    prior = None
    for index in range(writes):
        if index % CHAIN_WRITES == 0:
            prior = None
        base = ((salt * 1000 + round_index) * writes + index) * write_pages
        keys = [f"{base + page:032x}" for page in range(write_pages)]
        tokens = [(base + page) % 50000 for page in range(write_pages) for _ in range(PAGE_SIZE)]
        out.append((keys, tokens, prior))
        prior = keys[-1]
    return out


def _thread_cpu(thread) -> float:
    """CPU seconds ``thread`` (a started :class:`threading.Thread`) has run (Linux's per-thread clock)."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def timer_overhead_s(samples: int = 2001) -> float:
    """Seconds one ``time.thread_time`` call adds to an interval it ends (the median gap between
    two back-to-back calls: on a VM the per-thread clock is a system call, ~0.3-1 us)."""
    thread_time = time.thread_time
    gaps = []
    for _ in range(samples):
        start = thread_time()
        gaps.append(thread_time() - start)
    return statistics.median(gaps)


def _time_writes(store, page, plan, announcer, timer_s: float = 0.0) -> dict[str, float]:
    """Seconds of one round: ``wall`` (the writing loop), ``cpu`` (this process until every event
    is sent), ``writer`` (the writing thread's CPU), and with an announcer ``announce`` (the
    writing thread's CPU inside :meth:`~kvstage.events.KVEventAnnouncer.written`) and ``sender``
    (the publisher's sending thread's CPU until every event is sent)."""
    from kvstage.offload.store_io import write_pages

    pages = [page] * len(plan[0][0])
    namespace = (None, None)
    thread_time = time.thread_time
    cpu, writer, started = time.process_time(), thread_time(), time.perf_counter()
    if announcer is None:
        for keys, _, prior in plan:
            write_pages(store, keys, pages, prior_key=prior)
        writer = thread_time() - writer
        return {"wall": time.perf_counter() - started, "cpu": time.process_time() - cpu, "writer": writer}
    sender_thread = announcer.publisher._thread
    sender = _thread_cpu(sender_thread)
    announce = 0.0
    for keys, tokens, prior in plan:
        outcome = write_pages(store, keys, pages, prior_key=prior)
        before = thread_time()
        announcer.written(keys, tokens, prior, namespace, outcome.failed_keys)
        announce += thread_time() - before
    wall, writer = time.perf_counter() - started, thread_time() - writer
    assert announcer.publisher.flush(60), "the publisher did not send its events within 60 s"
    return {
        "wall": wall,
        "cpu": time.process_time() - cpu,
        "writer": writer,
        "announce": announce - timer_s * len(plan),
        "sender": _thread_cpu(sender_thread) - sender,
    }


def cost_per_page(quick: bool, log: Callable[[str], None]) -> list[dict]:
    """Publishing cost per stored page, in us: per write size, the publisher's own CPU (the writer
    thread's time in the announcer plus the sender thread's CPU) and the whole writer's CPU paired
    per round with the put alone; medians over the rounds (5 with ``quick``, else 21)."""
    from kvstage.events import KVEventAnnouncer, KVEventPublisher

    rounds = 5 if quick else 21
    results = []
    timer_s = timer_overhead_s()
    log(f"  (the per-thread clock costs {timer_s * 1e6:.2f} us a reading: taken off each write's announce time)")
    for write_pages in WRITE_PAGES:
        writes = (400 if quick else 2000) // write_pages * 4
        pages = writes * write_pages
        times: dict[int, list[dict[str, float]]] = {0: [], 1: []}  # per round, us per page
        publisher = KVEventPublisher("tcp://127.0.0.1:0", max_pending=1 << 20)
        subscriber = Subscriber(publisher.endpoint)
        for round_index in range(rounds):
            stores = (_store(pages), _store(pages))
            announcer = KVEventAnnouncer(publisher, stores[1][0], block_size=PAGE_SIZE)
            plans = (_writes(round_index, write_pages, writes, 0), _writes(round_index, write_pages, writes, 1))
            for which in (0, 1) if round_index % 2 == 0 else (1, 0):  # alternate which goes first
                measured = _time_writes(*stores[which], plans[which], announcer if which else None, timer_s)
                times[which].append({name: value / pages * 1e6 for name, value in measured.items()})
        publisher.close()
        received = subscriber.count(publisher.published)

        def median(which: int, name: str) -> float:
            return statistics.median(row[name] for row in times[which])

        def added(name: str) -> float:
            return statistics.median(w[name] - b[name] for b, w in zip(times[0], times[1]))

        publishing = statistics.median(row["announce"] + row["sender"] for row in times[1])
        added_threads = statistics.median(w["writer"] - b["writer"] + w["sender"] for b, w in zip(times[0], times[1]))
        row = {
            "method": "cost per page",
            "write_pages": write_pages,
            "page_size": PAGE_SIZE,
            "pages_per_round": pages,
            "rounds": rounds,
            "timer_us_per_call": timer_s * 1e6,
            "put_cpu_us_per_page": median(0, "writer"),
            "announce_us_per_page": median(1, "announce"),
            "sender_us_per_page": median(1, "sender"),
            "publishing_us_per_page": publishing,
            "added_threads_us_per_page": added_threads,
            "added_us_per_page": added("cpu"),
            "put_wall_us_per_page": median(0, "wall"),
            "added_wall_us_per_page": added("wall"),
            "events_published": publisher.events_published,
            "batches_published": publisher.published,
            "batches_received": received,
        }
        log(
            f"  {write_pages:2d}-page writes: put {row['put_cpu_us_per_page']:.2f} us/page (writer thread CPU); "
            f"publishing {publishing:.2f} us/page = announce {row['announce_us_per_page']:.2f} + sender thread "
            f"{row['sender_us_per_page']:.2f}; paired: writer+sender threads +{added_threads:.2f}, process CPU "
            f"+{row['added_us_per_page']:.2f}, wall +{row['added_wall_us_per_page']:.2f} (medians of {rounds}; "
            f"{publisher.events_published} events in {publisher.published} batches, {received} received)"
        )
        results.append(row)
    return results


def events_per_second(quick: bool, log: Callable[[str], None]) -> list[dict]:
    """Events (and pages) one publisher sends per second, per event size and ``max_batch``, over
    ``calls`` publish calls (20,000 with ``quick``, else 100,000)."""
    from kvstage.events import BlockStored, KVEventPublisher

    calls = 20000 if quick else 100000
    results = []
    for write_pages in WRITE_PAGES:
        for max_batch in (1, 1024):
            publisher = KVEventPublisher(
                "tcp://127.0.0.1:0", max_pending=calls + 1, hwm=calls + 16, max_batch=max_batch
            )
            subscriber = Subscriber(publisher.endpoint)
            tokens = list(range(write_pages * PAGE_SIZE))
            events = [
                [BlockStored(list(range(i * write_pages, (i + 1) * write_pages)), None, tokens, PAGE_SIZE)]
                for i in range(calls)
            ]
            started = time.perf_counter()
            for call in events:
                publisher.publish(call)
            publish_seconds = time.perf_counter() - started
            assert publisher.flush(300), "the publisher did not send its events within 300 s"
            seconds = time.perf_counter() - started
            publisher.close()
            received = subscriber.count(publisher.published)
            row = {
                "method": "events per second",
                "write_pages": write_pages,
                "page_size": PAGE_SIZE,
                "max_batch": max_batch,
                "events": calls,
                "events_per_s": calls / seconds,
                "pages_per_s": calls * write_pages / seconds,
                "batches_per_s": publisher.published / seconds,
                "publish_call_us": publish_seconds / calls * 1e6,
                "batches_sent": publisher.published,
                "batches_received": received,
            }
            log(
                f"  {write_pages:2d}-page BlockStored, max_batch {max_batch:4d}: {row['events_per_s']:,.0f} events/s "
                f"({row['pages_per_s']:,.0f} pages/s) in {publisher.published} batches; publish() "
                f"{row['publish_call_us']:.2f} us/call; subscriber got {received} of {publisher.published} batches"
            )
            results.append(row)
    return results


def run(quick: bool = False, *, log: Callable[[str], None] = print) -> dict:
    """Both measurements; ``{"results": [...], "summary": {name: {value, target, ok}}}``."""
    log("publishing cost per stored page on top of the store's put")
    results = cost_per_page(quick, log)
    log("events per second one publisher sends")
    results += events_per_second(quick, log)
    summary = {
        f"publishing us per page, {row['write_pages']}-page writes": dict(
            value=row["publishing_us_per_page"], target=TARGET_US, ok=row["publishing_us_per_page"] < TARGET_US
        )
        for row in results
        if row["method"] == "cost per page"
    }
    # The figures are CPU time, but a loaded machine still slows every one of them.
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"quick": quick, "page_size": PAGE_SIZE, "load_average_1m": load, "results": results, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer writes and rounds")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    report = run(args.quick)
    print(f"load average (1 min) at the end: {report['load_average_1m']}")
    for name, item in report["summary"].items():
        print(f"{'PASS' if item['ok'] else 'MISS'} {name}: {item['value']:.2f} (target < {item['target']})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
