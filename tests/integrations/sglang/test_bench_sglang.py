"""bench/bench_sglang.py's MLA page_first_direct and hybrid v2 figures run end to end (a few
pages, one round) and report each beside its baseline; no speed claim here."""

from __future__ import annotations

import importlib.util

from support import REPO_ROOT


def _bench():
    spec = importlib.util.spec_from_file_location("bench_sglang", REPO_ROOT / "bench" / "bench_sglang.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mla_page_first_direct_is_reported_paired_with_copy_per_round():
    results, summary = _bench()._measure_mla(4, 1, lambda line: None)
    assert [(row["layout"], row["op"]) for row in results] == [
        ("mla page_first_direct", "batch_set_v1"),
        ("mla page_first_direct", "batch_get_v1"),
    ]
    assert all(row["seconds"] > 0 and row["page_bytes"] == 8 * 64 * 576 * 2 for row in results)
    for op in ("set", "get"):
        for baseline in ("copy_", "copy_ page by page"):
            item = summary[f"memory {op} / {baseline}, mla page_first_direct"]
            assert item["value"] > 0 and item["target"] == ">= 0.8" and item["ok"] == (item["value"] >= 0.8)


def test_hybrid_v2_set_and_get_are_reported_for_mamba_and_dsa():
    results = _bench()._measure_hybrid_v2(1, lambda line: None)
    assert [(row["layout"], row["op"]) for row in results] == [
        (f"hybrid {strategy}", op) for strategy in ("mamba", "dsa") for op in ("batch_set_v2", "batch_get_v2")
    ]
    assert all(row["us_per_call"] == row["seconds"] * 1e6 > 0 for row in results)
