"""Properties of the page chains, for random tokens, page sizes, namespaces and schemes (hypothesis)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvstage.hashing import SCHEMES, compute_prefix_hash, namespace_seed, page_keys, prefill_page_keys

# Mostly u32 ids, with ids up to 2**63-1 now and then: pages of both encodings in one chain.
NARROW = st.integers(min_value=0, max_value=2**32 - 1)
WIDE = st.integers(min_value=2**32, max_value=2**63 - 1)
TOKEN = st.one_of(NARROW, NARROW, NARROW, NARROW, NARROW, NARROW, NARROW, WIDE)
TOKENS = st.lists(TOKEN, max_size=120)
PAGE_SIZE = st.integers(min_value=1, max_value=12)
NAME = st.none() | st.text(max_size=6)
SCHEME = st.sampled_from(SCHEMES)
SETTINGS = settings(max_examples=150, deadline=None)


@SETTINGS
@given(tokens=TOKENS, page_size=PAGE_SIZE, extra_key=NAME, cache_salt=NAME, scheme=SCHEME)
def test_matches_the_naive_per_token_reference(naive, tokens, page_size, extra_key, cache_salt, scheme):
    got = prefill_page_keys(tokens, page_size, extra_key=extra_key, cache_salt=cache_salt, scheme=scheme)
    assert got == naive.prefill(tokens, page_size, extra_key, cache_salt, scheme)
    assert len(got) == len(tokens) // page_size
    assert page_keys(np.array(tokens, dtype=np.uint64), page_size, scheme=scheme) == naive.keys(
        tokens, page_size, b"", scheme
    )


@SETTINGS
@given(tokens=TOKENS, page_size=PAGE_SIZE, extra_key=NAME, cache_salt=NAME, scheme=SCHEME, data=st.data())
def test_any_split_at_page_boundaries_gives_the_prefill_keys(tokens, page_size, extra_key, cache_salt, scheme, data):
    expected = prefill_page_keys(tokens, page_size, extra_key=extra_key, cache_salt=cache_salt, scheme=scheme)
    pages = len(tokens) // page_size
    cuts = sorted(data.draw(st.lists(st.integers(0, pages), max_size=5), label="cuts"))
    bounds = [0] + [c * page_size for c in cuts] + [len(tokens)]  # the last segment keeps the partial tail
    req = SimpleNamespace(extra_key=extra_key, cache_salt=cache_salt)
    keys, prior = [], ""
    for start, stop in zip(bounds, bounds[1:]):
        segment = compute_prefix_hash(req, tokens[start:stop], prior, page_size=page_size, scheme=scheme)
        keys += segment
        if keys:  # an empty first segment leaves the chain unstarted: the next one starts from the seed
            prior = keys[-1]
    assert keys == expected


@SETTINGS
@given(tokens=TOKENS, page_size=PAGE_SIZE, namespace=st.tuples(NAME, NAME), scheme=SCHEME, data=st.data())
def test_changing_one_token_changes_its_page_and_every_later_one_only(tokens, page_size, namespace, scheme, data):
    pages = len(tokens) // page_size
    assume(pages >= 1)
    position = data.draw(st.integers(0, pages * page_size - 1), label="position")
    new_value = data.draw(TOKEN.filter(lambda v: v != tokens[position]), label="new_value")
    changed = list(tokens)
    changed[position] = new_value
    extra_key, cache_salt = namespace
    before = prefill_page_keys(tokens, page_size, extra_key=extra_key, cache_salt=cache_salt, scheme=scheme)
    after = prefill_page_keys(changed, page_size, extra_key=extra_key, cache_salt=cache_salt, scheme=scheme)
    page = position // page_size
    assert before[:page] == after[:page]
    assert all(b != a for b, a in zip(before[page:], after[page:]))


@SETTINGS
@given(
    tokens=st.lists(TOKEN, min_size=1, max_size=40),
    page_size=PAGE_SIZE,
    extra_key=st.text(max_size=6),
    cache_salt=st.text(max_size=6),
    scheme=SCHEME,
)
def test_no_namespace_extra_key_only_salt_only_and_both_are_four_chains(
    tokens, page_size, extra_key, cache_salt, scheme
):
    page_size = min(page_size, len(tokens))
    chains = {
        tuple(prefill_page_keys(tokens, page_size, extra_key=e, cache_salt=c, scheme=scheme))
        for e, c in ((None, None), (extra_key, None), (None, cache_salt), (extra_key, cache_salt))
    }
    assert len(chains) == 4
    # Every page differs, not just the first (the seed is in every key's prefix).
    lasts = {chain[-1] for chain in chains}
    assert len(lasts) == 4


@SETTINGS
@given(
    a=st.text(max_size=5),
    b=st.text(min_size=1, max_size=5),
    c=st.text(max_size=5),
    x=st.text(max_size=8),
    scheme=SCHEME,
)
def test_namespace_encoding_is_unambiguous(a, b, c, x, scheme):
    assert namespace_seed(a, b + c, scheme) != namespace_seed(a + b, c, scheme)
    assert namespace_seed(x, None, scheme) != namespace_seed(None, x, scheme)
    assert namespace_seed(x, "", scheme) != namespace_seed(x, None, scheme)
    assert namespace_seed("", x, scheme) != namespace_seed(None, x, scheme)


def test_namespace_examples_from_the_spec():
    for scheme in SCHEMES:
        seeds = [
            namespace_seed("X", None, scheme),
            namespace_seed(None, "X", scheme),
            namespace_seed("", None, scheme),
            namespace_seed(None, "", scheme),
            namespace_seed("", "", scheme),
            namespace_seed("a", "bc", scheme),
            namespace_seed("ab", "c", scheme),
        ]
        assert len(set(seeds)) == len(seeds)
        assert namespace_seed(None, None, scheme) is None
