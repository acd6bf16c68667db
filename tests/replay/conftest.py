"""Fixtures of the replay tests: one torch intra-op thread, as ``kvstage replay`` uses on CPU;
this folder on ``sys.path`` for ``replay_helpers``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The replay's CPU copies are small; see ``kvstage.replay.command.set_cpu_threads``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
