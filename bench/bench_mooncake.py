"""Benchmark: a put and a get of 16 pages through one MooncakeStore from two threads at once,
against the same two calls one after the other.

What it shows: whether one thread's Mooncake call waits for another's (sglang's backup thread
puts while its prefetch thread gets, on one store). Each round times

* ``serial``: ``put`` of 16 pages under fresh keys, then ``get`` of 16 other stored pages,
  on one thread;
* ``concurrent``: the same put and get, each on its own thread, released together; the time
  from the release until both returned.

The two are interleaved within each round (their order alternating), then this round's pages
are cleared outside the timing so the segment never fills. Reported: the median of each over
the rounds and ``concurrent / serial`` (target < 0.75: the calls overlap), plus the median of
the per-round ratios, and ``calls overlapped``: in the concurrent rounds, the median share of
the shorter thread's time inside Mooncake's batch calls spent while the other thread was inside
one too (0 when one lock orders them, however busy the machine is). Pages have Llama-3-8B's KV
shape per layer in bf16: ``--layers`` x K,V x ``--tokens`` (default 64) x 8 KV heads x 128 x
2 bytes (default 1 layer and 64 tokens: 256 KiB a page).

Modes: ``registered`` (both chunks registered: zero-copy ``batch_put_from`` /
``batch_get_into``), ``bounce`` (pages in unregistered tensors: each call copies through a
bounce buffer of its own) and ``client``: the same calls straight on the Mooncake client the
store holds (``batch_is_exist`` + ``batch_put_from``, ``batch_get_into``, registered pages), no
kvstage code: the ceiling the client itself sets. The master runs on loopback
(``tests/mooncake_master.py``), TCP, this process holding the segment; run it in a network
namespace where the host's ports must stay closed
(``bash tools/in-netns.sh python bench/bench_mooncake.py``).

Run: ``python bench/bench_mooncake.py [--quick] [--rounds N] [--pages N] [--layers N]
[--tokens N] [--modes registered,bounce,client] [--json PATH]``; ``run(quick) -> dict`` for ``python -m bench``.
Without Mooncake installed the benchmark reports why and measures nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Callable

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's client logs every setup step at INFO

import torch

from kvstage.kv_layout import KVLayout
from kvstage.storage import LayoutFingerprint, PutStatus
from kvstage.storage.mooncake.store import INSTALL_HINT, MooncakeStore, mooncake_available

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/'s shared modules: these scripts run as files
from reporting import write_report  # noqa: E402

MODES = ("registered", "bounce", "client")
TARGET_RATIO = 0.75


class PairOnThreads:
    """Two worker threads that each run one job per round, released together by a barrier."""

    def __init__(self) -> None:
        self._jobs: list[Callable[[], object] | None] = [None, None]
        self._start = threading.Barrier(3)
        self._done = threading.Barrier(3)
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(2)]
        for thread in self._threads:
            thread.start()

    def _work(self, slot: int) -> None:
        while True:
            self._start.wait()
            job = self._jobs[slot]
            if job is None:
                return
            try:
                job()
            except BaseException as error:  # reported by run_pair
                self.errors.append(error)
            self._done.wait()

    def run_pair(self, first: Callable[[], object], second: Callable[[], object]) -> float:
        """Seconds from releasing both jobs until both returned.

        Raises:
            RuntimeError: a job raised (the first error is chained).
        """
        self._jobs = [first, second]
        self._start.wait()
        started = time.perf_counter()
        self._done.wait()
        seconds = time.perf_counter() - started
        if self.errors:
            raise RuntimeError("a job of the pair raised") from self.errors[0]
        return seconds

    def stop(self) -> None:
        self._jobs = [None, None]
        self._start.wait()
        for thread in self._threads:
            thread.join(10)


def _checked_put(store: MooncakeStore, keys: list[str], pages: list[torch.Tensor]) -> None:
    statuses = store.put(keys, pages)
    if any(status is not PutStatus.STORED for status in statuses):
        raise RuntimeError(f"put stored {sum(s is PutStatus.STORED for s in statuses)} of {len(keys)} pages")


def _checked_get(store: MooncakeStore, keys: list[str], into: list[torch.Tensor]) -> None:
    if not all(store.get(keys, into)):
        raise RuntimeError("get missed a stored page")


class TimedClient:
    """The store's Mooncake client, recording when each batch call ran and on which thread:
    ``intervals[thread id]`` is a list of (start, end) ``perf_counter`` seconds."""

    TIMED = ("batch_is_exist", "batch_put_from", "batch_get_into")

    def __init__(self, client) -> None:
        self._client = client
        self.intervals: dict[int, list[tuple[float, float]]] = {}

    def __getattr__(self, name):
        method = getattr(self._client, name)
        if name not in self.TIMED:
            return method

        def timed(*args):
            started = time.perf_counter()
            try:
                return method(*args)
            finally:
                self.intervals.setdefault(threading.get_ident(), []).append((started, time.perf_counter()))

        return timed

    def overlap_fraction(self) -> float | None:
        """Of the two threads' time inside Mooncake's calls, the share of the shorter one's
        spent while the other was inside one too (0: the calls never overlapped); resets."""
        spans, self.intervals = list(self.intervals.values()), {}
        if len(spans) != 2:
            return None
        both = sum(max(0.0, min(a[1], b[1]) - max(a[0], b[0])) for a in spans[0] for b in spans[1])
        shorter = min(sum(end - start for start, end in span) for span in spans)
        return both / shorter if shorter > 0 else None


class ClientCalls:
    """The put and get of the ``client`` mode: the Mooncake client's own batch calls on full
    keys, what :class:`MooncakeStore` makes for registered pages, without its code around them."""

    def __init__(self, store: MooncakeStore) -> None:
        self.client = store._store  # the store's own client: a second one would hold a second segment
        self.prefix, self.page_bytes = store.prefix, store.page_bytes

    def put(self, keys: list[str], pages: list[torch.Tensor]) -> None:
        full = [self.prefix + key for key in keys]
        if any(code != 0 for code in self.client.batch_is_exist(full)):
            raise RuntimeError("client: a fresh key exists")
        codes = self.client.batch_put_from(full, [p.data_ptr() for p in pages], [self.page_bytes] * len(full))
        if any(code != 0 for code in codes):
            raise RuntimeError(f"client: batch_put_from answered {codes}")

    def get(self, keys: list[str], into: list[torch.Tensor]) -> None:
        full = [self.prefix + key for key in keys]
        codes = self.client.batch_get_into(full, [p.data_ptr() for p in into], [self.page_bytes] * len(full))
        if any(code != self.page_bytes for code in codes):
            raise RuntimeError(f"client: batch_get_into answered {codes}")


def measure_mode(store: MooncakeStore, mode: str, num_pages: int, rounds: int, log: Callable[[str], None]) -> dict:
    """Median serial and concurrent seconds of one put and one get of ``num_pages`` pages."""
    elements = store.page_bytes // 2
    generator = torch.Generator().manual_seed(7)
    put_chunk = torch.randn(num_pages, elements, generator=generator).to(torch.bfloat16)
    get_source = torch.randn(num_pages, elements, generator=generator).to(torch.bfloat16)
    get_chunk = torch.empty_like(get_source)
    if mode in ("registered", "client"):
        store.register_host_buffers([put_chunk, get_source, get_chunk])
        put_pages, get_pages, into = list(put_chunk), list(get_source), list(get_chunk)
    else:  # separate allocations, never registered: every page bounces
        put_pages = [page.clone() for page in put_chunk]
        get_pages = [page.clone() for page in get_source]
        into = [torch.empty_like(page) for page in get_source]
    timed = TimedClient(store._store)  # the store's own client, wrapped: when its calls ran
    real_client, store._store = store._store, timed
    if mode == "client":
        calls = ClientCalls(store)
        put, get = calls.put, calls.get
    else:
        put, get = partial(_checked_put, store), partial(_checked_get, store)
    pair = PairOnThreads()
    serial: list[float] = []
    concurrent: list[float] = []
    overlaps: list[float] = []
    try:
        for round_index in range(rounds + 1):  # round 0 warms up (connections, page faults, bounce buffers)
            get_keys = [uuid.uuid4().hex for _ in range(num_pages)]
            put(get_keys, get_pages)
            for order in (0, 1) if round_index % 2 == 0 else (1, 0):
                put_keys = [uuid.uuid4().hex for _ in range(num_pages)]
                if order == 0:
                    started = time.perf_counter()
                    put(put_keys, put_pages)
                    get(get_keys, into)
                    seconds = time.perf_counter() - started
                else:
                    timed.intervals = {}
                    seconds = pair.run_pair(partial(put, put_keys, put_pages), partial(get, get_keys, into))
                    overlap = timed.overlap_fraction()
                    if round_index > 0 and overlap is not None:
                        overlaps.append(overlap)
                if round_index > 0:
                    (serial if order == 0 else concurrent).append(seconds)
                if not all(torch.equal(a, b) for a, b in zip(into, get_pages)):
                    raise RuntimeError(f"{mode}: a get returned other bytes")
                for target in into:
                    target.zero_()
            store.clear()  # outside the timing: the segment never fills
    finally:
        pair.stop()
        store._store = real_client
    serial_s, concurrent_s = statistics.median(serial), statistics.median(concurrent)
    per_round = statistics.median(c / s for c, s in zip(concurrent, serial))
    overlap = statistics.median(overlaps) if overlaps else float("nan")
    log(
        f"  {mode:10s} serial {serial_s * 1e3:7.2f} ms  concurrent {concurrent_s * 1e3:7.2f} ms  "
        f"ratio {concurrent_s / serial_s:.3f} (per-round median {per_round:.3f})  calls overlapped {overlap:.2f}"
    )
    return {
        "mode": mode,
        "pages": num_pages,
        "page_bytes": store.page_bytes,
        "rounds": rounds,
        "serial_seconds": serial_s,
        "concurrent_seconds": concurrent_s,
        "ratio": concurrent_s / serial_s,
        "per_round_ratio": per_round,
        "calls_overlapped": overlap,
    }


def run(
    quick: bool = False,
    *,
    rounds: int | None = None,
    num_pages: int = 16,
    num_layers: int = 1,
    page_tokens: int = 64,
    modes: tuple[str, ...] = MODES,
    log: Callable[[str], None] = print,
) -> dict:
    """Measure every mode; the report ``python -m bench`` writes (``results``, ``summary``)."""
    rounds = rounds or (15 if quick else 61)
    fingerprint = LayoutFingerprint(
        "meta-llama/Meta-Llama-3-8B", KVLayout(num_layers, 2, 8, 128, "bfloat16"), page_tokens
    )
    report: dict = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "quick": quick,
        "rounds": rounds,
        "pages": num_pages,
        "page_bytes": fingerprint.page_bytes,
        "protocol": "tcp, loopback, one client (this process holds the segment)",
        "results": [],
        "summary": {},
    }
    if not mooncake_available():
        report["skipped"] = f"Mooncake is not installed; {INSTALL_HINT}"
        log(f"  skipped: {report['skipped']}")
        return report
    sys.path.insert(
        0, str(Path(__file__).resolve().parent.parent / "tests")
    )  # the loopback launcher lives with the tests
    from mooncake_master import LocalMooncakeMaster

    batch_bytes = num_pages * fingerprint.page_bytes
    with tempfile.TemporaryDirectory(prefix="kvstage-bench-mooncake-") as workdir:
        with LocalMooncakeMaster(Path(workdir) / "master.log") as master:
            # Room for a round's three batches with the master's 10% eviction margin, and more.
            segment = 4 * batch_bytes * 5 // 4 + (64 << 20)
            url = master.url(segment=segment, buffer="64MiB", bounce=batch_bytes)
            with MooncakeStore(fingerprint, url) as store:
                for mode in modes:
                    report["results"].append(measure_mode(store, mode, num_pages, rounds, log))
    for result in report["results"]:
        report["summary"][f"mooncake {result['mode']}: concurrent / serial put+get of {num_pages} pages"] = dict(
            value=result["ratio"], target=TARGET_RATIO, ok=result["ratio"] < TARGET_RATIO
        )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="15 rounds instead of 61")
    parser.add_argument("--rounds", type=int, help="rounds to take the median over")
    parser.add_argument("--pages", type=int, default=16, help="pages a put and a get")
    parser.add_argument("--layers", type=int, default=1, help="layers a page (1: 256 KiB pages)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens a page (64 with 1 layer: 256 KiB pages)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    modes = tuple(filter(None, args.modes.split(",")))
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {','.join(MODES)}")
    report = run(
        args.quick,
        rounds=args.rounds,
        num_pages=args.pages,
        num_layers=args.layers,
        page_tokens=args.tokens,
        modes=modes,
    )
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
