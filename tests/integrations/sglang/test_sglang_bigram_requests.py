"""The decode drop-in's pair-unit view of an sglang Req (bigram_requests): units read live from
sglang's growing output, placeholders where a pair's token is not known, the hasher's keys
equal to the bigram keys of the raw ids."""

from __future__ import annotations

import gc
from array import array

import pytest
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams

from kvstage.errors import InvalidArgumentError
from kvstage.hashing import BigramPageHasher
from kvstage.integrations.sglang.bigram_requests import BigramRequest, PairUnitHasher
from kvstage.offload.request import request_tokens


def a_req(prompt, outputs=()):
    req = Req("r", "", array("q", prompt), SamplingParams(max_new_tokens=8), extra_key="k")
    req.output_ids.extend(outputs)
    return req


def test_units_pair_each_position_with_the_next_token_read_live():
    req = a_req([10, 11, 12], [13])
    view = BigramRequest.of(req)
    assert BigramRequest.of(req) is view and view.rid == "r" and view.extra_key == "k"
    assert list(view.origin_input_ids[0:3]) == [10 | 11 << 32, 11 | 12 << 32, 12 | 13 << 32]
    assert list(view.output_ids[0:1]) == [-1]  # the last sampled token pairs with nothing yet
    req.output_ids.append(14)
    assert list(view.output_ids[0:2]) == [13 | 14 << 32, -1] and len(view.output_ids) == 2


def test_the_hasher_gives_the_bigram_keys_of_the_raw_ids():
    prompt, outputs = list(range(100, 110)), [200, 201, 202, 203, 204, 205, 206]
    req = a_req(prompt, outputs)
    view = BigramRequest.of(req)
    raw = prompt + outputs
    hasher, bigrams = PairUnitHasher(page_size=4), BigramPageHasher(page_size=4)
    assert hasher.prefill_keys(view.origin_input_ids[0:8], extra_key="k") == bigrams.prefill_keys(raw[:9], "k")
    prior = bigrams.prefill_keys(raw[:9], "k")[-1]
    units = request_tokens(view, 8, 16)  # what the offload manager hashes: 8 positions, 2 pages
    assert hasher.continue_keys(units, prior) == bigrams.continue_keys(raw[8:17], prior)
    assert len(hasher.continue_keys(units, prior)) == 2


def test_a_placeholder_pair_is_refused_by_the_managers_token_check_and_a_wide_id_names_the_rule():
    req, wide_req = a_req([1, 2, 3, 4], [5, -1, 7]), a_req([1, 2**31, 3, 4], [5])
    view = BigramRequest.of(req)
    with pytest.raises(InvalidArgumentError, match="placeholder"):
        request_tokens(view, 4, 6)
    wide = BigramRequest.of(wide_req)
    with pytest.raises(InvalidArgumentError, match=r"position 1: EAGLE bigram keys .* below 2\*\*31"):
        _ = wide.origin_input_ids[0:4]


def test_the_view_holds_its_request_weakly():
    req = a_req([1, 2, 3])
    view = BigramRequest.of(req)
    del req
    gc.collect()
    with pytest.raises(ReferenceError):
        _ = view.rid
