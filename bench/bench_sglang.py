"""KVStageStorage inside sglang 0.5.23: ``batch_set_v1`` / ``batch_get_v1`` of llama3-8b-sized
pages (32 layers, 8 KV heads of 128, bf16, 64-token pages: 8 MiB) through sglang's own MHA
host pools, every host layout.

- memory store, beside a same-size ``copy_`` (the pages' bytes between two contiguous tensors, in
  one call and page by page): target >= 0.8 of it for page_first_direct and layer_first;
- file store (checksummed, crash-safe), beside sglang's own ``HiCacheFile`` on the same host pool
  and directory, through the calls sglang's controller makes for it (``batch_set`` of
  ``get_data_page`` flat pages; ``batch_get`` into flat pages then ``set_from_flat_data_page``):
  target not slower. kvstage's file store reads and writes ``io_threads`` page files at once (its
  default: 2 here); the rows ``1 thread`` are the same calls on one (``file:DIR?io_threads=1``).
  Both stores' pages are removed after each round of writes, untimed: otherwise the rounds
  pile up gigabytes of dirty page cache, and whichever write crosses the kernel's dirty limit
  waits for the disk (a figure of the disk and of the order of the calls, not of the store).

Each figure is the median of ``rounds`` calls (after a warm-up); each ratio is the median of
per-round ratios, the two calls timed back to back in each round. sglang must import on CPU (its
own virtual environment, ``make .venv-sglang/.sglang``): ``python -m bench --only sglang`` runs
this file there; ``.venv-sglang/bin/python bench/bench_sglang.py [--quick] [--layouts=layer_first,...]`` prints the
table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

# torch's OpenMP team spins for a while after each CPU op (the copy_ baseline) and takes the core
# kvstage's copy threads need on a small machine; PASSIVE parks it (README "Benchmarks"). Set before
# torch is imported; a value already in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parent.parent
SGLANG_TESTS = REPO / "tests" / "integrations" / "sglang"
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
PAGE_SIZE = 64


def _median_seconds(call: Callable[[], object], rounds: int) -> float:
    call()  # warm-up: first-touch page faults, staging buffers
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _paired(
    baseline: Callable[[], object],
    call: Callable[[], object],
    rounds: int,
    between: Callable[[], object] = lambda: None,
) -> tuple[float, float, float]:
    """(median baseline seconds, median call seconds, median of the per-round ratios
    baseline/call): each round times both back to back, so a machine shared with other work
    loads both alike; ``between`` runs untimed after each call."""
    baseline(), between(), call(), between()
    base_times, call_times = [], []
    for _ in range(rounds):
        for fn, times in ((baseline, base_times), (call, call_times)):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
            between()
    ratios = [b / c for b, c in zip(base_times, call_times)]
    return statistics.median(base_times), statistics.median(call_times), statistics.median(ratios)


def _measure(quick: bool, log: Callable[[str], None], layouts: tuple[str, ...] = LAYOUTS) -> dict:
    sys.path.insert(0, str(SGLANG_TESTS))
    from sglang_cpu import import_sglang

    missing = import_sglang()
    if missing:
        raise RuntimeError(missing)
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from sglang_rig import storage_config

    num_pages = 16 if quick else 128
    rounds = 5
    tokens = num_pages * PAGE_SIZE
    device = MHATokenToKVPool(
        size=tokens,
        page_size=PAGE_SIZE,
        dtype=torch.bfloat16,
        head_num=8,
        head_dim=128,
        layer_num=32,
        device="cpu",
        enable_memory_saver=False,
    )
    info = device.get_device_pool_infos()[0].buffer_info
    page_bytes = 2 * 32 * PAGE_SIZE * 8 * 128 * 2
    batch_bytes = num_pages * page_bytes
    log(f"sglang bench: {num_pages} pages of {page_bytes / 2**20:.0f} MiB a call, median of {rounds}")

    source = torch.randint(0, 256, (batch_bytes,), dtype=torch.uint8)
    target = torch.empty_like(source)
    copy_seconds = _median_seconds(lambda: target.copy_(source), rounds)
    source_pages, target_pages = source.view(num_pages, -1), target.view(num_pages, -1)

    def copy_pages():
        for into, page in zip(target_pages, source_pages):
            into.copy_(page)

    results = [
        {
            "layout": "-",
            "store": "-",
            "method": "copy_",
            "op": "copy",
            "pages": num_pages,
            "seconds": copy_seconds,
            "gbps": batch_bytes / copy_seconds / 1e9,
        }
    ]
    summary = {}
    scratch = Path(tempfile.mkdtemp(prefix="kvstage-bench-sglang-"))

    def measure_layout(layout: str) -> None:
        """Append the layout's rows and targets; its host pool and stores go when it returns."""
        # Room for the pages written and the pages read back (ratio 2 of the device pool).
        # The memory store holds one call's pages: from the second call on, each put reuses an
        # evicted page's memory (the steady state; fresh memory would add page faults).
        host = MHATokenToKVPoolHost(
            info,
            2.0,
            0,
            PAGE_SIZE,
            layout,
            pin_memory=False,
            device_capacity_tokens=device.size,
            start_layer=device.start_layer,
            end_layer=device.end_layer,
        )
        # Every host page touched first (sglang pins its host pools, which faults them in), then
        # any bytes in the pages written.
        raw = host.kv_buffer.view(torch.uint8).view(-1)
        raw.fill_(0)
        raw[:batch_bytes].copy_(source)
        written = torch.arange(0, tokens)
        read = torch.arange(tokens, 2 * tokens)

        def open_backend(url: str):
            backend = StorageBackendFactory.create_backend("dynamic", storage_config(url), host)
            backend.register_mem_pool_host(host)
            return backend

        def kvstage_calls(backend, round_keys):
            """(set, get): a batch_set_v1 of the written pages under fresh keys, a batch_get_v1
            of the last keys set into the read pages; both check that every page made it."""

            def set_v1():
                base = next(round_keys)
                set_v1.keys = [f"{base:032x}{i:032x}" for i in range(num_pages)]
                assert all(backend.batch_set_v1(set_v1.keys, written))

            def get_v1():
                assert all(backend.batch_get_v1(set_v1.keys, read))

            return set_v1, get_v1

        for store in ("memory", "file"):
            directory = scratch / f"{layout}-{store}"
            url = f"memory:{batch_bytes}" if store == "memory" else f"file:{directory}"
            backend = open_backend(url)
            round_keys = iter(range(10**6))

            if store == "memory":
                set_v1, get_v1 = kvstage_calls(backend, round_keys)
                copy = lambda: target.copy_(source)  # noqa: E731
                _, put, put_ratio = _paired(copy, set_v1, rounds)
                _, get, get_ratio = _paired(copy, get_v1, rounds)
                for op, seconds in (("batch_set_v1", put), ("batch_get_v1", get)):
                    results.append(
                        {
                            "layout": layout,
                            "store": store,
                            "method": "kvstage",
                            "op": op,
                            "pages": num_pages,
                            "seconds": seconds,
                            "gbps": batch_bytes / seconds / 1e9,
                        }
                    )
            if store == "memory" and layout in ("layer_first", "page_first_direct"):
                for op, ratio in (("set", put_ratio), ("get", get_ratio)):
                    summary[f"memory {op} / copy_, {layout}"] = {
                        "value": round(ratio, 2),
                        "target": ">= 0.8",
                        "ok": ratio >= 0.8,
                    }
                # A second baseline: the same bytes as one copy_ a page, between contiguous tensors
                # (a store holds pages apart, so no page-by-page design beats it).
                _, _, put_ratio = _paired(copy_pages, set_v1, rounds)
                _, _, get_ratio = _paired(copy_pages, get_v1, rounds)
                for op, ratio in (("set", put_ratio), ("get", get_ratio)):
                    summary[f"memory {op} / copy_ page by page, {layout}"] = {
                        "value": round(ratio, 2),
                        "target": ">= 0.8",
                        "ok": ratio >= 0.8,
                    }
            if store == "file":
                sglang_file = HiCacheFile(storage_config("-"), file_path=str(scratch / f"{layout}-hicachefile"))
                sglang_file.register_mem_pool_host(host)
                # Allocated once, untimed: sglang's controller allocates them in every get
                # (_generic_page_get), so HiCacheFile's get is timed here without that cost.
                dummy = [host.get_dummy_flat_data_page() for _ in range(num_pages)]

                def file_set():
                    base = next(round_keys)
                    keys = [f"{base:032x}{i:032x}" for i in range(num_pages)]
                    pages = [host.get_data_page(int(written[i * PAGE_SIZE])) for i in range(num_pages)]
                    assert sglang_file.batch_set(keys, pages)
                    file_set.keys = keys

                def file_get():
                    got = sglang_file.batch_get(file_set.keys, dummy)
                    for i, page in enumerate(got):
                        host.set_from_flat_data_page(int(read[i * PAGE_SIZE]), page)

                # kvstage's default (io_threads page files at once), then one thread.
                for method, kvstage in (("kvstage", backend), ("1 thread", open_backend(f"{url}?io_threads=1"))):
                    kvstage_set, kvstage_get = kvstage_calls(kvstage, round_keys)

                    def remove_pages():
                        kvstage.clear()
                        sglang_file.clear()

                    sput, kput, set_ratio = _paired(file_set, kvstage_set, rounds, between=remove_pages)
                    file_set(), kvstage_set()  # the pages the gets read
                    sget, kget, get_ratio = _paired(file_get, kvstage_get, rounds)
                    remove_pages()
                    kvstage.close()
                    rows = (
                        ((method, "batch_set_v1", kput), (method, "batch_get_v1", kget))
                        if method != "kvstage"
                        else (
                            ("HiCacheFile", "batch_set", sput),
                            ("HiCacheFile", "batch_get", sget),
                            (method, "batch_set_v1", kput),
                            (method, "batch_get_v1", kget),
                        )
                    )
                    for name, op, seconds in rows:
                        results.append(
                            {
                                "layout": layout,
                                "store": "file",
                                "method": name,
                                "op": op,
                                "pages": num_pages,
                                "seconds": seconds,
                                "gbps": batch_bytes / seconds / 1e9,
                            }
                        )
                    suffix = "" if method == "kvstage" else f", {method}"
                    for op, ratio in (("set", set_ratio), ("get", get_ratio)):
                        summary[f"file {op}{suffix}: HiCacheFile time / kvstage time, {layout}"] = {
                            "value": round(ratio, 2),
                            "target": ">= 1.0",
                            "ok": ratio >= 1.0,
                        }
            backend.close()

    for layout in layouts:
        measure_layout(layout)
        gc.collect()  # the closures above hold the host pool in reference cycles
        log(f"  {layout}: done")
        for directory in scratch.iterdir():  # disk: every round wrote a call's pages
            shutil.rmtree(directory, ignore_errors=True)
    shutil.rmtree(scratch, ignore_errors=True)
    mla_results, mla_summary = _measure_mla(num_pages, rounds, log)
    results += mla_results
    summary.update(mla_summary)
    results += _measure_hybrid_v2(rounds, log)
    return {
        "torch_threads": torch.get_num_threads(),  # a page's copy_ is split over them
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "load_average": os.getloadavg(),  # at the end: the machine may be shared
        "pages_per_call": num_pages,
        "page_bytes": page_bytes,
        "rounds": rounds,
        "results": results,
        "summary": summary,
    }


MLA_ROUNDS_PER_ROUND = 6  # paired rounds of the MLA figures per round of the others
MLA_LAYERS, MLA_DIM = 8, 576  # DeepSeek's latent (512 + 64 rope) on 8 layers: 0.56 MiB pages of bf16


def _measure_mla(num_pages: int, rounds: int, log: Callable[[str], None]) -> tuple[list[dict], dict]:
    """MLA ``page_first_direct`` (pages contiguous in kvstage's order): ``batch_set_v1`` /
    ``batch_get_v1`` through a memory store beside one ``copy_`` of the same bytes, paired per
    round (``MLA_ROUNDS_PER_ROUND * rounds`` rounds: the calls are short, and 10 rounds' medians
    ranged 0.63 to 0.79 over six runs)."""
    rounds *= MLA_ROUNDS_PER_ROUND
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from kvstage.integrations.sglang.host_layouts import page_views

    from sglang_rig import storage_config

    tokens = num_pages * PAGE_SIZE
    device = MLATokenToKVPool(
        size=tokens,
        page_size=PAGE_SIZE,
        dtype=torch.bfloat16,
        kv_lora_rank=MLA_DIM - 64,
        qk_rope_head_dim=64,
        layer_num=MLA_LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    host = MLATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        PAGE_SIZE,
        "page_first_direct",
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
        target_layer_num=device.layer_num,
        override_kv_cache_dim=device.kv_cache_dim,
    )
    page_bytes = MLA_LAYERS * PAGE_SIZE * MLA_DIM * 2
    batch_bytes = num_pages * page_bytes
    raw = host.kv_buffer.view(torch.uint8).view(-1)
    raw.fill_(0)
    source = torch.randint(0, 256, (batch_bytes,), dtype=torch.uint8)
    target = torch.empty_like(source)
    raw[:batch_bytes].copy_(source)
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(f"memory:{batch_bytes}", mla=True), host)
    backend.register_mem_pool_host(host)
    written, read = torch.arange(0, tokens), torch.arange(tokens, 2 * tokens)
    round_keys = iter(range(10**6))

    def set_v1():
        base = next(round_keys)
        set_v1.keys = [f"{base:032x}{i:032x}" for i in range(num_pages)]
        assert all(backend.batch_set_v1(set_v1.keys, written))

    def get_v1():
        assert all(backend.batch_get_v1(set_v1.keys, read))

    copy = lambda: target.copy_(source)  # noqa: E731
    source_pages, target_pages = source.view(num_pages, -1), target.view(num_pages, -1)

    def copy_pages():  # the store's floor: one copy_ a page (torch splits each over its threads)
        for into, page in zip(target_pages, source_pages):
            into.copy_(page)

    _, put, put_ratio = _paired(copy, set_v1, rounds)
    _, get, get_ratio = _paired(copy, get_v1, rounds)
    _, _, put_pages_ratio = _paired(copy_pages, set_v1, rounds)
    _, _, get_pages_ratio = _paired(copy_pages, get_v1, rounds)
    # The adapter's ceiling: the memory store's own put / get of the same page views (no sglang
    # call, no key building, one store call), so the adapter's share of the gap is visible.
    store = backend.store
    written_views = page_views(host, written[::PAGE_SIZE].tolist())
    read_views = page_views(host, read[::PAGE_SIZE].tolist())
    _, _, store_get_ratio = _paired(copy, lambda: store.get(set_v1.keys, read_views), rounds)

    def store_put():
        base = next(round_keys)
        assert all(
            s.name == "STORED" for s in store.put([f"{base:032x}{i:032x}" for i in range(num_pages)], written_views)
        )

    _, _, store_put_ratio = _paired(copy, store_put, rounds)
    assert torch.equal(raw[batch_bytes : 2 * batch_bytes], source), "MLA pages read back differ"
    backend.close()
    log(
        f"  mla page_first_direct ({page_bytes / 2**20:.2f} MiB pages): set {put_ratio:.2f}, get {get_ratio:.2f} of copy_"
    )
    results = [
        {
            "layout": "mla page_first_direct",
            "store": "memory",
            "method": "kvstage",
            "op": op,
            "pages": num_pages,
            "page_bytes": page_bytes,
            "seconds": seconds,
            "gbps": batch_bytes / seconds / 1e9,
        }
        for op, seconds in (("batch_set_v1", put), ("batch_get_v1", get))
    ]
    summary = {
        f"memory {op} / copy_, mla page_first_direct": {
            "value": round(ratio, 2),
            "target": ">= 0.8",
            "ok": ratio >= 0.8,
        }
        for op, ratio in (("set", put_ratio), ("get", get_ratio))
    }
    for op, ratio in (("set", put_pages_ratio), ("get", get_pages_ratio)):
        summary[f"memory {op} / copy_ page by page, mla page_first_direct"] = {
            "value": round(ratio, 2),
            "target": ">= 0.8",
            "ok": ratio >= 0.8,
        }
    for op, ratio in (("put", store_put_ratio), ("get", store_get_ratio)):
        summary[f"reference: MemoryStore.{op} alone / copy_, mla page_first_direct"] = {
            "value": round(ratio, 2),
            "target": "(the adapter's ceiling)",
            "ok": True,
        }
    return results, summary


def _measure_hybrid_v2(rounds: int, log: Callable[[str], None]) -> list[dict]:
    """sglang's hybrid ``batch_set_v2`` / ``batch_get_v2`` through ``KVStageStorage`` (a memory
    store) for the Mamba and DSA pool sets of ``sglang_hybrid_rig`` (small pools: the figure is
    a call's latency, KV pages and the pool's entries together, no baseline)."""
    import torch.distributed as dist
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
    from sglang.srt.runtime_context import get_parallel

    from sglang_hybrid_rig import Rig

    # sglang's controller reads its place in the TP group and uses the default process group
    get_parallel().override_permanently(
        tp_rank=0, pp_rank=0, attn_tp_rank=0, attn_dp_rank=0, attn_cp_rank=0, attn_dcp_rank=0
    )
    rendezvous = Path(tempfile.mkdtemp(prefix="kvstage-bench-gloo-"))
    dist.init_process_group("gloo", init_method=f"file://{rendezvous / 'rendezvous'}", rank=0, world_size=1)
    results = []
    for strategy in ("mamba", "dsa"):
        rig = Rig(strategy, f"memory:{64 << 20}", seed=3)
        try:
            backend, size = rig.cc.storage_backend, rig.page_size
            num_pages = 4 if strategy == "dsa" else 8
            written, read = rig.kv.alloc(num_pages * size), rig.kv.alloc(num_pages * size)
            mamba_slots = rig.mamba.alloc(2) if strategy == "mamba" else None

            def extra(slot: int, keys: list[str]) -> PoolTransfer:
                """The pool's transfer beside the KV pages: slot 0 written, slot 1 read."""
                if mamba_slots is not None:  # the state under the run's last page
                    transfer = mamba_slots[slot : slot + 1]
                    return PoolTransfer(
                        PoolName.MAMBA, transfer, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES
                    )
                return PoolTransfer(PoolName.INDEXER, written if slot == 0 else read, keys=keys)  # on the KV slots

            round_keys = iter(range(10**6))

            def set_v2():
                base = next(round_keys)
                set_v2.keys = [f"{strategy}{base:08x}{i:08x}" for i in range(num_pages)]
                got = backend.batch_set_v2(
                    [PoolTransfer(PoolName.KV, written, keys=set_v2.keys), extra(0, set_v2.keys)]
                )
                assert all(all(hits) for hits in got.values()) and len(got) == 2, got

            def get_v2():
                got = backend.batch_get_v2([PoolTransfer(PoolName.KV, read, keys=set_v2.keys), extra(1, set_v2.keys)])
                assert all(all(hits) for hits in got.values()) and len(got) == 2, got

            for op, call in (("batch_set_v2", set_v2), ("batch_get_v2", get_v2)):  # gets read the last set
                seconds = _median_seconds(call, 2 * rounds)
                results.append(
                    {
                        "layout": f"hybrid {strategy}",
                        "store": "memory",
                        "method": "kvstage",
                        "op": op,
                        "pages": num_pages,
                        "seconds": seconds,
                        "gbps": None,
                        "us_per_call": seconds * 1e6,
                    }
                )
                log(f"  hybrid {strategy} {op}: {seconds * 1e6:.0f} us a call of {num_pages} pages")
        finally:
            rig.stop()
    dist.destroy_process_group()
    shutil.rmtree(rendezvous, ignore_errors=True)
    return results


def run(quick: bool = False, log: Callable[[str], None] = print) -> dict:
    """The figures above, measured in a process of ``.venv-sglang``'s Python (sglang's CPU
    import changes process-wide state, which must not reach the other benchmarks).

    Raises:
        RuntimeError: ``.venv-sglang`` is missing, or the run there failed (its stderr's tail).
    """
    if not SGLANG_PYTHON.exists():
        raise RuntimeError(f"{SGLANG_PYTHON} is missing: make .venv-sglang/.sglang")
    log("sglang bench: in .venv-sglang")
    args = [str(SGLANG_PYTHON), str(Path(__file__).resolve()), "--json"] + (["--quick"] if quick else [])
    result = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if result.returncode != 0:
        raise RuntimeError(f"bench_sglang in .venv-sglang failed: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module doc); ``--json`` prints the report as one JSON line
    (what :func:`run` reads), otherwise a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 pages a call instead of 128")
    parser.add_argument(
        "--layouts",
        default=",".join(LAYOUTS),
        help=f"comma-separated host layouts to measure (e.g. a before/after of one store change); known: {','.join(LAYOUTS)}",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the report as one JSON line on stdout, progress on stderr"
    )
    args = parser.parse_args(argv)
    chosen = tuple(filter(None, args.layouts.split(",")))
    unknown = sorted(set(chosen) - set(LAYOUTS))
    if unknown:
        parser.error(f"--layouts: unknown {unknown}; known: {list(LAYOUTS)}")
    if args.json:
        print(json.dumps(_measure(args.quick, lambda line: print(line, file=sys.stderr), chosen)))
        return 0
    report = _measure(args.quick, print, chosen)
    print(
        f"torch threads {report['torch_threads']}, OMP_WAIT_POLICY {report['omp_wait_policy']}, "
        f"load average {report['load_average']}"
    )
    for row in report["results"]:
        speed = f"{row['gbps']:6.2f} GB/s" if row["gbps"] is not None else f"{row['us_per_call']:6.0f} us a call"
        print(f"{row['layout']:>21} {row['store']:>6} {row['method']:>11} {row['op']:>12}  {speed}")
    for name, item in report["summary"].items():
        print(f"{name}: {item['value']} (target {item['target']}) {'PASS' if item['ok'] else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
