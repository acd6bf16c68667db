"""The kernel compiles for a real GPU target (sm_90) on this machine, with 16-byte vector copies.

The interpreter runs the kernel's Python semantics; this checks what it cannot: that the
native compiler accepts the kernel and vectorizes the row copies. Runs in a subprocess
because the compiler needs ``TRITON_INTERPRET`` unset when triton is imported.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

SCRIPT = """
import collections, re, sys
from kvstage.kernels.triton_copy import compile_ptx
for gather in (True, False):
    ptx = compile_ptx(gather=gather)
    ops = collections.Counter(re.findall(r"(ld|st)\\.global[.a-zA-Z0-9:_]*", ptx))
    vec = collections.Counter(m.split(".")[0] for m in re.findall(r"(?:ld|st)\\.global[.a-zA-Z0-9:_]*\\.v2\\.b64", ptx))
    print("gather" if gather else "scatter", vec.get("ld", 0), vec.get("st", 0))
"""


def test_kernel_compiles_for_sm90_with_16_byte_accesses():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    if result.returncode != 0 and re.search(r"ptxas|No such file|not found", result.stderr):
        pytest.skip(f"no ptxas for compiling: {result.stderr[-300:]}")
    assert result.returncode == 0, result.stderr[-2000:]
    counts = {line.split()[0]: tuple(int(x) for x in line.split()[1:]) for line in result.stdout.splitlines()}
    # every row load and store of the tile is a 16-byte (v2.b64) access, in both directions
    assert counts["gather"][0] >= 1 and counts["gather"][1] >= 1, counts
    assert counts["scatter"][0] >= 1 and counts["scatter"][1] >= 1, counts
