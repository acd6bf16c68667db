"""Paths and small helpers shared by the tests (importable as ``support``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED = REPO_ROOT.parent / "shared"

# CI services set CI=true; there a test that cannot run for want of something CI provides
# (``../shared``, the Mooncake package, the ptxas binary) is a failure, not a skip.
CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
MISSING = "missing: "  # the prefix of such a skip's reason; tests/conftest.py fails it under CI


def skip_missing(what: str) -> NoReturn:
    """Skip the running test because ``what`` (a file, package or binary it needs, with how to
    get it) is absent. Under ``CI`` the harness (``tests/conftest.py``) reports it as failed."""
    pytest.skip(f"{MISSING}{what}")


def missing_mark(what: str) -> pytest.MarkDecorator:
    """:func:`skip_missing` as a mark (for a parameter that stands for absent data)."""
    return pytest.mark.skip(reason=f"{MISSING}{what}")
