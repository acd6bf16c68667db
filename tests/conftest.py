"""Test harness: Triton's interpreter when CUDA is absent, and the gpu/slow markers.

``TRITON_INTERPRET=1`` must be set before any module that defines ``@triton.jit`` kernels is
imported, so it is set here at collection time, before the tests import ``kvstage.kernels``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from support import SHARED


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(params=["cpu"] + (["cuda"] if CUDA else []))
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each device the suite can run on: CPU always, CUDA where present."""
    return torch.device(request.param)


@pytest.fixture
def shared_dir() -> Path:
    """``../shared`` beside the repository; skips where it is absent."""
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent")
    return SHARED
