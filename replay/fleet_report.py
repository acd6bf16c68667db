"""What a fleet replay prints and draws: a table with a column per routing policy, and the hit
rate over time per policy with the kill marked (matplotlib, the ``bench`` extra).

Units: rates are fractions; times seconds since the first request was routed; lags ms.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from kvstage.errors import BackendUnavailableError


def _kill(report: dict[str, Any]) -> str:
    kill = report["kill"]
    if kill is None:
        return "none"
    return (
        f"engine {kill['engine']} at {kill['time_s']:.1f} s (after {kill['after_requests']} routed), "
        f"{kill['rerouted']} re-routed"
    )


ROWS = (
    ("requests completed", lambda r: f"{r['requests_completed']:,} of {r['requests']:,}"),
    ("fleet prefix hit rate", lambda r: f"{r['fleet_hit_rate']:.1%}"),
    ("  requests not re-routed", lambda r: f"{r['hit_rate_not_rerouted']:.1%}"),
    (
        "prefill tokens saved",
        lambda r: (
            f"{r['prefill_tokens_saved']:,} of {r['prompt_tokens']:,} "
            f"({r['rerouted_tokens_saved']:,} by re-routed requests)"
        ),
    ),
    ("hit pages read locally", lambda r: f"{r['local_read_share']:.1%} ({r['local_pages_read']:,})"),
    ("hit pages read from the store", lambda r: f"{r['store_pages_read']:,}"),
    ("pages stored (verified)", lambda r: f"{r['pages_stored']:,} of {r['verify_pages_checked']:,} checked"),
    ("engine writes: stored / dedup", lambda r: f"{r['engine_pages_stored']:,} / {r['pages_deduplicated']:,}"),
    (
        "store: evicted / writes refused",
        lambda r: (
            f"{r['store_pages_evicted']:,} / {r['pages_refused']:,} ({r['missing_evicted']:,} missing, evicted; "
            f"{r['missing_cut_evictions']:,} of {r['puts_cut_by_kill']:,} puts the kill cut off)"
        ),
    ),
    (
        "Mooncake master: evicted / watcher saw vanish",
        lambda r: (
            "-"
            if r.get("master_evicted_keys") is None
            else f"{r['master_evicted_keys']:,} / {r['evictions_vanished']:,} ({r['evictions_unseen']:,} unseen, "
            f"{r['evictions_unattributed']:,} beyond the master's count; {r['pool_keys_at_end']:,} keys at the end)"
        ),
    ),
    ("lost / mismatched", lambda r: f"{r['lost']:,} / {r['mismatched']:,}"),
    ("absent: killed engine's writes", lambda r: f"{r['absent_killed_writes']:,} ({r['unreachable']:,} behind them)"),
    ("router lag p50 / p99", lambda r: f"{r['router_lag_p50_ms']:.2f} / {r['router_lag_p99_ms']:.2f} ms"),
    ("kill", _kill),
    ("run / verify / wall", lambda r: f"{r['run_s']:.1f} / {r['verify_s']:.1f} / {r['wall_s']:.1f} s"),
)


def fleet_rows(reports: Sequence[dict[str, Any]]) -> list[list[str]]:
    """``[figure, value per policy...]`` rows of the summary table."""
    return [[name, *(value(r) for r in reports)] for name, value in ROWS]


def print_fleet_summary(reports: Sequence[dict[str, Any]], console=None) -> None:
    """Print the table (a column per policy) to stdout by default."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    first = reports[0]
    table = Table(title=f"kvstage replay: {first['engines']} engines on {first['storage']}", header_style="bold")
    table.add_column("figure")
    for report in reports:
        table.add_column(report["policy"], overflow="fold")
    for row in fleet_rows(reports):
        table.add_row(*row)
    console.print(table)


def hit_rate_series(report: dict[str, Any]) -> tuple[list[float], list[float]]:
    """(times, cumulative fleet prefix hit rate) at each request's completion."""
    times, rates, prompt, saved = [], [], 0, 0
    for when, _order, _engine, tokens, loaded in report["timeline"]:
        prompt += tokens
        saved += loaded
        times.append(when)
        rates.append(saved / prompt if prompt else 0.0)
    return times, rates


def plot_hit_rates(reports: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Draw each policy's cumulative hit rate over time and over requests completed (runs differ
    in speed), the kill as a dashed line; write PNG.

    Raises:
        BackendUnavailableError: matplotlib is not installed (names the ``bench`` extra).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BackendUnavailableError("--plot: needs matplotlib: pip install 'kvstage[bench]'") from None
    figure, (by_time, by_count) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    top = 0.0
    for report in reports:
        times, rates = hit_rate_series(report)
        (line,) = by_time.plot(times, rates, label=report["policy"])
        by_count.plot(range(1, len(rates) + 1), rates, color=line.get_color(), label=report["policy"])
        top = max([top, *rates])
        kill = report["kill"]
        if kill is not None:
            by_time.axvline(kill["time_s"], color=line.get_color(), linestyle="--", linewidth=1)
            done_before = sum(1 for when in times if when <= kill["time_s"])
            by_count.axvline(done_before, color=line.get_color(), linestyle="--", linewidth=1)
    if any(r["kill"] for r in reports):
        by_time.plot([], [], color="grey", linestyle="--", label="engine killed")
    by_time.set_xlabel("seconds since the first request was routed")
    by_count.set_xlabel("requests completed")
    by_time.set_ylabel("fleet prefix hit rate (cumulative)")
    by_time.set_ylim(0, min(1.0, max(0.05, 1.2 * top)))
    for axes in (by_time, by_count):
        axes.grid(alpha=0.3)
    by_time.legend()
    figure.suptitle(title or f"{reports[0]['engines']} engines, {reports[0]['storage'].split(':')[0]} store")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
