"""offload/restorable: restorable lengths per component, the sliding-window store mask, snapshot checks."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.kv_layout import KVLayout
from kvstage.model_layout import FullAttention, ModelLayout, PageSidecar, RequestState, SlidingWindow, TensorSpec
from kvstage.offload.restorable import (
    lengths_unchecked,
    pages_to_load,
    reader_window_pages,
    restorable_lengths,
    snapshot_key_index,
    swa_store_mask,
)

P = 4
KV = KVLayout(1, 2, 1, 4, "float16")
CONV = TensorSpec("conv", (8, 4), "float32")


def swa_model(window: int) -> ModelLayout:
    return ModelLayout(2, (SlidingWindow((0,), KV, window), FullAttention((1,), KV)))


STATE_MODEL = ModelLayout(2, (RequestState((0,), (CONV,)), FullAttention((1,), KV)))
PLAIN = ModelLayout.full_attention(KV)
DSA = ModelLayout(
    1, (FullAttention((0,), KV), PageSidecar((0,), (TensorSpec("index_k", (4,), "float16"),), name="indexer"))
)


def pages(text: str) -> list[bool]:
    return [c == "x" for c in text]


def test_plain_model_restores_its_leading_pages_but_the_last_token():
    found = restorable_lengths(PLAIN, P, 4 * P + 1, {"full": pages("xxxx")})
    assert found.lengths == (4, 8, 12, 16) and found.max_length == 16 and found.num_pages == 4
    assert restorable_lengths(PLAIN, P, 4 * P + 1, {"full": pages("xx.x")}).lengths == (4, 8)


def test_a_prompt_of_exactly_l_tokens_restores_the_previous_boundary():
    # vLLM #44599: a hit of the whole prompt leaves no token to compute the logits of.
    full = {"full": pages("xxxx")}
    assert restorable_lengths(PLAIN, P, 4 * P, full).max_length == 12
    state = {"state": pages("xxxx"), "full": pages("xxxx")}
    assert restorable_lengths(STATE_MODEL, P, 4 * P, state).max_length == 12
    assert restorable_lengths(PLAIN, P, 1, full).lengths == () and restorable_lengths(PLAIN, P, 0, full).max_length == 0


def test_a_hit_rounds_down_to_the_last_snapshot():
    # every page stored; snapshots only after 2 and 3 pages (the last stored page has none)
    found = restorable_lengths(STATE_MODEL, P, 5 * P + 1, {"state": pages(".xx.."), "full": pages("xxxxx")})
    assert found.lengths == (8, 12) and found.max_length == 12
    # a snapshot past the full-attention prefix cannot be restored
    assert restorable_lengths(STATE_MODEL, P, 5 * P + 1, {"state": pages("...x"), "full": pages("xx.xx")}).lengths == ()


@pytest.mark.parametrize(
    "window, swa, lengths",
    [
        (5, "..x.x", (12, 20)),  # w = 1: the page before L
        (6, "..x.x", ()),  # w = 2: pages L/P-2 and L/P-1
        (6, ".xx.xx", (12, 24)),
        (1, "......", (4, 8, 12, 16, 20, 24)),  # a window of 1 keeps no earlier token
        (9, "xx....", (4, 8)),  # w = 2, and L = 4 needs only page 0
    ],
)
def test_sliding_window_needs_only_the_window_before_l(window, swa, lengths):
    found = restorable_lengths(
        swa_model(window), P, len(swa) * P + 1, {"swa": pages(swa), "full": pages("x" * len(swa))}
    )
    assert found.lengths == lengths


def test_sidecar_pages_are_needed_like_full_ones():
    assert restorable_lengths(DSA, P, 13, {"full": pages("xxx"), "indexer": pages("xx.")}).lengths == (4, 8)


def test_at_most_picks_the_largest_length_not_past_a_limit():
    found = restorable_lengths(STATE_MODEL, P, 9 * P, {"state": pages("x.x...x"), "full": pages("x" * 8)})
    assert found.lengths == (4, 12, 28)
    assert [found.at_most(n) for n in (0, 3, 4, 11, 12, 27, 100)] == [0, 0, 4, 4, 12, 12, 28]


def test_pages_to_load_per_component():
    model = ModelLayout(
        3,
        (
            SlidingWindow((0,), KV, 6),
            RequestState((1,), (CONV,)),
            FullAttention((1, 2), KVLayout(2, 2, 1, 4, "float16")),
        ),
    )
    assert pages_to_load(model, P, 20) == {"full": range(5), "swa": range(3, 5), "state": range(4, 5)}
    assert pages_to_load(model, P, 4) == {"full": range(1), "swa": range(0, 1), "state": range(0, 1)}
    assert pages_to_load(model, P, 0) == {"full": range(0), "swa": range(0), "state": range(0)}


# -- the sliding-window store mask ---------------------------------------------------------------------


def test_store_mask_keeps_only_the_windows_before_resume_lengths():
    swa = swa_model(6).component("swa")  # w = 2 at P = 4
    assert swa_store_mask(swa, P, [12, 32], end_page=10) == pages(".xx...xx..")
    assert swa_store_mask(swa, P, [12, 32], end_page=10, first_page=5) == pages(".xx..")
    assert swa_store_mask(swa, P, [], end_page=3) == pages("...")
    assert swa_store_mask(swa, P, [4, 4], end_page=3) == pages("x..")  # k < w: from page 0
    assert swa_store_mask(swa, P, [400], end_page=3) == pages("...")  # a later length's window is past these pages


@pytest.mark.parametrize(("window", "kvstage", "sglang"), [(1, 0, 1), (5, 1, 2), (6, 2, 2), (8, 2, 2), (9, 2, 3)])
def test_window_pages_of_each_reader(window, kvstage, sglang):
    swa = swa_model(window).component("swa")  # P = 4: ceil((W - 1) / 4) and ceil(W / 4)
    assert reader_window_pages(swa, P) == kvstage == swa.window_pages(P)
    assert reader_window_pages(swa, P, "sglang") == sglang
    with pytest.raises(InvalidArgumentError, match=r"reader: must be one of \('kvstage', 'sglang'\), got 'vllm'"):
        reader_window_pages(swa, P, "vllm")


def test_store_mask_and_lengths_take_a_reader_s_window_pages():
    model = swa_model(5)  # P = 4: kvstage reads 1 window page before a length, sglang 2
    swa = model.component("swa")
    assert swa_store_mask(swa, P, [12], end_page=4) == pages("..x.")
    assert swa_store_mask(swa, P, [12], end_page=4, window_pages=2) == pages(".xx.")
    present = {"swa": pages("x.xx"), "full": [True] * 4}
    assert restorable_lengths(model, P, 17, present).lengths == (4, 12, 16)
    assert restorable_lengths(model, P, 17, present, window_pages={"swa": 2}).lengths == (4, 16)
    assert lengths_unchecked(model, P, 17, present, window_pages={"swa": 2}) == (4, 16)
    with pytest.raises(InvalidArgumentError, match=r"window_pages: must be an int >= 0, got -1"):
        swa_store_mask(swa, P, [12], end_page=4, window_pages=-1)


@pytest.mark.parametrize("bad", [0, 6, -4, 4.0, True])
def test_store_mask_refuses_lengths_off_the_page_grid(bad):
    with pytest.raises(InvalidArgumentError, match=r"resume_lengths\[1\]: must be a positive multiple of page_size 4"):
        swa_store_mask(swa_model(6).component("swa"), P, [8, bad], end_page=4)


def test_store_mask_refuses_bad_ranges_and_components():
    with pytest.raises(InvalidArgumentError, match=r"first_page: must be ints with 0 <= first_page <= end_page"):
        swa_store_mask(swa_model(6).component("swa"), P, [8], end_page=2, first_page=3)
    with pytest.raises(ArgumentTypeError, match=r"component: must be a kvstage.model_layout.SlidingWindow"):
        swa_store_mask(PLAIN.component("full"), P, [8], end_page=2)


# -- snapshots --------------------------------------------------------------------------------------------


def test_snapshot_is_keyed_by_the_page_that_ends_at_l():
    assert snapshot_key_index(4, P, 4) == 0 and snapshot_key_index(12, P, 13) == 2


@pytest.mark.parametrize(
    "length, num_tokens, message",
    [
        (
            6,
            10,
            r"length: must be a positive multiple of page_size 4 \(a snapshot is taken at a page boundary\), got 6",
        ),
        (0, 10, r"length: must be a positive multiple of page_size 4"),
        (8.0, 10, r"length: must be a positive multiple of page_size 4"),
        (12, 10, r"length: 12 is past the request's 10 tokens with KV"),
    ],
)
def test_snapshot_checks_name_the_argument(length, num_tokens, message):
    with pytest.raises(InvalidArgumentError, match=message):
        snapshot_key_index(length, P, num_tokens)


def test_snapshot_check_names_the_callers_argument():
    with pytest.raises(InvalidArgumentError, match=r"^snapshot_length: 8 is past"):
        snapshot_key_index(8, P, 5, argument="snapshot_length")


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: restorable_lengths(PLAIN, P, 9, {}),
            InvalidArgumentError,
            r"present: has no entry for the layout's component 'full'",
        ),
        (
            lambda: restorable_lengths(PLAIN, P, 9, {"full": [], "swa": []}),
            InvalidArgumentError,
            r"present: names component 'swa', which the layout does not have \(it has \['full'\]\)",
        ),
        (
            lambda: restorable_lengths(PLAIN, 0, 9, {"full": []}),
            InvalidArgumentError,
            r"page_size: must be a positive int",
        ),
        (
            lambda: restorable_lengths(PLAIN, P, -1, {"full": []}),
            InvalidArgumentError,
            r"num_tokens: must be an int >= 0",
        ),
        (
            lambda: restorable_lengths(KV, P, 9, {"full": []}),
            ArgumentTypeError,
            r"layout: must be a kvstage.model_layout.ModelLayout",
        ),
        (lambda: restorable_lengths(PLAIN, P, 9, [True]), ArgumentTypeError, r"present: must map component names"),
        (lambda: pages_to_load(PLAIN, P, 6), InvalidArgumentError, r"length: must be a multiple of page_size 4 >= 0"),
    ],
)
def test_lookup_refuses_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()


# -- properties against the definition ----------------------------------------------------------------------


def naive_lengths(layout: ModelLayout, page_size: int, num_tokens: int, present) -> tuple[int, ...]:
    """The definition, length by length (module doc of offload/restorable)."""
    held = {name: lambda i, entries=entries: i < len(entries) and entries[i] for name, entries in present.items()}
    found = []
    for length in range(page_size, num_tokens, page_size):
        k = length // page_size
        ok = True
        for component in layout.components:
            if component.kind in ("full", "sidecar"):
                needed = range(k)
            elif component.kind == "swa":
                needed = range(max(0, k - math.ceil((component.window - 1) / page_size)), k)
            else:
                needed = [k - 1]
            ok = ok and all(held[component.name](i) for i in needed)
        if ok:
            found.append(length)
    return tuple(found)


@st.composite
def hybrid_cases(draw):
    page_size = draw(st.integers(1, 5))
    kinds = draw(st.sets(st.sampled_from(["swa", "state", "sidecar"])))
    components = [FullAttention((0,), KV)]
    if "swa" in kinds:
        components.append(SlidingWindow((1,), KV, draw(st.integers(1, 12))))
    if "state" in kinds:
        components.append(RequestState((0,), (CONV,)))
    if "sidecar" in kinds:
        components.append(PageSidecar((0,), (CONV,), name="indexer"))
    layout = ModelLayout(2 if "swa" in kinds else 1, tuple(components))
    num_tokens = draw(st.integers(0, 12 * page_size))
    present = {c.name: draw(st.lists(st.booleans(), max_size=num_tokens // page_size + 1)) for c in layout.components}
    # mostly-present full pages, so longer hits are explored too
    present["full"] = [draw(st.integers(0, 9)) > 0 for _ in range(num_tokens // page_size + 1)]
    return layout, page_size, num_tokens, present


@settings(max_examples=300, deadline=None)
@given(hybrid_cases())
def test_restorable_lengths_equal_the_definition(case):
    layout, page_size, num_tokens, present = case
    found = restorable_lengths(layout, page_size, num_tokens, present)
    assert found.lengths == naive_lengths(layout, page_size, num_tokens, present)
    assert all(0 < length <= num_tokens - 1 and length % page_size == 0 for length in found.lengths)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(1, 20),
    st.lists(st.integers(1, 12), max_size=5),
)
def test_storing_the_mask_restores_every_resume_length_and_no_page_is_spare(page_size, window, resume_pages):
    layout = swa_model(window)
    swa = layout.component("swa")
    num_pages = 12
    resume_lengths = [k * page_size for k in resume_pages]
    mask = swa_store_mask(swa, page_size, resume_lengths, end_page=num_pages)
    present = {"full": [True] * num_pages, "swa": mask}
    restorable = set(restorable_lengths(layout, page_size, num_pages * page_size + 1, present).lengths)
    assert set(resume_lengths) <= restorable
    for page, stored in enumerate(mask):  # each stored page serves some resume length
        if stored:
            without = {"full": present["full"], "swa": [s and i != page for i, s in enumerate(mask)]}
            after = set(restorable_lengths(layout, page_size, num_pages * page_size + 1, without).lengths)
            assert not set(resume_lengths) <= after


@st.composite
def many_component_cases(draw):
    """Two sliding windows, two states and a sidecar beside the full pages; presence as the ints
    and bools a store's ``exists`` may answer."""
    page_size = draw(st.integers(1, 4))
    kv2 = KVLayout(1, 2, 1, 4, "float16")
    layout = ModelLayout(
        4,
        (
            FullAttention((0,), kv2),
            SlidingWindow((1,), kv2, draw(st.integers(1, 10)), name="swa"),
            SlidingWindow((2,), kv2, draw(st.integers(1, 10)), name="swa_b"),
            RequestState((3,), (CONV,), name="state"),
            RequestState((0,), (CONV,), name="state_b"),
            PageSidecar((0,), (CONV,), name="indexer"),
        ),
    )
    num_tokens = draw(st.integers(0, 16 * page_size))
    size = num_tokens // page_size + 1
    present = {
        c.name: draw(
            st.lists(st.sampled_from([True, False, 1, 0]) if c.kind != "full" else st.booleans(), max_size=size)
        )
        for c in layout.components
    }
    present["full"] = [draw(st.integers(0, 15)) > 0 for _ in range(size)]
    present["indexer"] = [draw(st.integers(0, 15)) > 0 for _ in range(draw(st.integers(0, size)))]
    return layout, page_size, num_tokens, present


@settings(max_examples=300, deadline=None)
@given(many_component_cases())
def test_restorable_lengths_of_several_windows_and_states_equal_the_definition(case):
    layout, page_size, num_tokens, present = case
    assert restorable_lengths(layout, page_size, num_tokens, present).lengths == naive_lengths(
        layout, page_size, num_tokens, present
    )


@settings(max_examples=300, deadline=None)
@given(st.one_of(hybrid_cases(), many_component_cases()))
def test_the_lookups_unchecked_path_equals_the_definition(case):
    # The hybrid lookup's fast path (no argument checks) answers what the checked function does.
    layout, page_size, num_tokens, present = case
    assert lengths_unchecked(layout, page_size, num_tokens, present) == naive_lengths(
        layout, page_size, num_tokens, present
    )
