"""The load path's speed: prefetched host pages into a request's device slots, against a copy.

What is measured, per round (median of many rounds; the baseline runs in the same round):

- ``copy``: one ``Tensor.copy_`` of the same bytes from a host buffer into a contiguous tensor
  on the pool's device (the ceiling: no gather of scattered slots, no page structure; on CPU
  torch splits it over every core);
- ``copy_one_thread`` (CPU): the same copy on one thread, as the copy stream's worker runs;
- ``scatter``: :func:`kvstage.kernels.scatter` of the pages into scattered slots, every layer
  in one call (the kernels alone);
- ``load``: :meth:`OffloadManager.load` of a prefetched prefix into scattered slots, every
  layer in one copy, until the copy has finished (the manager, copier and copy stream included);
- ``first layer``: a layer-by-layer load until layer 0's copy has finished (when the forward
  pass may start), beside the whole layer-by-layer load.

The layout is llama3-8b's per-layer shape (8 KV heads of 128, bfloat16) with fewer layers so
that the bench fits a small machine; pages of 64 tokens. On CPU the copies run the torch
backend on the copy stream's worker thread (``backend="auto"`` picks native Triton on CUDA).
Target (issue 12): ``load`` >= 70% of ``copy`` on CPU.

Usage: python bench/bench_load.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from kvstage.hashing import PageHasher
from kvstage.kernels import KVPool, scatter
from kvstage.offload import HostPool, OffloadManager
from kvstage.offload.testing import SimpleRequest
from kvstage.storage import LayoutFingerprint, MemoryStore

PAGE_SIZE = 64
NUM_HEADS, HEAD_DIM = 8, 128
TARGET_LOAD_OVER_COPY = 0.70


def _pool(num_layers: int, num_slots: int, device: torch.device) -> KVPool:
    shape = (num_slots, NUM_HEADS, HEAD_DIM)
    k = [torch.randn(shape, device=device).to(torch.bfloat16) for _ in range(num_layers)]
    v = [torch.randn(shape, device=device).to(torch.bfloat16) for _ in range(num_layers)]
    return KVPool.mha(k, v)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(num_layers: int, num_pages: int, rounds: int, device: torch.device, backend: str = "auto") -> dict:
    """One configuration: a prefix of ``num_pages`` pages of ``num_layers`` layers."""
    num_tokens = num_pages * PAGE_SIZE
    num_slots = 4 * num_tokens
    kv_pool = _pool(num_layers, num_slots, device)
    host_pool = HostPool.like(kv_pool, num_pages=num_pages, page_size=PAGE_SIZE)
    page_bytes = host_pool.page_bytes
    total_bytes = num_pages * page_bytes
    store = MemoryStore(
        LayoutFingerprint.of(kv_pool, page_size=PAGE_SIZE, model_id="bench-load"), capacity_pages=num_pages
    )
    hasher = PageHasher(page_size=PAGE_SIZE)
    generator = torch.Generator().manual_seed(0)
    # Scattered whole pages of slots, as a pool after some churn hands them out.
    page_order = torch.randperm(num_slots // PAGE_SIZE, generator=generator)[:num_pages]
    slot_indices = (page_order.view(-1, 1) * PAGE_SIZE + torch.arange(PAGE_SIZE)).view(-1).to(device)
    manager = OffloadManager(kv_pool, host_pool, store, hasher, lambda req: slot_indices, backend=backend)
    prompt = list(range(num_tokens + 1))
    keys = hasher.prefill_keys(prompt[:num_tokens])
    pages = [torch.randn(page_bytes // 2, generator=generator).to(torch.bfloat16) for _ in range(num_pages)]
    store.put(keys, pages)

    host = torch.empty(total_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    target = torch.empty(total_bytes, dtype=torch.uint8, device=device)
    staging = host_pool.buffers[0]
    staged_ids = torch.arange(num_pages)
    results: dict[str, list[float]] = {
        "copy": [],
        "copy_one_thread": [],
        "scatter": [],
        "load": [],
        "first_layer": [],
        "layer_by_layer": [],
    }
    for round_index in range(rounds + 1):  # round 0 warms up
        started = time.perf_counter()
        target.copy_(host, non_blocking=True)
        _sync(device)
        copy_s = time.perf_counter() - started
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        started = time.perf_counter()
        target.copy_(host, non_blocking=True)
        _sync(device)
        copy_one_thread_s = time.perf_counter() - started
        torch.set_num_threads(threads)

        started = time.perf_counter()
        scatter(staging, kv_pool, slot_indices, staged_ids, page_size=PAGE_SIZE, backend=backend)
        _sync(device)
        scatter_s = time.perf_counter() - started

        timings = {}
        for layer_by_layer in (False, True):
            req = SimpleRequest(f"r{round_index}-{layer_by_layer}", prompt)
            handle = manager.prefetch(req, policy="wait_complete")
            handle.wait()
            assert handle.pages_ready == num_pages
            started = time.perf_counter()
            load = manager.load(handle, slot_indices, layer_by_layer=layer_by_layer)
            if layer_by_layer:
                load.layer_handle(0).synchronize()
                timings["first_layer"] = time.perf_counter() - started
            load.layer_handle(num_layers - 1).synchronize()
            timings["layer_by_layer" if layer_by_layer else "load"] = time.perf_counter() - started
            assert load.error is None
            manager.abort(req)
            manager.poll()
        if round_index:
            results["copy"].append(copy_s)
            results["copy_one_thread"].append(copy_one_thread_s)
            results["scatter"].append(scatter_s)
            for name, seconds in timings.items():
                results[name].append(seconds)
    manager.close()
    loaded = kv_pool.layer(1, num_layers - 1)[slot_indices[-PAGE_SIZE:]]
    expected = pages[-1].view(num_layers, 2, PAGE_SIZE, NUM_HEADS, HEAD_DIM)[num_layers - 1, 1].to(device)
    assert torch.equal(loaded, expected), "the load put other bytes in the slots"
    medians = {name: statistics.median(values) for name, values in results.items()}
    gbps = {name: total_bytes / seconds / 1e9 for name, seconds in medians.items() if name != "first_layer"}
    return {
        "num_layers": num_layers,
        "num_pages": num_pages,
        "bytes": total_bytes,
        "gbps": {name: round(value, 2) for name, value in gbps.items()},
        "load_over_copy": round(gbps["load"] / gbps["copy"], 3),
        "load_over_one_thread_copy": round(gbps["load"] / gbps["copy_one_thread"], 3),
        "scatter_over_copy": round(gbps["scatter"] / gbps["copy"], 3),
        "first_layer_ms": round(medians["first_layer"] * 1e3, 2),
        "layer_by_layer_ms": round(medians["layer_by_layer"] * 1e3, 2),
        "load_ms": round(medians["load"] * 1e3, 2),
    }


def run(quick: bool = False, device: str | None = None) -> dict:
    """Measure each configuration; returns the results and whether the target is met."""
    chosen = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rounds = 5 if quick else 15
    configs = [(4, 16)] if quick else [(4, 16), (8, 32)]
    results = [measure(layers, pages, rounds, chosen) for layers, pages in configs]
    return {
        "benchmark": "load_path",
        "config": {
            "page_size": PAGE_SIZE,
            "num_heads": NUM_HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "bfloat16",
            "rounds": rounds,
            "device": str(chosen),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "results": results,
        "target_load_over_copy": TARGET_LOAD_OVER_COPY,
        "meets_target": all(r["load_over_copy"] >= TARGET_LOAD_OVER_COPY for r in results),
    }


def print_report(report: dict) -> None:
    print(
        f"load path vs a same-size copy on {report['config']['device']}, GB/s (median of {report['config']['rounds']} rounds)"
    )
    print(
        f"{'layers':>6} {'pages':>6} {'MiB':>6} {'copy':>7} {'copy 1t':>8} {'scatter':>8} {'load':>7} {'load/copy':>10} {'load/1t':>8} {'first layer ms':>15} {'all layers ms':>14}"
    )
    for r in report["results"]:
        g = r["gbps"]
        print(
            f"{r['num_layers']:>6} {r['num_pages']:>6} {r['bytes'] / 2**20:>6.0f} {g['copy']:>7.2f} {g['copy_one_thread']:>8.2f} {g['scatter']:>8.2f} {g['load']:>7.2f} "
            f"{r['load_over_copy']:>10.2f} {r['load_over_one_thread_copy']:>8.2f} {r['first_layer_ms']:>15.2f} {r['layer_by_layer_ms']:>14.2f}"
        )
    print(f"target: load >= {report['target_load_over_copy']:.0%} of copy -> {report['meets_target']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small configuration, few rounds (a smoke run)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda where present)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    report = run(quick=args.quick, device=args.device)
    print_report(report)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
