"""The hashing tests' way to pick a scheme's chain: compiled (the C extension) or pure Python,
whatever ``KVSTAGE_PURE_PYTHON_HASH`` chose at import."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvstage.hashing import get_scheme
from kvstage.hashing.schemes import HashScheme

MODULES = {"sglang-v1": "kvstage.hashing._sha256_chain", "xxh3-128": "kvstage.hashing._xxh3_chain"}
LIBRARIES = {"sglang-v1": "OpenSSL", "xxh3-128": "xxHash"}
CHAINS = ("compiled", "pure-python")


def chain_module(name: str):
    """The scheme's compiled module; skips the test where it was not built."""
    return pytest.importorskip(
        MODULES[name],
        reason=f"the optional C extension {MODULES[name]} was not built (no compiler, or no "
        f"{LIBRARIES[name]} headers at install time)",
        exc_type=ImportError,
    )


def compiled_scheme(name: str) -> HashScheme:
    """The scheme with its compiled chain (skips where it was not built)."""
    return replace(get_scheme(name).pure_python(), compiled=chain_module(name), why_pure_python="")


def chain_scheme(name: str, chain: str) -> HashScheme:
    """The scheme with its compiled chain (``chain="compiled"``) or only its Python chain
    (``"pure-python"``)."""
    return get_scheme(name).pure_python() if chain == "pure-python" else compiled_scheme(name)
