"""The engine contract, store path (issue 17): chunked prefill (``kv_length=``), the per-request
"stored" signal (``on_stored``), and no silent loss (``finish`` keeps waiting pages, strides
that can never fit, a released object offloaded again, the store's error passed on, every
check before the first launch)."""

from __future__ import annotations

import errno
import logging
import threading

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.kv_layout import KVLayout
from kvstage.offload import StoreWorkers
from kvstage.offload.testing import SimpleRequest
from kvstage.storage import LayoutFingerprint

from offload_rig import FlakyStore, make_rig, settle

PAGE = 4


def prefilling(rig, rid, prompt, computed, max_new_tokens=8):
    """A request whose prefill has written the KV of its first ``computed`` prompt positions
    only (chunked prefill); slots for every token, the rest poisoned (-1)."""
    req = SimpleRequest(rid, list(prompt))
    rig.slots.assign(req, len(req.origin_input_ids) + max_new_tokens)
    rig.stacked[:, :, rig.slots(req)] = -1
    rig.write_kv(req, 0, computed)
    return req


def stored_pages_equal(rig, req, num_pages):
    """The store holds exactly ``req``'s first ``num_pages`` pages (bytes equal), not the next."""
    keys = rig.hasher.prefill_keys(list(req.origin_input_ids) + list(req.output_ids))
    into = torch.empty(rig.host_pool.page_shape, dtype=torch.int32)
    for index in range(num_pages):
        assert rig.storage.get([keys[index]], [into]) == [True], f"page {index} not stored"
        assert torch.equal(into, rig.expected_page(req, index)), f"page {index} holds other bytes"
    if len(keys) > num_pages:
        assert rig.storage.exists([keys[num_pages]]) == [False], f"page {num_pages} stored with unwritten slots"


# -- chunked prefill ---------------------------------------------------------------------------


def test_chunked_prefill_stores_only_pages_whose_every_slot_has_kv_chunk_by_chunk():
    # Before: offload(req) took every prompt position as computed; a 40-token prompt with its
    # first 16-token chunk computed stored 10 pages, 6 of them never-written slots.
    rig = make_rig(page_size=PAGE, store_prompt=True, num_host_pages=16)
    req = prefilling(rig, "long", range(40), 16)
    assert rig.manager.offload(req, kv_length=16)
    settle_copies(rig)
    stored_pages_equal(rig, req, 4)
    rig.write_kv(req, 16, 30)  # a chunk that ends mid-page: page 7 is not whole yet
    assert rig.manager.offload(req, kv_length=30)
    settle_copies(rig)
    stored_pages_equal(rig, req, 7)
    assert rig.manager.offload(req, kv_length=30) is False  # nothing new
    rig.write_kv(req, 30, 40)
    req.output_ids.append(7)  # prefill done, first token sampled: the default kv_length is 40
    assert rig.manager.offload(req)
    settle_copies(rig)
    stored_pages_equal(rig, req, 10)
    m = rig.manager.metrics
    assert (m.pages_launched, m.pages_stored, m.pages_failed) == (10, 10, 0)


def settle_copies(rig):
    rig.copy_stream.complete_all()
    rig.manager.poll()


def test_an_aborted_long_prefill_keeps_the_chunks_it_stored():
    rig = make_rig(page_size=PAGE, store_prompt=True)
    req = prefilling(rig, "long", range(40), 24)
    assert rig.manager.offload(req, kv_length=16)
    settle_copies(rig)
    assert rig.manager.offload(req, kv_length=24)  # launched, still copying when the abort comes
    rig.manager.abort(req)
    assert rig.released == []
    settle(rig)
    assert rig.released == [req]
    stored_pages_equal(rig, req, 6)
    m = rig.manager.metrics
    assert (m.pages_stored, m.pages_discarded) == (6, 0)


def test_finish_takes_kv_length_too():
    rig = make_rig(page_size=PAGE, store_prompt=True)
    req = prefilling(rig, "cut", range(40), 20)
    req.done = True
    assert rig.manager.finish(req, kv_length=20)
    settle(rig)
    assert rig.released == [req]
    stored_pages_equal(rig, req, 5)


@pytest.mark.parametrize(
    "bad, rule",
    [
        (41, r"^kv_length: 41 exceeds the 40 tokens of rid='long'"),
        (-1, r"^kv_length: must be an int >= 0"),
        (True, r"^kv_length: must be an int >= 0"),
        (16.0, r"^kv_length: must be an int >= 0"),
    ],
)
def test_a_kv_length_past_the_tokens_or_not_an_int_raises_before_anything(bad, rule):
    rig = make_rig(page_size=PAGE, store_prompt=True)
    req = prefilling(rig, "long", range(40), 40)
    with pytest.raises(InvalidArgumentError, match=rule):
        rig.manager.offload(req, kv_length=bad)
    assert not rig.manager.is_tracked(req) and rig.copy_stream.submitted == 0 and rig.host_pool.used == 0


def test_a_kv_length_below_what_was_launched_raises_and_changes_nothing():
    rig = make_rig(page_size=PAGE, store_prompt=True)
    req = prefilling(rig, "long", range(40), 24)
    assert rig.manager.offload(req, kv_length=24)
    with pytest.raises(
        InvalidArgumentError, match=r"^kv_length: 20 is below the 24 tokens of rid='long' launched already"
    ):
        rig.manager.offload(req, kv_length=20)
    with pytest.raises(InvalidArgumentError, match=r"^kv_length: 8 is below"):
        rig.manager.finish(req, kv_length=8)
    assert rig.manager.offloaded_length(req) == 24 and rig.copy_stream.submitted == 1 and rig.released == []


# -- the stored signal ------------------------------------------------------------------------


class GatedStore(FlakyStore):
    """A store whose puts wait until ``gate`` is set (a slow store on the writer thread)."""

    def __init__(self, fingerprint):
        super().__init__(fingerprint)
        self.gate = threading.Event()

    def _put(self, full_keys, pages, full_prior_key=None):
        assert self.gate.wait(10), "gate never opened"
        return super()._put(full_keys, pages, full_prior_key)


def rig_fingerprint():
    return LayoutFingerprint("rig", KVLayout(2, 2, 1, 4, "int32"), PAGE)


def test_on_stored_comes_after_the_last_write_landed_not_at_release():
    # Before: release(req) came before the writes landed and nothing said when they had: B's
    # lookup right after A's release found 0 pages, 10 a moment later.
    stored = []
    store = GatedStore(rig_fingerprint())
    rig = make_rig(
        page_size=PAGE,
        store_prompt=True,
        storage=store,
        store_workers=StoreWorkers(),
        on_stored=lambda *args: stored.append(args),
    )
    a = rig.new_request("a", range(40), 4)
    a.output_ids.append(1)
    a.done = True
    rig.manager.finish(a)
    rig.copy_stream.complete_all()
    rig.manager.poll()
    assert rig.released == [a] and stored == []  # released: the write is still running
    assert rig.manager.requests_live == 0 and rig.manager.reports_pending == 1
    assert rig.manager.match_prefix(token_ids=list(range(40))).num_pages == 0
    store.gate.set()
    rig.manager.drain()
    assert stored == [(a, 10, 0)] and rig.manager.reports_pending == 0
    assert rig.manager.match_prefix(token_ids=list(range(40))).num_pages == 10
    rig.manager.poll()
    assert stored == [(a, 10, 0)]  # exactly once
    rig.manager.close()


def test_on_stored_counts_deduplicated_pages_as_stored_and_failed_pages_as_failed():
    stored = []
    fingerprint = rig_fingerprint()
    keys_failing = set()
    store = FlakyStore(fingerprint, fail=lambda key: key in keys_failing)
    rig = make_rig(page_size=PAGE, store_prompt=True, storage=store, on_stored=lambda *args: stored.append(args))
    first = rig.new_request("first", range(8), 4)
    first.done = True
    rig.manager.finish(first)
    settle(rig)
    again = rig.new_request("again", range(8), 4)  # same pages: deduplicated
    again.done = True
    rig.manager.finish(again)
    settle(rig)
    other = rig.new_request("other", range(50, 62), 4)
    keys_failing.update(rig.hasher.prefill_keys(list(range(50, 62)))[1:])  # pages 1 and 2 fail
    other.done = True
    rig.manager.finish(other)
    settle(rig)
    assert stored == [(first, 2, 0), (again, 2, 0), (other, 1, 2)]
    assert rig.manager.metrics.pages_deduplicated == 2


def test_on_stored_is_called_once_per_lifecycle_also_aborted_retracted_and_with_nothing_stored():
    stored = []
    rig = make_rig(page_size=PAGE, store_prompt=True, on_stored=lambda *args: stored.append(args))
    aborted = rig.new_request("aborted", range(8), 4)
    rig.manager.offload(aborted)
    rig.manager.abort(aborted)
    untouched = rig.new_request("untouched", range(3), 4)
    rig.manager.abort(untouched)  # released at once; the signal still waits for poll
    assert rig.released == [untouched] and stored == []
    settle(rig)
    assert stored == [(untouched, 0, 0), (aborted, 2, 0)] or stored == [(aborted, 2, 0), (untouched, 0, 0)]
    stored.clear()
    retracted = rig.new_request("retracted", range(8), 20)
    rig.manager.offload(retracted)
    rig.manager.retract(retracted, keep_offloaded=True)
    settle(rig)
    assert stored == [(retracted, 2, 0)]
    rig.slots.assign(retracted, 28)
    for token in range(5):
        rig.decode(retracted, token)  # runs again: kv 8 + 4 tokens, one more page
    retracted.done = True
    rig.manager.finish(retracted)
    settle(rig)
    assert stored == [(retracted, 2, 0), (retracted, 1, 0)]


def test_an_on_stored_that_raises_is_logged_and_counted(caplog):
    def boom(req, pages_stored, pages_failed):
        raise RuntimeError("engine bug")

    rig = make_rig(page_size=PAGE, store_prompt=True, on_stored=boom)
    req = rig.new_request("r", range(8), 4)
    req.done = True
    rig.manager.finish(req)
    with caplog.at_level(logging.ERROR, logger="kvstage.offload.manager"):
        settle(rig)
    assert rig.manager.metrics.callback_errors == 1 and "on_stored callback raised for rid='r'" in caplog.text


def test_on_stored_must_be_callable():
    with pytest.raises(InvalidArgumentError, match=r"^on_stored: must be callable or None"):
        make_rig(page_size=PAGE, on_stored=3)


# -- no silent loss ---------------------------------------------------------------------------


def test_finish_keeps_every_page_waiting_for_host_pages_by_default():
    # Before: a 2-page host pool and a 10-page prompt finished after prefill: finish() returned
    # False and dropped 8 pages with one WARNING.
    rig = make_rig(page_size=PAGE, store_prompt=True, num_host_pages=2)
    req = rig.new_request("r", range(40), 4)
    req.output_ids.append(1)
    req.done = True
    assert rig.manager.finish(req) is True
    assert rig.manager.metrics.pages_launched == 2 and rig.released == []  # slots held while pages wait
    settle(rig)
    assert rig.released == [req]
    m = rig.manager.metrics
    assert (m.pages_launched, m.pages_stored, m.pages_dropped) == (10, 10, 0)
    stored_pages_equal(rig, req, 10)


def test_finish_backlog_pages_opts_into_dropping():
    rig = make_rig(page_size=PAGE, store_prompt=True, num_host_pages=2, finish_backlog_pages=3)
    req = rig.new_request("r", range(40), 4)
    req.done = True
    assert rig.manager.finish(req) is False  # 2 launched, 8 more > 3
    assert rig.released == [] and rig.manager.metrics.pages_dropped == 8
    settle(rig)
    assert rig.released == [req] and rig.manager.metrics.pages_stored == 2


def test_an_offload_stride_the_host_pool_can_never_hold_raises_at_construction():
    # Before: accepted, and never launched a stride.
    with pytest.raises(
        InvalidArgumentError,
        match=r"^offload_stride: 12 tokens \(3 pages of 4\) exceeds the host pool's capacity of 2 pages",
    ):
        make_rig(page_size=PAGE, num_host_pages=2, offload_stride=12)
    make_rig(page_size=PAGE, num_host_pages=2, offload_stride=8)  # exactly the capacity fits


def test_a_request_object_offloaded_after_its_release_raises_naming_the_rid():
    # Before: ignored with a DEBUG log, so an engine that reused an object lost its pages silently.
    rig = make_rig(page_size=PAGE, store_prompt=True)
    req = rig.new_request("reused", range(8), 8)
    req.done = True
    rig.manager.finish(req)
    settle(rig)
    assert rig.released == [req]
    req.done = False
    req.output_ids += [1, 2, 3, 4, 5]
    with pytest.raises(InvalidArgumentError, match=r"^req: rid='reused' was released already; .*retract"):
        rig.manager.offload(req)
    assert rig.manager.finish(req) is True and rig.manager.abort(req) is None  # ending calls stay idempotent
    assert rig.released == [req] and rig.copy_stream.submitted == 1


def test_on_storage_failure_gets_the_exception_that_failed_the_write_logged_once(caplog):
    reports = []

    class FullDisk(FlakyStore):
        def _put(self, full_keys, pages, full_prior_key=None):
            raise OSError(errno.ENOSPC, "No space left on device")

    rig = make_rig(
        page_size=PAGE,
        store_prompt=True,
        storage=FullDisk(rig_fingerprint()),
        on_storage_failure=lambda *args: reports.append(args),
    )
    req = rig.new_request("r", range(8), 4)
    req.done = True
    rig.manager.finish(req)
    with caplog.at_level(logging.WARNING, logger="kvstage.offload"):
        settle(rig)
    [(who, keys, error)] = reports
    assert who is req and keys == rig.hasher.prefill_keys(list(range(8)))
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No space left on device" in warnings[0].getMessage()


def test_a_placeholder_after_the_prompt_raises_before_the_prompt_pages_launch():
    # Before: with store_prompt=True the prompt's pages were launched, then the decode page's
    # placeholder raised, with one copy in flight and the request tracked.
    rig = make_rig(page_size=PAGE, store_prompt=True)
    req = rig.new_request("spec", range(8), 8)
    for token in (1, 2, -1, 4, 5):
        rig.decode(req, token)
    with pytest.raises(
        InvalidArgumentError, match=r"^output_ids\[2\]: rid='spec' holds the placeholder id -1 at token position 10"
    ):
        rig.manager.offload(req)
    assert rig.copy_stream.submitted == 0 and rig.host_pool.used == 0 and not rig.manager.is_tracked(req)
    req.output_ids[2] = 3
    assert rig.manager.offload(req)
    assert rig.copy_stream.submitted == 2  # the prompt's pages and the decode page


def test_too_few_slots_for_the_decode_pages_raise_before_the_prompt_pages_launch():
    rig = make_rig(page_size=PAGE, store_prompt=True)
    req = rig.new_request("short", range(8), 0)  # slots for the prompt only
    req.output_ids += [1, 2, 3, 4, 5]
    with pytest.raises(InvalidArgumentError, match=r"slots, its first 12 tokens have KV"):
        rig.manager.offload(req)
    assert rig.copy_stream.submitted == 0 and rig.host_pool.used == 0 and not rig.manager.is_tracked(req)


def test_a_raising_offload_of_a_resumed_request_keeps_its_offload_progress():
    rig = make_rig(page_size=PAGE, store_prompt=True)
    req = rig.new_request("r", range(8), 20)
    rig.manager.offload(req)
    rig.manager.retract(req, keep_offloaded=True)
    settle(rig)
    rig.slots.assign(req, 28)
    for token in (1, -1, 3, 4, 5):
        rig.decode(req, token)
    with pytest.raises(InvalidArgumentError, match="placeholder"):
        rig.manager.offload(req)
    assert rig.manager.offloaded_length(req) == 8 and not rig.manager.is_tracked(req)


def test_on_storage_failure_gets_the_error_a_store_answer_carries():
    # Before: a read-only file: directory answered FAILED and on_storage_failure got error=None.
    from kvstage.storage import PutStatus, PutStatuses

    reports = []

    class ReadOnly(FlakyStore):
        def _put(self, full_keys, pages, full_prior_key=None):
            return PutStatuses([PutStatus.FAILED] * len(full_keys), OSError(errno.EROFS, "Read-only file system"))

    rig = make_rig(
        page_size=PAGE,
        store_prompt=True,
        storage=ReadOnly(rig_fingerprint()),
        on_storage_failure=lambda *args: reports.append(args),
    )
    req = rig.new_request("r", range(8), 4)
    req.done = True
    rig.manager.finish(req)
    settle(rig)
    [(who, keys, error)] = reports
    assert who is req and len(keys) == 2 and isinstance(error, OSError) and error.errno == errno.EROFS


def test_a_backlog_larger_than_the_free_host_pages_is_offloaded_in_the_strides_that_fit():
    """A backlog of 4 pages with 2 free host pages is offloaded in the strides that fit. Before,
    ``offload()`` was all or nothing over the whole backlog, so a request whose backlog outgrew
    the free host pages never progressed and ``finish()`` dropped all of it."""
    rig = make_rig(page_size=4, offload_stride=4, num_host_pages=2)
    req = rig.new_request("r", range(4), 32)
    for token in range(100, 118):  # 4 + 17 tokens with KV: 4 whole pages after the prompt
        rig.decode(req, token)
    assert rig.manager.offload(req)  # 2 of the 4 pages fit
    assert rig.manager.metrics.pages_launched == 2 and rig.host_pool.free_pages == 0
    assert not rig.manager.offload(req)  # full: nothing changes
    assert rig.manager.metrics.pages_launched == 2
    rig.copy_stream.complete_all()
    rig.manager.poll()
    assert rig.manager.offload(req)  # the other 2 fit now
    req.done = True
    assert rig.manager.finish(req)
    rig.copy_stream.complete_all()
    rig.manager.poll()
    m = rig.manager.metrics
    assert (m.pages_launched, m.pages_stored, m.pages_dropped, m.releases) == (4, 4, 0, 1)
    assert rig.host_pool.used == 0


def test_finish_with_a_full_host_pool_keeps_the_rest_waiting_until_pages_free():
    """``finish`` of 5 pages with 3 host pages: 3 launch, 2 wait (the request's slots held) until a
    ``poll`` frees pages, then all 5 are stored and the request released once."""
    rig = make_rig(page_size=4, offload_stride=4, num_host_pages=3)
    req = rig.new_request("r", range(4), 32)
    for token in range(100, 122):  # 4 + 21 tokens with KV: 5 whole pages after the prompt
        rig.decode(req, token)
    req.done = True
    assert rig.manager.finish(req)  # 3 launched, 2 wait for host pages (its slots stay held)
    assert rig.manager.metrics.pages_launched == 3 and rig.released == []
    rig.copy_stream.complete_all()
    rig.manager.poll()  # frees 3 pages, launches the 2 waiting ones
    assert rig.manager.metrics.pages_launched == 5 and rig.released == []
    rig.copy_stream.complete_all()
    rig.manager.poll()
    m = rig.manager.metrics
    assert (m.pages_launched, m.pages_stored, m.pages_dropped, m.releases) == (5, 5, 0, 1)
    assert rig.check_stored_pages(req) == (5, 5) and rig.host_pool.used == 0


def test_finish_beyond_the_backlog_limit_drops_the_rest():
    """``finish`` of 5 pages with 3 host pages and ``finish_backlog_pages=1``: the 2 that cannot wait
    are dropped (counted), the 3 launched are stored."""
    rig = make_rig(page_size=4, offload_stride=4, num_host_pages=3, finish_backlog_pages=1)
    req = rig.new_request("r", range(4), 32)
    for token in range(100, 122):  # 5 whole pages after the prompt; 3 fit, 2 > the limit of 1
        rig.decode(req, token)
    req.done = True
    assert not rig.manager.finish(req)
    rig.copy_stream.complete_all()
    rig.manager.poll()
    m = rig.manager.metrics
    assert (m.pages_launched, m.pages_stored, m.pages_dropped, m.releases) == (3, 3, 2, 1)
