"""Under CI the compiled page chains must have been built, so that CI tests them, not only the
Python fallback (tools/setup-venv.sh installs their headers and fails under CI if it cannot)."""

from __future__ import annotations

import os

import pytest

from kvstage.hashing import SCHEMES, get_scheme, schemes


# Private: the same check the schemes make, so this test skips where they take the Python chains.
@pytest.mark.skipif(not os.environ.get("CI"), reason="only CI requires the optional extensions to be built")
@pytest.mark.skipif(schemes._pure_python_forced(), reason=f"{schemes.PURE_PYTHON_ENV} forces the Python chains")
@pytest.mark.parametrize("name", SCHEMES)
def test_ci_runs_the_compiled_chain_of_every_scheme(name):
    scheme = get_scheme(name)
    assert scheme.compiled is not None, scheme.why_pure_python
    assert scheme.implementation.startswith("compiled (")
