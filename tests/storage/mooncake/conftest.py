"""Fixtures for the Mooncake store tests: a real ``mooncake_master`` on loopback.

The master comes from the ``mooncake-transfer-engine-non-cuda`` wheel (``mooncake/mooncake_master``)
and runs with its HTTP metadata server, every port picked free. Where the wheel (or the Debian
libraries it links against) is missing, the tests that need it skip and say what to install
(under CI they fail: see ``tests/conftest.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvstage.kv_layout import KVLayout
from kvstage.storage import LayoutFingerprint
from kvstage.storage.mooncake.store import INSTALL_HINT, mooncake_available

from mooncake_master import LocalMooncakeMaster, master_binary
from support import REPO_ROOT, skip_missing

# A small layout: 2 layers x K,V x 16 tokens x 2 heads x 64 x bf16 = 16 KiB a page.
FINGERPRINT = LayoutFingerprint("tiny-model", KVLayout(2, 2, 2, 64, "bfloat16"), 16)


def drop_shadowing_module() -> None:
    """Forget a ``mooncake`` module that is this repository's root, not the Mooncake wheel.

    pytest's importlib mode imports the repository root's ``__init__.py`` under the checkout
    folder's name while it collects; in a checkout folder named ``mooncake`` that module hides
    the installed ``mooncake`` package. Elsewhere this does nothing.
    """
    shadow = sys.modules.get("mooncake")
    if shadow is not None and getattr(shadow, "__file__", None) == str(REPO_ROOT / "__init__.py"):
        del sys.modules["mooncake"]


def require_mooncake() -> Path:
    """The master binary, or skip naming what to install."""
    drop_shadowing_module()
    if not mooncake_available():
        skip_missing(f"the Mooncake store is not usable here; {INSTALL_HINT}")
    binary = master_binary()
    if binary is None:
        skip_missing(f"mooncake_master is not in the installed mooncake package; {INSTALL_HINT}")
    return binary


@pytest.fixture(scope="session")
def fingerprint() -> LayoutFingerprint:
    """The small layout the Mooncake tests store pages of (16 KiB a page)."""
    return FINGERPRINT


@pytest.fixture(scope="session")
def mooncake_installed() -> Path:
    """The ``mooncake_master`` binary; skips (naming what to install) where Mooncake is missing."""
    return require_mooncake()


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory):
    """A master shared by the tests of one module; stopped afterwards."""
    binary = require_mooncake()
    master = LocalMooncakeMaster(tmp_path_factory.mktemp("mooncake") / "master.log", binary)
    master.start()
    yield master
    master.stop()


@pytest.fixture
def private_master(tmp_path: Path):
    """A master for one test (which may kill or pause it); stopped afterwards."""
    binary = require_mooncake()
    master = LocalMooncakeMaster(tmp_path / "master.log", binary)
    master.start()
    yield master
    master.stop()
