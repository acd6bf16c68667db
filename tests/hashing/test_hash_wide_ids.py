"""Token ids above 2**32-1 (sglang 0.5.23's native page hash): both chains, every input kind.

A page whose ids all fit u32 is hashed as u32 little-endian after the prior; a page with an id
above 2**32-1 as the prior, one 0xff byte, then every id as u64 little-endian. Ids below 0 or
above 2**63-1 are errors. The compiled chains, the Python chains and the naive per-token
reference (conftest) must agree; the encoding is chosen page by page and the chain runs across both.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.errors import InvalidArgumentError
from kvstage.hashing import PageHasher, compute_prefix_hash, page_keys, prefill_page_keys, token_bytes
from kvstage.hashing.schemes import SCHEMES

from hash_chains import CHAINS, chain_module, chain_scheme

DIGEST = {"sglang-v1": lambda data: hashlib.sha256(data).digest(), "xxh3-128": xxhash.xxh3_128_digest}
U32_MAX = 2**32 - 1
ID_MAX = 2**63 - 1
GIL_RELEASE_MIN_BYTES = 2048  # _page_chain.c: at or above this many input bytes the loop runs without the GIL
by_scheme = pytest.mark.parametrize("name", SCHEMES)
by_chain = pytest.mark.parametrize("chain", CHAINS)


def spec_keys(name: str, tokens, page_size: int, prior: bytes = b"") -> list[str]:
    """The rule in one call per page: H(prior + 0xff + u64 LE ids) if an id > 2**32-1, else H(prior + u32 LE ids)."""
    keys = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = np.array([int(t) for t in tokens[start : start + page_size]], dtype=np.uint64)
        data = b"\xff" + page.astype("<u8").tobytes() if page.max() > U32_MAX else page.astype("<u4").tobytes()
        prior = DIGEST[name](prior + data)
        keys.append(prior.hex())
    return keys


def range_message(position: int, value: int) -> str:
    return f"tokens: every token id must satisfy 0 <= id <= 2**63-1; tokens[{position}] = {value}"


def containers(values: list[int]) -> dict:
    """``values`` in every container that can hold all of them (numpy and torch: by dtype range)."""
    kinds = {"list": list(values), "tuple": tuple(values), "object array": np.array(values, dtype=object)}
    kinds["numpy scalars"] = [
        np.uint64(v) if 0 <= v < 2**64 else v for v in values
    ]  # the compiled chain declines these
    if all(-(2**63) <= v <= ID_MAX for v in values):
        kinds["numpy int64"] = np.array(values, dtype=np.int64)
        kinds["numpy int64 strided"] = np.repeat(np.array(values, dtype=np.int64), 2)[::2]
        kinds["numpy big-endian int64"] = np.array(values, dtype=">i8")
        kinds["torch int64"] = torch.tensor(values, dtype=torch.int64)
        kinds["torch int64 slice"] = torch.tensor(np.repeat(np.array(values, dtype=np.int64), 2))[::2]
    if all(0 <= v < 2**64 for v in values):
        kinds["numpy uint64"] = np.array(values, dtype=np.uint64)
        kinds["torch uint64"] = torch.tensor(values, dtype=torch.uint64)
    if values == list(range(values[0], values[0] + len(values))):
        kinds["range"] = range(values[0], values[0] + len(values))
    return kinds


# ---- ids out of range: -1, 2**63, 2**64 ---------------------------------------------------------

# (ids before the bad one, page size): the bad id in a first page, after a narrow and a wide page,
# in a wide page after its wide id, in the partial tail after wide pages.
PLACES = {
    "first page": ([], 2),
    "after narrow and wide pages": ([1, U32_MAX, 2**40, 3], 2),
    "in a wide page": ([4, 5, ID_MAX], 4),
    "in the tail": ([2**32, 1, 2, ID_MAX, 8], 5),
}


@by_scheme
@by_chain
@pytest.mark.parametrize("bad", [-1, 2**63, 2**64])
@pytest.mark.parametrize("place", list(PLACES))
def test_an_id_below_0_or_above_2_63_minus_1_is_named(name, chain, bad, place):
    scheme = chain_scheme(name, chain)
    before, page_size = PLACES[place]
    values = before + [bad, 9, -5, 2**64 + 1]  # later bad ids: the first one is named
    position = len(before)
    kinds = containers(values)
    assert sorted(kinds) == ["list", "numpy scalars", "object array", "tuple"]  # arrays: the next test
    for kind, tokens in kinds.items():
        for call in (
            lambda: page_keys(tokens, page_size, scheme=scheme),
            lambda: prefill_page_keys(tokens, page_size, extra_key="lora", scheme=scheme),
            lambda: PageHasher(scheme, page_size).compute_prefix_hash(Request(), tokens, ""),
        ):
            with pytest.raises(InvalidArgumentError) as info:
                call()
            assert str(info.value) == range_message(position, bad), (kind, place)


@by_scheme
@by_chain
@pytest.mark.parametrize(
    "dtype, bad",
    [
        (np.int64, -1),
        (np.int32, -1),
        (np.int8, -1),
        (np.uint64, 2**63),
        (np.uint64, 2**64 - 1),
        (torch.int64, -1),
        (torch.int32, -1),
        (torch.uint64, 2**63),
    ],
    ids=lambda v: str(v).replace("<class '", "").replace("'>", "") if not isinstance(v, int) else hex(v),
)
@pytest.mark.parametrize("place", list(PLACES))
def test_an_id_out_of_range_in_an_array_is_named(name, chain, dtype, bad, place):
    scheme = chain_scheme(name, chain)
    before, page_size = PLACES[place]
    info = np.iinfo(dtype) if isinstance(dtype, type) else torch.iinfo(dtype)
    before = [v if v <= info.max else info.max for v in before]  # what the dtype can hold
    values = before + [bad, 9, 3]
    position = len(before)
    tokens = np.array(values, dtype=dtype) if isinstance(dtype, type) else torch.tensor(values, dtype=dtype)
    with pytest.raises(InvalidArgumentError) as error:
        page_keys(tokens, page_size, scheme=scheme)
    assert str(error.value) == range_message(position, bad)


@by_scheme
@by_chain
def test_a_range_past_2_63_minus_1_is_named_without_walking_it(name, chain):
    scheme = chain_scheme(name, chain)
    for tokens, position, value in (
        (range(ID_MAX - 2, 2**64), 3, 2**63),
        (range(2**63 + 4, 7, -1), 0, 2**63 + 4),
        (range(5, -3, -2), 3, -1),
        (range(5, 2**70), 2**63 - 5, 2**63),  # longer than any Py_ssize_t
    ):
        with pytest.raises(InvalidArgumentError) as info:
            page_keys(tokens, 2**70, scheme=scheme)
        assert str(info.value) == range_message(position, value)
    assert page_keys(range(ID_MAX - 3, ID_MAX + 1), 2, scheme=scheme) == spec_keys(
        name, list(range(ID_MAX - 3, ID_MAX + 1)), 2
    )


@by_scheme
def test_the_compiled_chain_reports_position_and_value(name):
    module = chain_module(name)
    for tokens, position, value in (
        ([1, 2**40, -1], 2, -1),
        ([1, 2**40, 2**63], 2, 2**63),
        ([2**40] * 700 + [2**64], 700, 2**64),  # 5608 bytes as int64: the GIL is released
        (np.array([2**40, 1, 2**63, 4], dtype=np.uint64), 2, 2**63),
        (np.array([2**40, 1, -4, 4], dtype=np.int64), 2, -4),
        (np.array([2**40] * 700 + [-1], dtype=np.int64), 700, -1),
    ):
        for page_size in (1, 2, 3, 1000):
            with pytest.raises(module.TokenOutOfRange) as info:
                module.page_chain(tokens, page_size, b"", True)
            assert info.value.args == (position, value)
            assert type(info.value.args[1]) is int


class Request:
    extra_key = None
    cache_salt = "tenant"


# ---- ids up to 2**63-1 are hashed, in every container ---------------------------------------

BOUNDARY_IDS = [0, U32_MAX, U32_MAX, 0, 2**32, 0, ID_MAX, U32_MAX, 1, 2, 3]  # narrow, narrow, wide, wide, narrow, tail


@by_scheme
@by_chain
def test_the_boundary_ids_in_every_container(name, chain, naive):
    scheme = chain_scheme(name, chain)
    expected = spec_keys(name, BOUNDARY_IDS, 2)
    assert expected == naive.keys(BOUNDARY_IDS, 2, b"", name)
    kinds = containers(BOUNDARY_IDS)
    assert "torch uint64" in kinds and "numpy int64" in kinds
    for kind, tokens in kinds.items():
        assert page_keys(tokens, 2, scheme=scheme) == expected, kind
    ranged = list(range(2**32 - 3, 2**32 + 3))  # narrow, mixed, wide
    assert page_keys(range(2**32 - 3, 2**32 + 3), 2, scheme=scheme) == spec_keys(name, ranged, 2)
    assert (
        spec_keys(name, ranged, 2)[0]
        == DIGEST[name]((2**32 - 3).to_bytes(4, "little") + (2**32 - 2).to_bytes(4, "little")).hex()
    )


@by_scheme
@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.longlong, np.ulonglong, np.intp, np.uintp])
def test_every_64_bit_dtype_reads_wide_ids_in_the_compiled_chain(name, dtype):
    module = chain_module(name)
    values = [2**32, 5, U32_MAX, ID_MAX, 7, 8]
    prior = b"\x5a" * len(DIGEST[name](b""))
    expected = spec_keys(name, values, 2, prior)
    assert module.page_chain(np.array(values, dtype=dtype), 2, prior, True) == expected
    assert module.page_chain(np.array(values, dtype=dtype), 2, prior, False) == b"".join(map(bytes.fromhex, expected))


@by_scheme
@pytest.mark.parametrize("wide_at", [0, 511, 512, 2999])
@pytest.mark.parametrize("kind", ["list", "tuple", "int64", "uint64"])
def test_a_long_input_with_one_wide_id(name, wide_at, kind):
    """A list turns from u32 into u64 storage at its first wide id; only that page is wide."""
    values = np.random.default_rng(wide_at).integers(0, 2**32, 3000).tolist()
    values[wide_at] = 2**32 + wide_at
    tokens = {
        "list": values,
        "tuple": tuple(values),
        "int64": np.array(values, dtype=np.int64),
        "uint64": np.array(values, dtype=np.uint64),
    }[kind]
    expected = spec_keys(name, values, 64)
    narrow = values[:]
    narrow[wide_at] = 0
    others = spec_keys(name, narrow, 64)
    page = wide_at // 64
    if page < len(expected):
        assert expected[:page] == others[:page] and expected[page] != others[page]
    else:  # in the tail: not hashed
        assert expected == others
    for chain in CHAINS:
        assert page_keys(tokens, 64, scheme=chain_scheme(name, chain)) == expected, chain


# ---- compiled == Python == naive on random mixes of narrow and wide pages ---------------------

NARROW = st.one_of(st.integers(0, U32_MAX), st.sampled_from([0, 1, U32_MAX]))
WIDE = st.one_of(st.integers(2**32, ID_MAX), st.sampled_from([2**32, ID_MAX]))


@st.composite
def mixed_pages(draw):
    """(ids, page_size): full pages each narrow or holding at least one wide id, then a partial tail."""
    page_size = draw(st.integers(1, 12))
    ids = []
    for wide in draw(st.lists(st.booleans(), max_size=10)):
        page = draw(st.lists(NARROW, min_size=page_size, max_size=page_size))
        if wide:
            page[draw(st.integers(0, page_size - 1))] = draw(WIDE)
            page = [draw(st.one_of(st.just(v), WIDE)) for v in page]
        ids += page
    ids += draw(st.lists(st.one_of(NARROW, WIDE), max_size=page_size - 1))
    return ids, page_size


@by_scheme
@settings(max_examples=120, deadline=None)
@given(
    case=mixed_pages(),
    namespace=st.tuples(st.none() | st.text(max_size=4), st.none() | st.text(max_size=4)),
    data=st.data(),
)
def test_compiled_and_python_chains_agree_on_mixed_pages(name, naive, case, namespace, data):
    ids, page_size = case
    extra_key, cache_salt = namespace
    expected = naive.prefill(ids, page_size, extra_key, cache_salt, name)
    module = chain_module(name)
    schemes = {chain: chain_scheme(name, chain) for chain in CHAINS}
    sources = {
        "list": ids,
        "numpy int64": np.array(ids, dtype=np.int64),
        "torch int64": torch.tensor(ids, dtype=torch.int64),
    }
    for chain, scheme in schemes.items():
        for kind, tokens in sources.items():
            got = prefill_page_keys(tokens, page_size, extra_key=extra_key, cache_salt=cache_salt, scheme=scheme)
            assert got == expected, (chain, kind)
    assert module.page_chain(np.array(ids, dtype=np.uint64), page_size, b"", True) == naive.keys(
        ids, page_size, b"", name
    )
    # Decode segments cut at random page boundaries give the prefill keys on both chains.
    pages = len(ids) // page_size
    cuts = sorted(data.draw(st.lists(st.integers(0, pages), max_size=4), label="cuts"))
    bounds = [0] + [c * page_size for c in cuts] + [len(ids)]
    req = type("Req", (), {"extra_key": extra_key, "cache_salt": cache_salt})()
    for chain, scheme in schemes.items():
        keys = []
        for start, stop in zip(bounds, bounds[1:]):
            keys += compute_prefix_hash(
                req, ids[start:stop], keys[-1] if keys else "", page_size=page_size, scheme=scheme
            )
        assert keys == expected, chain


# ---- token_bytes stays the u32 encoding ------------------------------------------------------


def test_token_bytes_names_the_u32_rule_for_a_wide_id():
    for tokens in ([1, 2**32], np.array([1, 2**32], dtype=np.int64), torch.tensor([1, 2**32])):
        with pytest.raises(InvalidArgumentError) as info:
            token_bytes(tokens)
        assert str(info.value) == (
            "tokens: every token id must satisfy 0 <= id <= 2**32-1 to be written as u32 "
            "(page keys take ids up to 2**63-1); tokens[1] = 4294967296"
        )
