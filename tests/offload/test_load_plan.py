"""``plan_load_resume``: where a request's offloading resumes after a load and which stored key
its chain continues from (page size 4; the lookup's keys ``k0``, ``k1``, ...)."""

from __future__ import annotations

import dataclasses

import pytest

from kvstage.offload.load_plan import LoadResume, plan_load_resume

PAGE = 4
KEYS = [f"k{index}" for index in range(6)]


def resume(num_pages, *, offloaded_length=0, has_chain=False, prompt_end=0, page_keys=KEYS):
    return plan_load_resume(
        num_pages=num_pages,
        page_size=PAGE,
        page_keys=page_keys,
        prompt_end=prompt_end,
        offloaded_length=offloaded_length,
        has_chain=has_chain,
    )


def test_a_loaded_prefix_starts_the_chain_at_its_last_page():
    assert resume(3) == LoadResume(12, True, "k2")


def test_nothing_loaded_changes_nothing():
    assert resume(0) == LoadResume(0, False, None)


def test_a_resumed_request_that_lost_a_page_stores_again_after_the_loaded_ones():
    # Retracted after 24 tokens; the store holds only its first four pages now.
    assert resume(4, offloaded_length=24, has_chain=True) == LoadResume(16, True, "k3")


def test_a_resumed_request_that_loads_all_it_stored_keeps_its_chain():
    assert resume(4, offloaded_length=16, has_chain=True) == LoadResume(16, False, None)


def test_decode_side_with_nothing_loaded_continues_from_the_prefill_sides_last_prompt_page():
    # store_prompt=False: the prompt's two whole pages were stored by the prefill side.
    assert resume(0, offloaded_length=8, prompt_end=8) == LoadResume(8, True, "k1")


def test_decode_side_loading_past_the_prompt_continues_after_the_loaded_pages():
    assert resume(4, offloaded_length=8, prompt_end=8) == LoadResume(16, True, "k3")


def test_decode_side_loading_less_than_the_prompt_resumes_at_the_prompts_end():
    assert resume(1, offloaded_length=8, prompt_end=8) == LoadResume(8, True, "k1")


def test_decode_side_whose_lookup_did_not_key_the_whole_prompt_starts_no_chain():
    # One key looked up (4 tokens) for an 8-token prompt: the prompt's last key is not known here.
    assert resume(0, offloaded_length=8, prompt_end=8, page_keys=KEYS[:1]) == LoadResume(8, False, None)


def test_decode_side_with_a_chain_already_keeps_it_at_the_prompts_end():
    assert resume(1, offloaded_length=8, has_chain=True, prompt_end=8) == LoadResume(8, False, None)


def test_decode_side_resumed_past_the_prompt_drops_back_to_the_prompts_end():
    # Retracted after 20 tokens; one page loaded: it resumes at the prompt's end, from its last key.
    assert resume(1, offloaded_length=20, has_chain=True, prompt_end=8) == LoadResume(8, True, "k1")


def test_the_decision_is_a_frozen_record():
    with pytest.raises(dataclasses.FrozenInstanceError):
        resume(3).offloaded_length = 0  # type: ignore[misc]
