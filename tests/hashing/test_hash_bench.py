"""bench/bench_hashing.py keeps running: a tiny run through its ``run()`` entry point."""

from __future__ import annotations

import importlib.util

from support import REPO_ROOT


def test_bench_run_returns_figures_and_targets():
    spec = importlib.util.spec_from_file_location("bench_hashing", REPO_ROOT / "bench" / "bench_hashing.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    lines = []
    report = bench.run(True, n_tokens=2048, rounds=1, page_sizes=(16, 64), log=lines.append)
    assert len(report["results"]) == 2 * 2 * len(bench.METHODS)
    assert all(r["tokens_per_s"] > 0 for r in report["results"])
    assert {r["scheme"] for r in report["ratios"]} == {"sglang-v1", "xxh3-128"}
    assert all(r["py_vs_per_token"] > 0 and r["py_of_ceiling"] > 0 for r in report["ratios"])  # the pure-Python rows
    assert all(r["array_of_numpy"] > 0 for r in report["ratios"])  # the array("q") rows
    assert report["chains"].startswith("sglang-v1 ") and "; xxh3-128 " in report["chains"]
    assert set(report["xxh3_vs_sglang"]) == {16, 64}
    assert len(report["summary"]) == 3 and all(
        set(item) == {"value", "target", "ok"} for item in report["summary"].values()
    )
    assert any("xxh3-128 / sglang-v1" in line for line in lines)
