"""The compiled page chains (``kvstage.hashing._sha256_chain``, ``kvstage.hashing._xxh3_chain``).

Both are built from ``hashing/_page_chain.c`` and expose ``page_chain(tokens, page_size, prior,
hex, /)``. They are checked against a spec chain written here (one ``hashlib.sha256`` /
``xxhash.xxh3_128_digest`` call per page over ``prior + struct.pack('<I'...)``, or
``prior + b"\xff" + struct.pack('<Q'...)`` for a page with an id above 2**32-1) and against the
pure-Python scheme (``get_scheme(name).pure_python()``): same keys, same errors, for every input
kind ``page_keys`` takes. The compiled scheme is built here explicitly (``dataclasses.replace``
of the pure one), so both paths are compared whatever ``KVSTAGE_PURE_PYTHON_HASH`` chose at
import. Each test skips, with the reason, where its scheme's optional extension was not built.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.hashing import PageHasher, get_scheme, page_keys, prefill_page_keys, schemes
from kvstage.hashing.schemes import SCHEMES

from hash_chains import LIBRARIES, MODULES, chain_module, compiled_scheme
from support import SHARED, skip_missing

SPEC_DIGEST = {"sglang-v1": lambda data: hashlib.sha256(data).digest(), "xxh3-128": xxhash.xxh3_128_digest}
DIGEST_SIZE = {"sglang-v1": 32, "xxh3-128": 16}
VECTORS = {
    "sglang-v1": SHARED / "reference" / "sglang_v1_vectors.json",
    "xxh3-128": Path(__file__).with_name("xxh3_128_vectors.json"),
}
U32_MAX = 2**32 - 1
GIL_RELEASE_MIN_BYTES = 2048  # _page_chain.c: at or above this many input bytes the loop runs without the GIL

INTEGER_DTYPES = [
    np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.intp, np.uintp, np.intc, np.uintc, np.longlong, np.ulonglong,
]  # fmt: skip
by_scheme = pytest.mark.parametrize("name", SCHEMES)


def spec_digests(name: str, tokens, page_size: int, prior: bytes) -> list[bytes]:
    """The chain as the spec states it, one call per page: H(prior + page as u32 little-endian),
    or H(prior + 0xff + page as u64 little-endian) for a page with an id above 2**32-1."""
    digest = SPEC_DIGEST[name]
    digests = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = [int(t) for t in tokens[start : start + page_size]]
        if max(page) > U32_MAX:
            prior = digest(prior + b"\xff" + struct.pack(f"<{page_size}Q", *page))
        else:
            prior = digest(prior + struct.pack(f"<{page_size}I", *page))
        digests.append(prior)
    return digests


def spec_keys(name: str, tokens, page_size: int, prior: bytes = b"") -> list[str]:
    return [d.hex() for d in spec_digests(name, tokens, page_size, prior)]


def range_message(position: int, value: int) -> str:
    return f"tokens: every token id must satisfy 0 <= id <= 2**63-1; tokens[{position}] = {value}"


def raised(call, *args, **kwargs) -> BaseException:
    """The exception ``call(*args, **kwargs)`` raises (fails the test if it returns)."""
    with pytest.raises(Exception) as info:
        call(*args, **kwargs)
    return info.value


class Color(enum.IntEnum):
    RED = 1
    GREEN = 7


# ---- 1. equality with the spec chain ----------------------------------------------------------

u32 = st.one_of(st.integers(0, U32_MAX), st.sampled_from([0, 1, U32_MAX]))
short_tokens = st.lists(u32, max_size=90)
# From GIL_RELEASE_MIN_BYTES // 4 list items on, the C loop releases the GIL; built from a seed to stay fast.
long_tokens = st.tuples(st.integers(GIL_RELEASE_MIN_BYTES // 4, 1300), st.integers(0, 2**32)).map(
    lambda n_seed: np.random.default_rng(n_seed[1]).integers(0, 2**32, n_seed[0]).tolist()
)


@by_scheme
@settings(max_examples=100, deadline=None)
@given(
    tokens=st.one_of(short_tokens, long_tokens),
    page_size=st.integers(1, 70),
    prior_seed=st.one_of(st.none(), st.binary(min_size=32, max_size=32)),
)
def test_page_chain_equals_the_spec_chain(name, tokens, page_size, prior_seed):
    module = chain_module(name)
    prior = b"" if prior_seed is None else prior_seed[: DIGEST_SIZE[name]]
    expected = spec_digests(name, tokens, page_size, prior)
    assert len(expected) == len(tokens) // page_size  # a partial tail gets no digest
    hex_keys = [d.hex() for d in expected]
    raw = b"".join(expected)
    for source in (tokens, tuple(tokens), np.array(tokens, dtype=np.uint32), np.array(tokens, dtype=np.int64)):
        keys = module.page_chain(source, page_size, prior, True)
        assert keys == hex_keys
        assert all(type(k) is str and len(k) == 2 * DIGEST_SIZE[name] for k in keys)
        digests = module.page_chain(source, page_size, prior, False)
        assert type(digests) is bytes and digests == raw
    # The pure-Python scheme, the compiled scheme and page_keys agree with the spec too.
    pure, compiled = get_scheme(name).pure_python(), compiled_scheme(name)
    prior_hash = prior.hex() or None
    assert page_keys(tokens, page_size, prior_hash=prior_hash, scheme=pure) == hex_keys
    assert page_keys(tokens, page_size, prior_hash=prior_hash, scheme=compiled) == hex_keys


@by_scheme
def test_a_large_input_equals_the_spec_chain(name):
    module = chain_module(name)
    tokens = np.random.default_rng(3).integers(0, 2**32, 1 << 15, dtype=np.uint32)
    prior = bytes(range(DIGEST_SIZE[name]))
    for page_size in (1, 64, 1000):
        expected = spec_digests(name, tokens.tolist(), page_size, prior)
        assert module.page_chain(tokens, page_size, prior, False) == b"".join(expected)
        assert module.page_chain(tokens.tolist(), page_size, prior, True) == [d.hex() for d in expected]


@by_scheme
def test_the_first_page_written_out_by_hand(name):
    module = chain_module(name)
    page = b"\x01\x00\x00\x00\xff\xff\xff\xff\x00\x00\x00\x00"  # 1, 2**32-1, 0 as u32 little-endian
    first = SPEC_DIGEST[name](page)
    second = SPEC_DIGEST[name](first + b"\x02\x00\x00\x00\x03\x00\x00\x00\x04\x00\x00\x00")
    assert module.page_chain([1, U32_MAX, 0, 2, 3, 4, 5], 3, b"", True) == [first.hex(), second.hex()]
    assert module.page_chain([2, 3, 4], 3, first, False) == second  # continue from a raw prior


# ---- shared vectors, both paths -----------------------------------------------------------------


def vector_cases(name: str) -> list[dict]:
    path = VECTORS[name]
    if not path.is_file():
        skip_missing(str(path))
    data = json.loads(path.read_text())
    cases = data["cases"] if isinstance(data, dict) else data
    assert cases
    return cases


@by_scheme
def test_every_shared_vector_under_both_paths(name):
    module = chain_module(name)
    for case in vector_cases(name):
        tokens, page_size, seed = case["tokens"], case["page_size"], case["namespace_seed"]
        assert module.page_chain(tokens, page_size, bytes.fromhex(seed or ""), True) == case["page_hashes"], case[
            "name"
        ]
        for scheme in (get_scheme(name).pure_python(), compiled_scheme(name)):
            for source in (tokens, np.array(tokens, dtype=np.int64)):
                got = prefill_page_keys(
                    source, page_size, extra_key=case["extra_key"], cache_salt=case["cache_salt"], scheme=scheme
                )
                assert got == case["page_hashes"], (case["name"], scheme.implementation)
            assert PageHasher(scheme, page_size).continue_keys(tokens, seed) == case["page_hashes"]


# ---- 2. every input kind gives the same keys -------------------------------------------------


def in_range_values(dtype, n: int, seed: int) -> list[int]:
    """n ids valid both for dtype and as tokens, including both ends of the overlap."""
    top = min(int(np.iinfo(dtype).max), U32_MAX)
    values = np.random.default_rng(seed).integers(0, top, n, endpoint=True).tolist()
    values[:2] = [0, top]
    return values


@by_scheme
@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [37, 3001])  # 3001: above GIL_RELEASE_MIN_BYTES for every item size
def test_every_integer_dtype_list_and_tuple_give_the_same_keys(name, dtype, n):
    module = chain_module(name)
    values = in_range_values(dtype, n, seed=n)
    array = np.array(values, dtype=dtype)
    assert array.tolist() == values
    assert (array.nbytes >= GIL_RELEASE_MIN_BYTES) == (n > 1000)
    prior = b"\x5a" * DIGEST_SIZE[name]
    expected = spec_keys(name, values, 6, prior)
    assert len(expected) == n // 6
    assert module.page_chain(array, 6, prior, True) == expected
    assert module.page_chain(values, 6, prior, True) == expected
    assert module.page_chain(tuple(values), 6, prior, True) == expected
    assert page_keys(array, 6, prior_hash=prior.hex(), scheme=compiled_scheme(name)) == expected


def input_kinds(values: list[int]) -> dict:
    """One token list in every form page_keys takes."""
    wide = np.array(values + values, dtype=np.int64)  # a contiguous view into a larger array
    readonly = np.array(values, dtype=np.uint32)
    readonly.setflags(write=False)
    return {
        "list": list(values),
        "tuple": tuple(values),
        "int64": np.array(values, dtype=np.int64),
        "uint32": np.array(values, dtype=np.uint32),
        "readonly": readonly,
        "slice": np.repeat(np.array(values, dtype=np.int64), 2)[::2],
        "reversed": np.array(values[::-1], dtype=np.int64)[::-1],
        "big-endian int64": np.array(values, dtype=np.int64).astype(">i8"),
        "big-endian uint32": np.array(values, dtype="<u4").astype(">u4"),
        "wide[:n]": wide[: len(values)],
        "torch int64": torch.tensor(values, dtype=torch.int64),
        "torch int64 slice": torch.tensor(np.repeat(values, 2))[::2],
        "torch uint32": torch.from_numpy(np.array(values, dtype=np.uint32)),
        "numpy scalars": [np.int64(v) for v in values],
        "mixed scalars": [np.uint32(v) if i % 2 else v for i, v in enumerate(values)],
        "object array": np.array(values, dtype=object),
    }


@by_scheme
@pytest.mark.parametrize("n", [50, 1100])
def test_page_keys_of_every_input_kind_equal_the_pure_python_keys(name, n):
    compiled, pure = compiled_scheme(name), get_scheme(name).pure_python()
    values = np.random.default_rng(n).integers(0, 2**32, n).tolist()
    prior_hash = "ab" * DIGEST_SIZE[name]
    expected = page_keys(values, 8, prior_hash=prior_hash, scheme=pure)
    assert expected == spec_keys(name, values, 8, bytes.fromhex(prior_hash))
    for kind, tokens in input_kinds(values).items():
        assert page_keys(tokens, 8, prior_hash=prior_hash, scheme=compiled) == expected, kind
        assert page_keys(tokens, 8, prior_hash=prior_hash, scheme=pure) == expected, kind
    ranged = list(range(1000, 1000 + n))
    assert page_keys(range(1000, 1000 + n), 8, scheme=compiled) == spec_keys(name, ranged, 8)
    enums = [Color.RED, 5, Color.GREEN, 9] * 5
    assert (
        page_keys(enums, 4, scheme=compiled) == page_keys(enums, 4, scheme=pure) == spec_keys(name, [1, 5, 7, 9] * 5, 4)
    )


class Spy:
    """A compiled module that records what each page_chain call returned."""

    def __init__(self, module):
        self.module, self.TokenOutOfRange, self.LIBRARY = module, module.TokenOutOfRange, module.LIBRARY
        self.results = []

    def page_chain(self, *args):
        result = self.module.page_chain(*args)
        self.results.append("NotImplemented" if result is NotImplemented else "keys")
        return result


@by_scheme
@pytest.mark.parametrize(
    "tokens, route",
    [
        ([1, 2, 3, 4], ["keys"]),
        ((1, 2, 3, 4), ["keys"]),
        (np.arange(1, 5, dtype=np.int16), ["keys"]),
        (np.arange(1, 5, dtype=">i8"), ["keys"]),  # byte-swapped to native first
        (np.arange(1, 9, dtype=np.int64)[::2], ["keys"]),  # made contiguous first
        (torch.arange(1, 5), ["keys"]),
        (range(1, 5), ["keys"]),  # an int64 array made from its ends
        ([1, 2, np.int64(3), 4], ["NotImplemented"]),
        ([Color.RED, 2, 3, 4], ["NotImplemented"]),
        (np.array([1, 2, 3, 4], dtype=object), []),
    ],
    ids=["list", "tuple", "int16", "big-endian", "strided", "torch", "range", "numpy scalar", "IntEnum", "object"],
)
def test_page_keys_routes_to_the_compiled_chain_where_it_reads_the_tokens(name, tokens, route):
    spy = Spy(chain_module(name))
    scheme = replace(get_scheme(name).pure_python(), compiled=spy)
    tokens_list = [int(t) for t in tokens]
    assert page_keys(tokens, 2, scheme=scheme) == spec_keys(name, tokens_list, 2)
    assert spy.results == route


# ---- 3. ids out of range ----------------------------------------------------------------------

BAD_VALUES = {
    "int8": (np.int8, [-1, -128]),
    "int16": (np.int16, [-1, -(2**15)]),
    "int32": (np.int32, [-1, -(2**31)]),
    "int64": (np.int64, [-1, -(2**63)]),
    "uint64": (np.uint64, [2**63, 2**64 - 1]),
    "list": (None, [-1, 2**63, 2**64 - 1, -(2**63), 2**100, -(2**100)]),
    "tuple": (tuple, [-1, 2**63, 2**100]),
}
# (number of tokens, page size, positions: first, middle, last full page, tail, last)
LAYOUTS = [(23, 5, [0, 11, 17, 20, 22]), (1003, 10, [0, 517, 995, 1000, 1002])]  # 1003: GIL released


def with_bad(kind: str, n: int, position: int, value: int, later: int | None = None):
    dtype, _ = BAD_VALUES[kind]
    values = np.random.default_rng(position).integers(0, 100, n).tolist()
    values[position] = value
    if later is not None:
        values[later] = 2**63 + 5 if kind == "uint64" else -7
    if dtype is None:
        return values
    if dtype is tuple:
        return tuple(values)
    return np.array(values, dtype=dtype)


@by_scheme
@pytest.mark.parametrize("kind", list(BAD_VALUES))
def test_an_id_out_of_range_raises_as_the_pure_path_does(name, kind):
    module, compiled, pure = chain_module(name), compiled_scheme(name), get_scheme(name).pure_python()
    for value in BAD_VALUES[kind][1]:
        for n, page_size, positions in LAYOUTS:
            for position in positions:
                later = n - 1 if position < n - 1 else None  # a second bad id after the first
                tokens = with_bad(kind, n, position, value, later)
                error = raised(module.page_chain, tokens, page_size, b"", True)
                assert type(error) is module.TokenOutOfRange
                assert isinstance(error, ValueError)
                assert error.args == (position, value), (kind, value, n, position)
                assert type(error.args[1]) is int
                assert raised(module.page_chain, tokens, page_size, b"\0" * DIGEST_SIZE[name], False).args == (
                    position,
                    value,
                )
                for scheme in (compiled, pure):
                    error = raised(page_keys, tokens, page_size, scheme=scheme)
                    assert type(error) is InvalidArgumentError, (scheme.implementation, kind, value, position)
                    assert str(error) == range_message(position, value)


@by_scheme
def test_a_torch_tensor_out_of_range_raises_as_the_pure_path_does(name):
    tokens = torch.tensor([3, 4, 5, -2, 6], dtype=torch.int64)
    for scheme in (compiled_scheme(name), get_scheme(name).pure_python()):
        error = raised(page_keys, tokens, 2, scheme=scheme)
        assert type(error) is InvalidArgumentError and str(error) == range_message(3, -2)


@by_scheme
@pytest.mark.parametrize("kind", ["int64", "uint64", "uint32", "list"])
def test_the_boundary_ids_are_accepted(name, kind):
    module = chain_module(name)
    values = [0, U32_MAX, U32_MAX, 0, 1, U32_MAX - 1]
    tokens = values if kind == "list" else np.array(values, dtype=kind)
    expected = spec_keys(name, values, 2)
    assert module.page_chain(tokens, 2, b"", True) == expected
    assert page_keys(tokens, 2, scheme=compiled_scheme(name)) == expected
    assert page_keys(tokens, 2, scheme=get_scheme(name).pure_python()) == expected


@by_scheme
@pytest.mark.parametrize(
    "tokens, error_type, message, raw",
    [
        ([1.5, -1], ArgumentTypeError, "tokens: token ids must be integers; tokens[0] = 1.5 (float)", NotImplemented),
        ([-1, 1.5], InvalidArgumentError, range_message(0, -1), (0, -1)),
        (
            [5, True],
            ArgumentTypeError,
            "tokens: token ids must be integers, not bools; tokens[1] = True (bool)",
            NotImplemented,
        ),
        (
            [True, -1],
            ArgumentTypeError,
            "tokens: token ids must be integers, not bools; tokens[0] = True (bool)",
            NotImplemented,
        ),
        ([7, 2**63, True], InvalidArgumentError, range_message(1, 2**63), (1, 2**63)),
        (
            [7, 2**40, True],
            ArgumentTypeError,
            "tokens: token ids must be integers, not bools; tokens[2] = True (bool)",
            NotImplemented,
        ),
        ([7, np.int64(-3), 2**40], InvalidArgumentError, range_message(1, -3), NotImplemented),
        ([7, Color.RED, -3], InvalidArgumentError, range_message(2, -3), NotImplemented),
    ],
)
def test_the_first_bad_element_of_a_list_is_named_whichever_path_finds_it(name, tokens, error_type, message, raw):
    module = chain_module(name)
    if raw is NotImplemented:
        assert module.page_chain(tokens, 1, b"", True) is NotImplemented
    else:
        assert raised(module.page_chain, tokens, 1, b"", True).args == raw
    for scheme in (compiled_scheme(name), get_scheme(name).pure_python()):
        error = raised(page_keys, tokens, 1, scheme=scheme)
        assert type(error) is error_type and str(error) == message, scheme.implementation


# ---- 4. what page_chain declines, and argument errors ----------------------------------------

DECLINED = {
    "list with bool": [1, True],
    "list with float": [1, 2.0],
    "list with IntEnum": [1, Color.GREEN],
    "list with numpy scalar": [np.int64(1), 2],
    "tuple with bool": (False, 1),
    "list subclass": type("Tokens", (list,), {})([1, 2]),
    "float64 array": np.arange(4, dtype=np.float64),
    "float16 array": np.arange(4, dtype=np.float16),
    "bool array": np.ones(4, dtype=bool),
    "complex array": np.arange(4, dtype=np.complex64),
    "object array": np.array([1, 2], dtype=object),
    "datetime array": np.array(["2020-01-01"], dtype="datetime64[D]"),
    "big-endian array": np.arange(4, dtype=">i8"),
    "big-endian uint32": np.arange(4, dtype=">u4"),
    "strided slice": np.arange(8, dtype=np.int64)[::2],
    "reversed": np.arange(4, dtype=np.int64)[::-1],
    "2-D array": np.arange(8, dtype=np.int64).reshape(2, 4),
    "2-D one row": np.arange(4, dtype=np.int32).reshape(1, 4),
    "0-d array": np.array(5, dtype=np.int64),
    "strided memoryview": memoryview(np.arange(8, dtype=np.int32))[::2],
    "range": range(4),
    "str": "abcd",
    "dict": {0: 1},
    "set": {1, 2},
    "None": None,
    "generator": (i for i in range(4)),
    "torch tensor": torch.arange(4),  # page_keys hands it over as a numpy array
}


@by_scheme
@pytest.mark.parametrize("tokens", list(DECLINED.values()), ids=list(DECLINED))
def test_page_chain_declines_what_it_does_not_read(name, tokens):
    module = chain_module(name)
    assert module.page_chain(tokens, 1, b"", True) is NotImplemented
    assert module.page_chain(tokens, 2, b"", False) is NotImplemented


@by_scheme
def test_other_native_integer_buffers_are_read_as_ids(name):
    import array

    module = chain_module(name)
    expected = spec_keys(name, [1, 2, 300, 4], 2)
    assert module.page_chain(array.array("q", [1, 2, 300, 4]), 2, b"", True) == expected
    assert module.page_chain(memoryview(np.array([1, 2, 300, 4], dtype="<u4")), 2, b"", True) == expected
    assert module.page_chain(bytes([1, 2, 250, 4]), 2, b"", True) == spec_keys(name, [1, 2, 250, 4], 2)  # format "B"


@by_scheme
@pytest.mark.parametrize(
    "page_size, error_type, message",
    [
        (0, ValueError, "page_size: must be >= 1, got 0"),
        (-5, ValueError, "page_size: must be >= 1, got -5"),
        (-(2**80), ValueError, f"page_size: must be >= 1, got {-(2**80)}"),
        (True, TypeError, "page_size: must be an int, got bool"),
        (4.0, TypeError, "page_size: must be an int, got float"),
        ("4", TypeError, "page_size: must be an int, got str"),
        (None, TypeError, "page_size: must be an int, got NoneType"),
    ],
)
def test_a_bad_page_size_is_named(name, page_size, error_type, message):
    module = chain_module(name)
    for tokens in ([1, 2, 3, 4], np.arange(4), [1.5]):  # checked before the tokens are looked at
        error = raised(module.page_chain, tokens, page_size, b"", True)
        assert type(error) is error_type and str(error) == message


@by_scheme
def test_a_prior_of_the_wrong_length_is_named(name):
    module = chain_module(name)
    size = DIGEST_SIZE[name]
    for length in (1, size - 1, size + 1, 2 * size):
        error = raised(module.page_chain, [1, 2], 1, b"x" * length, True)
        assert type(error) is ValueError
        assert str(error) == f"prior: must be 0 bytes (no prior) or {size} bytes (a raw digest), got {length} bytes"


@by_scheme
def test_a_prior_of_the_wrong_type_is_named(name):
    module = chain_module(name)
    for prior in ("00" * DIGEST_SIZE[name], None):
        error = raised(module.page_chain, [1, 2], 1, prior, True)
        assert type(error) is TypeError and str(error).startswith("prior: must be a bytes-like object, got ")
    error = raised(module.page_chain, [1, 2], 1, memoryview(b"x" * 2 * DIGEST_SIZE[name])[::2], True)
    assert type(error) is TypeError and str(error).startswith("prior: must be a C-contiguous bytes-like object")


@by_scheme
def test_a_prior_of_the_wrong_type_raises_type_error(name):
    module = chain_module(name)
    for prior in ("00" * DIGEST_SIZE[name], None, 0):
        assert type(raised(module.page_chain, [1, 2], 1, prior, True)) is TypeError


@by_scheme
def test_any_bytes_like_prior_of_the_right_length_is_read(name):
    module = chain_module(name)
    prior = bytes(range(DIGEST_SIZE[name]))
    expected = spec_keys(name, [9, 8, 7, 6], 2, prior)
    for form in (prior, bytearray(prior), memoryview(prior), np.frombuffer(prior, dtype=np.uint8)):
        assert module.page_chain([9, 8, 7, 6], 2, form, True) == expected


@by_scheme
def test_the_call_takes_exactly_four_positional_arguments(name):
    module = chain_module(name)
    error = raised(module.page_chain, [1, 2], 1, b"")
    assert type(error) is TypeError and "takes 4 positional arguments" in str(error) and "got 3" in str(error)
    assert "takes 4 positional arguments" in str(raised(module.page_chain, [1], 1, b"", True, None))
    assert "keyword" in str(raised(module.page_chain, [1, 2], 1, b"", hex=True))


@by_scheme
@pytest.mark.parametrize("page_size", [5, 6, 2**31, 2**62, 2**63, 2**80])
def test_a_page_longer_than_the_input_gives_no_keys_but_checks_the_ids(name, page_size):
    module = chain_module(name)
    for tokens in ([1, 2, 3, 4], (1, 2, 3, 4), np.arange(4, dtype=np.uint64), np.arange(4, dtype=np.int8)):
        assert module.page_chain(tokens, page_size, b"", True) == []
        assert module.page_chain(tokens, page_size, b"", False) == b""
    big = np.random.default_rng(1).integers(0, 2**32, 700).tolist()  # 2800 bytes: GIL released
    assert module.page_chain(big, page_size, b"", True) == ([] if page_size > 700 else spec_keys(name, big, page_size))
    for tokens, position, value in (
        ([1, 2, 2**63], 2, 2**63),
        ([-1, 2], 0, -1),
        (np.array([4, 5, -9, 6], dtype=np.int64), 2, -9),
        (np.array([4, 2**64 - 1], dtype=np.uint64), 1, 2**64 - 1),
        (big[:-1] + [-1], 699, -1),
    ):
        assert raised(module.page_chain, tokens, page_size, b"", True).args == (position, value)
    error = raised(page_keys, [1, 2, -4], 2**80, scheme=compiled_scheme(name))
    assert type(error) is InvalidArgumentError and str(error) == range_message(2, -4)


@by_scheme
def test_empty_input(name):
    module = chain_module(name)
    for tokens in ([], (), np.array([], dtype=np.int64), np.array([], dtype=np.uint8)):
        for prior in (b"", b"\1" * DIGEST_SIZE[name]):
            assert module.page_chain(tokens, 1, prior, True) == []
            assert module.page_chain(tokens, 3, prior, False) == b""


# ---- 5. threads ----------------------------------------------------------------------------


@by_scheme
def test_threads_hash_concurrently_with_the_same_results(name):
    module = chain_module(name)
    rng = np.random.default_rng(5)
    inputs = [rng.integers(0, 2**32, 4096, dtype=np.uint32) for _ in range(4)]
    inputs += [rng.integers(0, 2**32, 1024, dtype=np.int64).tolist() for _ in range(4)]  # lists: 4096 bytes as u32
    assert all(4 * len(tokens) >= GIL_RELEASE_MIN_BYTES for tokens in inputs)
    prior = b"\x11" * DIGEST_SIZE[name]
    expected = [module.page_chain(tokens, 64, prior, False) for tokens in inputs]
    assert expected[0] == b"".join(spec_digests(name, inputs[0].tolist(), 64, prior))
    assert expected[-1] == b"".join(spec_digests(name, inputs[-1], 64, prior))

    def work(tokens):
        return module.page_chain(tokens, 64, prior, False)

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(work, inputs * 6)) == expected * 6


@by_scheme
def test_a_large_input_is_hashed_without_the_gil(name):
    """While one thread hashes a large array, the main thread keeps running Python code."""
    module = chain_module(name)
    tokens = np.random.default_rng(2).integers(0, 2**32, 1 << 20, dtype=np.uint32)
    while True:  # grow the input until one call takes long enough to watch
        start = time.perf_counter()
        module.page_chain(tokens, 4, b"", False)
        if time.perf_counter() - start >= 0.06 or tokens.size >= 1 << 24:
            break
        tokens = np.concatenate([tokens, tokens])
    span = {}

    def hash_once():
        span["start"] = time.perf_counter()
        module.page_chain(tokens, 4, b"", False)
        span["end"] = time.perf_counter()

    worker = threading.Thread(target=hash_once)
    ticks = []
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
    worker.join()
    start, end = span["start"], span["end"]
    # With the GIL held for the call, the main thread could run only just before or after it.
    middle = [t for t in ticks if start + (end - start) / 4 < t < end - (end - start) / 4]
    assert middle, f"the main thread did not run during the middle of a {end - start:.3f} s call"


# ---- 6. which chain runs --------------------------------------------------------------------


@by_scheme
def test_the_scheme_uses_its_compiled_chain_unless_forced_off(name):
    module = chain_module(name)
    forced = os.environ.get(schemes.PURE_PYTHON_ENV, "") not in ("", "0")
    scheme = get_scheme(name)
    assert scheme.compiled is (None if forced else module)
    assert module.DIGEST_SIZE == scheme.digest_size == DIGEST_SIZE[name]
    assert issubclass(module.TokenOutOfRange, ValueError)
    assert module.LIBRARY.startswith(LIBRARIES[name] + " ")
    if name == "xxh3-128":
        assert re.fullmatch(r"xxHash \d+\.\d+\.\d+", module.LIBRARY)
    assert compiled_scheme(name).implementation == f"compiled ({module.LIBRARY})"
    pure = scheme.pure_python()
    assert pure.compiled is None and pure.implementation == "pure Python"
    assert pure.why_pure_python == "pure Python requested"


def expected_description(forced: bool) -> list[str | re.Pattern]:
    """Each scheme's part of describe_chains() in a subprocess, from what this process built."""
    parts = []
    for name in SCHEMES:
        if forced:
            parts.append(f"{name} pure Python ({schemes.PURE_PYTHON_ENV} is set)")
            continue
        try:
            module = __import__(MODULES[name], fromlist=["LIBRARY"])
        except ImportError:
            parts.append(re.compile(re.escape(f"{name} pure Python ({MODULES[name]} not built: ") + r".*\)"))
        else:
            parts.append(f"{name} compiled ({module.LIBRARY})")
    return parts


@pytest.mark.parametrize(
    "value, forced",
    [("1", True), ("yes", True), ("0", False), ("", False), ("false", False), (" Off ", False), ("no", False)],
)
def test_the_environment_variable_forces_the_python_chains(value, forced, tmp_path):
    env = {**os.environ, schemes.PURE_PYTHON_ENV: value}
    code = (
        "from kvstage.hashing import get_scheme, page_keys; from kvstage.hashing.schemes import SCHEMES, describe_chains; "
        "print(' '.join(str(get_scheme(n).compiled is not None) for n in SCHEMES)); print(describe_chains()); "
        "print(page_keys(list(range(8)), 4, scheme='xxh3-128')[1])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    flags, line, key = result.stdout.splitlines()
    expected = expected_description(forced)
    built = [not isinstance(part, re.Pattern) and " compiled (" in part for part in expected]
    assert flags.split() == [str(b) for b in built]
    parts = line.split("; ")
    assert len(parts) == len(SCHEMES)
    for part, want in zip(parts, expected):
        assert want.fullmatch(part) if isinstance(want, re.Pattern) else part == want
    if forced:
        assert line == "; ".join(f"{n} pure Python ({schemes.PURE_PYTHON_ENV} is set)" for n in SCHEMES)
    assert key == spec_keys("xxh3-128", list(range(8)), 4)[1]
