"""ChainIndex.touch_all (a memory store's queued lookup uses, applied at once) must leave the
index as touching each key in turn does: the same eviction order, whatever came before."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.storage.chain_index import ChainIndex

UNIVERSE = [f"k{i}" for i in range(12)]


def build(steps) -> ChainIndex:
    index: ChainIndex[str, int] = ChainIndex()
    for n, (key, prior) in enumerate(steps):
        if key not in index:
            index.add(key, n, prior)
    return index


def victims(index: ChainIndex) -> list[str]:
    order = []
    while (victim := index.pop_victim()) is not None:
        order.append(victim[0])
    return order


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(UNIVERSE), st.sampled_from([None, *UNIVERSE])), max_size=20),
    st.lists(st.sampled_from([*UNIVERSE, "absent"]), max_size=30),
    st.lists(st.sampled_from(UNIVERSE), max_size=5),
)
def test_touch_all_evicts_as_touching_each_key_in_turn(steps, uses, later):
    one_by_one, at_once = build(steps), build(steps)
    for key in uses:
        one_by_one.touch(key)
    at_once.touch_all(uses)
    for key in later:  # touches after it still come after every touch of the batch
        one_by_one.touch(key)
        at_once.touch(key)
    assert victims(one_by_one) == victims(at_once)


def test_touch_all_skips_absent_keys_and_keeps_ticks_increasing():
    index: ChainIndex[str, int] = ChainIndex()
    index.add("a", 0, None)
    index.add("b", 1, None)
    index.add("c", 2, None)
    before = index.tick()
    index.touch_all(["b", "gone", "a"])  # used order now: c, b, a
    assert index.tick() > before
    assert victims(index) == ["c", "b", "a"]
