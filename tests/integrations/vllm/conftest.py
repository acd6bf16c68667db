"""vLLM adapter tests: vLLM 0.33.0's own kv_offload and OffloadingConnector code, on CPU.

They run in their own pytest process, in the ``.venv-vllm`` overlay (``make test`` runs
``.venv-vllm/bin/python -m pytest tests/integrations/vllm``; the main run ignores this folder).
Without vLLM 0.33.0 (``make .venv-vllm/.installed``) every test module here skips
with the reason (``pytest.importorskip``), except under CI (``CI`` set), where a missing vLLM is
an error: CI must run them.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

VLLM_MISSING = importlib.util.find_spec("vllm") is None
REASON = "vLLM 0.33.0 is not installed (make .venv-vllm/.installed, then run with .venv-vllm/bin/python)"


def pytest_configure(config: pytest.Config) -> None:
    if VLLM_MISSING and os.environ.get("CI"):
        raise pytest.UsageError(f"CI: {REASON}")
