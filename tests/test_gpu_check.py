"""``bench/gpu_check.sh`` and ``bench/gpu_probes.py`` on a machine without a GPU, so they cannot rot.

A GPU session gets one short lease (the device README: 15 minutes, one command at most 10): the
script must run the first time. Here: the script parses, its step caps fit 8 minutes (and it
refuses caps that do not), its dry run (``--dry-run``: every step's Python code on CPU with tiny
sizes) passes and leaves only what the device tool brings back under ``$OUT``, the probes'
checks have teeth, and the harness rule of ``tests/conftest.py`` (a Triton copy on CPU tensors
skips where CUDA is present) holds under ``KVSTAGE_SIMULATE_CUDA=1``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvstage.errors import BackendUnavailableError

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu_check.sh"
STEPS = ["setup", "warm", "probes", "tests", "bench", "memcheck", "synccheck"]
EIGHT_MINUTES = 480
DEVICE_TOOL_FILES = 8  # the device README: at most 8 files come back, no more than 2 folders down
NAME = re.compile(r"^[A-Za-z0-9._-]+$")
INTERPRETER_ERROR = "backend: 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported"


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what conftest set for itself (the interpreter) or $OUT."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRITON_INTERPRET", "OUT", "KVSTAGE_SIMULATE_CUDA", "GPU_CHECK_DRY_RUN")
    }
    env.update(extra)
    return env


def load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def probes():
    return load_module("kvstage_gpu_probes", REPO / "bench" / "gpu_probes.py")


# -- the script --------------------------------------------------------------------------------


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def caps() -> tuple[dict[str, int], dict[str, int]]:
    out = subprocess.run(["bash", str(SCRIPT), "--print-caps"], capture_output=True, text=True, check=True).stdout
    values = {name: int(value) for name, value in (line.split() for line in out.splitlines())}
    totals = {k: values.pop(k) for k in ("sum", "budget", "limit")}
    return values, totals


def test_step_caps_sum_to_less_than_eight_minutes():
    steps, totals = caps()
    assert list(steps) == STEPS
    assert sum(steps.values()) == totals["sum"] <= totals["budget"]
    # a step overruns its cap by at most the 5 s kill-after, and the next starts with what is left
    assert totals["budget"] + 5 < totals["limit"] == EIGHT_MINUTES


def test_every_step_in_the_table_runs_and_every_run_has_a_cap():
    text = SCRIPT.read_text()
    ran = [name for name in re.findall(r"^\s*(?:\w+=\S+ )*run_step (\w+)", text, re.M)]
    assert sorted(set(ran)) == sorted(STEPS), ran


def test_the_script_refuses_caps_over_the_budget(tmp_path):
    text = SCRIPT.read_text()
    assert "probes:120" in text
    bad = tmp_path / "gpu_check.sh"
    bad.write_text(text.replace("probes:120", "probes:400"))
    result = subprocess.run(
        ["bash", str(bad), "--dry-run", str(tmp_path / "out")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "must fit BUDGET_S" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check-out")
    result = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        env=clean_env(OUT=str(out), PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=600,
    )
    return out, result


@pytest.mark.slow
def test_dry_run_passes_every_step(dry_run):
    out, result = dry_run
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    summary = (out / "00-summary.txt").read_text()
    assert "DRY RUN" in summary
    for step in STEPS:
        assert re.search(rf"^{step}: (PASS|SKIP) ", summary, re.M), summary
    assert not re.search(r"^FAIL ", summary, re.M), summary


@pytest.mark.slow
def test_dry_run_writes_only_what_the_device_tool_brings_back(dry_run):
    out, _ = dry_run
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert len(files) <= DEVICE_TOOL_FILES, files
    assert all(len(f.parts) <= 3 and all(NAME.match(part) for part in f.parts) for f in files), files
    assert not [p for p in out.rglob("*") if p.is_symlink()]
    names = [str(f) for f in files]
    assert names[0] == "00-summary.txt"  # the summary sorts first
    assert {"00-summary.txt", "gpu_check.log", "probes.json", "bench.json", "pytest.xml"} <= set(names)


@pytest.mark.slow
def test_dry_run_runs_every_probe_and_the_benchmark(dry_run, probes):
    out, _ = dry_run
    report = json.loads((out / "probes.json").read_text())
    assert report["dry_run"] is True and report["ok"] is True
    assert list(report["probes"]) == list(probes.PROBES)
    for name, result in report["probes"].items():
        statuses = {c["status"] for c in result["checks"]}
        assert result["ok"] and "FAIL" not in statuses and statuses, (name, result)
    assert report["probes"]["pinned_matrix"]["combinations"]  # the matrix ran (a subset in a dry run)
    bench = json.loads((out / "bench.json").read_text())
    assert bench["report"]["results"] and bench["sweep"]
    log = (out / "gpu_check.log").read_text()
    assert "PASS warm:" in log and "PASS sanitize:" in log


# -- the probes' teeth -------------------------------------------------------------------------


def test_the_matrix_sees_a_copy_that_writes_nothing(probes, monkeypatch):
    ctx = probes.Ctx(torch.device("cpu"), True, Path("."))
    probe = probes.Probe("pinned_matrix")
    combo = probes.matrix_combos(True)[:1]
    assert probes.run_matrix(ctx, probe, combo)[0]["gather"] is True and probe.ok
    monkeypatch.setattr(probes, "gather", lambda *args, **kwargs: None)
    monkeypatch.setattr(probes, "scatter", lambda *args, **kwargs: None)
    record = probes.run_matrix(ctx, probe, combo)[0]
    assert (record["gather"], record["scatter"], record["scatter_layer_1"]) == (False, False, False)
    assert not probe.ok


def test_the_stored_bytes_check_sees_a_wrong_page(probes):
    ctx = probes.Ctx(torch.device("cpu"), True, Path("."))
    rig = probes.make_rig(ctx, num_slots=256, num_host_pages=16)
    req = probes.SimpleRequest("r", probes.prompt(1, 2, rig.page))
    slots = rig.slots.assign(req, len(req.origin_input_ids))
    probes.put_rows_(rig.pool, slots, probes.device_rows(rig.pool, slots.numel(), seed=3))
    req.done = True
    rig.manager.finish(req)
    rig.manager.drain()
    assert probes.stored_pages_equal(rig, req, slots, 2) == (True, "2 of 2 pages equal")
    rig.pool.layer(1, 2)[slots[rig.page + 3]] = 0  # one row of page 2 changes after it was stored
    assert probes.stored_pages_equal(rig, req, slots, 2) == (False, "1 of 2 pages equal")
    rig.manager.close()


def test_the_probes_refuse_to_run_without_cuda_unless_dry(probes):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert probes.main(["probes", "--out", "/nonexistent"]) == 3


# -- tests/conftest.py where CUDA is present -----------------------------------------------------


def test_simulated_cuda_skips_a_cpu_triton_test_and_runs_the_rest():
    """KVSTAGE_SIMULATE_CUDA=1 leaves the interpreter off, as on a CUDA machine: the Triton
    parameter on CPU tensors skips with the reason (it failed before), the torch one passes."""
    test = "tests/kernels/test_kernel_strides.py::test_staging_with_a_storage_offset_is_read_at_its_offset"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            f"{test}[cpu-page_first-gather-triton-kernel]",
            f"{test}[cpu-page_first-gather-torch-kernel]",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
        ],
        cwd=REPO,
        env=clean_env(KVSTAGE_SIMULATE_CUDA="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert re.search(r"1 passed, 1 skipped", result.stdout), result.stdout[-3000:]
    assert "needs the interpreter (TRITON_INTERPRET=1), which is off where CUDA is present (simulated" in result.stdout


@pytest.fixture
def harness(monkeypatch):
    """tests/conftest.py as a module, its switch turned as on a CUDA machine."""
    module = load_module("kvstage_tests_conftest", REPO / "tests" / "conftest.py")
    monkeypatch.setattr(module, "CPU_TRITON_OFF", True)
    return module


def item(device: str | None) -> SimpleNamespace:
    return SimpleNamespace(callspec=SimpleNamespace(params={} if device is None else {"device": device}))


def test_the_skip_takes_only_the_interpreter_refusal_off_cuda(harness):
    refusal = BackendUnavailableError(INTERPRETER_ERROR)
    assert harness.needs_cpu_interpreter(item("cpu"), refusal)
    assert harness.needs_cpu_interpreter(item(None), refusal)  # an unparametrized test on CPU tensors
    assert not harness.needs_cpu_interpreter(item("cuda"), refusal)  # on the cuda parameter it is a real failure
    assert not harness.needs_cpu_interpreter(
        item("cpu"), BackendUnavailableError("backend: 'triton' needs the triton package (pip install triton)")
    )
    assert not harness.needs_cpu_interpreter(item("cpu"), AssertionError("bytes differ"))
    try:
        try:
            raise refusal
        except BackendUnavailableError as error:
            raise RuntimeError("the copy failed") from error
    except RuntimeError as wrapped:
        assert harness.needs_cpu_interpreter(item("cpu"), wrapped)


def test_without_cuda_the_interpreter_runs_and_nothing_is_skipped(harness, monkeypatch):
    monkeypatch.setattr(harness, "CPU_TRITON_OFF", False)
    assert not harness.needs_cpu_interpreter(item("cpu"), BackendUnavailableError(INTERPRETER_ERROR))


def test_without_cuda_the_script_stops_after_setup_with_exit_3_and_says_why(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    env.pop("GPU_CHECK_ALLOW_CPU", None)
    result = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 3, result.stdout + result.stderr
    summary = (tmp_path / "00-summary.txt").read_text()
    assert "setup: PASS" in summary and "cuda: NONE" in summary
    assert "no CUDA device visible to torch" in (tmp_path / "gpu_check.log").read_text()
