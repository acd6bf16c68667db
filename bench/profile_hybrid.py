"""Where a hybrid store and load of ``bench_hybrid.py`` spend their time (issue 27), step by step.

Two parts, on the benchmark's own rig (:class:`bench_hybrid._Rig`, full shape unless ``--quick``):

* ``timeline``: the copies and store calls of one round's store and load, each with its thread,
  start (ms after the call began) and duration: the copier's gather/scatter of the full pages,
  the component copies (``hy.*``: window pages, state snapshot) and the store's ``_put``,
  ``_get``, ``_adopt``, ``_lend``. What is on the critical path shows as the steps that follow
  each other.
* ``floors``: the full pages' copies alone next to one ``copy_`` of the same bytes: the gather
  into the host pool and the scatter from it (one index op per layer-part), and the same pages
  moved one hop as the one-hop path must move them, one ``copy_`` per (page, layer, part) into
  or out of a page buffer of its own (the memory a store adopts or lends), in one
  ``torch._foreach_copy_``. Their ratio to ``copy`` bounds what a store or load can reach.

Usage: python bench/profile_hybrid.py [--quick] [--model qwen3-next|gpt-oss]
(run it under ``flock /tmp/machine.lock`` and quote the load average it prints).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_hybrid  # noqa: E402

import kvstage.offload.copier as copier_module  # noqa: E402
import kvstage.offload.hybrid as hybrid_module  # noqa: E402
from kvstage.kernels import gather, scatter  # noqa: E402
from kvstage.offload import HostPool  # noqa: E402
from kvstage.offload.row_copies import RowCopies  # noqa: E402
from kvstage.storage import MemoryStore  # noqa: E402

PAGE_SIZE = bench_hybrid.PAGE_SIZE


class _Timeline:
    """Wraps the functions the paths call and records ``(thread, step, start_ms, took_ms)``."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, float, float]] = []
        self.started = 0.0
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                ended = time.perf_counter()
                self.events.append(
                    (threading.current_thread().name, label, (started - self.started) * 1e3, (ended - started) * 1e3)
                )

        self._undo.append((owner, name, original))
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    def start(self) -> None:
        self.events.clear()
        self.started = time.perf_counter()


def timeline(name: str, layout, num_pages: int, rounds: int = 6) -> list[dict]:
    """The steps of the last of ``rounds`` store/load rounds (the first ones fill the stores to
    capacity and the staging pool with the buffers the store hands back: the steady state)."""
    recorder = _Timeline()
    for owner, steps in (
        (copier_module, ("gather", "scatter")),
        (hybrid_module, ("gather", "scatter", "gather_state", "scatter_state")),
    ):
        prefix = "copier" if owner is copier_module else "hy"
        for step in steps:
            recorder.wrap(owner, step, f"{prefix}.{step}")
    for step in ("_put", "_get", "_adopt", "_lend"):
        recorder.wrap(MemoryStore, step, f"store.{step}")
    recorder.wrap(RowCopies, "copy_plan", "rows.copy_plan")  # the one-hop copies (host pages of their own)
    rig = bench_hybrid._Rig(name, layout, num_pages)
    out = []
    try:
        for index in range(rounds):
            prompt = [(index * 7919 + t) % 150_000 for t in range(num_pages * PAGE_SIZE + 1)]
            for path, call, rid in (("store", rig.store, f"s{index}"), ("load", rig.load, f"l{index}")):
                recorder.start()
                seconds = call(prompt, rid)
                if index == rounds - 1:
                    out.append({"path": path, "ms": seconds * 1e3, "steps": list(recorder.events)})
    finally:
        rig.manager.close()
        recorder.restore()
    return out


def _median_ms(call, repeats: int = 15) -> float:
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def floors(name: str, layout, num_pages: int) -> dict:
    """Milliseconds of the full pages' copies alone (module doc), and each one's ratio to ``copy``."""
    rig = bench_hybrid._Rig(name, layout, num_pages)
    try:
        pool = rig.kv_pool
        staging = HostPool.like(pool, num_pages=num_pages + 1, page_size=PAGE_SIZE, pin=False).buffers[0]
        local = torch.arange(num_pages)
        page_bytes = staging[0].numel() * staging.element_size()
        own = [torch.ones(page_bytes, dtype=torch.uint8) for _ in range(num_pages)]  # touched, as a store's
        layers, parts = pool.num_layers, pool.kv_parts
        device = [
            [
                pool.buffers[p][layer].view(torch.uint8).view(-1, page_bytes // (layers * parts))
                for layer in range(layers)
            ]
            for p in range(parts)
        ]
        store_pages = (rig.store_slots.view(-1, PAGE_SIZE)[:, 0] // PAGE_SIZE).tolist()
        load_pages = (rig.load_slots.view(-1, PAGE_SIZE)[:, 0] // PAGE_SIZE).tolist()
        planes = [
            page.view(layers, parts, -1)[layer, p] for page in own for layer in range(layers) for p in range(parts)
        ]
        sources = [device[p][layer][i] for i in store_pages for layer in range(layers) for p in range(parts)]
        targets = [device[p][layer][i] for i in load_pages for layer in range(layers) for p in range(parts)]
        source = torch.ones(num_pages * page_bytes, dtype=torch.uint8)
        target = torch.zeros_like(source)
        ms = {
            "copy": _median_ms(lambda: target.copy_(source)),
            "gather_host_pool": _median_ms(
                lambda: gather(
                    pool, staging, rig.store_slots, local, page_size=PAGE_SIZE, backend="torch", check_bounds=False
                )
            ),
            "scatter_host_pool": _median_ms(
                lambda: scatter(
                    staging, pool, rig.load_slots, local, page_size=PAGE_SIZE, backend="torch", check_bounds=False
                )
            ),
            "gather_own_pages": _median_ms(lambda: torch._foreach_copy_(planes, sources)),
            "scatter_own_pages": _median_ms(lambda: torch._foreach_copy_(targets, planes)),
        }
    finally:
        rig.manager.close()
    return {
        "model": name,
        "mib": round(num_pages * page_bytes / 2**20, 1),
        "copies_one_hop": len(planes),
        "copy_kib": page_bytes // (layers * parts) // 1024,
        **{f"{key}_ms": round(value, 2) for key, value in ms.items()},
        **{f"copy_over_{key}": round(ms["copy"] / value, 2) for key, value in ms.items() if key != "copy"},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the benchmark's --quick layouts (8 pages)")
    parser.add_argument("--model", choices=("qwen3-next", "gpt-oss"), help="one layout only")
    args = parser.parse_args(argv)
    layouts = {"qwen3-next": bench_hybrid.qwen3_next(args.quick), "gpt-oss": bench_hybrid.gpt_oss(args.quick)}
    num_pages = 8 if args.quick else 32
    print(f"load average at start {[round(x, 2) for x in os.getloadavg()]}")
    for name, layout in layouts.items():
        if args.model not in (None, name):
            continue
        for item in timeline(name, layout, num_pages):
            print(f"{name} {item['path']} {item['ms']:.2f} ms")
            for thread, step, start, took in item["steps"]:
                print(f"  {thread:<24} {step:<18} at {start:7.2f} ms took {took:6.2f} ms")
        print(floors(name, layout, num_pages))
    print(f"load average at end {[round(x, 2) for x in os.getloadavg()]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
