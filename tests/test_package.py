"""The package installs as laid out: imports from anywhere, a clean wheel, the command line."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

import kvstage

from support import REPO_ROOT


def run_python(*args: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_subpackages_import_from_another_directory(tmp_path):
    code = "import kvstage, kvstage.kernels, kvstage.offload, kvstage.hashing; print(kvstage.__file__)"
    result = run_python("-c", code, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert os.path.samefile(os.path.dirname(result.stdout.strip()), REPO_ROOT)


def test_version_flag_prints_the_package_version(tmp_path):
    result = run_python("-m", "kvstage", "--version", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"kvstage {kvstage.__version__}"


def test_info_names_versions_and_backend(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "kvstage", "info"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(None, 1) if " " in line else (line, "") for line in result.stdout.splitlines())
    import torch

    assert lines["torch"].strip() == torch.__version__
    expected_backend = "native Triton" if torch.cuda.is_available() else "torch reference"
    assert result.stdout.count(expected_backend) == 1
    assert "nvtx" in lines
    import importlib.util

    mooncake_installed = importlib.util.find_spec("mooncake") is not None
    assert lines["mooncake"].startswith("installed" if mooncake_installed else "not installed")


def test_no_command_prints_help_and_fails(tmp_path):
    result = run_python("-m", "kvstage", cwd=str(tmp_path))
    assert result.returncode == 2
    assert "info" in result.stderr


@pytest.mark.slow
def test_wheel_holds_only_the_kvstage_package(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO_ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("kvstage-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    outside = [n for n in names if not (n.startswith("kvstage/") or n.startswith("kvstage-"))]
    assert outside == []
    assert "kvstage/__init__.py" in names
    for sub in ("kernels", "offload", "hashing"):
        assert f"kvstage/{sub}/__init__.py" in names
    assert not any(n.startswith(("kvstage/tests/", "kvstage/bench/", "kvstage/tools/")) for n in names)


def test_every_subpackage_on_disk_is_declared_in_pyproject():
    import tomllib

    declared = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {"kvstage"}
    for init in REPO_ROOT.rglob("__init__.py"):
        relative = init.parent.relative_to(REPO_ROOT)
        # Dot folders are virtual environments (.venv, .venv-vllm) and tool state, never kvstage.
        if relative.parts and (
            relative.parts[0] in {"tests", "bench", "tools", "build"} or relative.parts[0].startswith(".")
        ):
            continue
        if relative.parts:
            on_disk.add("kvstage." + ".".join(relative.parts))
    assert on_disk == declared


def test_no_folder_of_the_repository_shadows_a_top_level_package():
    """The suite runs from the repository root (``python -m pytest``), which is the package kvstage:
    its folders must not be importable as top-level names (transformers 5.25 imports Hugging Face's
    ``kernels`` and got kvstage's ``kernels/``, failing 3 test modules at collection)."""
    import importlib.util

    folders = [init.parent.name for init in REPO_ROOT.glob("*/__init__.py")]
    assert "kernels" in folders and "storage" in folders
    shadowing = {}
    for name in folders:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and os.path.samefile(os.path.dirname(spec.origin), REPO_ROOT / name):
            shadowing[name] = spec.origin
    assert shadowing == {}
