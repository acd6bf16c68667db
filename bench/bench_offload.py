"""CPU cost of the offload manager's per-step calls: ``offload()`` and ``poll()``.

What is measured: the manager's own CPU time per call, with 64, 256 and 1024 live decoding
requests. The copy stream is a :class:`ManualCopyStream` with ``run_copies=False`` and
``in_order=True``: a launched copy is recorded but never runs (a no-op copy), and copies
complete oldest first as on a real stream. So ``offload()`` here is everything but the copy:
the stride arithmetic, host page allocation, one page key (sglang-v1, SHA-256 of 64 tokens),
the slot slice, the index tensor and the submit; ``poll()`` with all finished computes the
page keys and hands each segment's store write to the writer thread (the write itself runs
there, untimed here).

Per round, every request gets exactly one new page of tokens, then:
  offload (launch):   offload(req) for each request, each launching one page
  offload (idle):     offload(req) again, nothing new to launch (most decode steps)
  poll none finished: poll() with every request's copy in flight
  poll all finished:  poll() after every copy completed (handles N copies)

Then, with writes pending: 256 live requests, a store whose every write also moves the bytes
of a llama3-8b segment (16 pages of 64 tokens, 128 MiB) so the writer thread stays busy, and
poll() timed from the engine's thread (nothing finished, and all copies finished) while those
writes run.

Figures are medians over rounds (and repeated calls) of per-call wall time on one thread, in
microseconds.
Targets: poll() with nothing finished <= 20 us at 256 live requests, also with writes
pending; offload() <= 50 us.

Usage: python bench/bench_offload.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from kvstage.hashing import PageHasher
from kvstage.kernels import KVPool
from kvstage.kv_layout import KVLayout
from kvstage.offload import HostPool, ManualCopyStream, OffloadManager
from kvstage.offload.testing import SimpleRequest
from kvstage.storage import LayoutFingerprint, MemoryStore

LIVE = (64, 256, 1024)
PAGE_SIZE = 64
PROMPT = 100  # one full page (stored untimed) and 36 tokens that join the first decode page
TARGET_POLL_IDLE_US = 20.0
TARGET_OFFLOAD_US = 50.0


def _median_us(samples_ns: list[int]) -> float:
    return statistics.median(samples_ns) / 1e3


LLAMA3_8B_SEGMENT_BYTES = 16 * 64 * 32 * 2 * 8 * 128 * 2  # 16 pages of 64 tokens: 128 MiB


class _BusyStore(MemoryStore):
    """A memory store whose every write also moves a llama3-8b segment's bytes (the writer
    thread's load while the engine polls)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._source = torch.ones(LLAMA3_8B_SEGMENT_BYTES, dtype=torch.uint8)
        self._target = torch.empty_like(self._source)

    def _put(self, full_keys, pages, full_prior_key=None):
        self._target.copy_(self._source)
        return super()._put(full_keys, pages, full_prior_key)


def measure(live: int, rounds: int, poll_repeats: int, *, busy_writes: bool = False) -> dict:
    """One configuration: ``live`` requests, ``rounds`` pages each; ``busy_writes``: every store
    write also moves 128 MiB, and poll() is timed while those writes are pending."""
    num_slots = PROMPT + (rounds + 1) * PAGE_SIZE
    kv = KVPool.from_stacked(torch.zeros((2, 2, num_slots, 1, 8), dtype=torch.float16))  # never read: no-op copies
    # Pending writes hold their host pages: room for every round's pages when writes pile up.
    host = HostPool.like(kv, num_pages=live * (rounds + 2), page_size=PAGE_SIZE, pin=False)
    fingerprint = LayoutFingerprint("bench", KVLayout(2, 2, 1, 8, "float16"), PAGE_SIZE)
    store = (_BusyStore if busy_writes else MemoryStore)(fingerprint, capacity_pages=live * (rounds + 1))
    row = torch.arange(num_slots)  # every request's slots (never read)
    stream = ManualCopyStream(run_copies=False, in_order=True)
    manager = OffloadManager(
        kv,
        host,
        store,
        PageHasher(page_size=PAGE_SIZE),
        lambda req: row,
        release=lambda req: None,
        copy_stream=stream,
        backend="torch",
    )
    requests = [SimpleRequest(i, [(i * 7 + t) % 50000 for t in range(PROMPT)], [1]) for i in range(live)]
    for req in requests:  # first sight: the prompt's whole page is stored (not timed)
        assert manager.offload(req)
    stream.complete_all()
    manager.drain()
    launch, idle, poll_none, poll_all = [], [], [], []
    clock = time.perf_counter_ns
    for round_index in range(rounds):
        for req in requests:
            req.output_ids.extend((req.rid + round_index * 13 + t) % 50000 for t in range(PAGE_SIZE))
        for req in requests:
            start = clock()
            launched = manager.offload(req)
            launch.append(clock() - start)
            assert launched
        for req in requests:
            start = clock()
            manager.offload(req)
            idle.append(clock() - start)
        timed = not busy_writes or round_index > 0  # busy: only while the last round's writes run
        if busy_writes and round_index:
            assert manager.metrics.writes_pending > 0
        for _ in range(poll_repeats):
            start = clock()
            handled = manager.poll()
            if timed:
                poll_none.append(clock() - start)
            assert handled == 0
        stream.complete_all()
        start = clock()
        handled = manager.poll()
        if timed:
            poll_all.append(clock() - start)
        assert handled == live
        if not busy_writes:
            manager.drain()  # the writer thread finishes this round's writes (untimed)
    manager.drain()
    metrics = manager.metrics
    assert metrics.pages_stored == live * (rounds + 1) and metrics.host_pages_used == 0
    manager.close()
    all_us = _median_us(poll_all)
    return {
        "live": live,
        "writes_pending": busy_writes,
        "offload_launch_us": round(_median_us(launch), 2),
        "offload_launch_p90_us": round(sorted(launch)[int(0.9 * (len(launch) - 1))] / 1e3, 2),
        "offload_idle_us": round(_median_us(idle), 2),
        "poll_none_finished_us": round(_median_us(poll_none), 2),
        "poll_all_finished_us": round(all_us, 1),
        "poll_all_finished_per_copy_us": round(all_us / live, 2),
    }


def run(quick: bool = False) -> dict:
    """Measure every configuration; returns the results and whether the targets are met."""
    rounds, poll_repeats = (3, 100) if quick else (8, 400)
    results = [measure(live, rounds, poll_repeats) for live in LIVE]
    results.append(measure(256, 3, poll_repeats, busy_writes=True))
    at_256 = next(r for r in results if r["live"] == 256 and not r["writes_pending"])
    pending = results[-1]
    return {
        "benchmark": "offload_manager_cpu",
        "config": {
            "page_size": PAGE_SIZE,
            "prompt_tokens": PROMPT,
            "rounds": rounds,
            "poll_repeats": poll_repeats,
            "hash_scheme": "sglang-v1",
            "copy": "no-op (ManualCopyStream run_copies=False, in_order=True)",
            "storage": "MemoryStore",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "machine": platform.machine(),
        },
        "results": results,
        "targets": {
            "poll_none_finished_us_at_256": TARGET_POLL_IDLE_US,
            "offload_us": TARGET_OFFLOAD_US,
        },
        "meets_targets": {
            "poll_none_finished_at_256": at_256["poll_none_finished_us"] <= TARGET_POLL_IDLE_US,
            "poll_none_finished_at_256_writes_pending": pending["poll_none_finished_us"] <= TARGET_POLL_IDLE_US,
            "offload_launch_all": all(r["offload_launch_us"] <= TARGET_OFFLOAD_US for r in results),
        },
    }


def print_report(report: dict) -> None:
    columns = [
        ("live", "live"),
        ("writes_pending", "writes pending"),
        ("offload_launch_us", "offload launch"),
        ("offload_launch_p90_us", "launch p90"),
        ("offload_idle_us", "offload idle"),
        ("poll_none_finished_us", "poll none done"),
        ("poll_all_finished_us", "poll all done"),
        ("poll_all_finished_per_copy_us", "per copy"),
    ]
    print("offload manager CPU time per call, microseconds (median); copies are no-ops")
    print("  ".join(f"{title:>14}" for _, title in columns))
    for result in report["results"]:
        print("  ".join(f"{result[key]:>14}" for key, _ in columns))
    targets = report["targets"]
    print(
        f"targets: poll none done <= {targets['poll_none_finished_us_at_256']} us at 256 live; "
        f"offload <= {targets['offload_us']} us -> {report['meets_targets']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    report = run(quick=args.quick)
    print_report(report)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
