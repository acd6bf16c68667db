"""Benchmark: host-to-host copies of many rows (:func:`kvstage.kernels.host_copy.copy_rows`)
against one ``copy_`` of the same bytes.

* ``rows``: a batch of rows from one source allocation (a host pool's pages) into separate
  buffers (a store's pages), 512 MiB a batch (``--quick``: 64 MiB): rows of 1 MiB, 0.5625 MiB
  (an MLA page: 8 layers x 64 tokens x 576 bf16) and 64 KiB. Each round times, back to back:
  one ``copy_`` of the whole batch between two tensors (torch splits it over its threads; glibc
  ``memcpy`` streams above its non-temporal threshold, 192 MiB on a 32 MiB-L3 EPYC), then
  ``copy_rows`` on 1 thread, :class:`~kvstage.offload.row_copies.RowCopies` on 2 threads (its
  threads share the rows, one ``copy_rows`` call each), a ``numpy.copyto`` loop and a
  ``copy_`` loop (one a row). Figures: median seconds, and the median of the per-round ratios
  ``copy_ seconds / method seconds`` (1.0: as fast as one ``copy_``).
* ``--threshold``: the measurement behind ``STREAM_MIN_BYTES`` (``kernels/_host_copy.c``): the
  C copy with streaming stores for every row against ``memcpy`` for every row, into targets
  not in cache (each call writes another part of a 1 GiB arena), batches of 64 KiB to 32 MiB
  of 4 KiB, 64 KiB and 1 MiB rows.

Target (issue 29 items 5 and 6): copy_rows of 1 MiB rows >= 0.8 of one ``copy_``.

Run: ``python bench/bench_host_copy.py [--quick] [--threshold] [--rounds N] [--json PATH]``;
``run(quick) -> dict`` is the entry point of ``python -m bench``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reporting import write_report  # noqa: E402

from kvstage.kernels import host_copy  # noqa: E402
from kvstage.offload.row_copies import RowCopies  # noqa: E402

MIB = 1 << 20
ROW_BYTES = (MIB, 8 * 64 * 576 * 2, 64 << 10)


def _paired(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, dict[str, float]]:
    """Each round runs every call once, in order (the first is the baseline); per call: median
    seconds and the median of the per-round ratios baseline / call."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - started)
    baseline = next(iter(times.values()))
    return {
        name: {
            "seconds": statistics.median(spent),
            "ratio": statistics.median(b / s for b, s in zip(baseline, spent)),
        }
        for name, spent in times.items()
    }


def measure_rows(batch_bytes: int, rounds: int, log: Callable[[str], None]) -> list[dict]:
    """The ``rows`` results: one dict a (row size, method)."""
    source = torch.randint(0, 256, (batch_bytes,), dtype=torch.uint8)
    whole = torch.empty_like(source)
    results = []
    for row_bytes in ROW_BYTES:
        count = batch_bytes // row_bytes
        sources = list(source[: count * row_bytes].view(count, row_bytes).unbind())
        targets = [torch.empty(row_bytes, dtype=torch.uint8) for _ in range(count)]
        for target in targets:
            target.fill_(0)  # faulted in: the store reuses its buffers
        source_arrays, target_arrays = [s.numpy() for s in sources], [t.numpy() for t in targets]
        pairs = list(zip(targets, sources))
        two = RowCopies(2)

        def numpy_loop():
            for target, row in zip(target_arrays, source_arrays):
                np.copyto(target, row)

        def copy_loop():
            for target, row in zip(targets, sources):
                target.copy_(row)

        calls = {
            "one copy_": lambda: whole[: count * row_bytes].copy_(source[: count * row_bytes]),
            "copy_rows": lambda: host_copy.copy_rows(targets, sources),
            "copy_rows 2 threads": lambda: two.copy(pairs),
            "numpy.copyto loop": numpy_loop,
            "copy_ loop": copy_loop,
        }
        try:
            figures = _paired(calls, rounds)
        finally:
            two.close()
        assert all(torch.equal(t, s) for t, s in zip(targets[:: max(1, count // 16)], sources[:: max(1, count // 16)]))
        for method, figure in figures.items():
            seconds = figure["seconds"]
            results.append(
                {
                    "row_bytes": row_bytes,
                    "rows": count,
                    "method": method,
                    "seconds": seconds,
                    "gbps": count * row_bytes / seconds / 1e9,
                    "of_one_copy": round(figure["ratio"], 3),
                }
            )
        log(
            f"  {row_bytes / MIB:.4g} MiB x {count}: "
            + ", ".join(f"{m} {f['seconds'] * 1e3:.1f} ms ({f['ratio']:.2f})" for m, f in figures.items())
        )
    return results


def measure_threshold(rounds: int, log: Callable[[str], None]) -> list[dict]:
    """The ``--threshold`` results: streaming every row vs memcpy every row, cold targets."""
    compiled = host_copy._compiled
    if compiled is None:
        raise RuntimeError(f"--threshold needs the C extension: {host_copy.describe_host_copy()}")
    arena_bytes = 1 << 30
    arena, source = np.ones(arena_bytes, dtype=np.uint8), np.ones(arena_bytes, dtype=np.uint8)
    results = []
    for batch in (32 * MIB, 8 * MIB, 2 * MIB, 512 << 10, 64 << 10):
        slots = arena_bytes // batch
        for row_bytes in (4 << 10, 64 << 10, MIB):
            count = batch // row_bytes
            if count == 0:
                continue
            sizes = np.full(count, row_bytes, dtype=np.uint64)
            offsets = np.arange(count, dtype=np.uint64) * np.uint64(row_bytes)
            base_target, base_source = arena.ctypes.data, source.ctypes.data
            calls_per_round = min(slots, 64)
            slot = [0]

            def run(stream_min: int) -> None:
                for _ in range(calls_per_round):
                    k = slot[0] % slots
                    slot[0] += 1
                    targets = offsets + np.uint64(base_target + k * batch)
                    sources = offsets + np.uint64(base_source + ((k * 7919) % slots) * batch)
                    compiled.copy_rows(targets, sources, sizes, stream_min)

            figures = _paired({"memcpy": lambda: run(1 << 62), "streaming": lambda: run(0)}, rounds)
            for method, figure in figures.items():
                results.append(
                    {
                        "batch_bytes": batch,
                        "row_bytes": row_bytes,
                        "method": method,
                        "seconds": figure["seconds"] / calls_per_round,
                        "memcpy_over_this": round(figure["ratio"], 3),
                    }
                )
            log(
                f"  batch {batch >> 10} KiB, rows {row_bytes >> 10} KiB: memcpy "
                f"{figures['memcpy']['seconds'] / calls_per_round * 1e6:.0f} us, streaming "
                f"{figures['streaming']['seconds'] / calls_per_round * 1e6:.0f} us (x{figures['streaming']['ratio']:.2f})"
            )
    return results


def run(quick: bool = False, rounds: int | None = None, threshold: bool = False, log=print) -> dict:
    """The report: ``results`` (one dict a row size and method), ``summary`` (the target)."""
    rounds = rounds or (5 if quick else 15)
    batch = (64 if quick else 512) * MIB
    log(f"host_copy bench: {batch // MIB} MiB a batch, {rounds} rounds, {host_copy.describe_host_copy()}")
    results = measure_rows(batch, rounds, log)
    one_mib = {r["method"]: r["of_one_copy"] for r in results if r["row_bytes"] == MIB}
    summary = {
        f"1 MiB rows, {method} / one copy_": {
            "value": one_mib[method],
            "target": ">= 0.8",
            "ok": one_mib[method] >= 0.8,
        }
        for method in ("copy_rows", "copy_rows 2 threads")
    }
    report = {
        "implementation": host_copy.describe_host_copy(),
        "torch_threads": torch.get_num_threads(),
        "batch_bytes": batch,
        "rounds": rounds,
        "results": results,
        "summary": summary,
    }
    if threshold:
        report["threshold"] = measure_threshold(rounds, log)
    report["load_average"] = os.getloadavg()
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB batches, 5 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 15; --quick: 5)")
    parser.add_argument("--threshold", action="store_true", help="also the streaming threshold measurement")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args = parser.parse_args()
    report = run(args.quick, args.rounds, args.threshold)
    for name, target in report["summary"].items():
        print(f"{name}: {target['value']} (target {target['target']})")
    print(f"load average at the end: {report['load_average']}")
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
