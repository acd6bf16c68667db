"""ChainIndex.admit (a put's whole run in one call) must leave the index, and answer, as the
one-key-at-a-time steps do (touch a stored key, skip one whose predecessor is missing, else
pop_victim at capacity, then add): the same outcomes, victims in the same order, and the same
eviction order afterwards, whatever came before."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.storage.chain_index import ADDED, DEDUPLICATED, MISSING_PRIOR, NO_ROOM, ChainIndex

UNIVERSE = [f"k{i}" for i in range(10)]


def reference_admit(index: ChainIndex, keys, prior, capacity, keep):
    """The per-key steps MemoryStore's put took before admit."""
    outcomes, added, victims = [], [], []
    before = prior
    for i, key in enumerate(keys):
        prior, before = before, key
        if index.touch(key) is not None:
            outcomes.append(DEDUPLICATED)
            continue
        if prior is not None and prior not in index:
            outcomes.append(MISSING_PRIOR)
            continue
        if len(index) >= capacity:
            victim = index.pop_victim(keep)
            if victim is None:
                outcomes.append(NO_ROOM)
                continue
            victims.append(victim)
        index.add(key, None, prior)
        outcomes.append(ADDED)
        added.append(i)
    return outcomes, added, victims


def drain(index: ChainIndex) -> list[str]:
    order = []
    while (victim := index.pop_victim()) is not None:
        order.append(victim[0])
    return order


calls = st.lists(
    st.tuples(
        st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=6, unique=True),  # keys
        st.one_of(st.none(), st.sampled_from(UNIVERSE)),  # prior
        st.lists(st.sampled_from(UNIVERSE), max_size=2),  # extra kept keys (pages on loan)
        st.booleans(),  # touch some keys first (recency changes between calls)
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=300, deadline=None)
@given(calls=calls, capacity=st.integers(0, 6))
def test_admit_matches_one_key_at_a_time(calls, capacity):
    batched: ChainIndex[str, object] = ChainIndex()
    reference: ChainIndex[str, object] = ChainIndex()
    for keys, prior, lent, touch_first in calls:
        if prior in keys:
            prior = None  # a put refuses it
        if touch_first:
            for index in (batched, reference):
                index.touch_all(reversed(keys))
        keep = set(keys) | set(lent) | ({prior} if prior is not None else set())
        got = batched.admit(keys, prior, capacity, keep)
        want = reference_admit(reference, keys, prior, capacity, keep)
        assert got[0] == want[0]
        assert got[1] == want[1]
        assert [k for k, _ in got[2]] == [k for k, _ in want[2]]
        assert len(batched) == len(reference)
        batched.set_values([keys[i] for i in got[1]], [f"v{i}" for i in got[1]])
        for i in want[1]:
            reference.set_value(keys[i], f"v{i}")
        assert sorted(batched.items()) == sorted(reference.items())
    assert drain(batched) == drain(reference)


def test_admit_outcomes_on_a_small_index():
    index: ChainIndex[str, object] = ChainIndex()
    assert index.admit(["a", "b"], None, 2, {"a", "b"}) == ([ADDED, ADDED], [0, 1], [])
    # full, and both pages kept: no room; "d" then misses its predecessor "c"
    assert index.admit(["c", "d"], "b", 2, {"b", "c", "d", "a"}) == ([NO_ROOM, MISSING_PRIOR], [], [])
    # "b" is the only chain tail: evicted for "x"; "a" is then a tail, evicted for "y"
    outcomes, added, victims = index.admit(["x", "y"], None, 2, {"x", "y"})
    assert (outcomes, added, [k for k, _ in victims]) == ([ADDED, ADDED], [0, 1], ["b", "a"])
    assert index.admit(["x"], None, 2, {"x"})[0] == [DEDUPLICATED]
