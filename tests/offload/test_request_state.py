"""``RequestState``'s bookkeeping on its own: a launched gather, a load's start and end, where
offloading resumes after a load, and the pages a finish still has to launch (page size 4)."""

from __future__ import annotations

from kvstage.hashing import PageHasher
from kvstage.offload.key_chain import ChainRun, RequestChain
from kvstage.offload.request_state import LoadJob, RequestState, Segment
from kvstage.offload.testing import SimpleRequest

PAGE = 4
KEYS = [f"{i:02x}" * 16 for i in range(1, 6)]


def state_of(offloaded_length=0):
    return RequestState(SimpleRequest("r", list(range(20))), offloaded_length)


def test_a_launched_segment_joins_the_chain_in_flight_and_unsettled():
    state = state_of(4)
    state.chain = RequestChain(None, False)
    first, second = Segment(state, ChainRun(list(range(4, 12)))), Segment(state, ChainRun(list(range(12, 16))))
    state.launched(first)
    state.launched(second)
    assert (state.offloaded_length, state.launched_length, state.copies_in_flight) == (16, 16, 2)
    assert list(state.unsettled) == [first, second]
    # In the chain in launch order: keying the second run keys the first before it.
    second_keys = state.chain.keys_of(second.run, PageHasher(page_size=PAGE))
    assert first.run.keys is not None and second.run.prior_key == first.run.keys[-1]
    assert second_keys == PageHasher(page_size=PAGE).prefill_keys(list(range(4, 16)))[2:]


def test_a_load_is_in_flight_from_its_start_to_its_end():
    state = state_of()
    load, other = LoadJob(state, 2), LoadJob(state, 1)
    state.load_started(load)
    state.load_started(other)
    assert state.copies_in_flight == 2 and state.loads == [load, other]
    state.load_ended(load)
    assert state.copies_in_flight == 1 and state.loads == [other]


def test_a_load_resumes_after_its_pages_with_a_chain_from_the_last_loaded_key():
    state = state_of()
    resume = state.resume_after_load(3, PAGE, KEYS, 0)
    assert state.offloaded_length == resume.offloaded_length == 12
    assert state.chain.last_key == KEYS[2] and state.chain.last_key_stored


def test_a_load_at_the_old_progress_keeps_the_chain():
    state = state_of(8)
    chain = state.chain = RequestChain(KEYS[1], True)
    assert not state.resume_after_load(2, PAGE, KEYS, 0).new_chain
    assert state.chain is chain and state.offloaded_length == 8


def test_a_decode_side_that_loaded_nothing_continues_from_the_prompts_last_page():
    state = state_of()
    state.resume_after_load(0, PAGE, KEYS, 16)
    assert state.offloaded_length == 16 and state.chain.last_key == KEYS[3]


def test_a_shorter_load_than_the_old_progress_goes_back_to_it():
    state = state_of(16)
    state.chain = RequestChain(KEYS[3], True)
    state.resume_after_load(1, PAGE, KEYS, 0)
    assert state.offloaded_length == 4 and state.chain.last_key == KEYS[0]


def test_pages_to_launch_counts_whole_pages_up_to_kv_length_never_negative():
    state = state_of(8)
    state.kv_length = 19
    assert state.pages_to_launch(PAGE) == 2
    state.kv_length = 4  # a load resumed past what the finish has KV for
    assert state.pages_to_launch(PAGE) == 0
