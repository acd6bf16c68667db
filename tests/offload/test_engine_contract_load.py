"""The engine contract, load path (issue 17): a resumed request looks up every token with KV,
a finished prefetch frees the host pages it will not use and says what it wanted, got and
hit, ``min_pages`` waits for host pages instead of truncating, and ``flush()`` empties the
store's key space after in-flight work."""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.offload.testing import SimpleRequest
from kvstage.storage import LayoutFingerprint

from offload_rig import make_rig, settle

PAGE = 4


def store_prompt_of(rig, rid, prompt):
    """A request whose prompt's whole pages the manager stores, then finished and settled."""
    req = rig.new_request(rid, list(prompt), 4)
    req.output_ids.append(0)
    req.done = True
    rig.manager.finish(req)
    settle(rig)
    return req


def newcomer(rig, rid, prompt):
    """A request with slots, every slot poisoned (-1): nothing of it written yet."""
    req = SimpleRequest(rid, list(prompt))
    rig.slots.assign(req, len(req.origin_input_ids) + 8)
    rig.stacked[:, :, rig.slots(req)] = -1
    return req


def rows_equal(rig, source, target, num_tokens):
    rows = rig.stacked[:, :, rig.slots(target)[:num_tokens], 0, :4].permute(2, 0, 1, 3)
    return torch.equal(rows, rig.expected_rows(source, 0, num_tokens))


# -- resumed requests --------------------------------------------------------------------------


def test_a_retracted_request_that_runs_again_reloads_every_page_it_stored():
    # Before: prefetch looked up only origin_input_ids[:-1]: 2 of its 7 stored pages.
    rig = make_rig(page_size=PAGE, store_prompt=True, num_host_pages=16)
    req = rig.new_request("r", range(9), 24)
    for token in range(100, 120):  # 20 tokens decoded: 9 + 19 with KV, 7 whole pages
        rig.decode(req, token)
        rig.manager.offload(req)
    rig.manager.retract(req, keep_offloaded=True)
    settle(rig)
    assert rig.released == [req] and rig.manager.metrics.pages_stored == 7
    # Re-admitted: fresh slots, nothing written; sglang recomputes prompt + output but the last.
    rig.slots.assign(req, 40)
    rig.stacked[:, :, rig.slots(req)] = -1
    assert rig.manager.match_prefix(req).num_pages == 7
    handle = rig.manager.prefetch(req, policy="wait_complete")
    assert handle.pages_wanted == 7
    handle.wait()
    rig.manager.poll()
    assert handle.ready_to_load() and handle.pages_ready == 7
    load = rig.manager.load(handle, rig.slots(req)[:28])
    settle_loads(rig)
    assert load.error is None and rows_equal(rig, req, req, 28)


def settle_loads(rig):
    rig.copy_stream.complete_all()
    rig.manager.poll()


def test_a_fresh_request_still_looks_up_its_prompt_but_the_last_token():
    rig = make_rig(page_size=PAGE, store_prompt=True)
    store_prompt_of(rig, "a", range(16))
    b = newcomer(rig, "b", range(16))
    assert rig.manager.match_prefix(b).pages_asked == 3  # 15 tokens: 3 whole pages


# -- a prefetch and its host pages ------------------------------------------------------------


def test_a_finished_prefetch_frees_the_host_pages_beyond_its_hit_at_the_next_poll():
    # Before: all 8 host pages stayed held until load or cancel.
    rig = make_rig(page_size=PAGE, store_prompt=True, num_host_pages=8)
    store_prompt_of(rig, "a", range(8))  # 2 pages stored
    b = newcomer(rig, "b", range(33))
    handle = rig.manager.prefetch(b, policy="wait_complete")
    assert (handle.pages_wanted, handle.num_host_pages) == (8, 8) and rig.host_pool.used == 8
    handle.wait()
    rig.manager.poll()
    assert (handle.pages_hit, handle.pages_ready) == (2, 2) and rig.host_pool.used == 2
    assert rig.manager.metrics.pages_truncated == 0
    load = rig.manager.load(handle, rig.slots(b)[:8])
    settle_loads(rig)
    assert load.error is None and rows_equal(rig, b, b, 8) and rig.host_pool.used == 0


def test_a_prefetch_that_misses_holds_no_host_page_after_the_next_poll():
    rig = make_rig(page_size=PAGE, store_prompt=True, num_host_pages=8)
    b = newcomer(rig, "b", range(33))
    handle = rig.manager.prefetch(b, policy="wait_complete")
    handle.wait()
    rig.manager.poll()
    assert (handle.pages_hit, handle.pages_ready, rig.host_pool.used) == (0, 0, 0)
    assert rig.manager.offload(rig.new_request("c", range(50, 58), 4))  # the pool is free for offloads


def test_a_prefetch_short_of_host_pages_says_so_and_counts_the_truncated_pages():
    # Before: match_prefix said 30, 4 host pages were free, the handle showed wanted=4, hit=4.
    rig = make_rig(page_size=2, store_prompt=True, num_host_pages=64)
    store_prompt_of(rig, "a", range(61))  # 30 pages
    held = rig.host_pool.alloc(60)  # the engine's other work holds all but 4
    b = newcomer(rig, "b", range(61))
    assert rig.manager.match_prefix(b).num_pages == 30
    handle = rig.manager.prefetch(b, policy="wait_complete")
    handle.wait()
    rig.manager.poll()
    assert (handle.pages_wanted, handle.num_host_pages, handle.pages_hit, handle.pages_ready) == (30, 4, 30, 4)
    assert rig.manager.metrics.pages_truncated == 26
    rig.manager.cancel(handle)
    rig.host_pool.free(held)


def test_min_pages_waits_for_host_pages_instead_of_truncating():
    rig = make_rig(page_size=2, store_prompt=True, num_host_pages=64)
    a = store_prompt_of(rig, "a", range(61))  # 30 pages
    held = rig.host_pool.alloc(60)
    b = newcomer(rig, "b", range(61))
    handle = rig.manager.prefetch(b, policy="wait_complete", min_pages=30)
    assert handle.num_host_pages == 0 and rig.host_pool.used == 60  # took nothing: waits
    assert handle.wait(timeout_s=0) is False
    rig.manager.poll()
    assert not handle.ready_to_load() and handle.num_host_pages == 0
    rig.host_pool.free(held)
    rig.manager.poll()  # 64 free now: the read starts
    assert handle.num_host_pages == 30
    assert handle.wait(timeout_s=10)
    rig.manager.poll()
    assert handle.ready_to_load() and handle.pages_ready == 30
    assert rig.manager.metrics.pages_truncated == 0
    load = rig.manager.load(handle, rig.slots(b)[:60])
    settle_loads(rig)
    assert load.error is None and rows_equal(rig, a, b, 60)


def test_min_pages_is_capped_by_the_lookup_and_waiting_prefetches_start_in_order():
    rig = make_rig(page_size=2, store_prompt=True, num_host_pages=8)
    held = rig.host_pool.alloc(7)
    first = rig.manager.prefetch(newcomer(rig, "first", range(9)), min_pages=100)  # wants 4: waits for 4
    second = rig.manager.prefetch(
        newcomer(rig, "second", range(5)), min_pages=1
    )  # wants 2, 1 is free: but waits its turn
    assert (first.num_host_pages, second.num_host_pages) == (0, 0)
    rig.host_pool.free(held)
    rig.manager.poll()
    assert (first.num_host_pages, second.num_host_pages) == (4, 2)
    first.wait()
    second.wait()
    rig.manager.poll()
    assert rig.host_pool.used == 0  # both missed


def test_a_waiting_prefetch_can_be_cancelled():
    rig = make_rig(page_size=2, store_prompt=True, num_host_pages=8)
    held = rig.host_pool.alloc(8)
    req = newcomer(rig, "b", range(9))
    handle = rig.manager.prefetch(req, min_pages=2)
    rig.manager.cancel(handle)
    rig.host_pool.free(held)
    rig.manager.poll()
    assert handle.cancelled and handle.num_host_pages == 0 and rig.host_pool.used == 0
    assert rig.manager.prefetch(req).num_host_pages == 4  # no prefetch pending any more


@pytest.mark.parametrize(
    "bad, rule",
    [
        (0, r"^min_pages: must be None or an int >= 1, got 0"),
        (2.0, r"^min_pages: must be None or an int >= 1, got 2.0"),
        (9, r"^min_pages: 9 of the 20 pages looked up can never be free: the host pool holds 8 pages"),
    ],
)
def test_a_bad_min_pages_raises_before_anything(bad, rule):
    rig = make_rig(page_size=2, store_prompt=True, num_host_pages=8)
    req = newcomer(rig, "b", range(41))
    with pytest.raises(InvalidArgumentError, match=rule):
        rig.manager.prefetch(req, min_pages=bad)
    assert not rig.manager.is_tracked(req) and rig.host_pool.used == 0
    assert rig.manager.prefetch(newcomer(rig, "c", range(9)), min_pages=9).num_host_pages == 4  # capped by its lookup


# -- flush ------------------------------------------------------------------------------------


def test_flush_waits_for_in_flight_work_cancels_prefetches_and_clears_the_store():
    # Before: no call could invalidate; after a weight update the same prompt loaded old pages.
    rig = make_rig(page_size=PAGE, store_prompt=True, num_host_pages=16)
    store_prompt_of(rig, "a", range(20))  # 5 pages stored
    running = rig.new_request("running", range(100, 112), 8)
    assert rig.manager.offload(running)  # 3 pages: copying when the flush comes
    waiting = newcomer(rig, "waiting", range(20))
    handle = rig.manager.prefetch(waiting, policy="wait_complete")
    assert rig.manager.flush() == 8  # the 5 stored and the 3 that were in flight
    assert handle.cancelled and rig.host_pool.used == 0 and rig.copy_stream.pending == []
    assert rig.manager.match_prefix(token_ids=list(range(20))).num_pages == 0
    assert rig.manager.match_prefix(token_ids=list(range(100, 112))).num_pages == 0
    assert rig.manager.flush() == 0


def test_flush_forgets_retracted_progress_so_the_request_stores_again():
    rig = make_rig(page_size=PAGE, store_prompt=True)
    req = rig.new_request("r", range(8), 20)
    rig.manager.offload(req)
    rig.manager.retract(req, keep_offloaded=True)
    settle(rig)
    assert rig.manager.offloaded_length(req) == 8
    rig.manager.flush()
    assert rig.manager.offloaded_length(req) is None
    rig.slots.assign(req, 28)
    rig.write_kv(req, 0, 8)
    assert rig.manager.offload(req)
    settle_loads(rig)
    assert rig.manager.match_prefix(token_ids=list(range(8))).num_pages == 2


def test_flush_empties_a_file_store_and_the_same_prompt_then_misses(tmp_path):
    from kvstage.kv_layout import KVLayout
    from kvstage.storage import FileStore

    store = FileStore(LayoutFingerprint("rig", KVLayout(2, 2, 1, 4, "int32"), PAGE), tmp_path)
    rig = make_rig(page_size=PAGE, store_prompt=True, storage=store)
    store_prompt_of(rig, "a", range(20))
    assert rig.manager.match_prefix(token_ids=list(range(20))).num_pages == 5
    assert rig.manager.flush() == 5
    assert rig.manager.match_prefix(token_ids=list(range(20))).num_pages == 0
    reopened = FileStore(LayoutFingerprint("rig", KVLayout(2, 2, 1, 4, "int32"), PAGE), tmp_path)
    assert reopened.exists(rig.hasher.prefill_keys(list(range(20)))) == [False] * 5  # gone from disk too


def test_a_long_prompt_with_a_small_host_pool_prefetches_what_fits_and_the_chain_continues():
    """A 41-token prompt (20 stored pages) with a host pool of 4 pages: the prefetch reads the 4 that
    fit (16 counted truncated), and the request's chain continues, deduplicating the stored pages."""
    rig = make_rig(page_size=2, store_prompt=True, num_host_pages=4)
    a = rig.new_request("a", list(range(1, 42)), 4)
    a_slots = rig.slots(a)[:8].clone()  # freed at a's release
    a_kv = rig.stacked[:, :, a_slots].clone()
    for _ in range(10):
        rig.manager.offload(a)
        rig.copy_stream.complete_all()
        rig.manager.poll()
    a.done = True
    rig.manager.finish(a)
    rig.copy_stream.complete_all()
    rig.manager.drain()
    assert rig.manager.metrics.pages_stored == 20
    b = SimpleRequest("b", list(range(1, 42)))
    handle = rig.manager.prefetch(b, policy="wait_complete")
    handle.wait()
    # the lookup wants 20, the host pool holds 4: 4 read, 16 counted truncated (issue 17)
    assert (handle.pages_wanted, handle.num_host_pages, handle.pages_ready) == (20, 4, 4)
    rig.slots.assign(b, 45)
    rig.manager.load(handle, rig.slots(b)[:8])
    rig.copy_stream.complete_all()
    assert torch.equal(rig.stacked[:, :, rig.slots(b)[:8]], a_kv)
    rig.write_kv(b, 8, 41)
    b.output_ids.append(5)
    for _ in range(10):
        rig.manager.offload(b)
        rig.copy_stream.complete_all()
        rig.manager.poll()
    b.done = True
    rig.manager.finish(b)
    rig.manager.drain()
    m = rig.manager.metrics
    assert (m.pages_stored, m.pages_deduplicated, m.pages_failed, m.host_pages_used) == (20, 16, 0, 0)
