"""bench/bench_vllm.py runs end to end (quick, two rounds) and reports every figure with its
baseline; it makes no speed claim here (the benchmark's own report does)."""

from __future__ import annotations

import importlib.util
import os
import statistics

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.base",
    reason="vLLM 0.33.0 is not installed (make .venv-vllm/.installed, then run with .venv-vllm/bin/python)",
)

from support import REPO_ROOT  # noqa: E402


def test_the_quick_benchmark_reports_each_figure_beside_its_baseline():
    spec = importlib.util.spec_from_file_location("bench_vllm", REPO_ROOT / "bench" / "bench_vllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = module.run(quick=True, rounds=2, log=lambda line: None)
    assert report["omp_wait_policy"] == os.environ["OMP_WAIT_POLICY"]  # the module set it unless it was set
    methods = {result["method"] for result in report["results"]}
    assert methods == {
        "worker store",
        "worker load",
        "copy_",
        "manager take_events",
        "store take_events",
        "manager lookup",
        "file exists round trip",
    }
    assert all(result["seconds"] > 0 for result in report["results"])
    assert report["summary"]["lookup_us_per_request"]["target"] == "< 50"
    for method in ("worker store", "worker load"):
        # paired per round with copy_: the ratio is a positive number, judged against 0.8
        item = report["summary"][f"{method} / copy_"]
        assert item["value"] > 0 and item["target"] == ">= 0.8" and item["ok"] == (item["value"] >= 0.8)
        (row,) = [result for result in report["results"] if result["method"] == method]
        # each timed round's ratio, warm-ups left out; the figure is their median
        assert len(row["round_ratios"]) == 2 and row["copy_ratio"] == statistics.median(row["round_ratios"]) > 0
