"""bench/bench_hybrid.py keeps running: its quick form, every figure of its report (not timings)."""

from __future__ import annotations

import importlib.util
import statistics

from support import REPO_ROOT


def test_hybrid_bench_quick_reports_each_path_and_lookup_against_its_target():
    spec = importlib.util.spec_from_file_location("bench_hybrid", REPO_ROOT / "bench" / "bench_hybrid.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = bench.run(quick=True)  # asserts inside: every entry stored, the last load's bytes exact
    assert report["benchmark"] == "hybrid" and report["quick"] is True
    assert [r["model"] for r in report["results"]] == ["qwen3-next", "gpt-oss"]
    qwen, gpt = report["results"]
    # 8 pages of 64 tokens: 2 full layers of 2x2x256 bf16, plus a snapshot of 6 state layers
    snapshot = 6 * (8192 * 4 * 2 + 32 * 128 * 128 * 4)
    assert round((8 * 64 * 2 * 2 * 2 * 256 * 2 + snapshot) / 2**20, 1) == qwen["mib"]
    # 8 full pages and the window's 2 pages of 2 layers of 2x8x64 bf16 each
    assert round((8 + 2) * 64 * 2 * 2 * 8 * 64 * 2 / 2**20, 1) == gpt["mib"]
    for r in report["results"]:
        assert r["pages"] == 8 and r["tokens"] == 512
        for key in ("copy", "two_copies", "store", "load"):
            assert r[f"{key}_ms"] > 0 and r[f"{key}_gbps"] > 0
        rounds = r["rounds_ms"]
        assert all(len(rounds[key]) == 3 for key in ("copy", "two_copies", "store", "load"))
        for path in ("store", "load"):  # paired: the median of each round's own ratio
            ratio = statistics.median(c / p for c, p in zip(rounds["copy"], rounds[path]))
            assert abs(r[f"copy_over_{path}"] - ratio) < 0.01
            assert abs(r[f"{path}_ms"] - statistics.median(rounds[path])) < 0.011
    for r in report["lookup"]:
        assert (r["keys_per_store"], r["stores"], r["pages_asked"], r["requests"]) == (3_200, 2, 32, 200)
        assert all(r[f"{key}_us"] > 0 for key in ("match_prefix", "hash", "exists", "restorable_lengths"))
        assert r["match_prefix_mean_us"] > 0
    summary = report["summary"]
    assert len(summary) == 6
    assert sorted(item["target"] for item in summary.values()) == [0.8] * 4 + [50.0] * 2
    for item in summary.values():
        assert item["ok"] == (item["value"] >= 0.8 if item["target"] == 0.8 else item["value"] < 50.0)
