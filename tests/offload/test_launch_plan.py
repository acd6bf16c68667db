"""``LaunchPlanner``: the checked tokens and device slots of what ``plan_store`` chose, sliced into
runs, and the chain they continue; without a manager (page size 4; positions are tokens)."""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.hashing import PageHasher
from kvstage.offload.key_chain import RequestChain
from kvstage.offload.launch_plan import NOTHING, LaunchPlan, LaunchPlanner
from kvstage.offload.request_state import RequestState
from kvstage.offload.testing import SimpleRequest

PAGE = 4


class Checks:
    """A ``check_slot_indices`` that records what it was given and raises on a negative slot."""

    def __init__(self):
        self.calls = []

    def __call__(self, slot_indices, argument):
        self.calls.append((slot_indices.tolist(), argument))
        if (slot_indices < 0).any():
            raise InvalidArgumentError(f"{argument}: a negative slot")
        return slot_indices.shape[0] // PAGE


def planner(store_prompt=True, checks=None):
    return LaunchPlanner(PAGE, PageHasher(page_size=PAGE), store_prompt, checks or Checks())


def slots_of(req):
    return torch.arange(100, 100 + 40)  # slot 100 + position


def state_of(prompt, output=(), offloaded_length=0, **namespace):
    return RequestState(SimpleRequest("r", prompt, output, **namespace), offloaded_length)


def tokens_and_slots(plan):
    return [(list(run.tokens), slots.tolist()) for run, slots in plan.runs]


def test_less_than_a_page_new_is_nothing_and_asks_for_no_slots():
    def no_slots(req):
        raise AssertionError("slot_indices_of called")

    assert planner().plan(state_of(list(range(10)), offloaded_length=8), 11, 8, 100, no_slots) is NOTHING


def test_the_prompt_pages_launch_as_one_run_with_their_slots_and_a_new_chain_at_the_seed():
    checks = Checks()
    hasher = PageHasher(page_size=PAGE)
    plan = LaunchPlanner(PAGE, hasher, True, checks).plan(state_of(list(range(10))), 10, 8, 100, slots_of)
    assert tokens_and_slots(plan) == [(list(range(8)), list(range(100, 108)))]
    assert plan.rejected == 0
    assert plan.chain.last_key == hasher.seed(None, None) and plan.chain.last_key_stored is False
    assert checks.calls == [(list(range(100, 108)), "slot_indices_of(rid='r')")]


def test_prompt_pages_then_decode_units_slice_into_two_runs():
    # 12 prompt tokens (3 pages), 13 more with KV: one 8-token unit after the prompt.
    state = state_of(list(range(12)), list(range(50, 63)))
    plan = planner().plan(state, 25, 8, 100, slots_of)
    assert tokens_and_slots(plan) == [
        (list(range(12)), list(range(100, 112))),
        (list(range(50, 58)), list(range(112, 120))),
    ]


def test_what_does_not_fit_is_checked_but_not_launched_and_counted_rejected():
    checks = Checks()
    state = state_of(list(range(12)), list(range(50, 63)))
    plan = LaunchPlanner(PAGE, PageHasher(page_size=PAGE), True, checks).plan(state, 25, 8, 3, slots_of)
    assert tokens_and_slots(plan) == [(list(range(12)), list(range(100, 112)))]
    assert plan.rejected == 1
    assert checks.calls[0][0] == list(range(100, 120))  # the slots of the unit that waits too


def test_no_free_host_page_keeps_the_states_chain_and_launches_nothing():
    state = state_of(list(range(20)), offloaded_length=8)
    state.chain = RequestChain("ab" * 16, True)
    plan = planner().plan(state, 16, 8, 0, slots_of)
    assert plan == LaunchPlan([], state.chain, 1)


def test_a_request_with_a_chain_continues_it():
    state = state_of(list(range(4)), list(range(50, 60)), offloaded_length=4)
    state.chain = RequestChain("cd" * 16, True)
    plan = planner().plan(state, 13, 8, 100, slots_of)
    assert plan.chain is state.chain
    assert tokens_and_slots(plan) == [(list(range(50, 58)), list(range(104, 112)))]


def test_a_decode_side_chain_starts_at_the_prompts_last_page_key():
    hasher = PageHasher(page_size=PAGE)
    prompt = list(range(10))
    state = state_of(prompt, list(range(50, 60)), offloaded_length=8)
    plan = LaunchPlanner(PAGE, hasher, False, Checks()).plan(state, 16, 8, 100, slots_of)
    assert plan.chain.last_key == hasher.prefill_keys(prompt[:8])[-1] and plan.chain.last_key_stored


def test_a_namespace_reaches_the_seed():
    hasher = PageHasher(page_size=PAGE)
    state = state_of(list(range(8)), extra_key="lora-a", cache_salt="s")
    plan = LaunchPlanner(PAGE, hasher, True, Checks()).plan(state, 8, 8, 100, slots_of)
    assert plan.chain.last_key == hasher.seed("lora-a", "s") != hasher.seed(None, None)


def test_a_placeholder_id_raises_before_the_slots_are_asked_for():
    def no_slots(req):
        raise AssertionError("slot_indices_of called")

    state = state_of(list(range(8)), [50, 51, 52, -1, 54])
    with pytest.raises(InvalidArgumentError, match=r"rid='r'"):
        planner().plan(state, 12, 4, 100, no_slots)


def test_too_few_slots_name_the_request_and_the_tokens_with_kv():
    state = state_of(list(range(12)))
    with pytest.raises(InvalidArgumentError, match=r"^slot_indices_of\(rid='r'\): 10 slots, its first 12 tokens"):
        planner().plan(state, 12, 8, 100, lambda req: torch.arange(10))


def test_the_slot_check_raises_through_and_nothing_is_returned():
    state = state_of(list(range(8)))
    with pytest.raises(InvalidArgumentError, match="a negative slot"):
        planner().plan(state, 8, 8, 100, lambda req: torch.tensor([-1] * 8))
    assert state.chain is None and state.offloaded_length == 0  # the state is read, never changed
