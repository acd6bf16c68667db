"""The kernel compiles for a real GPU target (sm_90) on this machine, with 16-byte vector copies.

The interpreter runs the kernel's Python semantics; this checks what it cannot: that the
native compiler accepts the kernel and that every row load and store is a 16-byte access
(``.v2.b64``, ``.v4.b32``), both for Llama-3 rows (8 heads x 128 x bf16 = 2 KiB) and for fp8
DeepSeek MLA rows (576 bytes, not a multiple of 16 words: the case that compiled to 8-byte
accesses while the kernel took the row length in words). :func:`compile_ptx` specializes
the arguments by Triton's own rules, as a launch does. Runs in a subprocess because the
compiler needs ``TRITON_INTERPRET`` unset when triton is imported.

Only a missing ptxas binary (Triton's wheel ships one; ``TRITON_PTXAS_BLACKWELL_PATH`` points
elsewhere) skips, and under ``CI`` it fails (:func:`support.skip_missing`); any other compiler
error fails the test.
"""

from __future__ import annotations

import pytest

from kernel_helpers import run_ptx_script

ROWS = {"llama3-8b-bf16": 2048, "deepseek-mla-fp8": 576, "odd-18-bytes": 18}

SCRIPT = """
import json, re, sys
from triton.backends.nvidia.compiler import get_ptxas
try:
    get_ptxas(90)  # the binary for sm_90 (compile_ptx's default arch), as the compiler looks it up
except RuntimeError as error:  # Triton's "Cannot find <binary>": none found, nothing else
    print(f"no ptxas: {error}", file=sys.stderr)
    sys.exit(int(sys.argv[2]))
from kvstage.kernels.triton_copy import compile_ptx
counts = {}
for name, row_bytes in json.loads(sys.argv[1]).items():
    for gather in (True, False):
        ptx = compile_ptx(row_bytes=row_bytes, gather=gather)
        # the row copies: evict_first loads (the source rows) and every store
        loads = re.findall(r"ld\\.global\\.L1::evict_first[.a-zA-Z0-9:_]*", ptx)
        stores = re.findall(r"st\\.global[.a-zA-Z0-9:_]*", ptx)
        wide = lambda ops: sum(bool(re.search(r"\\.v2\\.b64|\\.v4\\.b32", op)) for op in ops)
        counts[f"{name} {'gather' if gather else 'scatter'}"] = [len(loads), wide(loads), len(stores), wide(stores)]
print(json.dumps(counts))
"""


@pytest.fixture(scope="module")
def access_counts():
    return run_ptx_script(SCRIPT, ROWS)


@pytest.mark.parametrize("op", ["gather", "scatter"])
@pytest.mark.parametrize("rows", ["llama3-8b-bf16", "deepseek-mla-fp8"])
def test_every_row_access_is_16_bytes(access_counts, rows, op):
    loads, wide_loads, stores, wide_stores = access_counts[f"{rows} {op}"]
    assert loads >= 1 and stores >= 1, access_counts
    assert (wide_loads, wide_stores) == (loads, stores), access_counts


def test_rows_that_allow_no_vector_get_none(access_counts):
    """18-byte rows allow 2-byte words only: the count distinguishes, it is not always 'wide'."""
    loads, wide_loads, stores, wide_stores = access_counts["odd-18-bytes gather"]
    assert loads >= 1 and wide_loads == 0 and wide_stores == 0
