"""``plan_store``: which token ranges of a request the store path launches now, from numbers
alone (page size 4 throughout; positions are tokens)."""

from __future__ import annotations

import dataclasses

import pytest

from kvstage.offload.store_plan import StorePlan, plan_store

PAGE = 4


def plan(offloaded_length, kv_length, *, unit=8, prompt_end=16, free_pages=100):
    return plan_store(
        offloaded_length=offloaded_length,
        kv_length=kv_length,
        unit=unit,
        page_size=PAGE,
        prompt_end=prompt_end,
        free_pages=free_pages,
    )


def test_less_than_a_page_new_is_nothing():
    decision = plan(16, 19)
    assert decision == StorePlan(16, 16, (), 0) and decision.nothing


def test_past_the_prompt_less_than_a_unit_is_nothing():
    # 6 new tokens: a whole page, but not a whole 8-token unit.
    decision = plan(16, 22)
    assert decision == StorePlan(16, 16) and decision.nothing


def test_decode_whole_units_that_fit_launch_as_one_run():
    # 17 new tokens: two whole units (16 tokens), four host pages.
    assert plan(16, 33) == StorePlan(16, 32, ((16, 32),), 0)


def test_decode_units_beyond_the_free_pages_wait_but_are_checked():
    # Three free pages hold one 2-page unit: [16, 24) launches, [16, 32) is checked.
    decision = plan(16, 33, free_pages=3)
    assert decision == StorePlan(16, 32, ((16, 24),), 0) and not decision.nothing


def test_decode_unit_with_no_room_is_one_rejection():
    assert plan(16, 33, free_pages=1) == StorePlan(16, 32, (), 1)


def test_a_chunk_of_the_prompt_launches_its_whole_pages():
    # Chunked prefill: KV up to 10 of an 18-token prompt (16 in whole pages): two pages.
    assert plan(0, 10) == StorePlan(0, 8, ((0, 8),), 0)


def test_the_whole_prompt_then_whole_units_are_two_runs():
    # KV up to 30: the prompt's four pages, then one whole unit [16, 24); [24, 30) waits.
    assert plan(0, 30, free_pages=6) == StorePlan(0, 24, ((0, 16), (16, 24)), 0)


def test_a_prompt_that_partly_fits_launches_its_oldest_pages_only():
    # Three free pages: [0, 12); the unit after the prompt cannot start before the prompt is launched.
    assert plan(0, 30, free_pages=3) == StorePlan(0, 24, ((0, 12),), 0)


def test_the_prompt_fills_the_pool_and_the_unit_after_it_is_rejected():
    assert plan(0, 30, free_pages=4) == StorePlan(0, 24, ((0, 16),), 1)


def test_a_prompt_with_no_free_page_is_one_rejection():
    assert plan(0, 30, free_pages=0) == StorePlan(0, 24, (), 1)


def test_a_resumed_prompt_continues_from_its_offloaded_pages():
    # Two prompt pages launched before (a retraction kept them): the other two, then a unit.
    assert plan(8, 30, free_pages=10) == StorePlan(8, 24, ((8, 16), (16, 24)), 0)


def test_finish_plans_page_units_after_the_prompt():
    # finish() plans whole pages (unit = page size): three pages have KV, two fit.
    assert plan(16, 29, unit=PAGE, free_pages=2) == StorePlan(16, 28, ((16, 24),), 0)


def test_a_prompt_shorter_than_a_page_goes_by_units_from_the_start():
    # prompt_end 0 (a 3-token prompt): the decode rule applies from position 0.
    assert plan(0, 17, prompt_end=0) == StorePlan(0, 16, ((0, 16),), 0)


def test_the_decision_is_a_frozen_record():
    decision = plan(16, 33)
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.wanted_end = 0  # type: ignore[misc]
