"""The lookup's ``exists`` path: the base class's key checks and prefixing, the memory store's
membership tests (``ChainIndex.holds``), against a per-key model of what is stored."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
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


class Recording(MemoryStore):
    """A memory store that keeps the keys its ``_exists`` hook was handed."""

    def _exists(self, keys):
        self.handed = list(keys)
        return super()._exists(keys)


class Prefixed(MemoryStore):
    """A memory store whose hooks take full keys (prefix included), as a shared key space's."""

    prefixed_hook_keys = True


def test_a_memory_stores_hooks_take_page_keys_and_a_prefixed_stores_full_keys():
    # The memory store is its own key space: a lookup builds no prefixed key per page.
    bare = Recording(FP, capacity_pages=4)
    bare.exists(["a", "b"])
    assert bare.handed == ["a", "b"] and not MemoryStore.prefixed_hook_keys

    class RecordingPrefixed(Prefixed, Recording):
        pass

    prefixed = RecordingPrefixed(FP, capacity_pages=4)
    prefixed.exists(["a", "b"])
    assert prefixed.handed == [FP.prefix() + "a", FP.prefix() + "b"]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["put", "get", "exists", "remove", "clear"]),
            st.lists(st.sampled_from("abcdefg"), max_size=4),
            st.sampled_from([None, "a", "c", "z"]),
        ),
        max_size=25,
    ),
    st.integers(1, 5),
)
# found by hypothesis: the removal events followed the successor sets' hash order
@example([("put", ["b", "a"], None), ("put", ["b", "c"], None), ("remove", ["b"], None)], 3)
def test_a_memory_store_answers_the_same_whichever_keys_its_hooks_take(ops, capacity):
    # Bare page keys inside (the memory store) or prefixed keys (as before): every answer, the
    # statuses' error, the events and the stats are the same.
    stores = MemoryStore(FP, capacity_pages=capacity), Prefixed(FP, capacity_pages=capacity)
    for op, keys, prior in ops:
        keys = list(dict.fromkeys(keys))
        answers = []
        for store in stores:
            if op == "put" and keys and prior not in keys:
                statuses = store.put(keys, [torch.full((16,), float(ord(k))) for k in keys], prior_key=prior)
                error = statuses.error
                answers.append((list(statuses), type(error), getattr(error, "prior_key", None)))
            elif op == "get":
                into = [torch.zeros(16) for _ in keys]
                answers.append((store.get(keys, into), [t.tolist() for t in into]))
            elif op == "exists":
                answers.append(store.exists(keys))
            elif op == "remove":
                answers.append(store.remove(keys))
            elif op == "clear":
                answers.append(store.clear())
        if answers:
            assert answers[0] == answers[1], (op, keys, prior)
    events = [[(e.kind, e.key, e.key_space) for e in store.take_events()] for store in stores]
    assert events[0] == events[1]
    counts = [{k: v for k, v in vars(store.stats).items() if not k.endswith("seconds")} for store in stores]
    assert counts[0] == counts[1]
