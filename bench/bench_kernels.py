"""Benchmark: GB/s of gather (D2H) and scatter (H2D) beside the contiguous-copy ceiling.

Shapes: Llama-3-8B (32 layers, 8 KV heads, head_dim 128, bf16, K and V) and DeepSeek-V3 MLA
(61 layers, kv_dim 576, bf16), at page sizes 1, 16 and 64. Methods, each moving the same bytes:

* ``ceiling``: one contiguous copy of the batch's bytes (GPU: a pinned ``cudaMemcpyAsync``
  D2H / H2D; CPU: ``copy_``). What a perfect gather could reach.
* ``torch``: :func:`kvstage.kernels.gather` / ``scatter`` with ``backend="torch"`` (the
  reference, ``index_select``/``index_copy_`` per layer).
* ``loop``: one ``copy_`` per (page, layer, part), what a naive engine does.
* ``triton`` / ``triton-staged`` (GPU only): the Triton kernel writing pinned memory
  directly, and the kernel into a device buffer plus ``cudaMemcpyAsync`` per run of host pages.

Timing: ``triton.testing.do_bench`` (median) on GPU; on CPU the median of repeated
``perf_counter`` runs, torch paths only: the Triton interpreter's timings mean nothing.

Slots come as whole pages at random places in the pool (as a paged allocator hands them
out; page size 1 = random single slots); host pages are one consecutive run.

Run: ``python bench/bench_kernels.py [--quick] [--json PATH] [--plot PATH]``; on a GPU
machine it times the GPU paths. ``run(quick) -> dict`` is the entry point for other scripts.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from kvstage.kernels import KVPool, gather, scatter, staging_shape, warm_up

CASES = {
    "llama3-8b": dict(parts=2, layers=32, heads=8, dim=128),
    "deepseek-v3-mla": dict(parts=1, layers=61, heads=1, dim=576),
}
PAGE_SIZES = (1, 16, 64)
DTYPE = torch.bfloat16
# the per-page loop issues num_pages * layers * parts copies; above this many it times a prefix of the batch
LOOP_MAX_COPIES = {"cpu": 1 << 14, "cuda": 1 << 15}
CPU_NOTE = "CPU: only torch paths are timed; the Triton interpreter's timings mean nothing."


def batch_tokens(device: torch.device, quick: bool) -> int:
    """Tokens per batch: enough bytes to be meaningful (CPU 256 MB for Llama; GPU 1 GB)."""
    if device.type == "cuda":
        return 2048 if quick else 8192
    return 512 if quick else 2048


def make_case(name: str, page_size: int, num_tokens: int, device: torch.device, seed: int = 0):
    """A pool of twice the batch's slots, a pinned (GPU) staging buffer, and the batch's indices."""
    shape = CASES[name]
    num_pages = num_tokens // page_size
    num_slots = 2 * num_pages * page_size
    buffers = [
        [
            torch.empty((num_slots, shape["heads"], shape["dim"]), dtype=DTYPE, device=device)
            for _ in range(shape["layers"])
        ]
        for _ in range(shape["parts"])
    ]
    for i, part in enumerate(buffers):
        for j, t in enumerate(part):
            t.fill_(float((i * 131 + j) % 97))
    pool = KVPool.mla(buffers[0]) if shape["parts"] == 1 else KVPool.mha(buffers[0], buffers[1])
    pin = device.type == "cuda"
    staging = torch.zeros(staging_shape(pool, num_pages, page_size), dtype=DTYPE, pin_memory=pin)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randperm(num_slots // page_size, generator=gen)[:num_pages] * page_size
    slot_indices = (starts[:, None] + torch.arange(page_size)).reshape(-1).to(device)
    host_page_ids = torch.arange(num_pages)
    return pool, staging, slot_indices, host_page_ids


def page_loop(
    pool: KVPool,
    staging: torch.Tensor,
    slot_indices: torch.Tensor,
    host_page_ids: torch.Tensor,
    page_size: int,
    *,
    to_host: bool,
) -> Callable[[], None]:
    """The naive engine: one ``copy_`` per (page, layer, part) of whole page runs."""
    firsts = slot_indices.view(-1, page_size)[:, 0].tolist()
    host = host_page_ids.tolist()
    non_blocking = pool.device.type == "cuda"
    planes = [
        (layer, part, pool.buffers[part][layer]) for layer in range(pool.num_layers) for part in range(pool.kv_parts)
    ]

    def run() -> None:
        for first, h in zip(firsts, host):
            for layer, part, buffer in planes:
                if to_host:
                    staging[h, layer, part].copy_(buffer[first : first + page_size], non_blocking=non_blocking)
                else:
                    buffer[first : first + page_size].copy_(staging[h, layer, part], non_blocking=non_blocking)

    return run


def time_medians(fns: dict[str, Callable[[], None]], device: torch.device, *, quick: bool) -> dict[str, float]:
    """Median seconds of each function.

    GPU: ``triton.testing.do_bench`` (median) per function. CPU: the functions take turns,
    one run each per round, so that load from other processes hits them alike (on a shared
    machine the spread between runs is larger than the differences being measured).
    """
    if device.type == "cuda":
        import triton.testing

        warmup, rep = (10, 40) if quick else (25, 200)
        return {
            name: triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") / 1e3
            for name, fn in fns.items()
        }
    for fn in fns.values():
        fn()  # warm up: page faults, allocator
    times: dict[str, list[float]] = {name: [] for name in fns}
    budget = 0.3 if quick else 1.5
    rounds, begin = 0, time.perf_counter()
    while rounds < 3 or (rounds < 15 and time.perf_counter() - begin < budget):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
        rounds += 1
    return {name: statistics.median(values) for name, values in times.items()}


def _ceiling(nbytes: int, device: torch.device, *, to_host: bool) -> Callable[[], None]:
    numel = nbytes // 2
    if device.type == "cuda":
        dev = torch.ones(numel, dtype=DTYPE, device=device)
        host = torch.zeros(numel, dtype=DTYPE, pin_memory=True)
        if to_host:
            return lambda: host.copy_(dev, non_blocking=True)
        return lambda: dev.copy_(host, non_blocking=True)
    src, dst = torch.ones(numel, dtype=DTYPE), torch.zeros(numel, dtype=DTYPE)
    return lambda: dst.copy_(src)


def methods_for(device: torch.device) -> list[str]:
    names = ["ceiling", "torch", "loop"]
    if device.type == "cuda":
        names += ["triton", "triton-staged"]
    return names


def _methods(device, pool, staging, slot_indices, host_page_ids, page_size, nbytes, *, op, max_programs):
    """The functions to time for one (case, page size, op), and the bytes each moves."""
    to_host = op == "gather"
    fns: dict[str, Callable[[], None]] = {"ceiling": _ceiling(nbytes, device, to_host=to_host)}
    moved = {"ceiling": nbytes}
    for method in methods_for(device)[1:]:
        if method == "loop":
            keep = max(1, min(host_page_ids.numel(), LOOP_MAX_COPIES[device.type] // (pool.num_layers * pool.kv_parts)))
            fns[method] = page_loop(
                pool, staging, slot_indices[: keep * page_size], host_page_ids[:keep], page_size, to_host=to_host
            )
            moved[method] = nbytes * keep // host_page_ids.numel()
            continue
        backend, mode = (
            ("torch", "kernel")
            if method == "torch"
            else ("triton", "staged" if method.endswith("staged") else "kernel")
        )
        options = dict(page_size=page_size, backend=backend, mode=mode, max_programs=max_programs)
        if to_host:
            fns[method] = functools.partial(gather, pool, staging, slot_indices, host_page_ids, **options)
        else:
            fns[method] = functools.partial(scatter, staging, pool, slot_indices, host_page_ids, **options)
        moved[method] = nbytes
    return fns, moved


def run(
    quick: bool = False,
    *,
    device: str | torch.device | None = None,
    cases: tuple[str, ...] = tuple(CASES),
    page_sizes: tuple[int, ...] = PAGE_SIZES,
    max_programs: int | None = None,
    threads: int | None = None,
    num_tokens: int | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Time every case x page size x op x method; return the results as a JSON-able dict.

    Args:
        quick: a smaller batch and fewer repetitions (seconds instead of a minute).
        device: ``"cuda"`` when available else ``"cpu"`` by default.
        max_programs: grid cap for the Triton paths (``None`` = the default heuristic).
        threads: torch intra-op threads while timing; ``None`` = 1 on CPU (every method alike:
            on a shared machine OpenMP barriers wait out other processes' time slices and the
            numbers turn to noise), unchanged on GPU.
        num_tokens: tokens per batch (default :func:`batch_tokens`); a multiple of every page size.
        log: where progress lines go.

    Returns:
        ``{"device", "torch", "note", "num_tokens", "results": [{case, page_size, op, method,
        bytes, seconds, gbps, of_ceiling, of_loop}], "summary": {...}}``.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if threads is None and device.type == "cpu":
        threads = 1
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    num_tokens = num_tokens or batch_tokens(device, quick)
    results: list[dict] = []
    try:
        for case in cases:
            for page_size in page_sizes:
                pool, staging, slot_indices, host_page_ids = make_case(case, page_size, num_tokens, device)
                if device.type == "cuda":
                    warm_up(pool, page_size)  # compile the kernel variants outside the timed runs
                nbytes = staging.numel() * staging.element_size()
                for op in ("gather", "scatter"):
                    fns, moved = _methods(
                        device,
                        pool,
                        staging,
                        slot_indices,
                        host_page_ids,
                        page_size,
                        nbytes,
                        op=op,
                        max_programs=max_programs,
                    )
                    seconds = time_medians(fns, device, quick=quick)
                    row = {m: moved[m] / seconds[m] / 1e9 for m in fns}
                    for m in fns:
                        results.append(
                            dict(
                                case=case,
                                page_size=page_size,
                                op=op,
                                method=m,
                                bytes=moved[m],
                                seconds=seconds[m],
                                gbps=row[m],
                                of_ceiling=row[m] / row["ceiling"],
                                of_loop=row[m] / row["loop"],
                            )
                        )
                    log(
                        f"{case:16s} page {page_size:3d} {op:8s} "
                        + "  ".join(f"{m} {g:6.2f}" for m, g in row.items())
                        + f"  GB/s ({nbytes / 1e6:.0f} MB)"
                    )
                del pool, staging, slot_indices, host_page_ids
    finally:
        torch.set_num_threads(previous_threads)
    report = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()}, {threads} torch threads of {os.cpu_count()})",
        "torch": torch.__version__,
        "num_tokens": num_tokens,
        "threads": torch.get_num_threads() if threads is None else threads,
        "quick": quick,
        "note": None if device.type == "cuda" else CPU_NOTE,
        "results": results,
        "summary": summarize(results, device),
    }
    if report["note"]:
        log(report["note"])
    return report


def summarize(results: list[dict], device: torch.device) -> dict:
    """The targets of issue 4 per op and page size, as ``{name: {"value", "target", "ok"}}``.

    GPU: the Triton kernel at >= 90% of the pinned memcpy, and >= 3x the per-page loop at
    page size 16. CPU: the torch path at >= 70% of ``copy_``.
    """
    summary: dict[str, dict] = {}
    method, key, target = ("triton", "of_ceiling", 0.9) if device.type == "cuda" else ("torch", "of_ceiling", 0.7)
    ceiling = "pinned memcpy" if device.type == "cuda" else "copy_"
    for r in results:
        if r["method"] == method:
            name = f"{method} {r['op']} / {ceiling}, {r['case']} page {r['page_size']}"
            summary[name] = dict(value=r[key], target=target, ok=r[key] >= target)
    if device.type == "cuda":
        for r in results:
            if r["method"] == "triton" and r["page_size"] == 16:
                name = f"triton {r['op']} / per-page loop, {r['case']} page 16"
                summary[name] = dict(value=r["of_loop"], target=3.0, ok=r["of_loop"] >= 3.0)
    return summary


def plot(report: dict, path: str | Path) -> None:
    """Bar charts of GB/s: one panel per (op, case), bars per page size and method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    cases = list(dict.fromkeys(r["case"] for r in results))
    page_sizes = list(dict.fromkeys(r["page_size"] for r in results))
    methods = list(dict.fromkeys(r["method"] for r in results))
    fig, axes = plt.subplots(2, len(cases), figsize=(6 * len(cases), 7), squeeze=False)
    width = 0.8 / len(methods)
    for i, op in enumerate(("gather", "scatter")):
        for j, case in enumerate(cases):
            ax = axes[i][j]
            for k, method in enumerate(methods):
                values = [
                    next(
                        (
                            r["gbps"]
                            for r in results
                            if (r["case"], r["page_size"], r["op"], r["method"]) == (case, p, op, method)
                        ),
                        0.0,
                    )
                    for p in page_sizes
                ]
                ax.bar([x + k * width for x in range(len(page_sizes))], values, width, label=method)
            ax.set_xticks(
                [x + width * (len(methods) - 1) / 2 for x in range(len(page_sizes))], [f"page {p}" for p in page_sizes]
            )
            ax.set_title(f"{op} ({'D2H' if op == 'gather' else 'H2D'}), {case}")
            ax.set_ylabel("GB/s")
            ax.legend(fontsize="small")
    fig.suptitle(
        f"kvstage gather/scatter on {report['device']}" + (f"\n{report['note']}" if report.get("note") else ""),
        fontsize="medium",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small batch, few repetitions")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--case", action="append", choices=list(CASES), help="repeatable; default all")
    parser.add_argument("--page-size", action="append", type=int, help="repeatable; default 1 16 64")
    parser.add_argument("--max-programs", type=int, default=None, help="Triton grid cap (GPU)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads while timing (default 1 on CPU)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="write a PNG bar chart here")
    args = parser.parse_args(argv)
    report = run(
        args.quick,
        device=args.device,
        cases=tuple(args.case or CASES),
        page_sizes=tuple(args.page_size or PAGE_SIZES),
        max_programs=args.max_programs,
        threads=args.threads,
    )
    for name, item in report["summary"].items():
        print(f"{'PASS' if item['ok'] else 'MISS'} {name}: {item['value']:.2f} (target {item['target']})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
