"""What a replay prints and writes: a progress bar, a summary table and the JSON report.

Units: bytes, seconds, GB/s with GB = 1e9 bytes, tokens/s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0


def build_report(engine, verify, *, trace_name: str, elapsed_s: float, round_trip=None) -> dict[str, Any]:
    """Every figure of one replay as a flat JSON-able dict (see the README for the fields).

    Args:
        engine: the :class:`kvstage.replay.engine.ReplayEngine` after ``run()``.
        verify: the :class:`kvstage.replay.verify.VerifyResult`.
        trace_name: the trace file's name or ``"built-in synthetic"``.
        round_trip: the :class:`kvstage.replay.verify.RoundTripResult` (None: not run).
        elapsed_s: wall-clock seconds of the whole command (setup, run, verify).
    """
    stats, config, model = engine.stats, engine.config, engine.model
    metrics = engine.manager.metrics
    storage_stats = engine.storage.stats
    bytes_d2h = stats.prefill_bytes_d2h + metrics.bytes_offloaded
    d2h_seconds = stats.prefill_d2h_seconds + metrics.copy_seconds
    page_bytes = engine.host_pool.page_bytes
    return {
        "trace": trace_name,
        "requests": stats.requests,
        "prompt_tokens": stats.prompt_tokens,
        "output_tokens": stats.output_tokens,
        "model": model.describe(),
        "page_size": engine.page_size,
        "page_bytes": page_bytes,
        "stride": engine.stride,
        "max_running": config.max_running,
        "device": str(engine.device),
        "copy_backend": engine.backend_used,
        "hash_scheme": config.hash_scheme,
        "storage": engine.storage_url,
        "tenants": config.tenants,
        "lora_share": config.lora_share,
        "seed": config.seed,
        "prefill_pages_total": stats.prefill_pages_total,
        "prefill_pages_unique_stored": stats.prefill_pages_stored,
        "prefill_pages_deduplicated": stats.prefill_pages_deduplicated,
        "decode_pages_offloaded": metrics.pages_offloaded,
        "decode_pages_stored": metrics.pages_stored,
        "decode_pages_deduplicated": metrics.pages_deduplicated,
        "decode_pages_dropped": metrics.pages_dropped,
        "offloads_rejected_host_full": metrics.offloads_rejected,
        "bytes_d2h": bytes_d2h,
        "d2h_seconds": d2h_seconds,
        "d2h_gbps": _rate(bytes_d2h, d2h_seconds) / 1e9,
        "hashed_tokens": stats.hashed_tokens,
        "hashing_tokens_per_s": _rate(stats.hashed_tokens, stats.hash_seconds),
        "storage_put_gbps": storage_stats.put_gbps(),
        "storage_get_gbps": storage_stats.get_gbps(),
        "storage_pages_evicted": storage_stats.pages_evicted,
        # What a store must hold to keep every page of this trace (sizing a store).
        "stored_bytes": (stats.prefill_pages_stored + metrics.pages_stored) * page_bytes,
        "storage_failures": stats.prefill_pages_failed + metrics.pages_failed,
        "host_pool_high_water_pages": engine.host_pool.high_water,
        "host_pool_high_water_bytes": engine.host_pool.high_water * page_bytes,
        "host_pool_capacity_pages": engine.host_pool.capacity,
        "device_pool_pages": engine.device_pages.capacity,
        "decode_steps": stats.decode_steps,
        "verify_pages_checked": verify.pages_checked,
        "verify_sampled": verify.sampled,
        "verify_mismatches": verify.mismatches,
        "verify_missing_explained": verify.explained,
        "lost_pages": verify.lost,
        "round_trip_pages": round_trip.pages if round_trip else 0,
        "round_trip_mismatches": round_trip.mismatches if round_trip else 0,
        "h2d_gbps": round_trip.h2d_gbps if round_trip else 0.0,
        "run_s": stats.run_seconds,
        "verify_s": verify.seconds,
        "elapsed_s": elapsed_s,
        "notes": list(engine.notes),
    }


def write_json(report: dict[str, Any], path: str | Path) -> None:
    """Write the report as indented JSON (parent folders are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


class ProgressDisplay:
    """A rich progress bar of requests done and D2H GB/s so far, on stderr.

    Use as a context manager; pass :meth:`update` as the engine's ``on_progress``.
    Disabled (``enabled=False``) it does nothing.
    """

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self.console = Console(stderr=True)
        self.progress = Progress(
            TextColumn("replay"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("requests"),
            TextColumn("{task.fields[gbps]:.2f} GB/s D2H"),
            TextColumn("{task.fields[pages]} pages stored"),
            TimeElapsedColumn(),
            console=self.console,
            disable=not enabled,
        )
        self.task = self.progress.add_task("replay", total=total, gbps=0.0, pages=0)

    def __enter__(self) -> "ProgressDisplay":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.progress.__exit__(*exc_info)

    def update(self, engine) -> None:
        """Refresh from the engine's counters."""
        metrics = engine.manager.metrics
        stats = engine.stats
        bytes_d2h = stats.prefill_bytes_d2h + metrics.bytes_offloaded
        seconds = stats.prefill_d2h_seconds + metrics.copy_seconds
        self.progress.update(
            self.task,
            completed=engine.requests_done,
            gbps=_rate(bytes_d2h, seconds) / 1e9,
            pages=stats.prefill_pages_stored + metrics.pages_stored,
        )


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def summary_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary table's (figure, value) rows."""
    r = report
    return [
        ("trace", f"{r['trace']}"),
        ("model", r["model"]),
        ("device / copy backend", f"{r['device']} / {r['copy_backend']}"),
        ("storage / hash", f"{r['storage']} / {r['hash_scheme']}"),
        ("requests", f"{r['requests']:,}"),
        ("prompt / output tokens", f"{r['prompt_tokens']:,} / {r['output_tokens']:,}"),
        ("page size / stride", f"{r['page_size']} / {r['stride']} tokens ({_human_bytes(r['page_bytes'])} a page)"),
        ("prefill pages total", f"{r['prefill_pages_total']:,}"),
        ("  unique stored", f"{r['prefill_pages_unique_stored']:,}"),
        ("  deduplicated", f"{r['prefill_pages_deduplicated']:,}"),
        ("decode pages offloaded", f"{r['decode_pages_offloaded']:,} ({r['decode_pages_stored']:,} stored)"),
        ("bytes moved D2H", f"{_human_bytes(r['bytes_d2h'])} at {r['d2h_gbps']:.2f} GB/s"),
        ("hashing", f"{r['hashing_tokens_per_s'] / 1e6:.2f} M tokens/s"),
        ("storage put / get", f"{r['storage_put_gbps']:.2f} / {r['storage_get_gbps']:.2f} GB/s"),
        ("stored by this run", f"{_human_bytes(r['stored_bytes'])}"),
        ("host pool high-water", f"{r['host_pool_high_water_pages']:,} of {r['host_pool_capacity_pages']:,} pages ({_human_bytes(r['host_pool_high_water_bytes'])})"),
        ("storage failures", f"{r['storage_failures']:,}"),
        ("verify: pages checked", f"{r['verify_pages_checked']:,}{' (sample)' if r['verify_sampled'] else ''}"),
        ("verify: mismatches", f"{r['verify_mismatches']:,}"),
        ("verify: lost pages", f"{r['lost_pages']:,}" + (
            f" ({r['verify_missing_explained']:,} more missing, explained by failures, drops or evictions)"
            if r["verify_missing_explained"] else "")),
        ("load back H2D", f"{r['round_trip_pages']:,} pages at {r['h2d_gbps']:.2f} GB/s, {r['round_trip_mismatches']:,} mismatched"),
        ("elapsed", f"{r['elapsed_s']:.1f} s (run {r['run_s']:.1f} s, verify {r['verify_s']:.1f} s)"),
    ]


def print_summary(report: dict[str, Any], console: Console | None = None) -> None:
    """Print the summary table (to stdout by default)."""
    console = console or Console()
    table = Table(title="kvstage replay", show_header=True, header_style="bold")
    table.add_column("figure")
    table.add_column("value", overflow="fold")
    for name, value in summary_rows(report):
        table.add_row(name, value)
    console.print(table)
