"""The compiled sglang-v1 chain (``kvstage.hashing._chain``) equals the pure-Python chain.

Both paths are built here explicitly, so they are compared whatever the environment chose at
import (``KVSTAGE_PURE_PYTHON_HASH``). Skipped with a reason where the optional extension was
not built (no compiler or no OpenSSL headers at install time).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.hashing import PageHasher, get_scheme, page_keys, prefill_page_keys, schemes
from kvstage.hashing.schemes import HashScheme
from support import SHARED

_chain = pytest.importorskip(
    "kvstage.hashing._chain",
    reason="the optional C extension kvstage.hashing._chain was not built (no compiler or OpenSSL headers at install)",
)
sha256_chain = _chain.sha256_chain

PURE = HashScheme("sglang-v1", 32, schemes._sha256_digest, schemes._chain_hash_objects(hashlib.sha256), cryptographic=True)
_compiled_chain, _compiled_keys = schemes._compiled_chains(sha256_chain)
COMPILED = HashScheme(
    "sglang-v1", 32, schemes._sha256_digest, _compiled_chain, cryptographic=True, keys=_compiled_keys, accelerated=True
)
SGLANG_VECTORS = SHARED / "reference" / "sglang_v1_vectors.json"


def spec_chain(data: bytes, page_bytes: int, prior: bytes) -> list[bytes]:
    """The chain as the spec states it, one hashlib call per page."""
    digests = []
    for start in range(0, len(data) - page_bytes + 1, page_bytes):
        prior = hashlib.sha256(prior + data[start : start + page_bytes]).digest()
        digests.append(prior)
    return digests


@settings(max_examples=150, deadline=None)
@given(
    data=st.binary(max_size=3000),  # past 2048 bytes the C loop runs with the GIL released
    page_bytes=st.integers(1, 300),
    prior=st.one_of(st.just(b""), st.binary(min_size=32, max_size=32)),
)
def test_compiled_chain_equals_the_python_chain(data, page_bytes, prior):
    expected = PURE.chain(data, page_bytes, prior)
    assert expected == spec_chain(data, page_bytes, prior)
    assert len(expected) == len(data) // page_bytes  # a partial tail gets no digest
    assert sha256_chain(data, page_bytes, prior) == b"".join(expected)
    assert COMPILED.chain(data, page_bytes, prior) == expected
    assert sha256_chain(data, page_bytes, prior, True) == [d.hex() for d in expected]
    assert COMPILED.keys(data, page_bytes, prior) == PURE.keys(data, page_bytes, prior)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=300),
    page_size=st.integers(1, 70),
    extra_key=st.none() | st.text(max_size=5),
    cache_salt=st.none() | st.text(max_size=5),
)
def test_compiled_page_keys_equal_the_python_page_keys(tokens, page_size, extra_key, cache_salt):
    pure = prefill_page_keys(tokens, page_size, extra_key=extra_key, cache_salt=cache_salt, scheme=PURE)
    assert prefill_page_keys(tokens, page_size, extra_key=extra_key, cache_salt=cache_salt, scheme=COMPILED) == pure
    assert prefill_page_keys(np.array(tokens, dtype=np.int64), page_size, extra_key=extra_key, cache_salt=cache_salt, scheme=COMPILED) == pure


def test_a_large_input_hashes_the_same_on_both_paths():
    data = np.random.default_rng(3).integers(0, 2**32, 1 << 16, dtype=np.uint32).tobytes()
    for page_bytes in (4, 256, 1000):
        assert sha256_chain(data, page_bytes, b"\x07" * 32) == b"".join(PURE.chain(data, page_bytes, b"\x07" * 32))


def test_every_shared_vector_under_both_paths():
    if not SGLANG_VECTORS.is_file():
        pytest.skip(f"{SGLANG_VECTORS} is absent")
    data = json.loads(SGLANG_VECTORS.read_text())
    cases = data["cases"] if isinstance(data, dict) else data
    assert cases
    for case in cases:
        for scheme in (PURE, COMPILED):
            got = prefill_page_keys(
                case["tokens"], case["page_size"], extra_key=case["extra_key"], cache_salt=case["cache_salt"], scheme=scheme
            )
            assert got == case["page_hashes"], (case["name"], scheme.implementation)
            hasher = PageHasher(scheme, case["page_size"])
            assert hasher.continue_keys(case["tokens"], case["namespace_seed"]) == case["page_hashes"]


def test_buffers_of_any_shape_and_format_are_read_as_bytes():
    tokens = np.arange(64, dtype="<u4")
    expected = sha256_chain(tokens.tobytes(), 64, b"")
    assert sha256_chain(tokens, 64, b"") == expected  # a numpy array, format "I"
    assert sha256_chain(tokens.reshape(4, 16), 64, b"") == expected  # 2-D, C-contiguous
    assert sha256_chain(bytearray(tokens.tobytes()), 64, memoryview(b"")) == expected
    assert sha256_chain(b"abc", 4, b"") == b""  # no full page
    assert sha256_chain(b"abc", 2**80, b"") == b""  # a page longer than any buffer


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((b"abcd", 0, b""), ValueError, "page_bytes: must be >= 1, got 0"),
        ((b"abcd", -5, b""), ValueError, "page_bytes: must be >= 1, got -5"),
        ((b"abcd", -(2**80), b""), ValueError, "page_bytes: must be >= 1"),
        ((b"abcd", True, b""), TypeError, "page_bytes: must be an int, got bool"),
        ((b"abcd", 4.0, b""), TypeError, "page_bytes: must be an int, got float"),
        ((b"abcd", 4, b"x" * 31), ValueError, "prior: must be 0 bytes (no prior) or 32 bytes (a raw SHA-256 digest), got 31 bytes"),
        ((b"abcd", 4, b"x" * 64), ValueError, "prior: must be 0 bytes"),
        ((b"abcd", 4, "00" * 32), TypeError, "prior: must be a bytes-like object, got str"),
        (("abcd", 4, b""), TypeError, "data: must be a bytes-like object, got str"),
        ((memoryview(b"abcdefgh")[::2], 4, b""), TypeError, "data: must be a C-contiguous bytes-like object"),
        ((np.arange(16, dtype="<u4")[::2], 4, b""), TypeError, "data: must be a C-contiguous bytes-like object"),
        ((b"abcd", 4), TypeError, "takes 3 or 4 positional arguments"),
    ],
)
def test_argument_errors_name_the_argument(args, error, message):
    with pytest.raises(error) as info:
        sha256_chain(*args)
    assert message in str(info.value)


def test_threads_hash_concurrently_with_the_same_results():
    rng = np.random.default_rng(5)
    inputs = [rng.integers(0, 2**32, 4096, dtype=np.uint32).tobytes() for _ in range(8)]
    expected = [sha256_chain(data, 256, b"") for data in inputs]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda data: sha256_chain(data, 256, b""), inputs * 4)) == expected * 4


def test_the_default_scheme_uses_the_compiled_chain_unless_forced_off():
    forced = os.environ.get(schemes.PURE_PYTHON_ENV, "") not in ("", "0")
    assert get_scheme("sglang-v1").accelerated is not forced
    assert not get_scheme("xxh3-128").accelerated
    assert page_keys(list(range(128)), 64) == prefill_page_keys(list(range(128)), 64, scheme=PURE)


@pytest.mark.parametrize("value, accelerated", [("1", False), ("0", True), ("", True)])
def test_the_environment_variable_forces_the_python_chain(value, accelerated, tmp_path):
    env = {**os.environ, schemes.PURE_PYTHON_ENV: value}
    code = (
        "from kvstage.hashing import get_scheme; from kvstage.hashing.schemes import describe_chains; "
        "print(get_scheme().accelerated); print(describe_chains())"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    flag, line = result.stdout.splitlines()
    assert flag == str(accelerated)
    if accelerated:
        assert line == "sglang-v1 chain: compiled (OpenSSL)"
    else:
        assert line == f"sglang-v1 chain: pure Python ({schemes.PURE_PYTHON_ENV} is set)"
