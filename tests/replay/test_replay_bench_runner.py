"""``python -m bench`` finds every bench_*.py, survives a broken one, and writes JSON, markdown and PNGs."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess

import pytest
import torch

from support import REPO_ROOT


def load_run_all():
    spec = importlib.util.spec_from_file_location("kvstage_bench_run_all", REPO_ROOT / "bench/run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_discovers_the_bench_modules_by_name():
    run_all = load_run_all()
    found = run_all.discover()
    assert "replay" in found
    assert all(path.name == f"bench_{name}.py" for name, path in found.items())


def test_writes_json_markdown_and_plots_and_records_a_failure(tmp_path):
    run_all = load_run_all()
    bench_dir = tmp_path / "bench"
    bench_dir.mkdir()
    (bench_dir / "bench_fake.py").write_text(
        "def run(quick):\n"
        "    rows = [dict(case=c, page_size=p, method=m, gbps=float(p * (2 if m == 'fast' else 1)))\n"
        "            for c in ('a', 'b') for p in (16, 64) for m in ('slow', 'fast')]\n"
        "    return {'quick': quick, 'results': rows, 'summary': {'fast/slow': {'value': 2.0, 'target': 1.5, 'ok': True}}}\n"
    )
    (bench_dir / "bench_broken.py").write_text("def run(quick):\n    raise RuntimeError('no device')\n")
    paths = run_all.discover(bench_dir)
    assert list(paths) == ["broken", "fake"]
    outcomes = run_all.run_benchmarks(list(paths), paths, quick=True, log=lambda line: None)
    assert outcomes["broken"]["error"] == "RuntimeError: no device"
    assert outcomes["fake"]["report"]["quick"] is True
    written = run_all.write_outputs(
        tmp_path / "out", run_all.machine_meta(True), outcomes, paths, log=lambda line: None
    )
    names = sorted(path.name for path in written)
    assert names == ["fake.png", "results.json", "results.md"]
    data = json.loads((tmp_path / "out/results.json").read_text())
    assert data["meta"]["quick"] is True
    assert data["benchmarks"]["fake"]["report"]["results"][3] == {
        "case": "a",
        "page_size": 64,
        "method": "fast",
        "gbps": 128.0,
    }
    markdown = (tmp_path / "out/results.md").read_text()
    assert "| fake | fast/slow | 2 | 1.5 | yes |" in markdown
    assert "| broken | (failed: RuntimeError: no device) | | | no |" in markdown
    assert "| a | 64 | fast | 128 |" in markdown
    assert (tmp_path / "out/fake.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_runs_the_replay_benchmark_and_rejects_unknown_names(tmp_path, capsys):
    run_all = load_run_all()
    assert run_all.main(["--only", "nope", "--out", str(tmp_path)]) == 2
    assert "--only: unknown benchmark nope" in capsys.readouterr().err
    assert run_all.main(["--quick", "--only", "replay", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    (row,) = data["benchmarks"]["replay"]["report"]["results"]
    assert row["case"] == "default" and row["lost_pages"] == 0 and row["verify_mismatches"] == 0
    assert (tmp_path / "replay.png").exists()


def test_gpu_check_script_parses():
    assert subprocess.run(["bash", "-n", str(REPO_ROOT / "bench/gpu_check.sh")]).returncode == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit; this machine has CUDA")
@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_results_without_a_rate_column_get_a_line_plot_and_bool_targets(tmp_path):
    run_all = load_run_all()
    report = {
        "results": [{"live": n, "launch_us": 20.0 + n / 100, "poll_us": 3.0} for n in (64, 256, 1024)],
        "targets": {"launch_us": 50.0},
        "meets_targets": {"launch_us": True},
    }
    assert run_all.generic_plot("fake", report, tmp_path / "fake.png")
    assert (tmp_path / "fake.png").read_bytes()[:4] == b"\x89PNG"
    markdown = run_all.to_markdown({}, {"fake": {"report": report, "seconds": 1.0}})
    assert "| fake | launch_us | | 50 | yes |" in markdown
    assert "| 1024 | 30.24 | 3 |" in markdown
