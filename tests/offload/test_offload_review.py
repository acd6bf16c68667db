"""Edge cases found in review: storage layouts, misbehaving backends, torn FileStore pages."""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.hashing import PageHasher
from kvstage.kernels import KVPool
from kvstage.kv_layout import KVLayout
from kvstage.offload import HostPool, OffloadManager
from kvstage.storage import LayoutFingerprint, MemoryStore


def _pool_and_host():
    kv_pool = KVPool.from_stacked(torch.zeros((2, 2, 16, 1, 4), dtype=torch.int32))
    return kv_pool, HostPool.like(kv_pool, num_pages=4, page_size=4)


@pytest.mark.parametrize(
    "fingerprint, field",
    [
        (LayoutFingerprint("m", KVLayout(2, 2, 1, 4, "float32"), 4), "dtype"),  # same bytes, another dtype
        (LayoutFingerprint("m", KVLayout(4, 2, 1, 4, "int32"), 2), "num_layers"),  # same bytes: 4 layers x page 2
        (LayoutFingerprint("m", KVLayout(2, 2, 2, 2, "int32"), 4), "num_heads"),  # same bytes: 2 heads x dim 2
        (LayoutFingerprint("m", KVLayout(2, 1, 2, 4, "int32"), 4), "kv_parts"),  # same bytes: MLA-shaped
    ],
    ids=["dtype", "layers-and-page", "heads-and-dim", "parts"],
)
def test_a_storage_whose_layout_differs_from_the_pools_is_rejected(fingerprint, field):
    # Pages would be stored under another layout's prefix and read back as that layout.
    kv_pool, host_pool = _pool_and_host()
    assert fingerprint.page_bytes == host_pool.page_bytes
    with pytest.raises(InvalidArgumentError, match=rf"storage: .*{field}"):
        OffloadManager(kv_pool, host_pool, MemoryStore(fingerprint), PageHasher(page_size=4), lambda req: None)


def test_a_storage_with_the_pools_layout_is_accepted_under_a_dtype_alias():
    kv_pool = KVPool.from_stacked(torch.zeros((2, 2, 16, 1, 4), dtype=torch.float16))
    host_pool = HostPool.like(kv_pool, num_pages=4, page_size=4)
    storage = MemoryStore(LayoutFingerprint("m", KVLayout(2, 2, 1, 4, "half"), 4))
    OffloadManager(kv_pool, host_pool, storage, PageHasher(page_size=4), lambda req: None).close()


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
    from offload_rig import make_rig

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


@pytest.mark.parametrize("keep", [0, 40, 200], ids=lambda n: f"first-{n}-bytes")
def test_a_torn_file_store_page_is_not_reported_present_and_is_written_again(tmp_path, keep):
    # A power loss without fsync can leave a page's name with a short file. If exists() and
    # put() took the name for the page, the manager would deduplicate it forever: lost.
    from kvstage.storage import FileStore, PutStatus

    fingerprint = LayoutFingerprint("tiny/model", KVLayout(2, 2, 1, 4, "float32"), 2)
    key = "c" * 64
    page = torch.arange(32, dtype=torch.float32)
    store = FileStore(fingerprint, tmp_path)
    assert store.put([key], [page]) == [PutStatus.STORED]
    size = store.used_bytes
    path = store.path_of(key)
    path.write_bytes(path.read_bytes()[:keep])
    reopened = FileStore(fingerprint, tmp_path)
    assert reopened.exists([key]) == [False]
    assert reopened.put([key], [page]) == [PutStatus.STORED]
    into = torch.zeros(32)
    assert reopened.get([key], [into]) == [True] and torch.equal(into, page)
    assert reopened.used_bytes == size == path.stat().st_size


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_a_put_larger_than_the_capacity_never_reports_stored_a_page_it_evicted(tmp_path, kind):
    # STORED means "readable from now on": a page evicted by a later page of the same put must
    # not be reported STORED (the manager would count a page stored that storage does not hold).
    from kvstage.storage import FileStore, PutStatus

    fingerprint = LayoutFingerprint("tiny/model", KVLayout(2, 2, 1, 4, "float32"), 2)  # 128-byte pages
    keys = [c * 64 for c in "abc"]
    pages = [torch.full((32,), float(i)) for i in range(3)]
    if kind == "memory":
        store = MemoryStore(fingerprint, capacity_pages=2)
    else:
        probe = FileStore(fingerprint, tmp_path / "probe")
        probe.put(keys[:1], pages[:1])
        store = FileStore(fingerprint, tmp_path / "store", capacity_bytes=2 * probe.used_bytes)
    statuses = store.put(keys, pages)
    present = store.exists(keys)
    for key, status, here in zip(keys, statuses, present):
        assert (status is PutStatus.STORED) == here, (key[0], status, here)
    assert statuses[:2] == [PutStatus.STORED, PutStatus.STORED] and statuses[2] is PutStatus.FAILED
    # A later call still evicts for a new page, from the chain's tail (b), never its start (a).
    assert store.put([keys[2]], [pages[2]]) == [PutStatus.STORED]
    assert store.exists(keys) == [True, False, True]


def test_a_file_store_reopened_with_a_smaller_capacity_is_within_it_at_once(tmp_path):
    import os

    from kvstage.storage import FileStore

    fingerprint = LayoutFingerprint("tiny/model", KVLayout(2, 2, 1, 4, "float32"), 2)
    keys = [c * 64 for c in "abc"]
    store = FileStore(fingerprint, tmp_path)
    for age, key in enumerate(keys):
        store.put([key], [torch.full((32,), float(age))])
        os.utime(store.path_of(key), ns=(10**18 + age * 10**9,) * 2)  # a is the oldest
    one = store.used_bytes // 3
    reopened = FileStore(fingerprint, tmp_path, capacity_bytes=2 * one)
    assert reopened.used_bytes == 2 * one <= reopened.capacity_bytes
    assert reopened.exists(keys) == [False, True, True]
    assert sorted(os.listdir(tmp_path)) == sorted(reopened.file_name(key) for key in keys[1:])


@pytest.mark.parametrize("action", ["abort", "finish"])
def test_a_failure_callback_that_ends_the_request_releases_it_once_and_poll_does_not_raise(action):
    # An engine may react to a failed backup by aborting (or finishing) the request from inside
    # on_storage_failure; the copy being handled is no longer in flight, so that call releases.
    from offload_rig import FlakyStore, make_rig

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


@pytest.mark.parametrize(
    "slots",
    [list(range(32)), torch.arange(32, dtype=torch.float32), torch.arange(32).view(4, 8)],
    ids=["list", "float-tensor", "2-d"],
)
def test_bad_slot_indices_are_an_error_of_offload_itself(slots):
    # On CPU the gather runs on the copy thread: without a check here a wrong slot tensor would
    # only show up later as a failed copy (and a list as an AttributeError).
    from kvstage.errors import ArgumentTypeError

    from offload_rig import make_rig

    rig = make_rig(page_size=4)
    req = rig.new_request("r", range(4), 8)
    for token in range(100, 106):
        rig.decode(req, token)
    rig.manager.slot_indices_of = lambda r: slots
    with pytest.raises(ArgumentTypeError, match=r"^slot_indices_of\(rid='r'\): must be a 1-D int32/int64 tensor"):
        rig.manager.offload(req)
    # a call that raises tracks nothing new (issue 17)
    assert rig.host_pool.used == 0 and rig.manager.offloaded_length(req) is None and not rig.copy_stream.pending


def test_a_backlog_larger_than_the_free_host_pages_is_offloaded_in_the_strides_that_fit():
    # Before: offload() was all or nothing over the whole backlog, so a request whose backlog
    # outgrew the free host pages never progressed and finish() dropped all of it.
    from offload_rig import make_rig

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
    from offload_rig import make_rig

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
    from offload_rig import make_rig

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


def test_a_missing_hasher_is_named():
    from kvstage.errors import ArgumentTypeError

    kv_pool, host_pool = _pool_and_host()
    storage = MemoryStore(LayoutFingerprint("m", KVLayout(2, 2, 1, 4, "int32"), 4))
    with pytest.raises(ArgumentTypeError, match=r"^hasher: must be a kvstage.hashing.PageHasher .* got NoneType"):
        OffloadManager(kv_pool, host_pool, storage, None, lambda req: None)
