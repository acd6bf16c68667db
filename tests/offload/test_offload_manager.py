"""OffloadManager: decode keys continue the prefill chain, state keyed by request object,
all-or-nothing host allocation, abort/finish/release, storage and copy failures, metrics."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.hashing import PageHasher
from kvstage.kv_layout import KVLayout
from kvstage.nvtx_ranges import open_ranges
from kvstage.offload import CopyStream, HostPool, OffloadManager, OffloadRequest
from kvstage.offload.testing import SimpleRequest
from kvstage.storage import LayoutFingerprint, MemoryStore

from offload_rig import STORED_PROMPT, FlakyStore, make_rig

NAMESPACES = [
    pytest.param({}, id="no-namespace"),
    pytest.param({"extra_key": "lora-a"}, id="extra_key"),
    pytest.param({"cache_salt": "tenant-1"}, id="cache_salt"),
    pytest.param({"extra_key": "lora-a", "cache_salt": "tenant-1"}, id="both"),
]


class RidEqualRequest(SimpleRequest):
    """Equal and hashed by rid, as some engines define requests: the manager must not care."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SimpleRequest) and other.rid == self.rid

    def __hash__(self) -> int:
        return hash(self.rid)


def decode_steps(rig, req, tokens, *, poll=True):
    results = []
    for token in tokens:
        rig.decode(req, token)
        results.append(rig.manager.offload(req))
        if poll:
            rig.manager.poll()
    return results


def test_simple_request_satisfies_the_protocol():
    assert isinstance(SimpleRequest("r", [1, 2]), OffloadRequest)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_decode_pages_are_stored_under_the_prefill_chain(namespace):
    # A real worker-thread copy stream: the lifecycle is asynchronous.
    rig = make_rig(page_size=4, copy_stream=CopyStream("cpu"), slot_generator=torch.Generator().manual_seed(1))
    req = rig.new_request("r1", range(1000, 1010), 32, **namespace)  # prompt: 2 full pages + 2 tokens
    decode_steps(rig, req, range(2000, 2019))
    assert rig.manager.finish(req)
    rig.manager.drain()
    tokens = (req.origin_input_ids + req.output_ids)[: req.kv_length]  # 28 tokens: 7 pages
    prefill = PageHasher(page_size=4).prefill_keys(tokens, **namespace)
    assert len(prefill) == 7
    # Pages 0-1 are the prompt's (the rig's prefill side stored them); 2-6 were offloaded by decode.
    assert rig.storage.exists(prefill) == [True] * 7
    assert rig.check_stored_pages(req) == (5, 5)
    assert rig.released == [req]
    metrics = rig.manager.metrics
    assert (metrics.pages_launched, metrics.pages_stored, metrics.requests_live, metrics.host_pages_used) == (
        5,
        5,
        0,
        0,
    )
    assert metrics.bytes_offloaded == 5 * rig.host_pool.page_bytes and metrics.d2h_gbps > 0
    rig.copy_stream.close()


def test_namespaces_give_disjoint_chains():
    rig = make_rig(page_size=4)
    chains = []
    for namespace in ({}, {"extra_key": "x"}, {"cache_salt": "x"}, {"extra_key": "x", "cache_salt": "x"}):
        req = rig.new_request(str(namespace), range(6), 8, **namespace)
        decode_steps(rig, req, range(100, 105))
        rig.manager.finish(req)
        chains.append(rig.chain(req))
    rig.copy_stream.complete_all()
    rig.manager.poll()
    assert len({key for chain in chains for key in chain}) == 4 * 2
    assert rig.manager.metrics.pages_stored == 4 * 1


def test_strides_start_after_the_prompt_prefix_and_stay_page_aligned():
    rig = make_rig(page_size=4, offload_stride=8)
    req = rig.new_request("r", range(10), 40)  # aligned prefix: 8 tokens
    manager = rig.manager
    launched_at = []
    for token in range(100, 125):
        rig.decode(req, token)
        if manager.offload(req):
            launched_at.append((req.kv_length, manager.offloaded_length(req)))
    # The first stride is tokens 8..16 (the prompt's partial page joins it), then 16..24, 24..32.
    assert launched_at == [(16, 16), (24, 24), (32, 32)]
    # kv: 10 + 24 = 34 tokens; finish offloads the remaining whole pages (none: 32..34 is partial).
    assert manager.finish(req) and manager.offloaded_length(req) == 32
    rig.copy_stream.complete_all()
    manager.poll()
    assert rig.check_stored_pages(req) == (6, 6)


def test_finish_offloads_remaining_whole_pages_not_only_strides():
    rig = make_rig(page_size=4, offload_stride=16)
    req = rig.new_request("r", range(4), 20)
    decode_steps(rig, req, range(100, 113), poll=False)  # kv: 4 + 12 = 16 tokens: 12 new, < one stride
    assert rig.manager.metrics.pages_launched == 0
    assert rig.manager.finish(req)
    assert rig.manager.metrics.pages_launched == 3
    rig.copy_stream.complete_all()
    rig.manager.poll()
    assert rig.released == [req] and rig.check_stored_pages(req) == (3, 3)


@pytest.mark.parametrize("cls", [SimpleRequest, RidEqualRequest])
def test_reused_rid_late_completion_cleans_up_only_the_old_request(cls):
    """The seeds' scenario: old request finished with a copy in flight, a new request with the
    same rid offloading; the old copy's late completion touches only the old object."""
    rig = make_rig(page_size=2)
    manager, stream = rig.manager, rig.copy_stream
    old = rig.new_request("same", [1, 2, 3], 10, cls=cls)
    decode_steps(rig, old, [4, 5], poll=False)  # kv 4 tokens: page 1 launched
    assert manager.in_flight(old) == 1
    manager.finish(old)
    assert rig.released == []  # its copy is in flight: its slots stay
    new = rig.new_request("same", [1, 2, 3], 10, cls=cls)
    assert new == old and new is not old if cls is RidEqualRequest else new != old
    decode_steps(rig, new, [7, 8, 9], poll=False)  # kv 5: page 1 launched
    assert manager.in_flight(new) == 1 and manager.in_flight(old) == 1
    stream.complete(0)  # the old copy completes late, after the new one launched
    assert manager.poll() == 1
    assert len(rig.released) == 1 and rig.released[0] is old
    assert manager.is_tracked(new) and manager.in_flight(new) == 1 and rig.slots.holds(new)
    assert manager.offloaded_length(new) == 4
    decode_steps(rig, new, [10, 11], poll=False)
    manager.finish(new)
    stream.complete_all()
    manager.poll()
    assert [r is x for r, x in zip(rig.released, [old, new])] == [True, True]
    assert rig.check_stored_pages(old) == (1, 1) and rig.check_stored_pages(new) == (2, 2)
    assert manager.metrics.requests_live == 0


def test_host_pool_full_returns_false_and_changes_nothing():
    rig = make_rig(page_size=2, num_host_pages=3)
    manager = rig.manager
    a = rig.new_request("a", [1, 2], 20)
    decode_steps(rig, a, [3, 4, 5, 6, 7, 8, 9], poll=False)  # 3 pages in flight: pool full
    assert rig.host_pool.used == 3
    b = rig.new_request("b", [1, 2], 20)
    decode_steps(rig, b, [3, 4, 5], poll=False)  # kv 4: page 1 wanted, refused
    before = (manager.offloaded_length(b), manager.in_flight(b), rig.host_pool.used, rig.copy_stream.submitted)
    assert manager.offload(b) is False
    assert (manager.offloaded_length(b), manager.in_flight(b), rig.host_pool.used, rig.copy_stream.submitted) == before
    assert manager.metrics.offloads_rejected >= 1
    rig.copy_stream.complete(0)
    manager.poll()
    assert manager.offload(b) is True and manager.offloaded_length(b) == 4  # same start as refused
    for req in (a, b):
        manager.finish(req)
    rig.copy_stream.complete_all()
    manager.poll()
    assert rig.check_stored_pages(b) == (1, 1)


def test_finish_with_the_host_pool_full_keeps_pages_waiting_and_releases_once_launched():
    # Issue 17: finish drops nothing by default (it used to drop b's 2 pages and release it).
    rig = make_rig(page_size=2, num_host_pages=1)
    a = rig.new_request("a", [1, 2], 20)
    decode_steps(rig, a, [3, 4, 5], poll=False)  # kv 4: page 1 in flight
    b = rig.new_request("b", [9], 20)
    decode_steps(rig, b, [3, 4, 5, 6], poll=False)  # kv 4: pages 0-1 refused, pool full
    assert rig.manager.finish(b) is True
    assert rig.released == [] and rig.manager.metrics.pages_dropped == 0
    rig.manager.finish(a)
    for _ in range(3):  # a's copy ends, then b's pages go one by one through the 1-page pool
        rig.copy_stream.complete_all()
        rig.manager.poll()
    assert rig.released == [a, b]
    metrics = rig.manager.metrics
    assert (metrics.pages_stored, metrics.pages_deduplicated, metrics.pages_dropped) == (3, 0, 0)
    assert rig.check_stored_pages(b) == (2, 2)


def test_abort_stores_in_flight_pages_and_releases_once():
    rig = make_rig(page_size=2)
    manager = rig.manager
    req = rig.new_request("r", [1, 2], 20)
    decode_steps(rig, req, [3, 4, 5, 6, 7, 8, 9], poll=False)  # kv 8: 3 segments of 1 page
    assert manager.in_flight(req) == 3
    rig.copy_stream.complete(1)
    manager.abort(req)
    assert rig.released == []
    assert manager.offload(req) is False  # aborted: nothing more
    manager.poll()
    assert rig.released == []
    rig.copy_stream.complete_all()
    manager.poll()
    assert rig.released == [req]
    metrics = manager.metrics
    # Issue 17: an abort keeps what was launched (it used to discard these 3 pages).
    assert (metrics.pages_discarded, metrics.pages_stored, metrics.host_pages_used) == (0, 3, 0)
    assert rig.storage.stats.pages_stored == len(req.origin_input_ids) // 2 + 3  # the prefill side's and the 3


def test_abort_or_finish_of_an_untracked_request_releases_at_once():
    rig = make_rig(page_size=4)
    quiet = rig.new_request("q", [1, 2, 3], 4)
    rig.manager.abort(quiet)
    short = rig.new_request("s", [1, 2, 3], 4)
    assert rig.manager.finish(short) is True
    assert rig.released == [quiet, short] and rig.manager.metrics.requests_live == 0


def test_abort_after_finish_before_release_keeps_what_was_launched():
    rig = make_rig(page_size=2)
    req = rig.new_request("r", [1, 2], 20)
    decode_steps(rig, req, [3, 4, 5], poll=False)
    rig.manager.finish(req)
    rig.manager.finish(req)  # a second finish does nothing
    rig.manager.abort(req)
    rig.copy_stream.complete_all()
    rig.manager.poll()
    assert rig.released == [req] and (rig.manager.metrics.pages_discarded, rig.manager.metrics.pages_stored) == (0, 1)


def test_ending_calls_after_release_are_ignored_and_offload_raises():
    # Issue 17: an offload after the release used to be ignored (a DEBUG log); it raises now.
    rig = make_rig(page_size=2)
    req = rig.new_request("r", [1, 2], 20)
    decode_steps(rig, req, [3, 4, 5], poll=False)
    rig.manager.finish(req)
    rig.copy_stream.complete_all()
    rig.manager.poll()
    assert rig.released == [req]
    req.output_ids += [6, 7]  # more whole pages: none may be launched now
    assert rig.manager.finish(req) is True
    rig.manager.abort(req)
    with pytest.raises(InvalidArgumentError, match=r"^req: rid='r' was released already"):
        rig.manager.offload(req)
    req.done = True
    with pytest.raises(InvalidArgumentError, match=r"^req: rid='r' was released already"):
        rig.manager.offload(req)
    assert rig.released == [req] and rig.manager.metrics.releases == 1
    assert not rig.manager.is_tracked(req) and rig.copy_stream.submitted == 1


def test_offload_of_a_finished_request_finishes_it():
    rig = make_rig(page_size=2)
    req = rig.new_request("r", [1, 2], 20)
    decode_steps(rig, req, [3, 4, 5], poll=False)  # kv 4: page 1 launched
    rig.decode(req, 6)
    rig.decode(req, 7)  # kv 6: page 2 not launched yet
    req.done = True
    assert rig.manager.offload(req) is True  # the remaining whole page went; release pending
    assert rig.manager.offload(req) is False
    rig.copy_stream.complete_all()
    rig.manager.poll()
    assert rig.released == [req] and rig.check_stored_pages(req) == (2, 2)


def test_completions_in_any_order_store_every_page():
    rig = make_rig(page_size=2)
    reqs = [rig.new_request(f"r{i}", [i, i + 1, i + 2], 20) for i in range(3)]
    for step in range(6):
        for req in reqs:
            rig.decode(req, 100 + step)
            rig.manager.offload(req)
    for req in reqs:
        rig.manager.finish(req)
    order = [4, 0, 3, 1, 0, 2, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    while rig.copy_stream.pending:
        rig.copy_stream.complete(order.pop(0) % len(rig.copy_stream.pending))
        rig.manager.poll()
    assert sorted(map(id, rig.released)) == sorted(map(id, reqs))
    assert [rig.check_stored_pages(req) for req in reqs] == [(3, 3)] * 3


def test_identical_pages_of_two_requests_are_deduplicated():
    rig = make_rig(page_size=2)
    a = rig.new_request("a", [5, 6, 7], 10)
    b = rig.new_request("b", [5, 6, 7], 10)
    for req in (a, b):
        decode_steps(rig, req, [8, 9, 10, 11], poll=False)  # kv 6: pages 1-2
        rig.manager.finish(req)
    rig.copy_stream.complete_all()
    rig.manager.poll()
    metrics = rig.manager.metrics
    assert (metrics.pages_stored, metrics.pages_deduplicated) == (2, 2)
    assert rig.storage.stats.pages_stored == 3  # page 0 by the prefill side (once), pages 1-2 by a


def test_storage_failures_are_counted_logged_reported_and_the_manager_goes_on(caplog):
    reports = []
    failing = {"on": True}
    fingerprint = LayoutFingerprint("rig", KVLayout(2, 2, 1, 4, "int32"), 2)
    store = FlakyStore(fingerprint, fail=lambda key: failing["on"])
    rig = make_rig(page_size=2, storage=store, on_storage_failure=lambda *args: reports.append(args))
    req = rig.new_request("r", [1, 2], 20)
    decode_steps(rig, req, [3, 4, 5, 6, 7], poll=False)  # kv 6: pages 1 and 2, one copy each
    rig.copy_stream.complete(0)
    with caplog.at_level(logging.WARNING, logger="kvstage.offload.manager"):
        rig.manager.poll()
    key_1 = rig.chain(req)[1]
    assert reports == [(req, [key_1], None)]
    assert "storage write failed for 1 of 1 pages of rid='r'" in caplog.text
    assert store.exists([key_1]) == [False] and rig.host_pool.used == 1
    failing["on"] = False
    rig.copy_stream.complete(0)
    rig.manager.poll()
    # Page 2 comes after a page the store does not hold: no lookup could reach it, so the
    # chain-aware store refuses it too.
    assert store.exists(rig.chain(req)[1:]) == [False, False]
    metrics = rig.manager.metrics
    assert (metrics.pages_failed, metrics.storage_failures, metrics.pages_stored, metrics.host_pages_used) == (
        2,
        2,
        0,
        0,
    )
    assert [keys for _, keys, _ in reports] == [[key_1], [rig.chain(req)[2]]]


def test_a_put_that_raises_fails_its_pages_and_the_next_one_works():
    reports = []
    calls = {"n": 0}

    def raise_first() -> bool:
        calls["n"] += 1
        return calls["n"] == 1

    store = FlakyStore(LayoutFingerprint("rig", KVLayout(2, 2, 1, 4, "int32"), 2), raise_on_put=raise_first)
    rig = make_rig(page_size=2, storage=store, on_storage_failure=lambda *args: reports.append(args))
    req = rig.new_request("r", [1], 20)  # no whole prompt page: the prefill side puts nothing
    decode_steps(rig, req, [2, 3, 4, 5, 6], poll=False)
    rig.manager.finish(req)
    rig.copy_stream.complete_all()
    rig.manager.poll()
    assert len(reports) == 2 and "injected failure" in str(reports[0][2])
    metrics = rig.manager.metrics
    # Page 0's put raised; page 1 follows it in the chain and is refused (reported without error).
    assert (metrics.pages_failed, metrics.pages_stored, rig.released) == (2, 0, [req])


def test_failed_copy_frees_its_pages_and_is_reported():
    reports = []
    rig = make_rig(page_size=2, on_storage_failure=lambda *args: reports.append(args))
    req = rig.new_request("r", [1, 2], 20)
    decode_steps(rig, req, [3, 4, 5], poll=False)
    rig.manager.finish(req)
    rig.copy_stream.complete(0, error=RuntimeError("copy broke"))
    rig.manager.poll()
    assert rig.released == [req] and rig.host_pool.used == 0
    assert reports[0][0] is req and isinstance(reports[0][2], RuntimeError)
    metrics = rig.manager.metrics
    assert (metrics.copy_failures, metrics.pages_failed, metrics.pages_offloaded) == (1, 1, 0)


def test_a_raising_release_callback_is_logged_and_counted(caplog):
    rig = make_rig(page_size=2)
    rig.on_release = lambda req: 1 / 0
    req = rig.new_request("r", [1], 4)
    with caplog.at_level(logging.ERROR, logger="kvstage.offload.manager"):
        rig.manager.finish(req)
    assert rig.manager.metrics.callback_errors == 1 and "release callback raised" in caplog.text
    assert not rig.manager.is_tracked(req)


def test_poll_never_waits_for_a_running_copy():
    rig = make_rig(page_size=2, copy_stream=CopyStream("cpu"))
    gate = threading.Event()
    rig.copy_stream.submit(lambda: gate.wait(10))  # the worker is busy until the gate opens
    req = rig.new_request("r", [1, 2], 20)
    decode_steps(rig, req, [3, 4, 5], poll=False)
    assert rig.manager.poll() == 0 and rig.manager.in_flight(req) == 1
    gate.set()
    rig.manager.drain()
    assert rig.manager.in_flight(req) == 0 and rig.manager.metrics.pages_stored == 1
    rig.copy_stream.close()


def test_nvtx_ranges_cover_offload_poll_and_backup():
    seen = {}
    rig = make_rig(page_size=2)
    slot_table = rig.slots

    def slots_of(req):
        seen["offload"] = open_ranges()
        return slot_table(req)

    rig.manager.slot_indices_of = slots_of
    original_put = rig.storage.put

    def put(keys, pages, **options):
        seen["put"] = open_ranges()
        return original_put(keys, pages, **options)

    rig.storage.put = put
    req = rig.new_request("r", [1, 2], 10)
    decode_steps(rig, req, [3, 4, 5], poll=False)
    rig.copy_stream.complete_all()
    rig.manager.poll()
    assert seen == {"offload": ("offload",), "put": ("poll", "backup")}


def test_slot_indices_too_short_raise_and_change_nothing():
    rig = make_rig(page_size=2)
    req = rig.new_request("r", [1, 2], 8)
    decode_steps(rig, req, [3, 4, 5], poll=False)  # page 1 launched
    rig.manager.slot_indices_of = lambda r: torch.arange(3)
    rig.decode(req, 6)
    rig.decode(req, 7)
    with pytest.raises(InvalidArgumentError, match=r"^slot_indices_of\(rid='r'\): 3 slots, its first 6 tokens"):
        rig.manager.offload(req)
    assert rig.host_pool.used == 1 and rig.manager.offloaded_length(req) == 4


def test_mismatched_parts_are_rejected():
    rig = make_rig(page_size=4)
    args = (rig.kv_pool, rig.host_pool, rig.storage, PageHasher(page_size=4), rig.slots)
    with pytest.raises(
        InvalidArgumentError, match="^offload_stride: must be a positive multiple of page_size 4, got 6"
    ):
        OffloadManager(*args, offload_stride=6)
    with pytest.raises(InvalidArgumentError, match="^hasher: page_size 8 must equal"):
        OffloadManager(*args[:3], PageHasher(page_size=8), rig.slots)
    other = MemoryStore(LayoutFingerprint("rig", KVLayout(2, 2, 1, 8, "int32"), 4))
    with pytest.raises(InvalidArgumentError, match="^storage: its layout's head_dim 8 must equal the pool's 4"):
        OffloadManager(args[0], args[1], other, *args[3:])
    pool = HostPool(KVLayout(3, 2, 1, 4, torch.int32), num_pages=2, page_size=4)
    with pytest.raises(InvalidArgumentError, match="^host_pool: layout's num_layers 3 must equal the KV pool's 2"):
        OffloadManager(args[0], pool, *args[2:])
    with pytest.raises(InvalidArgumentError, match="^backend: must be one of"):
        OffloadManager(*args, backend="cuda")


def test_triton_backend_copies_the_same_pages(device):
    """One run through backend="auto" (Triton; the interpreter on CPU), multi-chunk host pool."""
    rig = make_rig(
        page_size=2,
        num_host_pages=6,
        buffer_pages=2,
        device=device,
        backend="auto",
        copy_stream=CopyStream(device),
        slot_generator=torch.Generator().manual_seed(3),
    )
    req = rig.new_request("r", [1, 2, 3], 12, cache_salt="t")
    for token in range(10, 17):
        rig.decode(req, token)
    assert rig.manager.offload(req)  # kv 9 tokens: pages 1..3 in one segment over two chunks
    # The launched copy's host pages: no public view of a copy in flight.
    assert len(rig.host_pool.locate(rig.manager.copier._copies[0].host_page_ids)) == 2
    rig.manager.finish(req)
    rig.manager.drain()
    assert rig.check_stored_pages(req) == (3, 3) and rig.released == [req]
    rig.copy_stream.close()


def test_decode_keys_match_the_reference_vectors(shared_dir):
    """The shared sglang-v1 vectors: a prompt with a partial last page, then decode; the keys the
    manager stores are the vectors' page hashes (the prompt's first page was prefill's)."""
    import json

    cases = json.loads((shared_dir / "reference" / "sglang_v1_vectors.json").read_text())
    checked = 0
    for case in cases:
        tokens, page_size = case["tokens"], case["page_size"]
        hashes = case["page_hashes"]
        if len(hashes) < 3 or page_size > 8:
            continue
        rig = make_rig(page_size=page_size)
        prompt = page_size + 1  # one full page and a partial one
        req = rig.new_request(
            "v", tokens[:prompt], len(tokens), extra_key=case["extra_key"], cache_salt=case["cache_salt"]
        )
        decode_steps(rig, req, tokens[prompt:] + [0], poll=False)  # the trailing 0 has no KV yet
        rig.manager.finish(req)
        rig.copy_stream.complete_all()
        rig.manager.poll()
        full = len(tokens) // page_size
        assert rig.storage.exists(hashes[:full]) == [True] * full, case["name"]  # page 0: the prefill side's
        checked += 1
    assert checked >= 4


def test_later_segment_completing_first_gets_keys_continuing_the_earlier_ones():
    rig = make_rig(page_size=2)
    req = rig.new_request("r", [1, 2, 3], 20, cache_salt="s")
    decode_steps(rig, req, [4, 5, 6, 7, 8], poll=False)  # kv 7: segments for pages 1, 2
    assert len(rig.copy_stream.pending) == 2
    rig.copy_stream.complete(1)  # page 2's copy first: its prior is page 1's key
    rig.manager.poll()
    chain = rig.chain(req)
    # Page 2 waits for page 1: a request's pages reach the store in chain order.
    assert rig.storage.exists(chain) == [True, False, False] and rig.host_pool.used == 2
    rig.copy_stream.complete(0)
    rig.manager.poll()
    assert rig.storage.exists(chain) == [True, True, True] and rig.check_stored_pages(req) == (2, 2)


def test_a_token_the_hash_scheme_rejects_fails_its_pages_without_stopping_poll():
    # An id above 2**63-1 is refused by offload itself now (test_token_arrays.py); a scheme
    # that rejects an id offload takes still fails only that run's pages, after its copy.
    reports = []
    rig = make_rig(page_size=2, on_storage_failure=lambda *args: reports.append(args))
    bad = rig.new_request("bad", [1, 2], 10)
    good = rig.new_request("good", [1, 2], 10)
    original_keys = rig.hasher.continue_keys

    def continue_keys(tokens, prior_hash):
        if 777 in list(tokens):
            raise InvalidArgumentError("tokens: this scheme takes no id 777")
        return original_keys(tokens, prior_hash)

    rig.hasher.continue_keys = continue_keys
    decode_steps(rig, bad, [3, 777, 4], poll=False)
    decode_steps(rig, good, [3, 4, 5], poll=False)
    rig.copy_stream.complete_all()
    assert rig.manager.poll() == 2
    assert len(reports) == 1 and reports[0][0] is bad and reports[0][1] == []
    metrics = rig.manager.metrics
    assert (metrics.pages_failed, metrics.pages_stored, metrics.host_pages_used) == (1, 1, 0)


def test_manager_backs_up_to_a_file_store(tmp_path):
    from kvstage.storage import FileStore

    store = FileStore(LayoutFingerprint("rig", KVLayout(2, 2, 1, 4, "int32"), 2), tmp_path)
    rig = make_rig(page_size=2, storage=store)
    req = rig.new_request("r", [1, 2, 3], 10, extra_key="lora")
    decode_steps(rig, req, [4, 5, 6, 7, 8, 9], poll=False)
    rig.manager.finish(req)
    rig.copy_stream.complete_all()
    rig.manager.poll()
    assert rig.check_stored_pages(req) == (3, 3) and len(list(tmp_path.iterdir())) == 4  # and the prefill side's page 0


def test_an_interrupted_poll_keeps_the_copies_it_did_not_handle():
    rig = make_rig(page_size=2)
    req = rig.new_request("r", [1, 2], 10)
    decode_steps(rig, req, [3, 4, 5, 6, 7], poll=False)  # two copies
    rig.copy_stream.complete_all()
    original_keys = rig.hasher.continue_keys
    calls = []

    def continue_keys(tokens, prior_hash):
        calls.append(tokens)
        if len(calls) == 1:
            raise KeyboardInterrupt  # not an Exception: the manager lets it through
        return original_keys(tokens, prior_hash)

    rig.hasher.continue_keys = continue_keys
    with pytest.raises(KeyboardInterrupt):
        rig.manager.poll()
    assert rig.manager.metrics.copies_in_flight == 1 and rig.host_pool.used == 1
    assert calls == [[3, 4]]  # the first copy's page was being keyed when the interrupt came
    assert rig.manager.poll() == 1
    # The interrupted page's key was never recorded, so the next copy's prior is keyed again first.
    assert [list(tokens) for tokens in calls] == [[3, 4], [3, 4], [5, 6]]
    # Handled, its host pages freed; its predecessor (the interrupted page) was never written,
    # so the chain-aware store refuses it and it counts failed, not lost.
    assert rig.host_pool.used == 0 and (rig.manager.metrics.pages_stored, rig.manager.metrics.pages_failed) == (0, 1)


def test_live_counters_equal_the_metrics_snapshot():
    rig = make_rig(page_size=2)
    req = rig.new_request("r", [1, 2], 10)
    assert (rig.manager.requests_live, rig.manager.copies_in_flight) == (0, 0)
    decode_steps(rig, req, [3, 4, 5, 6, 7], poll=False)  # two copies
    m = rig.manager.metrics
    assert (rig.manager.requests_live, rig.manager.copies_in_flight) == (m.requests_live, m.copies_in_flight) == (1, 2)


def test_offload_after_close_is_a_clear_error():
    """``offload`` after ``close`` raises naming close, launching nothing."""
    rig = make_rig(page_size=2, store_prompt=True, copy_stream=CopyStream("cpu"), store_workers=None)
    rig.manager.close()
    req = rig.new_request("a", STORED_PROMPT, 4)
    try:
        with pytest.raises(InvalidArgumentError, match="close"):
            rig.manager.offload(req)
    finally:
        rig.copy_stream.close()
    assert rig.manager.metrics.pages_launched == 0


@pytest.mark.parametrize("kind", ["strided", "offset", "int32"])
def test_slot_views_from_slot_indices_of_store_the_right_bytes(kind):
    """``slot_indices_of`` answering a strided view, a view at an offset, or int32: the stored pages
    hold the right tokens' bytes."""
    rig = make_rig(page_size=4, store_prompt=True, slot_generator=torch.Generator().manual_seed(1))
    req = rig.new_request("a", list(range(1, 18)), 8)
    row = rig.slots(req)
    if kind == "strided":
        view = torch.stack([torch.zeros_like(row), row, torch.zeros_like(row)], 1)[:, 1]
        assert not view.is_contiguous()
    elif kind == "offset":
        view = torch.cat([torch.tensor([999, 998, 997]), row])[3:]
    else:
        view = row.to(torch.int32)
    rig.manager.slot_indices_of = lambda r: view
    for token in range(100, 106):
        rig.decode(req, token)
        rig.manager.offload(req)
    req.done = True
    rig.manager.finish(req)
    rig.copy_stream.complete_all()
    rig.manager.drain()
    keys = rig.chain(req)
    page = torch.empty(rig.host_pool.page_shape, dtype=torch.int32)
    for index, key in enumerate(keys):
        assert rig.storage.get([key], [page]) == [True]
        assert torch.equal(page, rig.expected_page(req, index)), index
    assert rig.manager.metrics.pages_stored == len(keys) == 5


def test_two_requests_with_one_rid_keep_their_keys_and_releases_apart():
    """Two request objects with one rid (the first aborted with its copy in flight): their chains and
    releases stay apart."""
    rig = make_rig(page_size=2, store_prompt=True)
    old = rig.new_request("x", [1, 2, 3, 4, 5], 4)
    rig.manager.offload(old)
    rig.manager.abort(old)  # its gather is still in flight
    new = rig.new_request("x", [9, 8, 7, 6, 5], 4)
    rig.manager.offload(new)
    rig.copy_stream.complete_all()
    rig.manager.poll()
    assert rig.released == [old]
    new.done = True
    rig.manager.finish(new)
    rig.manager.drain()
    assert rig.released == [old, new]
    # an abort keeps what it launched (issue 17): both chains stored, apart
    assert rig.storage.exists(rig.chain(new)) == [True, True] and rig.storage.exists(rig.chain(old)) == [True, True]
    assert rig.chain(new) != rig.chain(old)
    m = rig.manager.metrics
    assert (m.pages_stored, m.pages_discarded) == (4, 0)


class _ShortAnswers(MemoryStore):
    """A backend that breaks the interface: ``exists`` or ``put`` answers fewer keys than asked."""

    def __init__(self, fingerprint, short: str) -> None:
        super().__init__(fingerprint, capacity_pages=1000)
        self.short = short

    def _exists(self, full_keys):
        answer = super()._exists(full_keys)
        return answer[:-1] if self.short == "exists" else answer

    def _put(self, full_keys, pages, full_prior_key=None):
        answer = super()._put(full_keys, pages, full_prior_key)
        return answer[:-1] if self.short == "put" else answer


@pytest.mark.parametrize("short", ["put"])  # backups ask put alone (it deduplicates); lookups: test_offload_load_path
def test_a_backend_answering_too_few_keys_fails_the_pages_instead_of_losing_them(short):
    """A backend whose ``put`` answers fewer keys than asked: the pages are counted failed (and the
    failure callback told), never lost from the counts."""
    fingerprint = LayoutFingerprint("rig", KVLayout(2, 2, 1, 4, "int32"), 4)
    failures = []
    rig = make_rig(
        page_size=4,
        offload_stride=8,
        storage=_ShortAnswers(fingerprint, short),
        on_storage_failure=lambda req, keys, error: failures.append((keys, error)),
    )
    req = rig.new_request("r", range(4), 16)
    for token in range(100, 110):  # 4 + 9 tokens with KV: one stride of 2 pages after the prompt
        rig.decode(req, token)
    assert rig.manager.offload(req)
    assert rig.manager.finish(req)
    rig.copy_stream.complete_all()
    rig.manager.poll()
    m = rig.manager.metrics
    assert m.pages_launched == 2
    # Every launched page ends exactly once; an answer the manager cannot trust is a failure.
    assert m.pages_stored + m.pages_deduplicated + m.pages_failed + m.pages_discarded == 2
    assert m.pages_failed == 2 and m.storage_failures == 1 and len(failures) == 1
    assert len(failures[0][0]) == 2 and failures[0][1] is not None
    assert rig.released == [req] and m.host_pages_used == 0


@pytest.mark.parametrize("action", ["abort", "finish"])
def test_a_failure_callback_that_ends_the_request_releases_it_once_and_poll_does_not_raise(action):
    """An ``on_storage_failure`` that aborts (or finishes) the request: the copy being handled is no
    longer in flight, so that call releases it, once, and ``poll`` handles the other request's copy
    without a KeyError."""
    fingerprint = LayoutFingerprint("rig", KVLayout(2, 2, 1, 4, "int32"), 4)
    rigs = []

    def on_failure(req, keys, error):
        getattr(rigs[0].manager, action)(req)

    rig = make_rig(page_size=4, storage=FlakyStore(fingerprint, fail=lambda key: True), on_storage_failure=on_failure)
    rigs.append(rig)
    req = rig.new_request("r", range(4), 16)
    other = rig.new_request("o", range(4), 16)
    for token in range(100, 106):
        rig.decode(req, token)
        rig.decode(other, token)
    assert rig.manager.offload(req) and rig.manager.offload(other)
    rig.copy_stream.complete_all()
    assert rig.manager.poll() == 2  # no KeyError; the other request's copy is handled too
    m = rig.manager.metrics
    assert rig.released == [req, other]  # each once, by the callback's own call
    assert m.releases == 2 and m.requests_live == 0 and m.host_pages_used == 0 and m.copies_in_flight == 0
    assert m.pages_failed == m.pages_launched == 2
