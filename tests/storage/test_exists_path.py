"""The lookup's ``exists`` path: the base class's key checks and prefixing, the memory store's
membership tests (``ChainIndex.holds``), against a per-key model of what is stored."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.errors import InvalidArgumentError
from kvstage.kv_layout import KVLayout
from kvstage.storage import LayoutFingerprint, MemoryStore
from kvstage.storage.chain_index import ChainIndex

FP = LayoutFingerprint("tiny", KVLayout(1, 2, 1, 4, "float32"), 2)  # 64 bytes
OTHER = LayoutFingerprint("other", KVLayout(1, 2, 1, 4, "float32"), 2)


class Key(str):
    """A str subclass: a key like any other."""


@pytest.mark.parametrize(
    "keys, index, shown",
    [(["a", 3], 1, "3"), (["", "a"], 0, "''"), (["a", "b", None], 2, "None"), ([b"a"], 0, "b'a'")],
)
def test_exists_refuses_a_key_that_is_no_non_empty_str_naming_it(keys, index, shown):
    store = MemoryStore(FP, capacity_pages=4)
    with pytest.raises(InvalidArgumentError, match=rf"^keys\[{index}\]: must be a non-empty str, got {shown}$"):
        store.exists(keys)


def test_exists_takes_any_sequence_of_strs_and_str_subclasses():
    store = MemoryStore(FP, capacity_pages=4)
    store.put(["a", "b"], [torch.zeros(16), torch.ones(16)])
    assert store.exists(("a", "c")) == [True, False]
    assert store.exists(iter(["b", "a"])) == [True, True]
    assert store.exists([Key("a"), Key("zz")]) == [True, False]
    assert store.exists([]) == []


def test_a_key_space_answers_only_for_its_own_keys():
    mine, theirs = MemoryStore(FP, capacity_pages=4), MemoryStore(OTHER, capacity_pages=4)
    mine.put(["a"], [torch.zeros(16)])
    theirs.put(["b"], [torch.zeros(16)])
    assert mine.exists(["a", "b"]) == [True, False] and theirs.exists(["a", "b"]) == [False, True]
    assert mine.exists([FP.prefix() + "a"]) == [False]  # a caller's key is never taken as a full key


def test_chain_index_holds_answers_each_key_in_order():
    index: ChainIndex[str, int] = ChainIndex()
    index.add("x", 1, None)
    index.add("y", 2, "x")
    assert index.holds(["y", "q", "x", "x"]) == [True, False, True, True]
    index.remove("x")
    assert index.holds(iter(["x", "y"])) == [False, True] and index.holds([]) == []


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["put", "remove", "clear"]), st.lists(st.sampled_from("abcdefg"), max_size=4))),
    st.lists(st.sampled_from("abcdefgh"), max_size=10),
    st.integers(1, 8),
)
def test_exists_equals_each_keys_own_read(ops, asked, capacity):
    # The reference is get() key by key (its own lookup): exists answers the same for every key
    # after any mix of puts (with evictions), removes and clears.
    store = MemoryStore(FP, capacity_pages=capacity)
    for op, keys in ops:
        keys = list(dict.fromkeys(keys))
        if op == "put" and keys:
            store.put(keys, [torch.zeros(16)] * len(keys))
        elif op == "remove":
            store.remove(keys)
        elif op == "clear":
            store.clear()
        answer = store.exists(asked)
        assert answer == [store.get([key], [torch.empty(16)])[0] for key in asked]
