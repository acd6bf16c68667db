"""sglang 0.5.23's own code on CPU, in a pytest process of its own (``make test`` runs this
folder separately; the main run ignores it).

Importing sglang on a CPU machine needs two things done once per process, which is why these
tests never share a process with the rest of the suite:

- torchvision: PyPI's Linux wheel is a CUDA build; on a CPU torch its operator library cannot
  load, and its fake-kernel registrations for those operators then fail at import. sglang uses
  torchvision only for image transforms of vision-language configs (imported with
  ``sglang.srt.configs``), so when that import fails the registrations module is replaced by an
  empty one and torchvision is imported again.
- sglang's runtime context: pools read the published config (``get_parallel()``,
  ``get_memory()``), so a CPU config is installed with sglang's own test hook
  ``override_server_args(device="cpu")``.

Where sglang is not installed the sglang-importing test modules are not collected and
``test_install.py`` skips with the reason; under ``CI=true`` that is an error. In a pytest run
given other paths too (a plain ``pytest`` of the whole suite) sglang is not imported and they
skip the same way, naming the command that runs them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# sglang_rig.py beside this file (the suite's pythonpath is tests/ only)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402

from sglang_cpu import import_sglang  # noqa: E402

HERE = Path(__file__).resolve().parent
SGLANG_MISSING: str | None = None
collect_ignore_glob: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """Import sglang only in a pytest process given this folder (or files in it) alone: in a run
    of the whole suite its CPU import would change process-wide state under the other tests."""
    global SGLANG_MISSING
    paths = [Path(arg.split("::")[0]).resolve() for arg in config.args]
    if any(not path.is_relative_to(HERE) for path in paths):
        SGLANG_MISSING = (
            "sglang's tests run in a pytest process of their own: pytest tests/integrations/sglang (make test does)"
        )
    else:
        SGLANG_MISSING = import_sglang()
        if SGLANG_MISSING is not None and os.environ.get("CI") == "true":
            raise RuntimeError(f"CI=true: the sglang tests must run, but {SGLANG_MISSING}")
    if SGLANG_MISSING is not None:
        collect_ignore_glob.append("test_sglang_*.py")


@pytest.fixture
def sglang_missing() -> str | None:
    """Why sglang cannot be used in this process, or None."""
    return SGLANG_MISSING
