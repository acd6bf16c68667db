"""Test harness: Triton's interpreter when CUDA is absent, and the gpu/slow markers.

``TRITON_INTERPRET=1`` must be set before any module that defines ``@triton.jit`` kernels is
imported, so it is set here at collection time, before the tests import ``kvstage.kernels``.

Where CUDA is present the interpreter stays off (the ``cuda`` parameter of the ``device``
fixture runs the kernels natively, and the interpreter would take the CUDA launches too). A
Triton copy on CPU tensors then cannot run: ``resolve_backend`` raises
``BackendUnavailableError`` ("... needs TRITON_INTERPRET=1 ..."). A test (or fixture) that
does not run on the ``cuda`` parameter and raises exactly that is reported as *skipped*, with
the reason, instead of failed: the same test's ``cuda`` parameter (or the CPU machines of CI,
where the interpreter is on) covers that code. Anything else a test raises still fails.

Under ``CI`` (``CI=true``, as CI services set it), a test skipped for want of something CI
provides (``../shared``, the Mooncake package, the ptxas binary: :func:`support.skip_missing`)
is reported as *failed*, naming what is missing: a green CI run never hides such a test.

``KVSTAGE_SIMULATE_CUDA=1`` (test-only; ``tests/test_gpu_check.py`` uses it) makes this
harness behave on a CPU machine as on a CUDA one: the interpreter is left off, so the tests
that would skip on a GPU skip here, which proves the rule without a GPU. There is still no
``cuda`` parameter and the ``gpu``-marked tests still skip.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# `python -m pytest` puts the working directory first on sys.path. From the repository root, which
# is the package kvstage (imported as `kvstage`, installed), its folders would shadow top-level
# packages of the same names: transformers 5.25 imports Hugging Face's `kernels` and got kvstage's.
REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != REPO_ROOT]

import pytest  # noqa: E402
import torch  # noqa: E402

CUDA = torch.cuda.is_available()
SIMULATE_CUDA = os.environ.get("KVSTAGE_SIMULATE_CUDA") == "1"  # test-only, see the module doc
if not (CUDA or SIMULATE_CUDA):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Triton copies on CPU tensors cannot run in this process: the interpreter is off where CUDA is.
CPU_TRITON_OFF = (CUDA or SIMULATE_CUDA) and os.environ.get("TRITON_INTERPRET", "0") != "1"
CPU_TRITON_SKIP_REASON = (
    "a Triton copy on CPU tensors needs the interpreter (TRITON_INTERPRET=1), which is off where CUDA is "
    "present"
    + (" (simulated: KVSTAGE_SIMULATE_CUDA=1)" if SIMULATE_CUDA and not CUDA else "")
    + "; the cuda parameter and the CPU CI run cover this code"
)

from kvstage.errors import BackendUnavailableError  # noqa: E402

from support import CI, MISSING, SHARED, skip_missing  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def needs_cpu_interpreter(item: pytest.Item, error: BaseException | None) -> bool:
    """Whether ``error`` (raised by ``item``) is a Triton copy on CPU tensors refused because the
    interpreter is off where CUDA is present: the one failure reported as a skip."""
    if not CPU_TRITON_OFF or error is None:
        return False
    callspec = getattr(item, "callspec", None)
    if callspec is not None and str(callspec.params.get("device", "")).startswith("cuda"):
        return False  # a CUDA-parameter test never takes this path: a real failure
    seen = set()
    while error is not None and id(error) not in seen:  # the error, or what it was raised from
        seen.add(id(error))
        if isinstance(error, BackendUnavailableError) and "TRITON_INTERPRET=1" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def missing_under_ci(report: pytest.TestReport) -> str | None:
    """The reason of ``report``'s skip when it is a :func:`support.skip_missing` skip and CI
    is on (the skip is then a failure), else None."""
    if not (CI and report.skipped and isinstance(report.longrepr, tuple)):
        return None
    reason = str(report.longrepr[2]).removeprefix("Skipped: ")
    return reason if reason.startswith(MISSING) else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if (
        report.failed
        and call.when in ("setup", "call")
        and call.excinfo is not None
        and needs_cpu_interpreter(item, call.excinfo.value)
    ):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), (item.location[1] or 0) + 1, f"Skipped: {CPU_TRITON_SKIP_REASON}")
    reason = missing_under_ci(report)
    if reason is not None:
        report.outcome = "failed"
        report.longrepr = f"{reason} (CI is set: a test CI must run may not skip)"


@pytest.fixture(params=["cpu"] + (["cuda"] if CUDA else []))
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each device the suite can run on: CPU always, CUDA where present."""
    return torch.device(request.param)


@pytest.fixture
def shared_dir() -> Path:
    """``../shared`` beside the repository; skips where it is absent (fails under CI)."""
    if not SHARED.is_dir():
        skip_missing(f"{SHARED} (../shared beside the repository)")
    return SHARED
