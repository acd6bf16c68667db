"""bench/bench_offload.py keeps running: one tiny configuration through its measure() function."""

from __future__ import annotations

import importlib.util

import torch

from support import REPO_ROOT


def test_bench_measures_every_call_and_stores_every_page():
    spec = importlib.util.spec_from_file_location("bench_offload", REPO_ROOT / "bench" / "bench_offload.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.measure(live=8, rounds=2, poll_repeats=3)  # asserts every page is stored inside
    assert result["live"] == 8
    for key in ("offload_launch_us", "offload_idle_us", "poll_none_finished_us", "poll_all_finished_us"):
        assert result[key] > 0
    assert abs(result["poll_all_finished_per_copy_us"] * 8 - result["poll_all_finished_us"]) < 0.1


def test_load_bench_loads_the_right_bytes_and_reports_each_figure():
    spec = importlib.util.spec_from_file_location("bench_load", REPO_ROOT / "bench" / "bench_load.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.measure(
        num_layers=2, num_pages=2, rounds=1, device=torch.device("cpu"), backend="torch"
    )  # checks bytes inside
    assert result["bytes"] == 2 * 2 * 2 * 64 * 8 * 128 * 2
    assert set(result["gbps"]) == {"copy", "copy_one_thread", "scatter", "load", "layer_by_layer"} and all(
        v > 0 for v in result["gbps"].values()
    )
    assert 0 < result["first_layer_ms"] <= result["layer_by_layer_ms"]
