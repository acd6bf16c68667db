"""The hashing tests' ``naive`` fixture: the naive reference of ``tests/naive_keys.py``."""

from __future__ import annotations

import pytest

from naive_keys import Naive


@pytest.fixture(scope="session")
def naive() -> type[Naive]:
    """The naive reference: ``naive.seed``, ``naive.keys``, ``naive.prefill``."""
    return Naive
