"""Token ids as ``array.array`` and other buffer-protocol objects (sglang 0.5.23 keeps a request's
``origin_input_ids`` / ``output_ids`` as ``array('q')``): the same keys as a list, for both
schemes and both chains (compiled and pure Python), sglang's reference vectors included; the
compiled chain reads such a buffer in place; bad formats and ids out of range raise naming
``tokens``."""

from __future__ import annotations

import array
import ctypes
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.hashing import PageHasher, compute_prefix_hash, get_scheme, page_keys, prefill_page_keys, token_bytes
from kvstage.hashing.schemes import SCHEMES
from kvstage.hashing.tokens import compiled_source, token_ids

from hash_chains import CHAINS, chain_scheme
from support import SHARED

LONG_IS_64_BIT = array.array("l").itemsize == 8
SGLANG_VECTORS = SHARED / "reference" / "sglang_v1_vectors.json"
SGLANG_NATIVE_VECTORS = SHARED / "reference" / "sglang_native_vectors.json"
XXH3_VECTORS = Path(__file__).with_name("xxh3_128_vectors.json")


def array_forms(tokens: list[int]) -> dict[str, object]:
    """``tokens`` in every array.array / buffer form that can hold them, by name."""
    n, top = len(tokens), max(tokens, default=0)
    interleaved = [value for token in tokens for value in (token, 0)]
    forms = {
        "array-q": array.array("q", tokens),
        "array-Q": array.array("Q", tokens),
        "memoryview-of-array-q": memoryview(array.array("q", tokens)),
        "memoryview-of-numpy-int64": memoryview(np.array(tokens, dtype=np.int64)),
        "memoryview-of-numpy-uint64": memoryview(np.array(tokens, dtype=np.uint64)),
        "ctypes-int64 (format <q)": (ctypes.c_int64 * n)(*tokens),  # a standard-size format
        "memoryview-strided": memoryview(array.array("q", interleaved))[::2],
        "memoryview-big-endian (format >q)": memoryview(np.array(tokens, dtype=">i8")),
    }
    if LONG_IS_64_BIT or top < 2**31:
        forms["array-l"] = array.array("l", tokens)
    if top < 2**31:
        forms["array-i"] = array.array("i", tokens)
        forms["ctypes-int32 (format <i)"] = (ctypes.c_int32 * n)(*tokens)
    if top < 2**32:
        forms["array-I"] = array.array("I", tokens)
        forms["memoryview-of-numpy-uint32"] = memoryview(np.array(tokens, dtype=np.uint32))
    if top < 2**16:
        forms["array-H"] = array.array("H", tokens)
        forms["ctypes-uint16 (format <H)"] = (ctypes.c_uint16 * n)(*tokens)
    if top < 2**8:
        forms["array-B"] = array.array("B", tokens)
        forms["memoryview-of-array-B"] = memoryview(array.array("B", tokens))
    return forms


def all_forms(tokens: list[int]) -> dict[str, object]:
    """Today's forms (list, tuple, numpy, torch) and every array form."""
    return {"list": tokens, "tuple": tuple(tokens), "numpy-int64": np.array(tokens, dtype=np.int64),
            "torch-int64": torch.tensor(tokens, dtype=torch.int64), **array_forms(tokens)}  # fmt: skip


class Request:
    def __init__(self, extra_key, cache_salt):
        self.extra_key = extra_key
        self.cache_salt = cache_salt


rng = np.random.default_rng(17)
TOKEN_SETS = {
    "bytes-sized": rng.integers(0, 256, 37).tolist(),
    "vocabulary": rng.integers(0, 152064, 203).tolist(),
    "u32-edges": [0, 2**32 - 1, 2**31, 2**31 - 1, 65535, 65536, 1, 2] * 5,
    # pages of u32 ids and pages holding an id above 2**32 (u64 encoded), up to 2**63-1
    "wide": [7, 2**32, 5, 6, 2**63 - 1, 1, 2, 3, 2**40, 9, 10, 11] * 3,
    "long": rng.integers(0, 2**20, 3001).tolist(),  # above the C chain's GIL release threshold
}


@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("token_set", list(TOKEN_SETS))
def test_every_form_gives_the_keys_of_the_list(token_set, name, chain, naive):
    tokens = TOKEN_SETS[token_set]
    scheme = chain_scheme(name, chain)
    page_size = 4
    hasher = PageHasher(scheme, page_size)
    req = Request("lora-7", "tenant-a")
    expected = naive.prefill(tokens, page_size, "lora-7", "tenant-a", name)
    plain = naive.keys(tokens, page_size, b"", name)
    assert len(expected) == len(tokens) // page_size
    for form, ids in all_forms(tokens).items():
        assert (
            prefill_page_keys(ids, page_size, extra_key="lora-7", cache_salt="tenant-a", scheme=scheme) == expected
        ), form
        assert hasher.prefill_keys(ids, "lora-7", "tenant-a") == expected, form
        assert page_keys(ids, page_size, scheme=scheme) == plain, form
        assert hasher.continue_keys(ids, None) == plain, form
        assert compute_prefix_hash(req, ids, "", page_size=page_size, scheme=scheme) == expected, form
        # Decode: the first three pages, then the rest continued from their last key (a slice
        # of an array is an array, of a memoryview a memoryview).
        first = hasher.compute_prefix_hash(req, ids[: 3 * page_size])
        rest = hasher.compute_prefix_hash(req, ids[3 * page_size :], first[-1])
        assert first + rest == expected, form


def vector_cases(path: Path, keys: str, seed: str) -> list:
    """(tokens, page_size, extra_key, cache_salt, seed, keys) of every case of a vector file."""
    if not path.is_file():
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"{path} is absent"), id="absent")]
    data = json.loads(path.read_text())
    cases = data["cases"] if isinstance(data, dict) else data
    return [
        pytest.param(
            (c["tokens"], c["page_size"], c["extra_key"], c["cache_salt"], c[seed], c[keys]), id=f"{path.stem}-{i:02d}"
        )
        for i, c in enumerate(cases)
    ]


VECTOR_CASES = [
    *(("sglang-v1", case) for case in vector_cases(SGLANG_VECTORS, "page_hashes", "namespace_seed")),
    *(("sglang-v1", case) for case in vector_cases(SGLANG_NATIVE_VECTORS, "keys", "seed")),
    *(("xxh3-128", case) for case in vector_cases(XXH3_VECTORS, "page_hashes", "namespace_seed")),
]


@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize(
    "name, case", [pytest.param(name, case.values[0], id=case.id, marks=case.marks) for name, case in VECTOR_CASES]
)
def test_reference_vectors_in_every_array_form(name, case, chain):
    """sglang's own keys (its v1 vectors and its native page hash with ids up to 2**63-1) and the
    committed xxh3-128 vectors, from every array form that holds the case's ids."""
    tokens, page_size, extra_key, cache_salt, seed, expected = case
    scheme = chain_scheme(name, chain)
    for form, ids in array_forms(tokens).items():
        assert (
            prefill_page_keys(ids, page_size, extra_key=extra_key, cache_salt=cache_salt, scheme=scheme) == expected
        ), form
        assert PageHasher(scheme, page_size).continue_keys(ids, seed) == expected, form


# ---- the compiled chain reads the buffer in place ------------------------------------------


class Spy:
    """A compiled module that records what each page_chain call was handed and what it returned."""

    def __init__(self, module):
        self.module, self.TokenOutOfRange, self.LIBRARY = module, module.TokenOutOfRange, module.LIBRARY
        self.calls = []

    def page_chain(self, tokens, *args):
        result = self.module.page_chain(tokens, *args)
        self.calls.append((tokens, result is not NotImplemented))
        return result


IN_PLACE = {
    "array-q": lambda: array.array("q", [1, 2, 2**40, 4]),
    "array-l": lambda: array.array("l", [1, 2, 3, 4]),
    "array-i": lambda: array.array("i", [1, 2, 3, 4]),
    "array-Q": lambda: array.array("Q", [1, 2, 2**63 - 1, 4]),
    "array-H": lambda: array.array("H", [1, 2, 3, 4]),
    "memoryview-of-array-q": lambda: memoryview(array.array("q", [1, 2, 3, 4])),
    "ctypes-int64 (format <q)": lambda: (ctypes.c_int64 * 4)(1, 2, 3, 4),
    "ctypes-uint16 (format <H)": lambda: (ctypes.c_uint16 * 4)(1, 2, 3, 4),
}


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("form", list(IN_PLACE))
def test_the_compiled_chain_reads_a_contiguous_buffer_in_place(name, form):
    """The object itself reaches the C chain (its buffer read without a copy), and hashes once."""
    tokens = IN_PLACE[form]()
    assert compiled_source(tokens) is tokens
    spy = Spy(chain_scheme(name, "compiled").compiled)
    scheme = replace(get_scheme(name).pure_python(), compiled=spy)
    assert page_keys(tokens, 2, scheme=scheme) == page_keys(list(tokens), 2, scheme=get_scheme(name).pure_python())
    assert len(spy.calls) == 1 and spy.calls[0][0] is tokens and spy.calls[0][1]


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize(
    "form",
    [
        pytest.param(lambda: memoryview(array.array("q", [1, 0, 2, 0, 2**40, 0, 4, 0]))[::2], id="strided"),
        pytest.param(lambda: memoryview(array.array("q", [4, 2**40, 2, 1]))[::-1], id="reversed"),
        pytest.param(lambda: memoryview(np.array([1, 2, 2**40, 4], dtype=">i8")), id="big-endian"),
    ],
)
def test_a_buffer_the_chain_cannot_read_in_place_is_made_contiguous_first(name, form):
    """The C chain takes C-contiguous native buffers only (it declines a strided or big-endian
    one); such a buffer is copied once into a contiguous native array, then hashed in C."""
    tokens = form()
    module = chain_scheme(name, "compiled").compiled
    assert module.page_chain(tokens, 2, b"", True) is NotImplemented
    source = compiled_source(tokens)
    assert isinstance(source, np.ndarray) and source.flags.c_contiguous and source.dtype.isnative
    spy = Spy(module)
    scheme = replace(get_scheme(name).pure_python(), compiled=spy)
    assert page_keys(tokens, 2, scheme=scheme) == page_keys([1, 2, 2**40, 4], 2, scheme=get_scheme(name).pure_python())
    assert [ok for _, ok in spy.calls] == [True]


def test_the_python_conversion_gives_the_same_bytes_for_every_form():
    ids = [0, 1, 255, 65535, 65536, 2**31, 2**32 - 1]
    expected = token_bytes(ids)
    for form, tokens in array_forms(ids).items():
        assert token_bytes(tokens) == expected, form
        assert token_ids(tokens) == (memoryview(expected), 4), form
    wide = [1, 2**32, 2**63 - 1]
    for form, tokens in array_forms(wide).items():
        data, id_bytes = token_ids(tokens)
        assert id_bytes == 8 and data.tobytes() == np.array(wide, dtype="<u8").tobytes(), form


# ---- bad input ---------------------------------------------------------------------------------

ACCEPTED = (
    "a list/tuple/range of ints, a numpy integer array, a torch integer tensor, or an array.array or buffer of integers"
)
BAD_FORMATS = {
    "bytes": (lambda: b"\x01\x02\x03\x04", ArgumentTypeError, "tokens: bytes is a byte string, not token ids"),
    "bytearray": (
        lambda: bytearray(b"\x01\x02\x03\x04"),
        ArgumentTypeError,
        "tokens: bytearray is a byte string, not token ids",
    ),
    "chars (format c)": (
        lambda: memoryview(b"abcd").cast("c"),
        ArgumentTypeError,
        "tokens: token ids must be integers, got a buffer of format 'c'",
    ),
    "array-f": (
        lambda: array.array("f", [1, 2, 3, 4]),
        ArgumentTypeError,
        "tokens: token ids must be integers, got a buffer of format 'f'",
    ),
    "array-d": (
        lambda: array.array("d", [1, 2, 3, 4]),
        ArgumentTypeError,
        "tokens: token ids must be integers, got a buffer of format 'd'",
    ),
    "bools (format ?)": (
        lambda: memoryview(bytes(4)).cast("?"),
        ArgumentTypeError,
        "tokens: token ids must be integers, got a buffer of format '?'",
    ),
    "ctypes-double (format <d)": (
        lambda: (ctypes.c_double * 4)(),
        ArgumentTypeError,
        "tokens: token ids must be integers, got a buffer of format '<d'",
    ),
    "2-D": (
        lambda: memoryview(np.zeros((2, 2), dtype=np.int64)),
        InvalidArgumentError,
        "tokens: must be 1-D, got shape (2, 2)",
    ),
    "0-D": (lambda: memoryview(np.array(5, dtype=np.int64)), InvalidArgumentError, "tokens: must be 1-D, got shape ()"),
}


@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("form", list(BAD_FORMATS))
def test_a_buffer_of_no_integer_format_raises_naming_tokens_and_the_accepted_forms(form, name, chain):
    make, error_type, message = BAD_FORMATS[form]
    scheme = chain_scheme(name, chain)
    for call in (
        lambda: page_keys(make(), 4, scheme=scheme),
        lambda: PageHasher(scheme, 4).prefill_keys(make(), "lora-7"),
        lambda: compute_prefix_hash(Request(None, None), make(), page_size=4, scheme=scheme),
        lambda: token_bytes(make()),
    ):
        with pytest.raises(error_type) as info:
            call()
        assert str(info.value).startswith(message), str(info.value)
        if error_type is ArgumentTypeError:
            assert ACCEPTED in str(info.value)


def range_message(position: int, value: int) -> str:
    return f"tokens: every token id must satisfy 0 <= id <= 2**63-1; tokens[{position}] = {value}"


OUT_OF_RANGE = {
    "array-Q above 2**63-1": (lambda: array.array("Q", [1, 2, 3, 4, 2**63, 6]), 4, 2**63),
    "array-Q at 2**64-1": (lambda: array.array("Q", [2**64 - 1, 2]), 0, 2**64 - 1),
    "array-q negative": (lambda: array.array("q", [1, 2, 3, -1]), 3, -1),
    "array-i negative": (lambda: array.array("i", [1, -(2**31), 3, 4]), 1, -(2**31)),
    "array-b negative": (lambda: array.array("b", [1, 2, -5]), 2, -5),  # in the partial last page: still checked
    "ctypes-int64 negative": (lambda: (ctypes.c_int64 * 4)(1, 2, -7, 4), 2, -7),
    "strided memoryview negative": (lambda: memoryview(array.array("q", [1, 0, -3, 0, 5, 0]))[::2], 1, -3),
    "big-endian memoryview above": (lambda: memoryview(np.array([1, 2**63, 2], dtype=">u8")), 1, 2**63),
}


@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("form", list(OUT_OF_RANGE))
def test_an_id_out_of_range_in_a_buffer_raises_the_range_error(form, name, chain):
    make, position, value = OUT_OF_RANGE[form]
    scheme = chain_scheme(name, chain)
    with pytest.raises(InvalidArgumentError) as info:
        page_keys(make(), 2, scheme=scheme)
    assert str(info.value) == range_message(position, value)


def test_u32_bytes_of_a_buffer_take_ids_up_to_2_32_minus_1_only():
    with pytest.raises(
        InvalidArgumentError,
        match=r"^tokens: every token id must satisfy 0 <= id <= 2\*\*32-1 .*tokens\[1\] = 4294967296$",
    ):
        token_bytes(array.array("Q", [1, 2**32]))


# Every format letter with a prefix: '<' and '=' mean standard sizes ('l' is 4 bytes there, 8
# natively), '>' and '!' big-endian. CPython's test-only _testbuffer exports any of them.
PREFIXED_FORMATS = ["<l", "<L", "=q", "=Q", "@n", "@N", "<h", "=b", "<B", ">H", "!i", ">q"]


@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("format", PREFIXED_FORMATS)
def test_standard_size_and_big_endian_formats(format, name, chain):
    testbuffer = pytest.importorskip("_testbuffer", reason="CPython's test-only _testbuffer module is not installed")
    values = [1, 2, 3, 100, 7, 0, 126, 5]
    tokens = testbuffer.ndarray(values, shape=[len(values)], format=format)
    assert memoryview(tokens).format == format
    scheme = chain_scheme(name, chain)
    expected = page_keys(values, 2, scheme=get_scheme(name).pure_python())
    assert page_keys(tokens, 2, scheme=scheme) == expected
    in_place = format[0] not in ">!"
    assert (compiled_source(tokens) is tokens) == in_place
    if chain == "compiled":
        result = scheme.compiled.page_chain(tokens, 2, b"", True)
        assert result == expected if in_place else result is NotImplemented
    if format[-1].islower():  # signed: a negative id is named
        bad = testbuffer.ndarray(values[:5] + [-1] + values[6:], shape=[len(values)], format=format)
        with pytest.raises(InvalidArgumentError) as info:
            page_keys(bad, 2, scheme=scheme)
        assert str(info.value) == range_message(5, -1)
