"""``Lifecycles``: which request objects are tracked, and what is remembered of released ones."""

from __future__ import annotations

import gc

import pytest

from kvstage.errors import InvalidArgumentError
from kvstage.offload.key_chain import RequestChain
from kvstage.offload.lifecycles import Lifecycles
from kvstage.offload.testing import SimpleRequest

PAGE = 4


def request(rid="r"):
    return SimpleRequest(rid, list(range(10)))  # two whole prompt pages (8 tokens)


def test_a_new_lifecycle_starts_at_the_prompts_start_or_after_the_prefill_sides_pages():
    assert Lifecycles(PAGE, True).new_state(request()).offloaded_length == 0
    assert Lifecycles(PAGE, False).new_state(request()).offloaded_length == 8


def test_state_of_builds_a_new_state_that_commit_tracks():
    lifecycles, req = Lifecycles(PAGE, True), request()
    state, new = lifecycles.state_of(req, released_raises=True)
    assert new and lifecycles.states == {}  # built, not tracked until commit
    lifecycles.commit(state)
    assert lifecycles.states == {id(req): state}
    assert lifecycles.state_of(req, released_raises=True) == (state, False)
    state.ending = True
    assert lifecycles.state_of(req, released_raises=True) == (None, False)


def test_a_released_finished_request_is_remembered_and_offloading_it_again_raises():
    lifecycles, req = Lifecycles(PAGE, True), request("done")
    state = lifecycles.track(req)
    assert lifecycles.release(state) and lifecycles.states == {}
    assert not lifecycles.release(state)  # released already
    assert lifecycles.has_ended(req) and not lifecycles.has_ended(request("done"))
    assert lifecycles.state_of(req, released_raises=False) == (None, False)
    with pytest.raises(InvalidArgumentError, match=r"req: rid='done' was released already"):
        lifecycles.state_of(req, released_raises=True)


def test_a_retraction_that_keeps_progress_resumes_with_its_length_and_chain():
    lifecycles, req = Lifecycles(PAGE, True), request()
    state = lifecycles.track(req)
    state.retract_keep, state.offloaded_length, state.chain = True, 12, RequestChain("seed", False)
    chain = state.chain
    lifecycles.release(state)
    assert lifecycles.resumed(req) == (12, chain) and not lifecycles.has_ended(req)
    again = lifecycles.new_state(req)
    assert again.offloaded_length == 12 and again.chain is chain
    lifecycles.commit(again)  # it runs again: the kept progress is taken
    assert lifecycles.retracted == {} and lifecycles.resumed(req) is None


def test_a_retraction_that_starts_over_remembers_nothing():
    lifecycles, req = Lifecycles(PAGE, True), request()
    state = lifecycles.track(req)
    state.retract_keep, state.offloaded_length = False, 12
    lifecycles.release(state)
    assert lifecycles.retracted == {} and not lifecycles.has_ended(req)
    assert lifecycles.new_state(req).offloaded_length == 0


def test_a_kept_retraction_is_forgotten_when_the_engine_drops_the_request():
    lifecycles, req = Lifecycles(PAGE, True), request()
    state = lifecycles.track(req)
    state.retract_keep, state.offloaded_length = True, 8
    lifecycles.release(state)
    assert len(lifecycles.retracted) == 1
    del req, state
    gc.collect()
    assert lifecycles.retracted == {}
