"""``bench/bench_storage.py`` as ``python -m bench`` loads it: its declared cases run and report every figure."""

from __future__ import annotations

import importlib.util

from support import REPO_ROOT


def load_run_all():
    spec = importlib.util.spec_from_file_location("kvstage_bench_run_all", REPO_ROOT / "bench/run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_memory_cases_report_every_figure_and_skip_what_was_not_asked_for():
    bench = load_run_all().load("storage", REPO_ROOT / "bench" / "bench_storage.py")  # its dataclasses load there
    asked = ("memory", "memory-events-off", "memory-growing", "memcpy")
    lines: list[str] = []
    report = bench.run(rounds=1, num_pages=2, num_layers=1, methods=asked, event_repeats=1, log=lines.append)
    rows = [(r["method"], r["op"]) for r in report["results"]]
    assert rows == [(m, op) for m in asked for op in ("put", "get")]
    page_bytes = 1 * 2 * 64 * 8 * 128 * 2  # one layer of Llama-3-8B's K and V, 64 tokens, bf16
    assert all(r["page_bytes"] == page_bytes and r["pages"] == 2 and r["gbps"] > 0 for r in report["results"])
    assert report["skipped"] == {m: "not asked for (--methods)" for m in ("mooncake", "mooncake-bounce")}
    assert list(report["ratios"]) == [
        f"{name}_{op}_{what}"
        for op in ("put", "get")
        for name, what in (
            ("memory", "events_on_vs_off"),
            ("memory", "vs_memcpy"),
            ("memory_growing", "vs_memcpy"),
        )
    ]
    assert set(report["events_us_per_10000"]) == {"record", "take_all", "take_100"}
    assert "  mooncake: skipped (not asked for (--methods))" in lines
