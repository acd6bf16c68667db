"""Under ``CI`` a test skipped for want of something CI provides fails, naming what is missing.

``support.skip_missing`` / ``support.missing_mark`` skip with a ``missing: `` reason (``../shared``,
the Mooncake package, the ptxas binary); ``tests/conftest.py`` turns exactly those skips into
failures when ``CI`` is set. Checked on a throwaway test module run by a real pytest with the
suite's conftest, under ``CI=true`` and without ``CI``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from support import REPO_ROOT

MODULE = """
import pytest
from support import missing_mark, skip_missing

def test_needs_a_file():
    skip_missing("/nowhere/trace.jsonl (../shared beside the repository)")

@pytest.mark.parametrize("case", [pytest.param(None, marks=missing_mark("/nowhere/vectors.json"), id="absent")])
def test_needs_vectors(case):
    pass

def test_skips_for_another_reason():
    pytest.skip("not about what CI provides")

def test_runs():
    pass
"""


def run_module(tmp_path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_module.py").write_text(MODULE)
    env = {key: value for key, value in os.environ.items() if key != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = str(REPO_ROOT / "tests")
    command = [
        sys.executable,
        "-m",
        "pytest",
        "test_module.py",
        "-p",
        "conftest",
        "-c",
        os.devnull,
        "--rootdir",
        str(tmp_path),
        "-p",
        "no:cacheprovider",
        "-q",
        "-rA",
    ]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_under_ci_a_missing_thing_fails_and_names_it(tmp_path):
    result = run_module(tmp_path, "true")
    assert result.returncode == 1, result.stdout[-3000:]
    # A skip in the call fails the test; one at setup (a mark, a fixture) is an error: both fail the run.
    assert re.search(r"1 failed, 1 passed, 1 skipped, 1 error", result.stdout), result.stdout[-3000:]
    assert "FAILED test_module.py::test_needs_a_file - missing: /nowhere/trace.jsonl" in result.stdout
    assert (
        "ERROR test_module.py::test_needs_vectors[absent] - missing: /nowhere/vectors.json (CI is set" in result.stdout
    )
    assert "SKIPPED [1] test_module.py:13: not about what CI provides" in result.stdout


def test_without_ci_a_missing_thing_skips_with_its_name(tmp_path):
    result = run_module(tmp_path, None)
    assert result.returncode == 0, result.stdout[-3000:]
    assert re.search(r"1 passed, 3 skipped", result.stdout), result.stdout[-3000:]
    assert "missing: /nowhere/trace.jsonl" in result.stdout and "missing: /nowhere/vectors.json" in result.stdout
