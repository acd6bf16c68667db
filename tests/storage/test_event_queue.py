"""EventQueue keeps a record call's keys as one chunk and builds the events in take: it must
answer as a queue of one event a key does (content, order, drops of the oldest, counters), in
take and in take_chunks alike."""

from __future__ import annotations

import collections

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.storage.backend import StorageStats
from kvstage.storage.events import EventQueue

steps = st.lists(
    st.one_of(
        st.tuples(st.just("record"), st.sampled_from(["stored", "evicted", "removed"]), st.integers(1, 7)),
        st.tuples(st.just("take"), st.one_of(st.none(), st.integers(0, 9)), st.just(0)),
        st.tuples(st.just("chunks"), st.none(), st.just(0)),
    ),
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(steps=steps, capacity=st.integers(1, 10))
def test_chunks_answer_as_one_event_a_key(steps, capacity):
    stats = StorageStats()
    queue = EventQueue(stats, tier="memory", key_space="tiny", page_bytes=64, capacity=capacity)
    model: collections.deque = collections.deque()
    dropped = serial = 0
    for step, arg, count in steps:
        if step == "record":
            keys = [f"k{serial + i}" for i in range(count)]
            serial += count
            queue.record(arg, keys)
            model.extend((key, arg) for key in keys)
            while len(model) > capacity:
                model.popleft()
                dropped += 1
        elif step == "chunks":  # every event kept, as (kind, keys) runs of one record call each
            chunks = queue.take_chunks()
            assert all(type(keys) is list and keys for _, keys in chunks)
            assert [(key, kind) for kind, keys in chunks for key in keys] == list(model)
            model.clear()
        else:
            got = queue.take(arg)
            want = [model.popleft() for _ in range(len(model) if arg is None else min(arg, len(model)))]
            assert [(event.key, event.kind) for event in got] == want
            assert all(event.tier == "memory" and event.page_bytes == 64 for event in got)
    assert stats.events_dropped == dropped
    assert [(event.key, event.kind) for event in queue.take()] == list(model)
