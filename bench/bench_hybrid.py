"""Hybrid models through the offload manager: a request's store and load against a copy of the same
bytes, and the restorable-length lookup at 100,000 stored keys (issue 27's targets).

Layouts (pages of 64 tokens, bfloat16 KV):

* ``qwen3-next``: Qwen3-Next-80B-A3B's shape, 48 layers, every fourth full attention (12 layers,
  2 KV heads of 256), the other 36 linear attention with conv ``(8192, 4)`` bf16 and recurrent
  ``(32, 128, 128)`` fp32 state: about 74 MiB a snapshot.
* ``gpt-oss``: gpt-oss-20b's shape, 24 layers alternating sliding-window (window 128: 2 pages
  before a length) and full attention, 8 KV heads of 64.

Store and load (per round, interleaved; times are medians over rounds, ratios the median of
each round's own ratio, so a round slowed by other work on the machine is compared with its
own baseline; each round stores a new prompt of
``num_pages`` whole pages plus one token, so nothing deduplicates; the stores are at their
capacity, so each put reuses an evicted page's memory, the steady state):

- ``copy``: one contiguous ``Tensor.copy_`` of the bytes the path moves (every full page, the
  window pages, the snapshot), source and target already touched (the baseline);
  ``two_copies``: two such copies one after the other (what two hops would take, a reference);
- ``store``: ``offload`` + ``snapshot`` (Qwen3-Next: the state after the prompt's whole pages)
  + ``finish``, then ``poll`` (with 0.2 ms sleeps, as an engine's steps) until ``on_stored``
  ran and every component's entries were counted stored;
- ``load``: ``prefetch(policy="wait_complete")`` (lookup and reads on the reader thread), wait,
  ``load`` into other slots (the state into another state slot, the window into other window
  slots), wait.

Every byte moves once each way (one hop): the host pool holds one page a buffer
(``buffer_pages=1``), the copier copies the pool's rows straight into those pages
(:mod:`kvstage.offload.host_rows`, :class:`~kvstage.offload.row_copies.RowCopies`: streaming
stores), the memory store adopts them (:meth:`~kvstage.storage.MemoryStore.put_adopting`, its
evicted pages' memory coming back in their place) and a prefetch lends the stored pages back in
(:meth:`~kvstage.storage.MemoryStore.lend`, :meth:`HostPool.lend_in
<kvstage.offload.HostPool.lend_in>`) for the scatter to read; the snapshot likewise, through its
staging buffer. The window's two pages take a buffer each (rows into them, the store adopting
them; a load reads the lent pages). The baseline moves every byte once; its copies run just before the
store, and torch's OpenMP team spins on after them for a while (on 2 cores it shares the store's
second core: ``OMP_WAIT_POLICY=PASSIVE`` shows what that costs, README "Hybrid").
The last round's load goes into poisoned slots and is checked byte for byte.

Lookup: every component's store (``MemoryStore``) holds ``100,000`` keys (an entry at every page
of 3,125 prompts of 32 pages: the most work for the restorable-length loop); per request
``match_prefix(token_ids=...)`` (hash the pages, ``exists`` on each store, then
:func:`~kvstage.offload.restorable.restorable_lengths`) is timed alone, median over requests
(half whole stored prompts, a quarter diverging at half their pages, a quarter unseen), with the
three parts timed on their own on other requests of the same kinds (taking turns in blocks, so
neither finds the other's keys in the caches). ``match_prefix``'s mean is shown too: a memory
store queues the recency of the keys ``exists`` finds and applies it at its next put or get, or
in the lookup that fills the queue (65,536 uses), so the mean carries that deferred work. The lookup layouts have the same components with tiny
pages (the lookup never touches page bytes).

Targets (issue 27): ``copy / store`` and ``copy / load`` >= 0.8; lookup < 50 us a request.

Usage: python bench/bench_hybrid.py [--quick] [--lookup-only] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

# torch's OpenMP team spins for a while after each CPU op (the copy_ baseline) and takes the core
# kvstage's copy threads need on a small machine; PASSIVE parks it (README "Benchmarks"). Set before
# torch is imported; a value already in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reporting import write_report  # noqa: E402

from kvstage.hashing import PageHasher  # noqa: E402
from kvstage.kernels import KVPool, StatePool  # noqa: E402
from kvstage.kv_layout import KVLayout  # noqa: E402
from kvstage.model_layout import FullAttention, ModelLayout, RequestState, SlidingWindow, TensorSpec  # noqa: E402
from kvstage.offload import ComponentPools, HostPool, OffloadManager  # noqa: E402
from kvstage.offload.restorable import restorable_lengths  # noqa: E402
from kvstage.offload.testing import SimpleRequest  # noqa: E402
from kvstage.storage import MemoryStore  # noqa: E402

PAGE_SIZE = 64
TARGET_OVER_COPY = 0.8
TARGET_LOOKUP_US = 50.0
LOOKUP_KEYS = 100_000
LOOKUP_PAGES = 32  # pages a lookup request asks (2048 tokens)
POISON = 0x5A


def qwen3_next(quick: bool = False) -> ModelLayout:
    """Qwen3-Next-80B-A3B's shape (module doc); ``quick``: 8 layers."""
    num_layers = 8 if quick else 48
    full = tuple(range(3, num_layers, 4))
    linear = tuple(layer for layer in range(num_layers) if layer not in full)
    state = (TensorSpec("conv", (8192, 4), "bfloat16"), TensorSpec("recurrent", (32, 128, 128), "float32"))
    kv = KVLayout(len(full), 2, 2, 256, "bfloat16")
    return ModelLayout(num_layers, (RequestState(linear, state), FullAttention(full, kv)))


def gpt_oss(quick: bool = False) -> ModelLayout:
    """gpt-oss-20b's shape (module doc); ``quick``: 4 layers."""
    num_layers = 4 if quick else 24
    kv = KVLayout(num_layers // 2, 2, 8, 64, "bfloat16")
    return ModelLayout(
        num_layers,
        (
            SlidingWindow(tuple(range(0, num_layers, 2)), kv, window=128),
            FullAttention(tuple(range(1, num_layers, 2)), kv),
        ),
    )


def _kv_pool(layout: KVLayout, num_slots: int) -> KVPool:
    t = torch.empty(
        (layout.kv_parts, layout.num_layers, num_slots, layout.num_heads, layout.head_dim), dtype=layout.dtype
    )
    return KVPool.from_stacked(t.view(torch.uint8).random_(0, 256).view(layout.dtype))


def _rows(pool: KVPool, slots: torch.Tensor) -> list[torch.Tensor]:
    return [buffer[slots].view(torch.uint8).clone() for part in pool.buffers for buffer in part]


def _poison(pool: KVPool, slots: torch.Tensor) -> None:
    for part in pool.buffers:
        for buffer in part:
            buffer.view(torch.uint8)[slots] = POISON


class _Rig:
    """Device pools of a layout on CPU (scattered store slots and load slots), a memory store
    per component at a capacity of two requests, and a manager over them."""

    def __init__(self, name: str, layout: ModelLayout, num_pages: int) -> None:
        self.layout, self.num_pages = layout, num_pages
        tokens = num_pages * PAGE_SIZE
        num_slots = 2 * tokens
        generator = torch.Generator().manual_seed(0)

        def two_rows() -> tuple[torch.Tensor, torch.Tensor]:
            order = torch.randperm(num_slots // PAGE_SIZE, generator=generator)
            rows = (order.view(-1, 1) * PAGE_SIZE + torch.arange(PAGE_SIZE)).view(-1)
            return rows[:tokens], rows[tokens:]

        full = layout.of_kind("full")[0]
        self.kv_pool = _kv_pool(full.layout, num_slots)
        self.store_slots, self.load_slots = two_rows()
        pools, slots_of = {}, {}
        self.window = None
        for component in layout.components:
            if component.kind == "swa":
                pools[component.name] = _kv_pool(component.layout, num_slots)
                self.window_store, self.window_load = two_rows()
                slots_of[component.name] = lambda req: self.window_store
                self.window = component
            elif component.kind == "state":
                pools[component.name] = StatePool.from_layers(
                    [
                        [torch.empty((2, *spec.shape), dtype=spec.dtype).uniform_() for spec in component.tensors]
                        for _ in component.layers
                    ]
                )
        self.pools = pools
        self.state = pools.get("state")
        self.window_pages = self.window.window_pages(PAGE_SIZE) if self.window else 0
        page_bytes = {c.name: c.entry_bytes(PAGE_SIZE) for c in layout.components}
        capacity = {"full": 2 * num_pages, "swa": 2 * self.window_pages, "state": 2}
        self.stores = {  # as component_stores, with a capacity per component
            c: MemoryStore(fp, capacity_pages=capacity[c])
            for c, fp in layout.fingerprints(f"bench-{name}", page_size=PAGE_SIZE).items()
        }
        self.bytes = num_pages * page_bytes["full"]
        self.bytes += self.window_pages * page_bytes.get("swa", 0) + page_bytes.get("state", 0)
        self.stored: dict[str, tuple[int, int]] = {}
        self.manager = OffloadManager(
            self.kv_pool,
            HostPool.like(self.kv_pool, num_pages=num_pages + 1, page_size=PAGE_SIZE, pin=False, buffer_pages=1),
            self.stores,
            PageHasher(page_size=PAGE_SIZE),
            lambda req: self.store_slots if req.rid.startswith("s") else self.load_slots,
            on_stored=lambda req, stored, failed: self.stored.__setitem__(req.rid, (stored, failed)),
            components=ComponentPools(layout, pools, slots_of=slots_of),
            backend="torch",
        )

    def entries(self) -> int:
        return sum(stored for stored, _ in self.manager.entries_stored.values())

    def store(self, prompt: list[int], rid: str) -> float:
        """Seconds of one request's store, until every entry is counted stored."""
        manager, length = self.manager, self.num_pages * PAGE_SIZE
        want = self.entries() + (self.window_pages if self.window else 0) + (1 if self.state else 0)
        req = SimpleRequest(rid, prompt)
        started = time.perf_counter()
        manager.offload(req)
        if self.state is not None:
            manager.snapshot(req, length, 0)
        req.done = True
        manager.finish(req)
        while rid not in self.stored or self.entries() < want:
            manager.poll()
            time.sleep(0.0002)
        seconds = time.perf_counter() - started
        assert self.stored[rid] == (self.num_pages, 0) and self.entries() == want, (self.stored[rid], self.entries())
        return seconds

    def load(self, prompt: list[int], rid: str) -> float:
        """Seconds of one request's prefetch and load of every component, until its copies are done."""
        manager, length = self.manager, self.num_pages * PAGE_SIZE
        req = SimpleRequest(rid, prompt)
        kwargs = {}
        if self.window is not None:
            kwargs["component_slots"] = {
                self.window.name: self.window_load[length - self.window_pages * PAGE_SIZE : length]
            }
        if self.state is not None:
            kwargs["state_slot"] = 1
        started = time.perf_counter()
        handle = manager.prefetch(req, policy="wait_complete")
        handle.wait()
        loaded = manager.load(handle, self.load_slots[: handle.tokens_ready], **kwargs)
        loaded.wait()
        seconds = time.perf_counter() - started
        assert loaded.error is None and loaded.num_tokens == length, (loaded.error, loaded.num_tokens)
        manager.abort(req)
        manager.poll()
        return seconds

    def poison_load_targets(self) -> None:
        _poison(self.kv_pool, self.load_slots)
        if self.window is not None:
            _poison(self.pools[self.window.name], self.window_load)
        if self.state is not None:
            for t in self.state.tensors:
                t[1].view(torch.uint8).fill_(POISON)

    def check_loaded(self) -> None:
        """The last load's bytes are the stored request's, component by component."""
        assert all(map(torch.equal, _rows(self.kv_pool, self.load_slots), _rows(self.kv_pool, self.store_slots)))
        if self.window is not None:
            length, pool = self.num_pages * PAGE_SIZE, self.pools[self.window.name]
            window = slice(length - self.window_pages * PAGE_SIZE, length)
            assert all(map(torch.equal, _rows(pool, self.window_load[window]), _rows(pool, self.window_store[window])))
        if self.state is not None:
            assert all(torch.equal(t[1].view(torch.uint8), t[0].view(torch.uint8)) for t in self.state.tensors)


def measure_paths(name: str, layout: ModelLayout, num_pages: int, rounds: int, warm_up: int = 2) -> dict:
    """Store, load and the same-size copy of one request of ``num_pages`` pages, ``rounds`` times."""
    rig = _Rig(name, layout, num_pages)
    source = torch.ones(rig.bytes, dtype=torch.uint8)
    middle, target = torch.zeros_like(source), torch.zeros_like(source)
    times: dict[str, list[float]] = {"copy": [], "two_copies": [], "store": [], "load": []}
    try:
        for index in range(warm_up + rounds):
            prompt = [(index * 7919 + t) % 150_000 for t in range(num_pages * PAGE_SIZE + 1)]
            started = time.perf_counter()
            target.copy_(source)
            copy_s = time.perf_counter() - started
            started = time.perf_counter()
            middle.copy_(source)
            target.copy_(middle)
            two_copies_s = time.perf_counter() - started
            store_s = rig.store(prompt, f"s{index}")
            if index == warm_up + rounds - 1:
                rig.poison_load_targets()
            load_s = rig.load(prompt, f"l{index}")
            if index >= warm_up:
                for key, seconds in (
                    ("copy", copy_s),
                    ("two_copies", two_copies_s),
                    ("store", store_s),
                    ("load", load_s),
                ):
                    times[key].append(seconds)
        rig.check_loaded()
    finally:
        rig.manager.close()
    medians = {key: statistics.median(values) for key, values in times.items()}

    def paired(base: str, path: str) -> float:  # the median over rounds of each round's own ratio
        return round(statistics.median(b / p for b, p in zip(times[base], times[path])), 3)

    return {
        "model": name,
        "pages": num_pages,
        "tokens": num_pages * PAGE_SIZE,
        "mib": round(rig.bytes / 2**20, 1),
        **{f"{key}_ms": round(seconds * 1e3, 2) for key, seconds in medians.items()},
        **{f"{key}_gbps": round(rig.bytes / seconds / 1e9, 2) for key, seconds in medians.items()},
        "copy_over_store": paired("copy", "store"),
        "copy_over_load": paired("copy", "load"),
        "two_copies_over_store": paired("two_copies", "store"),
        "two_copies_over_load": paired("two_copies", "load"),
        "rounds_ms": {key: [round(seconds * 1e3, 3) for seconds in values] for key, values in times.items()},
    }


def _tiny(layout: ModelLayout) -> ModelLayout:
    """The same components and layers with one head of 2 bytes (the lookup never reads pages)."""
    kv = lambda c: KVLayout(len(c.layers), 2, 1, 1, "bfloat16")  # noqa: E731
    tiny = {
        "full": lambda c: FullAttention(c.layers, kv(c)),
        "swa": lambda c: SlidingWindow(c.layers, kv(c), window=c.window),
        "state": lambda c: RequestState(c.layers, (TensorSpec("conv", (1,), "uint8"),)),
    }
    return ModelLayout(layout.num_layers, tuple(tiny[c.kind](c) for c in layout.components))


def measure_lookup(name: str, layout: ModelLayout, num_keys: int, num_requests: int) -> dict:
    """Per request, microseconds of ``match_prefix`` with ``num_keys`` keys in every component's
    store, and of its three parts alone (median over ``num_requests``)."""
    layout = _tiny(layout)
    full = layout.of_kind("full")[0]
    stores = {
        c: MemoryStore(fp, capacity_pages=num_keys)
        for c, fp in layout.fingerprints(f"bench-{name}", page_size=PAGE_SIZE).items()
    }
    pools: dict = {}
    slots_of = {}
    for c in layout.components:
        if c.kind == "swa":
            pools[c.name] = _kv_pool(c.layout, PAGE_SIZE)
            slots_of[c.name] = lambda req: torch.arange(PAGE_SIZE)
        elif c.kind == "state":
            pools[c.name] = StatePool.from_layers([[torch.zeros(1, 1, dtype=torch.uint8)] for _ in c.layers])
    kv_pool = _kv_pool(full.layout, PAGE_SIZE)
    hasher = PageHasher(page_size=PAGE_SIZE)
    manager = OffloadManager(
        kv_pool,
        HostPool.like(kv_pool, num_pages=1, page_size=PAGE_SIZE, pin=False),
        stores,
        hasher,
        lambda req: torch.arange(PAGE_SIZE),
        components=ComponentPools(layout, pools, slots_of=slots_of),
        backend="torch",
    )
    tokens = LOOKUP_PAGES * PAGE_SIZE
    prompts = []
    for index in range(num_keys // LOOKUP_PAGES):
        prompt = [(index * 104_729 + t * 31) % 150_000 for t in range(tokens)]
        keys = hasher.prefill_keys(prompt)
        for component in layout.components:
            page = torch.zeros(component.entry_bytes(PAGE_SIZE), dtype=torch.uint8)
            stores[component.name].put(keys, [page] * len(keys))
        prompts.append(prompt)
    assert all(len(store) == len(prompts) * LOOKUP_PAGES for store in stores.values())
    rng = random.Random(0)
    queries = []
    for index in range(num_requests):
        prompt = prompts[rng.randrange(len(prompts))]
        kind = index % 4
        if kind < 2:  # a stored prompt and one more token: all its pages restorable
            queries.append((prompt + [1], LOOKUP_PAGES))
        elif kind == 2:  # diverges at half its pages
            half = tokens // 2
            queries.append((prompt[:half] + [(t * 17 + 3) % 150_000 for t in range(half)] + [1], LOOKUP_PAGES // 2))
        else:  # unseen
            queries.append(([(index * 13 + t * 7) % 150_000 + 150_000 for t in range(tokens + 1)], 0))
    times: dict[str, list[float]] = {"match_prefix": [], "hash": [], "exists": [], "restorable_lengths": []}
    clock = time.perf_counter_ns
    try:
        for index, (token_ids, pages) in enumerate(queries):
            # Blocks of four (every kind) take turns: the parts are timed on requests of their
            # own, so they find the store's memory as cold as match_prefix does.
            if index // 4 % 2 == 0:
                started = clock()
                found = manager.match_prefix(token_ids=token_ids)
                times["match_prefix"].append(clock() - started)
                assert found.num_tokens == pages * PAGE_SIZE, (found.num_tokens, pages)
                continue
            started = clock()
            keys = hasher.prefill_keys(token_ids)
            times["hash"].append(clock() - started)
            started = clock()
            present = {c.name: stores[c.name].exists(keys) for c in layout.components}
            times["exists"].append(clock() - started)
            started = clock()
            restorable_lengths(layout, PAGE_SIZE, len(token_ids), present)
            times["restorable_lengths"].append(clock() - started)
    finally:
        manager.close()
    return {
        "model": name,
        "keys_per_store": num_keys,
        "stores": len(stores),
        "pages_asked": LOOKUP_PAGES,
        "requests": num_requests,
        **{f"{key}_us": round(statistics.median(values) / 1e3, 2) for key, values in times.items()},
        "match_prefix_mean_us": round(statistics.mean(times["match_prefix"]) / 1e3, 2),
    }


def run(quick: bool = False, lookup_only: bool = False) -> dict:
    """Both measurements for both layouts; the report ``python -m bench`` writes; ``lookup_only``:
    the lookup alone (no store or load rounds)."""
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    layouts = {"qwen3-next": qwen3_next(quick), "gpt-oss": gpt_oss(quick)}
    num_pages, rounds = (8, 3) if quick else (32, 31)
    paths = [] if lookup_only else [measure_paths(name, layout, num_pages, rounds) for name, layout in layouts.items()]
    num_keys, requests = (3_200, 200) if quick else (LOOKUP_KEYS, 4_000)
    lookups = [measure_lookup(name, layout, num_keys, requests) for name, layout in layouts.items()]
    summary = {}
    for r in paths:
        for path in ("store", "load"):
            value = r[f"copy_over_{path}"]
            summary[f"copy / {path}, {r['model']}"] = dict(
                value=value, target=TARGET_OVER_COPY, ok=value >= TARGET_OVER_COPY
            )
    for r in lookups:
        value = r["match_prefix_us"]
        summary[f"match_prefix us at {r['keys_per_store']} keys a store, {r['model']}"] = dict(
            value=value, target=TARGET_LOOKUP_US, ok=value < TARGET_LOOKUP_US
        )
    return {
        "benchmark": "hybrid",
        "config": {
            "page_size": PAGE_SIZE,
            "rounds": rounds,
            "device": "cpu",
            "torch_threads": torch.get_num_threads(),
            "load_average_at_start": load_at_start,
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "torch": torch.__version__,
        },
        "quick": quick,
        "results": paths,
        "lookup": lookups,
        "summary": summary,
    }


def print_report(report: dict) -> None:
    config = report["config"]
    print(
        f"hybrid store/load vs one copy_ of the same bytes, CPU, median of {config['rounds']} rounds, "
        f"load average {config['load_average_at_start']} -> {config['load_average']}"
    )
    print(
        f"{'model':>10} {'MiB':>6} {'copy ms':>8} {'2 copies':>9} {'store ms':>9} {'load ms':>8} {'copy/store':>11} "
        f"{'copy/load':>10} {'2 copies/store':>15} {'2 copies/load':>14}"
    )
    for r in report["results"]:
        print(
            f"{r['model']:>10} {r['mib']:>6} {r['copy_ms']:>8} {r['two_copies_ms']:>9} {r['store_ms']:>9} "
            f"{r['load_ms']:>8} {r['copy_over_store']:>11} {r['copy_over_load']:>10} "
            f"{r['two_copies_over_store']:>15} {r['two_copies_over_load']:>14}"
        )
    print("restorable-length lookup per request, us (median)")
    print(
        f"{'model':>10} {'keys/store':>10} {'match_prefix':>13} {'hash':>7} {'exists':>7} {'restorable':>11} "
        f"{'match_prefix mean':>18}"
    )
    for r in report["lookup"]:
        print(
            f"{r['model']:>10} {r['keys_per_store']:>10} {r['match_prefix_us']:>13} {r['hash_us']:>7} "
            f"{r['exists_us']:>7} {r['restorable_lengths_us']:>11} {r['match_prefix_mean_us']:>18}"
        )
    for name, item in report["summary"].items():
        print(f"{'PASS' if item['ok'] else 'MISS'} {name}: {item['value']} (target {item['target']})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small layouts, few rounds, fewer keys (a smoke run)")
    parser.add_argument("--lookup-only", action="store_true", help="only the lookup (no store or load rounds)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON to PATH")
    args = parser.parse_args(argv)
    report = run(quick=args.quick, lookup_only=args.lookup_only)
    print_report(report)
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
