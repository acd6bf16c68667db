"""The state kernel compiles for sm_90 on this machine, with 16-byte accesses where the rows allow.

As tests/kernels/test_kernel_ptx.py does for the KV kernel: :func:`compile_state_ptx` specializes
the arguments by Triton's own rules and compiles in a subprocess (the compiler needs
``TRITON_INTERPRET`` unset when triton is imported); the row loads (``evict_first``) and stores
are counted by access width. Each word class present in a pool compiles one branch, so a
Qwen3-Next-like pool (1024- and 4096-byte rows) has 16-byte accesses only, a pool with one
3-byte row adds byte accesses for that row alone, and 132-byte DSA-like rows (4 x 33) get 4-byte words.
"""

from __future__ import annotations

import pytest

from kernel_helpers import run_ptx_script

POOLS = {
    "qwen3-next-conv-and-recurrent": [1024, 4096],
    "jamba-conv-and-ssm-fp32": [2048, 4096],
    "with-a-3-byte-row": [1024, 4096, 3],
    "rows-of-132-bytes": [132],
    "rows-of-20-bytes": [20],
    "rows-of-3-bytes": [3],
}

SCRIPT = """
import json, re, sys
from triton.backends.nvidia.compiler import get_ptxas
try:
    get_ptxas(90)
except RuntimeError as error:
    print(f"no ptxas: {error}", file=sys.stderr)
    sys.exit(int(sys.argv[2]))
from kvstage.kernels.triton_state import compile_state_ptx
WIDTHS = {"v2.b64": 16, "v4.b32": 16, "b64": 8, "v2.b32": 8, "b32": 4, "b16": 2, "b8": 1}
def width(op):
    return next(w for suffix, w in WIDTHS.items() if op.endswith("." + suffix))
counts = {}
for name, rows in json.loads(sys.argv[1]).items():
    for gather in (True, False):
        ptx = compile_state_ptx(rows, gather=gather)
        loads = re.findall(r"ld\\.global\\.L1::evict_first[.a-zA-Z0-9:_]*", ptx)
        stores = re.findall(r"st\\.global[.a-zA-Z0-9:_]*", ptx)
        counts[f"{name} {'gather' if gather else 'scatter'}"] = {
            "loads": sorted({width(op) for op in loads}), "stores": sorted({width(op) for op in stores})}
print(json.dumps(counts))
"""


@pytest.fixture(scope="module")
def widths():
    return run_ptx_script(SCRIPT, POOLS)


EXPECTED = {
    "qwen3-next-conv-and-recurrent": [16],
    "jamba-conv-and-ssm-fp32": [16],
    "with-a-3-byte-row": [1, 16],
    "rows-of-132-bytes": [4],
    "rows-of-20-bytes": [4],
    "rows-of-3-bytes": [1],
}


@pytest.mark.parametrize("op", ["gather", "scatter"])
@pytest.mark.parametrize("pool", list(POOLS))
def test_row_accesses_are_as_wide_as_the_rows_allow(widths, pool, op):
    got = widths[f"{pool} {op}"]
    assert got == {"loads": EXPECTED[pool], "stores": EXPECTED[pool]}, widths
