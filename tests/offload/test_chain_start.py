"""Where a decode side's chain starts (``store_prompt=False``): after the prompt's last whole
page, whose key a prefetch of the request already computed; the manager reuses that key
instead of hashing the prompt again, and the keys stay those of the prefill side's chain."""

from __future__ import annotations

import torch

from kvstage.offload.testing import SimpleRequest

from offload_rig import STORED_PROMPT, make_rig, settle

PAGE = 4


def count_prefill_keys(hasher):
    """Count ``hasher.prefill_keys`` calls and the tokens they hash (the instance's method wrapped)."""
    calls = []
    inner = hasher.prefill_keys

    def prefill_keys(tokens, *args, **kwargs):
        calls.append(len(tokens))
        return inner(tokens, *args, **kwargs)

    hasher.prefill_keys = prefill_keys
    return calls


def decode_and_finish(rig, req, outputs):
    for token in range(100, 100 + outputs):
        rig.decode(req, token)
        rig.manager.offload(req)
    req.done = True
    rig.manager.finish(req)
    settle(rig)


def test_a_request_loaded_from_a_prefetch_continues_from_the_prompt_key_the_prefetch_computed():
    rig = make_rig(page_size=PAGE, store_prompt=False)
    req = rig.new_request("a", list(range(17)), 16)  # 4 whole prompt pages, stored by the "prefill side"
    calls = count_prefill_keys(rig.hasher)
    handle = rig.manager.prefetch(req, policy="wait_complete")
    handle.wait()
    rig.manager.poll()
    assert calls == [16] and handle.pages_ready == 4
    load = rig.manager.load(handle, rig.slots(req)[: 2 * PAGE])  # fewer pages than the prompt holds
    load.wait()
    decode_and_finish(rig, req, 9)  # kv_length 25: decode pages 4 and 5
    assert calls == [16]  # the prompt was not hashed again
    assert rig.manager.metrics.pages_stored == 2
    assert rig.missing_pages(req) == []  # every page at the prefill side's chain key, byte for byte


def test_a_request_that_loaded_nothing_continues_from_the_prompt_key_too():
    rig = make_rig(page_size=PAGE, store_prompt=False)
    req = rig.new_request("a", list(range(17)), 16)
    rig.storage.clear()  # the prefill side's pages are not there yet: the prefetch hits nothing
    calls = count_prefill_keys(rig.hasher)
    handle = rig.manager.prefetch(req, policy="wait_complete")
    handle.wait()
    rig.manager.poll()
    assert handle.pages_ready == 0
    rig.manager.load(handle, torch.empty(0, dtype=torch.int64))
    rig.store_prompt_as_prefill(req)  # the prefill side's pages land
    decode_and_finish(rig, req, 9)
    assert calls == [16]
    assert rig.missing_pages(req) == []


def test_a_prompt_of_whole_pages_hashes_its_last_page_which_the_lookup_left_out():
    rig = make_rig(page_size=PAGE, store_prompt=False)
    req = rig.new_request("a", list(range(16)), 16)  # the lookup covers 15 tokens: 3 of the 4 pages
    calls = count_prefill_keys(rig.hasher)
    handle = rig.manager.prefetch(req, policy="wait_complete")
    handle.wait()
    rig.manager.poll()
    rig.manager.load(handle, rig.slots(req)[: 2 * PAGE]).wait()
    decode_and_finish(rig, req, 9)
    assert calls == [12, 16]  # the lookup, then the chain's start
    assert rig.missing_pages(req) == []


def test_prefetch_with_store_prompt_false_loads_the_prefill_sides_pages_and_the_chain_continues():
    """A prefetch on a ``store_prompt=False`` manager (a decode side) loads the pages the prefill side
    stored, and the request's offloaded length starts after them."""
    rig = make_rig(page_size=2)  # store_prompt=False: the rig's prefill side stores prompts
    a = rig.new_request("a", STORED_PROMPT, 4)
    b = SimpleRequest("b", STORED_PROMPT)
    rig.slots.assign(b, len(STORED_PROMPT) + 4)
    handle = rig.manager.prefetch(b)
    assert handle.wait(5.0)
    assert handle.pages_ready == (len(STORED_PROMPT) - 1) // 2 and rig.manager.is_tracked(b)
    rig.manager.load(handle, rig.slots(b)[: handle.tokens_ready])
    rig.copy_stream.complete_all()
    rig.manager.poll()
    assert rig.manager.offloaded_length(b) == len(STORED_PROMPT) // 2 * 2  # the prefill side's pages
    assert torch.equal(rig.stacked[:, :, rig.slots(b)[:4]], rig.stacked[:, :, rig.slots(a)[:4]])
