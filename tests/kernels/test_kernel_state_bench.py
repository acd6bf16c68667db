"""The state benchmark runs end to end on its small case and reports every method beside the ceiling."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from support import REPO_ROOT


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_state", REPO_ROOT / "bench" / "bench_state.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_reports_every_method_beside_the_ceiling():
    bench = load_bench()
    lines = []
    report = bench.run(True, device="cpu", cases=("small-odd-rows", "jamba-v0.1"), log=lines.append)
    rows = {(r["case"], r["slots"], r["op"], r["method"]) for r in report["results"]}
    assert rows == {
        (c, s, op, m)
        for c in ("small-odd-rows", "jamba-v0.1")
        for s in bench.SLOT_SETS
        for op in ("gather", "scatter")
        for m in ("ceiling", "torch")
    }
    assert all(r["gbps"] > 0 and r["seconds"] > 0 for r in report["results"])
    assert all(r["of_ceiling"] == pytest.approx(1.0) for r in report["results"] if r["method"] == "ceiling")
    assert set(report["summary"]) == {
        f"torch {op}_state / copy_, jamba-v0.1 {s}" for op in ("gather", "scatter") for s in bench.SLOT_SETS
    }
    assert lines[-1] == bench.CPU_NOTE
    json.dumps(report)


def test_the_bench_pool_moves_its_snapshot_bytes():
    bench = load_bench()
    from kvstage.kernels import gather_state

    pool = bench.make_pool("jamba-v0.1", 3, torch.device("cpu"), quick=True)
    staging = torch.zeros(pool.staging_shape(1), dtype=torch.uint8)
    gather_state(pool, [1], staging, backend="torch")
    assert staging.numel() == 4 * (8192 * 4 + 8192 * 16) * 4
    want = torch.cat([t[1].reshape(-1).view(torch.uint8) for t in pool.tensors])
    assert torch.equal(staging.view(-1), want)
