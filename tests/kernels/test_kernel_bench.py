"""The benchmark script runs end to end on a tiny batch and writes its JSON-able report and plot."""

from __future__ import annotations

import importlib.util
import json

import pytest

from support import REPO_ROOT


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", REPO_ROOT / "bench" / "bench_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_reports_every_method_beside_the_ceiling(tmp_path):
    bench = load_bench()
    lines = []
    report = bench.run(
        True, device="cpu", cases=("deepseek-v3-mla",), page_sizes=(1, 16), num_tokens=32, log=lines.append
    )
    methods = {(r["page_size"], r["op"], r["method"]) for r in report["results"]}
    assert methods == {
        (p, op, m) for p in (1, 16) for op in ("gather", "scatter") for m in ("ceiling", "torch", "loop")
    }
    assert all(r["gbps"] > 0 and r["seconds"] > 0 for r in report["results"])
    assert all(r["of_ceiling"] == pytest.approx(1.0) for r in report["results"] if r["method"] == "ceiling")
    assert report["note"] == bench.CPU_NOTE and lines[-1] == bench.CPU_NOTE
    assert set(report["summary"]) == {
        f"torch {op} / copy_, deepseek-v3-mla page {p}" for op in ("gather", "scatter") for p in (1, 16)
    }
    assert all(item["target"] == 0.7 for item in report["summary"].values())
    json.dumps(report)
    bench.plot(report, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_page_loop_moves_the_same_bytes_as_gather():
    import torch

    bench = load_bench()
    from kvstage.kernels import gather

    pool, staging, slot_indices, host_page_ids = bench.make_case("deepseek-v3-mla", 16, 64, torch.device("cpu"))
    bench.page_loop(pool, staging, slot_indices, host_page_ids, 16, to_host=True)()
    want = torch.zeros_like(staging)
    gather(pool, want, slot_indices, host_page_ids, page_size=16, backend="torch")
    assert torch.equal(staging, want)
