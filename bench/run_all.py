"""Run every benchmark in ``bench/`` and write a JSON file, a markdown table and PNG plots.

Each ``bench/bench_<name>.py`` exposes ``run(quick: bool) -> dict``; they are found by name, run
one after another in this process, and a benchmark that raises is recorded (its error and
traceback) without stopping the others. What the writer reads from a report, when present:

* ``report["results"]``: a list of flat dicts, one measurement each -> a markdown table and,
  unless the module draws its own, a bar chart of its rate column (``gbps``,
  ``tokens_per_s``, ... see :data:`RATE_KEYS`) per configuration, one bar per ``method``;
  without a rate column, a line plot of the numeric columns against the first int column;
* ``report["summary"]``: ``{name: {"value", "target", "ok"}}`` -> the targets table (or
  ``report["targets"]`` with ``report["meets_targets"]``: ``{name: bool}``);
* ``module.plot(report, path)``: the module draws its own PNG.

Output folder (default ``bench/results/``, git-ignored)::

    results.json   {"meta": {...}, "benchmarks": {name: {"seconds", "report" | "error"}}}
    results.md     meta, the targets of every benchmark, then each one's results table
    <name>.png     one plot per benchmark with results

Usage: ``python -m bench [--quick] [--out DIR] [--only NAME ...] [--list]`` (or
``python bench/run_all.py ...``). Exit code: 0 when every benchmark ran (missed targets are
reported, not failures), 1 when one raised, 2 for an unknown ``--only`` name.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

# As each benchmark sets when run as a file (bench/bench_vllm.py): torch's OpenMP team parked between
# CPU ops, set before any benchmark imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results"
RATE_KEYS = ("gbps", "tokens_per_s", "pages_per_s", "ops_per_s", "requests_per_s", "value", "seconds")
CATEGORY_KEYS_ALSO = ("page_size",)  # ints that name a configuration rather than measure one


def discover(bench_dir: Path = BENCH_DIR) -> dict[str, Path]:
    """``{name: path}`` of every ``bench_<name>.py`` in ``bench_dir``, sorted by name."""
    return {path.stem.removeprefix("bench_"): path for path in sorted(bench_dir.glob("bench_*.py"))}


_LOADED: dict[Path, ModuleType] = {}


def load(name: str, path: Path) -> ModuleType:
    """Import a benchmark module from its file, once (works without ``bench`` being importable)."""
    if path in _LOADED:
        return _LOADED[path]
    spec = importlib.util.spec_from_file_location(f"kvstage_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # where dataclasses (bench_storage's cases) look their module up
    spec.loader.exec_module(module)
    _LOADED[path] = module
    return module


def _git_commit() -> str | None:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=BENCH_DIR, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None


def machine_meta(quick: bool) -> dict[str, Any]:
    """Where and when the benchmarks ran."""
    meta: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "quick": quick,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {platform.system()}",
        "git_commit": _git_commit(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    try:
        import torch

        meta["torch"] = torch.__version__
        meta["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        meta["cpu_threads"] = torch.get_num_threads()
    except ImportError:
        meta["torch"] = None
    return meta


def run_benchmarks(
    names: list[str], paths: dict[str, Path], quick: bool, log: Callable[[str], None] = print
) -> dict[str, dict]:
    """Run the named benchmarks; ``{name: {"seconds", "report"}}`` or ``{"seconds", "error", "traceback"}``."""
    outcomes: dict[str, dict] = {}
    for name in names:
        log(f"== bench_{name} ({'quick' if quick else 'full'})")
        started = time.perf_counter()
        try:
            module = load(name, paths[name])
            report = module.run(quick)
            outcome = {"report": report}
        except Exception as exc:  # one broken benchmark must not hide the others' results
            outcome = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            log(f"   FAILED: {outcome['error']}")
        outcome["seconds"] = time.perf_counter() - started
        log(f"   {outcome['seconds']:.1f} s")
        outcomes[name] = outcome
    return outcomes


# -- markdown --------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value == 0 or not math.isfinite(value):
            return str(value)
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:.3e}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)[:60]
    return str(value).replace("|", "\\|")


def markdown_table(rows: list[dict]) -> list[str]:
    """A markdown table of flat dicts (columns: every key, in first-seen order)."""
    columns: list[str] = []
    for row in rows:
        columns.extend(key for key in row if key not in columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(column, "")) for column in columns) + " |")
    return lines


def to_markdown(meta: dict, outcomes: dict[str, dict]) -> str:
    """The whole markdown report."""
    lines = ["# kvstage benchmarks", ""]
    lines += [f"- {key}: {_cell(value)}" for key, value in meta.items()]
    lines += ["", "## Targets", "", "| benchmark | figure | value | target | met |", "|---|---|---|---|---|"]
    for name, outcome in outcomes.items():
        report = outcome.get("report")
        if report is None:
            lines.append(f"| {name} | (failed: {_cell(outcome['error'])}) | | | no |")
            continue
        if not isinstance(report, dict):
            continue
        for figure, item in (report.get("summary") or {}).items():
            if isinstance(item, dict):
                lines.append(
                    f"| {name} | {_cell(figure)} | {_cell(item.get('value'))} | {_cell(item.get('target'))} | {_cell(item.get('ok'))} |"
                )
        # Another shape some benchmarks use: {"targets": {name: target}, "meets_targets": {name: bool}}.
        targets, met = report.get("targets"), report.get("meets_targets")
        if not report.get("summary") and isinstance(met, dict):
            targets = targets if isinstance(targets, dict) else {}
            for figure, ok in met.items():
                target = targets.get(figure, next((v for k, v in targets.items() if k.startswith(figure)), ""))
                lines.append(f"| {name} | {_cell(figure)} | | {_cell(target)} | {_cell(ok)} |")
    for name, outcome in outcomes.items():
        lines += ["", f"## {name} ({outcome['seconds']:.1f} s)", ""]
        report = outcome.get("report")
        if report is None:
            lines += ["```", outcome.get("traceback", outcome["error"]).rstrip(), "```"]
            continue
        if isinstance(report, dict) and report.get("note"):
            lines += [f"Note: {report['note']}", ""]
        rows = report.get("results") if isinstance(report, dict) else None
        if isinstance(rows, list) and rows and all(isinstance(row, dict) for row in rows):
            lines += markdown_table(rows)
        else:
            flat = {
                k: v for k, v in (report.items() if isinstance(report, dict) else []) if not isinstance(v, (dict, list))
            }
            lines += markdown_table([flat]) if flat else ["(no tabular results)"]
    return "\n".join(lines) + "\n"


# -- plots -----------------------------------------------------------------------------------


def _rate_key(rows: list[dict]) -> str | None:
    for key in RATE_KEYS:
        if all(isinstance(row.get(key), (int, float)) and not isinstance(row.get(key), bool) for row in rows):
            return key
    return None


def generic_plot(name: str, report: dict, path: Path) -> bool:
    """A grouped bar chart of the results' rate column: one group per configuration (the
    string-valued fields and page_size), one bar per ``method``. False when nothing to plot."""
    rows = report.get("results") if isinstance(report, dict) else None
    if not isinstance(rows, list) or not rows or not all(isinstance(row, dict) for row in rows):
        return False
    metric = _rate_key(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if metric is None:
        return _line_plot(name, rows, path, plt)

    series_key = "method" if all("method" in row for row in rows) else None
    config_keys = [
        key for key in rows[0] if key != series_key and (isinstance(rows[0][key], str) or key in CATEGORY_KEYS_ALSO)
    ]
    groups: list[str] = []
    series: list[str] = []
    values: dict[tuple[str, str], float] = {}
    for row in rows:
        group = " ".join(f"{row.get(k)}" if k != "page_size" else f"p{row.get(k)}" for k in config_keys) or name
        label = str(row.get(series_key, metric)) if series_key else metric
        if group not in groups:
            groups.append(group)
        if label not in series:
            series.append(label)
        values[(group, label)] = float(row[metric])
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(groups) * max(1, len(series)) ** 0.5 + 2), 4.5))
    for i, label in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ys = [values.get((group, label), 0.0) for group in groups]
        ax.bar(xs, ys, width, label=label)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(metric)
    positive = [v for v in values.values() if v > 0]
    if positive and max(positive) / min(positive) > 100:
        ax.set_yscale("log")
    ax.set_title(f"bench_{name}: {metric}")
    if series_key:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _line_plot(name: str, rows: list[dict], path: Path, plt) -> bool:
    """No rate column: every numeric column against the first int column (e.g. live requests)."""

    def numeric(key: str) -> bool:
        return all(isinstance(row.get(key), (int, float)) and not isinstance(row.get(key), bool) for row in rows)

    keys = [key for key in rows[0] if numeric(key)]
    x_key = next((key for key in keys if all(isinstance(row[key], int) for row in rows)), None)
    columns = [key for key in keys if key != x_key]
    if x_key is None or not columns or len(rows) < 2:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [row[x_key] for row in rows]
    for key in columns:
        ax.plot(xs, [row[key] for row in rows], marker="o", label=key)
    ax.set_xlabel(x_key)
    if all(row[key] > 0 for row in rows for key in columns):
        ax.set_yscale("log")
    ax.set_title(f"bench_{name}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_outputs(
    out: Path, meta: dict, outcomes: dict[str, dict], paths: dict[str, Path], log: Callable[[str], None] = print
) -> list[Path]:
    """Write results.json, results.md and a PNG per benchmark into ``out``; returns the files."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    json_path = out / "results.json"
    json_path.write_text(json.dumps({"meta": meta, "benchmarks": outcomes}, indent=2, default=str) + "\n")
    written.append(json_path)
    md_path = out / "results.md"
    md_path.write_text(to_markdown(meta, outcomes))
    written.append(md_path)
    for name, outcome in outcomes.items():
        report = outcome.get("report")
        if report is None:
            continue
        png = out / f"{name}.png"
        try:
            module_plot = getattr(load(name, paths[name]), "plot", None)
            if callable(module_plot):
                module_plot(report, png)
                drawn = png.exists()
            else:
                drawn = generic_plot(name, report, png)
        except Exception as exc:  # a plot is a nicety; the numbers are already written
            log(f"   plot of {name} failed: {type(exc).__name__}: {exc}")
            drawn = False
        if drawn:
            written.append(png)
    return written


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench`` / ``python bench/run_all.py``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="each benchmark's quick form (seconds, not minutes)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument(
        "--only", action="append", metavar="NAME", help="run only this benchmark (repeatable), e.g. kernels"
    )
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args(argv)
    paths = discover()
    if args.list:
        print("\n".join(f"{name}\t{path}" for name, path in paths.items()))
        return 0
    names = args.only or list(paths)
    unknown = [name for name in names if name not in paths]
    if unknown:
        print(
            f"python -m bench: error: --only: unknown benchmark {', '.join(unknown)}; known: {', '.join(paths)}",
            file=sys.stderr,
        )
        return 2
    meta = machine_meta(args.quick)
    outcomes = run_benchmarks(names, paths, args.quick)
    written = write_outputs(args.out, meta, outcomes, paths)
    print("wrote " + ", ".join(str(path) for path in written))
    failed = [name for name, outcome in outcomes.items() if "error" in outcome]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
