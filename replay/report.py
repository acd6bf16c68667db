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


def build_report(engine, verify, *, trace_name: str, elapsed_s: float) -> dict[str, Any]:
    """Every figure of one replay as a flat JSON-able dict (see the README for the fields).

    Page counters named as :class:`kvstage.offload.OffloadMetrics`' are the manager's at the end
    of the run (verification's loads are the ``verify_`` fields).

    Args:
        engine: the :class:`kvstage.replay.engine.ReplayEngine` after ``run()``.
        verify: the :class:`kvstage.replay.verify.VerifyResult`.
        trace_name: the trace file's name or ``"built-in synthetic"``.
        elapsed_s: wall-clock seconds of the whole command (setup, run, verify).
    """
    stats, config, model = engine.stats, engine.config, engine.model
    metrics = engine.run_metrics
    storage_stats = engine.storage.stats
    page_size = engine.page_size
    page_bytes = engine.host_pool.page_bytes
    return {
        "trace": trace_name,
        "requests": stats.requests,
        "prompt_tokens": stats.prompt_tokens,
        "output_tokens": stats.output_tokens,
        "model": model.describe(),
        "page_size": page_size,
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
        "prompt_pages": stats.prompt_pages,
        # load path: each request's prompt (all but its last token) looked up, the hit loaded
        "pages_looked_up": metrics.pages_looked_up,
        "pages_hit": metrics.pages_hit,
        "page_hit_rate": _rate(metrics.pages_hit, metrics.pages_looked_up),
        "tokens_looked_up": metrics.pages_looked_up * page_size,
        "tokens_hit": metrics.pages_hit * page_size,
        "prefill_tokens_saved": stats.prefill_tokens_saved,
        "prompt_token_hit_rate": _rate(stats.prefill_tokens_saved, stats.prompt_tokens),
        "pages_loaded": metrics.pages_loaded,
        "bytes_loaded": metrics.bytes_loaded,
        "load_seconds": metrics.load_seconds,
        "h2d_gbps": metrics.h2d_gbps,
        "load_mismatches": stats.load_mismatches,
        "prefetch_failures": metrics.prefetch_failures,
        "load_failures": metrics.load_failures,
        # store path: prompt pages past the hit, then decode pages
        "pages_launched": metrics.pages_launched,
        "pages_offloaded": metrics.pages_offloaded,
        "pages_stored": metrics.pages_stored,
        "pages_deduplicated": metrics.pages_deduplicated,
        "pages_failed": metrics.pages_failed,
        "pages_dropped": metrics.pages_dropped,
        "offloads_rejected": metrics.offloads_rejected,
        "bytes_offloaded": metrics.bytes_offloaded,
        "copy_seconds": metrics.copy_seconds,
        "d2h_gbps": metrics.d2h_gbps,
        "hashed_tokens": stats.hashed_tokens,
        "hashing_tokens_per_s": _rate(stats.hashed_tokens, stats.hash_seconds),
        "storage_put_gbps": storage_stats.put_gbps(),
        "storage_get_gbps": storage_stats.get_gbps(),
        "storage_pages_evicted": storage_stats.pages_evicted,
        # What a store must hold to keep every page of this trace (sizing a store).
        "stored_bytes": metrics.pages_stored * page_bytes,
        "host_pool_high_water_pages": metrics.host_pages_high_water,
        "host_pool_high_water_bytes": metrics.host_pages_high_water * page_bytes,
        "host_pool_capacity_pages": metrics.host_pages_capacity,
        "device_pool_pages": engine.device_pages.capacity,
        "decode_steps": stats.decode_steps,
        "verify_requests": verify.verify_requests,
        "verify_pages_checked": verify.pages_checked,
        "verify_sampled": verify.sampled,
        "verify_mismatches": verify.mismatches,
        "verify_pages_unreachable": verify.unreachable,
        "verify_missing_explained": verify.explained,
        "lost_pages": verify.lost,
        "verify_bytes_loaded": verify.bytes_loaded,
        "verify_h2d_gbps": verify.h2d_gbps,
        "run_s": stats.run_seconds,
        "verify_s": verify.seconds,
        "elapsed_s": elapsed_s,
        "notes": list(engine.notes),
        **_hybrid_fields(engine, verify),
    }


def _hybrid_fields(engine, verify) -> dict[str, Any]:
    """A hybrid model's restorable lengths (tokens) and its other components' verify counts."""
    hybrid = getattr(engine, "hybrid", None)
    if hybrid is None:
        return {}
    return {
        "snapshot_every_pages": engine.config.snapshot_every,
        "requests_hit": hybrid.requests_hit,
        "hits_rounded_down": hybrid.hits_rounded_down,
        "tokens_stored_prefix": hybrid.tokens_stored_prefix,
        "tokens_restored": hybrid.tokens_restored,
        "snapshots_taken": hybrid.snapshots_taken,
        "resume_offloads": hybrid.resume_offloads,
        "entries_stored_failed": {name: list(counts) for name, counts in engine.manager.entries_stored.items()},
        "verify_components": verify.components,
        "verify_rounded_loads": verify.rounded_loads,
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
        self.progress.update(
            self.task, completed=engine.requests_done, gbps=metrics.d2h_gbps, pages=metrics.pages_stored
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
        ("prefix hit: pages", f"{r['pages_hit']:,} of {r['pages_looked_up']:,} looked up ({r['page_hit_rate']:.1%})"),
        ("prefix hit: tokens", f"{r['tokens_hit']:,} of {r['tokens_looked_up']:,} looked up"),
        ("prefill tokens saved", f"{r['prefill_tokens_saved']:,} ({r['prompt_token_hit_rate']:.1%} of prompt tokens)"),
        ("loaded H2D", f"{r['pages_loaded']:,} pages, {_human_bytes(r['bytes_loaded'])} at {r['h2d_gbps']:.2f} GB/s"),
        ("load mismatches", f"{r['load_mismatches']:,}"),
        (
            "pages offloaded D2H",
            f"{r['pages_offloaded']:,} of {r['pages_launched']:,} launched, "
            f"{_human_bytes(r['bytes_offloaded'])} at {r['d2h_gbps']:.2f} GB/s",
        ),
        ("  stored / deduplicated", f"{r['pages_stored']:,} / {r['pages_deduplicated']:,}"),
        ("  failed / dropped", f"{r['pages_failed']:,} / {r['pages_dropped']:,}"),
        ("hashing", f"{r['hashing_tokens_per_s'] / 1e6:.2f} M tokens/s"),
        ("storage put / get", f"{r['storage_put_gbps']:.2f} / {r['storage_get_gbps']:.2f} GB/s"),
        ("stored by this run", f"{_human_bytes(r['stored_bytes'])}"),
        (
            "host pool high-water",
            f"{r['host_pool_high_water_pages']:,} of {r['host_pool_capacity_pages']:,} pages ({_human_bytes(r['host_pool_high_water_bytes'])})",
        ),
        (
            "verify: pages checked",
            f"{r['verify_pages_checked']:,}{' (sample)' if r['verify_sampled'] else ''} "
            f"in {r['verify_requests']:,} loads at {r['verify_h2d_gbps']:.2f} GB/s",
        ),
        ("verify: mismatches", f"{r['verify_mismatches']:,}"),
        (
            "verify: lost pages",
            f"{r['lost_pages']:,}"
            + (
                f" ({r['verify_missing_explained']:,} more missing, explained by failures, drops or evictions)"
                if r["verify_missing_explained"]
                else ""
            ),
        ),
        (
            "verify: unreachable",
            f"{r['verify_pages_unreachable']:,} (stored behind a missing page of their chain"
            + (", or past its last restorable length)" if "requests_hit" in r else ")"),
        ),
        *_hybrid_rows(r),
        ("elapsed", f"{r['elapsed_s']:.1f} s (run {r['run_s']:.1f} s, verify {r['verify_s']:.1f} s)"),
    ]


def _hybrid_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    if "requests_hit" not in r:
        return []
    rows = [
        (
            "restorable: hits",
            f"{r['requests_hit']:,} requests, {r['hits_rounded_down']:,} rounded down "
            f"(resume point every {r['snapshot_every_pages']} pages)",
        ),
        ("restorable: tokens", f"{r['tokens_restored']:,} restored of {r['tokens_stored_prefix']:,} stored prefix"),
    ]
    for name, counts in r["verify_components"].items():
        extra = f", {counts['missing']:,} missing" if "missing" in counts else ""
        rows.append(
            (
                f"verify: {name} entries",
                f"{counts['matched']:,} matched of {counts['checked']:,} checked, {counts['mismatched']:,} mismatched, "
                f"{counts['unreachable']:,} unreachable{extra}",
            )
        )
    return rows


def print_summary(report: dict[str, Any], console: Console | None = None) -> None:
    """Print the summary table (to stdout by default)."""
    console = console or Console()
    table = Table(title="kvstage replay", show_header=True, header_style="bold")
    table.add_column("figure")
    table.add_column("value", overflow="fold")
    for name, value in summary_rows(report):
        table.add_row(name, value)
    console.print(table)
