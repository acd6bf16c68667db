"""Benchmark: put and get GB/s of 64-token KV pages through MooncakeStore beside MemoryStore.

Pages have Llama-3-8B's KV shape in bf16: 32 layers x K,V x 64 tokens x 8 KV heads x 128 x
2 bytes = 8 MiB a page (``--quick``: 8 layers, 2 MiB). A batch of pages (16; quick: 8) sits in
one host-pool-like chunk tensor; every round stores the batch under fresh keys with one ``put``
and reads it back into another chunk with one ``get``, for each method:

* ``memory``: :class:`kvstage.storage.MemoryStore` at its capacity, the steady state of a
  serving engine: the store holds one batch (filled by the warm-up round), so every put evicts
  the previous round's pages and reuses their memory; get copies the pages out.
* ``memory-events-off``: ``memory`` with store events off (``event_capacity=0``), the
  baseline for what recording a ``stored`` and an ``evicted`` event per page costs a put
  (every other store records them, as in serving; nobody drains them here, so the queue
  runs full and drops its oldest, the most expensive case).
* ``memory-growing``: a MemoryStore with room for every round, so every put takes memory the
  process never touched before (the page faults of a store that is still filling up).
* ``mooncake``: :class:`kvstage.storage.MooncakeStore` over TCP to a ``mooncake_master`` this
  script starts on loopback (HTTP metadata); both chunks registered, so pages move with
  ``batch_put_from`` / ``batch_get_into`` straight from/into them (zero-copy on kvstage's side;
  over TCP to this process's own segment Mooncake itself does a memcpy). ``put`` includes the
  ``batch_is_exist`` round trip that finds duplicates.
* ``mooncake-bounce``: the same store, pages and targets NOT registered: every page is copied
  through kvstage's registered bounce buffer (what an engine that does not register its host
  pool pays).
* ``memcpy``: one ``copy_`` of the batch from chunk to chunk: the host-memory ceiling.

Store events: the cost of ``take_events`` per 10,000 events (all at once, and 100 at a time),
and of recording them (a ``stored`` event per page, 16 pages a call, as puts do): median of
``--event-repeats`` runs (default 21) of 10,000 events.

Timing: wall clock (``time.perf_counter``; Mooncake works on its own threads), one warm-up round
not counted, then the median over rounds; methods interleaved within each round. Every get is
checked against the pages put (outside the timing).

Run: ``python bench/bench_storage.py [--quick] [--rounds N] [--pages N] [--layers N]
[--methods memory,memcpy] [--json PATH]``;
``run(quick) -> dict`` is the entry point for other scripts. Without Mooncake installed the
Mooncake methods are skipped (reported, with what to install).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's client logs every setup step at INFO

import torch

from kvstage.kv_layout import KVLayout
from kvstage.storage import LayoutFingerprint, StorageBackend, StorageStats
from kvstage.storage.events import EventQueue
from kvstage.storage.memory_store import MemoryStore
from kvstage.storage.mooncake.store import INSTALL_HINT, MooncakeStore, mooncake_available

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/'s shared modules: these scripts run as files
from reporting import write_report  # noqa: E402

EVENTS_TIMED = 10_000


def time_events(repeats: int = 21, log: Callable[[str], None] = print) -> dict:
    """Median microseconds per 10,000 store events: recorded (16 keys a call, as a put of 16
    pages), taken all at once, taken 100 at a time. A fresh queue each repeat."""
    keys = [uuid.uuid4().hex for _ in range(EVENTS_TIMED)]
    samples: dict[str, list[float]] = {"record": [], "take_all": [], "take_100": []}
    for _ in range(repeats):
        for how in ("take_all", "take_100"):
            queue = EventQueue(StorageStats(), tier="memory", key_space="bench@", page_bytes=1, capacity=EVENTS_TIMED)
            started = time.perf_counter()
            for start in range(0, EVENTS_TIMED, 16):
                queue.record("stored", keys[start : start + 16])
            if how == "take_all":
                samples["record"].append(time.perf_counter() - started)
            started = time.perf_counter()
            if how == "take_all":
                taken = len(queue.take())
            else:
                taken = 0
                while batch := queue.take(100):
                    taken += len(batch)
            samples[how].append(time.perf_counter() - started)
            if taken != EVENTS_TIMED:
                raise RuntimeError(f"events: took {taken} of {EVENTS_TIMED}")
    result = {name: statistics.median(values) * 1e6 for name, values in samples.items()}
    for name, micros in result.items():
        log(f"  events {name:9s}: {micros:8.0f} us per {EVENTS_TIMED} events (median of {repeats})")
    return result


def llama3_8b_fingerprint(num_layers: int = 32) -> LayoutFingerprint:
    """Llama-3-8B's KV layout in bf16 with 64-token pages (8 KV heads of 128), ``num_layers`` layers."""
    return LayoutFingerprint("meta-llama/Meta-Llama-3-8B", KVLayout(num_layers, 2, 8, 128, "bfloat16"), 64)


@dataclass(frozen=True)
class Case:
    """One timed method: the store it goes through and how that store is built.

    Attributes:
        method: the name in the report (:data:`METHODS`).
        store: ``"memory"``, ``"mooncake"`` or ``"none"`` (a plain ``copy_`` of the batch).
        capacity_batches: memory: the batches the store holds; None: one per round and the
            warm-up (a store that is still filling up).
        event_capacity: memory: the store's event queue (None: its default; 0: events off).
        registered: mooncake: pages and targets sit in registered chunks (False: separate
            allocations, copied through kvstage's bounce buffer).
    """

    method: str
    store: str
    capacity_batches: int | None = 1
    event_capacity: int | None = None
    registered: bool = True


CASES = (
    Case("memory", "memory"),
    Case("memory-events-off", "memory", event_capacity=0),
    Case("memory-growing", "memory", capacity_batches=None),
    Case("mooncake", "mooncake"),
    Case("mooncake-bounce", "mooncake", registered=False),
    Case("memcpy", "none"),
)
METHODS = tuple(case.method for case in CASES)
# Ratios of GB/s, per op: (name, numerator method, denominator method), in report order.
RATIOS = (
    ("memory_{op}_events_on_vs_off", "memory", "memory-events-off"),
    ("memory_{op}_vs_memcpy", "memory", "memcpy"),
    ("memory_growing_{op}_vs_memcpy", "memory-growing", "memcpy"),
    ("mooncake_{op}_vs_memory", "mooncake", "memory"),
    ("mooncake_{op}_vs_bounce", "mooncake", "mooncake-bounce"),
)


@dataclass
class Batch:
    """The pages of a round: in one host-pool-like chunk, its target chunk, and loose copies."""

    pages: torch.Tensor  # [pages, page elements] bf16, each row one contiguous page
    into: torch.Tensor
    loose_pages: list[torch.Tensor]  # separate allocations, never registered

    @classmethod
    def random(cls, num_pages: int, page_bytes: int) -> Batch:
        generator = torch.Generator().manual_seed(0)
        pages = torch.randn(num_pages, page_bytes // 2, generator=generator).to(torch.bfloat16)
        return cls(pages, torch.empty_like(pages), [p.clone() for p in pages])


def _round_trip(
    method: str,
    store: StorageBackend,
    pages: list[torch.Tensor],
    into: list[torch.Tensor],
    clear: torch.Tensor | None = None,
) -> tuple[float, float]:
    """put ``pages`` under fresh keys, then get them into ``into``; (put seconds, get seconds).
    ``clear`` (the chunk ``into`` views) is zeroed between the two, so the get is seen to write.
    Checks the statuses and the bytes (outside the timing)."""
    keys = [uuid.uuid4().hex for _ in pages]
    started = time.perf_counter()
    statuses = store.put(keys, pages)
    put_seconds = time.perf_counter() - started
    if any(status.value != "stored" for status in statuses):
        raise RuntimeError(f"{method}: put answered {[s.value for s in statuses]}")
    if clear is not None:
        clear.zero_()
    started = time.perf_counter()
    hits = store.get(keys, into)
    get_seconds = time.perf_counter() - started
    if not all(hits) or not all(torch.equal(got, want) for got, want in zip(into, pages)):
        raise RuntimeError(f"{method}: get did not return the pages put ({sum(hits)} hits)")
    return put_seconds, get_seconds


def time_round(case: Case, store: StorageBackend | None, batch: Batch) -> tuple[float, float]:
    """One round of ``case``: (put seconds, get seconds); memcpy's one copy counts as both."""
    if store is None:
        started = time.perf_counter()
        batch.into.copy_(batch.pages)
        seconds = time.perf_counter() - started
        return seconds, seconds
    if case.registered:
        return _round_trip(case.method, store, list(batch.pages), list(batch.into), clear=batch.into)
    return _round_trip(case.method, store, batch.loose_pages, [torch.empty_like(p) for p in batch.loose_pages])


def open_stores(
    cases: list[Case], fingerprint: LayoutFingerprint, rounds: int, batch: Batch, workdir: Path, stack: ExitStack
) -> tuple[dict[str, StorageBackend | None], dict[str, str]]:
    """The store of every case (None: none needed), closed by ``stack``; and the cases that cannot
    run, with why (a Mooncake that is not installed or does not start)."""
    batch_bytes = batch.pages.numel() * batch.pages.element_size()
    stores: dict[str, StorageBackend | None] = {}
    skipped: dict[str, str] = {}
    mooncake: StorageBackend | str | None = None  # the store both Mooncake cases share, or why there is none
    for case in cases:
        if case.store == "none":
            stores[case.method] = None
        elif case.store == "memory":
            batches = case.capacity_batches or rounds + 1
            options = {} if case.event_capacity is None else {"event_capacity": case.event_capacity}
            stores[case.method] = stack.enter_context(
                MemoryStore(fingerprint, capacity_bytes=batches * batch_bytes, **options)
            )
        else:
            if mooncake is None:
                mooncake = _start_mooncake(fingerprint, rounds, batch, workdir, stack)
            if isinstance(mooncake, str):
                skipped[case.method] = mooncake
            else:
                stores[case.method] = mooncake
    return stores, skipped


def _start_mooncake(
    fingerprint: LayoutFingerprint, rounds: int, batch: Batch, workdir: Path, stack: ExitStack
) -> StorageBackend | str:
    """A MooncakeStore on a ``mooncake_master`` started on loopback, both chunks registered; or why not."""
    if not mooncake_available():
        return f"Mooncake is not installed; {INSTALL_HINT}"
    sys.path.insert(
        0, str(Path(__file__).resolve().parent.parent / "tests")
    )  # the loopback launcher lives with the tests
    from mooncake_master import LocalMooncakeMaster

    batch_bytes = batch.pages.numel() * batch.pages.element_size()
    try:
        master = stack.enter_context(LocalMooncakeMaster(workdir / "master.log"))
        # The segment holds every batch of both Mooncake methods, with room to spare
        # (the master evicts above 90% full).
        segment = 2 * (rounds + 1) * batch_bytes * 5 // 4 + (64 << 20)
        store = stack.enter_context(
            MooncakeStore(fingerprint, master.url(segment=segment, buffer="64MiB", bounce=batch_bytes))
        )
        store.register_host_buffers([batch.pages, batch.into])
    except Exception as error:  # reported, the other methods still run
        return f"{error.__class__.__name__}: {error}"
    return store


def summarize(
    times: dict[tuple[str, str], list[float]], page_bytes: int, num_pages: int, log: Callable[[str], None]
) -> tuple[list[dict], dict[str, float]]:
    """The result row of each timed (method, op), from the median of its rounds, and the ratios of
    :data:`RATIOS` whose two methods were timed; both logged."""
    batch_bytes = num_pages * page_bytes
    results = []
    for (method, op), samples in times.items():
        if not samples:
            continue
        seconds = statistics.median(samples)
        results.append(
            {
                "method": method,
                "op": op,
                "page_bytes": page_bytes,
                "pages": num_pages,
                "seconds": seconds,
                "gbps": batch_bytes / seconds / 1e9,
            }
        )
        log(f"  {method:16s} {op}: {batch_bytes / seconds / 1e9:7.2f} GB/s  ({seconds * 1e3:8.2f} ms a batch)")
    gbps = {(r["method"], r["op"]): r["gbps"] for r in results}
    ratios = {
        name.format(op=op): gbps[(top, op)] / gbps[(bottom, op)]
        for op in ("put", "get")
        for name, top, bottom in RATIOS
        if (top, op) in gbps and (bottom, op) in gbps
    }
    for name, value in ratios.items():
        log(f"  {name}: {value:.2f}")
    return results, ratios


def run(
    quick: bool = False,
    *,
    rounds: int | None = None,
    num_pages: int | None = None,
    num_layers: int | None = None,
    methods: tuple[str, ...] = METHODS,
    event_repeats: int = 21,
    log: Callable[[str], None] = print,
) -> dict:
    """Time put and get of every method; return the results as a JSON-able dict.

    Args:
        quick: 8 layers (2 MiB pages), 8 pages a batch, 3 rounds instead of 32 layers (8 MiB),
            16 pages, 5 rounds.
        rounds, num_pages, num_layers: override those.
        methods: the methods to time (a subset of :data:`METHODS`).
        event_repeats: runs of :func:`time_events` to take the median over (0: skip it).
        log: where progress lines go.

    Raises:
        ValueError: ``methods`` names an unknown method.

    Returns:
        ``{"machine", "python", "torch", "quick", "rounds", "pages_per_batch", "page_bytes",
        "layout", "results": [{method, op, page_bytes, pages, seconds, gbps}],
        "skipped": {method: reason}, "ratios": {name: x}, "events_us_per_10000": {record,
        take_all, take_100}}``.
    """
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"methods: unknown {unknown}; known: {list(METHODS)}")
    rounds = rounds or (3 if quick else 5)
    num_pages = num_pages or (8 if quick else 16)
    fingerprint = llama3_8b_fingerprint(num_layers or (8 if quick else 32))
    page_bytes = fingerprint.page_bytes
    log(f"storage bench: {num_pages} pages of {page_bytes / 2**20:.1f} MiB a batch, {rounds} rounds (+1 warm-up)")
    batch = Batch.random(num_pages, page_bytes)
    skipped = {case.method: "not asked for (--methods)" for case in CASES if case.method not in methods}
    times: dict[tuple[str, str], list[float]] = {(m, op): [] for m in METHODS for op in ("put", "get")}
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvstage-bench-storage-")))
        stores, failed = open_stores(
            [case for case in CASES if case.method in methods], fingerprint, rounds, batch, workdir, stack
        )
        skipped.update(failed)
        for method, reason in skipped.items():
            log(f"  {method}: skipped ({reason})")
        timed = [case for case in CASES if case.method not in skipped]
        for round_index in range(rounds + 1):  # methods interleaved within each round
            for case in timed:
                put_seconds, get_seconds = time_round(case, stores[case.method], batch)
                if round_index > 0:  # round 0 warms up (page faults, connections)
                    times[(case.method, "put")].append(put_seconds)
                    times[(case.method, "get")].append(get_seconds)

    results, ratios = summarize(times, page_bytes, num_pages, log)
    events = time_events(event_repeats, log) if event_repeats else {}
    return {
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "quick": quick,
        "rounds": rounds,
        "pages_per_batch": num_pages,
        "page_bytes": page_bytes,
        "layout": fingerprint.prefix(),
        "protocol": "tcp, loopback, one client (this process holds the segment)",
        "results": results,
        "skipped": skipped,
        "ratios": ratios,
        "events_us_per_10000": events,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 MiB pages, 8 a batch, 3 rounds")
    parser.add_argument("--rounds", type=int, help="rounds to take the median over")
    parser.add_argument("--pages", type=int, help="pages a batch")
    parser.add_argument("--layers", type=int, help="layers a page (32: 8 MiB pages)")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--event-repeats", type=int, default=21, help="runs of the store-event timing (0: skip)")
    args = parser.parse_args(argv)
    methods = tuple(filter(None, args.methods.split(",")))
    report = run(
        args.quick,
        rounds=args.rounds,
        num_pages=args.pages,
        num_layers=args.layers,
        methods=methods,
        event_repeats=args.event_repeats,
    )
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
