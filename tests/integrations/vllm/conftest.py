"""vLLM adapter tests: vLLM 0.33.0's own kv_offload and OffloadingConnector code, on CPU.

They run in their own pytest process (``make test`` names this folder; the main run ignores
it). Without vLLM 0.33.0 (``bash tools/install-vllm.sh .venv``) every test module here skips
with the reason (``pytest.importorskip``), except under CI (``CI`` set), where a missing vLLM is
an error: CI must run them.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

VLLM_MISSING = importlib.util.find_spec("vllm") is None
REASON = "vLLM 0.33.0 is not installed (bash tools/install-vllm.sh .venv; `make test` does it)"


def pytest_configure(config: pytest.Config) -> None:
    if VLLM_MISSING and os.environ.get("CI"):
        raise pytest.UsageError(f"CI: {REASON}")

