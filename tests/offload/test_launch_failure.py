"""A copy's launch that raises (on CUDA a kernel launch can fail; no check foresees it): a call
whose first run fails to launch changed nothing; a call whose later run fails keeps the runs
launched before it tracked, so their pages are stored and the release waits for their copies;
a finished request's waiting pages count as dropped only where they were not launched, and
the ``finish_backlog_pages`` limit counts only the pages still waiting."""

from __future__ import annotations

import pytest

from kvstage.offload.copy_stream import ManualCopyStream

from offload_rig import make_rig, settle

PAGE = 4


class LaunchFails(ManualCopyStream):
    """A manual copy stream whose ``fail_at``-th submit (1-based) raises, as a kernel launch can."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.calls = 0

    def submit(self, copy, *, keep=(), after=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("launch failed")
        return super().submit(copy, keep=keep, after=after)


def decoded(rig, rid, prompt, outputs):
    """A request with its prompt's KV and ``outputs`` sampled tokens (all but the last with KV)."""
    req = rig.new_request(rid, list(prompt), 16)
    for token in range(100, 100 + outputs):
        rig.decode(req, token)
    return req


def test_a_finish_whose_second_run_fails_keeps_the_first_run_until_its_pages_are_stored():
    rig = make_rig(page_size=PAGE, store_prompt=True, copy_stream=LaunchFails(2))
    req = decoded(rig, "a", range(8), 5)  # kv_length 12: two prompt pages (one run) and a decode page
    req.done = True
    with pytest.raises(RuntimeError, match="launch failed"):
        rig.manager.finish(req)
    metrics = rig.manager.metrics
    assert (metrics.pages_launched, metrics.pages_in_flight, metrics.host_pages_used) == (2, 2, 2)
    assert rig.manager.in_flight(req) == 1 and rig.manager.offloaded_length(req) == 8
    assert rig.released == []
    rig.manager.abort(req)
    assert rig.released == []  # the first run's copy is still in flight: its slots are held
    settle(rig)
    assert rig.released == [req]
    assert rig.missing_pages(req) == [2]  # pages 0 and 1 stored, byte for byte
    metrics = rig.manager.metrics
    assert (metrics.pages_stored, metrics.pages_in_flight, metrics.host_pages_used, metrics.pages_dropped) == (
        2,
        0,
        0,
        0,
    )


def test_an_offload_whose_first_run_fails_tracks_nothing_and_a_retry_stores_the_right_keys():
    rig = make_rig(page_size=PAGE, store_prompt=True, copy_stream=LaunchFails(1))
    req = decoded(rig, "a", range(8), 5)
    with pytest.raises(RuntimeError, match="launch failed"):
        rig.manager.offload(req)
    assert not rig.manager.is_tracked(req)
    metrics = rig.manager.metrics
    assert (metrics.pages_launched, metrics.host_pages_used) == (0, 0)
    assert rig.manager.offload(req)  # the next launch works
    req.done = True
    rig.manager.finish(req)
    settle(rig)
    assert rig.missing_pages(req) == []
    assert rig.manager.metrics.pages_stored == 3


def test_a_finish_whose_first_run_fails_keeps_its_pending_prefetch():
    rig = make_rig(page_size=PAGE, store_prompt=True, copy_stream=LaunchFails(1))
    req = decoded(rig, "a", range(8), 5)
    handle = rig.manager.prefetch(req)  # an empty store: nothing hit, still pending
    rig.manager.poll()
    req.done = True
    with pytest.raises(RuntimeError, match="launch failed"):
        rig.manager.finish(req)
    assert not handle.cancelled
    assert rig.manager.is_tracked(req) and rig.manager.in_flight(req) == 0
    assert rig.manager.metrics.pages_launched == 0
    assert rig.manager.finish(req)  # the same call again: the prefetch is cancelled, every page launched
    assert handle.cancelled
    settle(rig)
    assert rig.released == [req] and rig.missing_pages(req) == []


def test_waiting_pages_whose_second_run_fails_drop_only_the_pages_not_launched():
    rig = make_rig(page_size=PAGE, store_prompt=True, num_host_pages=4, copy_stream=LaunchFails(3))
    holder = decoded(rig, "holder", range(200, 216), 1)
    assert rig.manager.offload(holder)  # submit 1: four pages, the whole host pool, in flight
    req = decoded(rig, "a", range(8), 5)  # three whole pages with KV
    req.done = True
    assert rig.manager.finish(req)  # no host page free: all three wait
    assert rig.manager.metrics.pages_launched == 4
    rig.copy_stream.complete_all()
    rig.manager.poll()  # frees the holder's pages; the waiting ones launch: submit 2 (two prompt pages), submit 3 fails
    metrics = rig.manager.metrics
    assert (metrics.pages_launched, metrics.pages_dropped) == (4 + 2, 1)
    holder.done = True
    rig.manager.finish(holder)
    settle(rig)
    assert sorted(released.rid for released in rig.released) == ["a", "holder"]
    assert rig.missing_pages(req) == [2]
    metrics = rig.manager.metrics
    assert (metrics.pages_stored, metrics.pages_dropped, metrics.host_pages_used) == (4 + 2, 1, 0)


def test_the_backlog_limit_counts_only_the_pages_still_waiting_after_a_partial_launch():
    rig = make_rig(page_size=PAGE, store_prompt=True, num_host_pages=4, finish_backlog_pages=3)
    holder = rig.new_request("holder", list(range(200, 216)), 1)
    assert rig.manager.offload(holder, kv_length=8) and rig.manager.offload(
        holder, kv_length=16
    )  # two copies, the whole pool
    a = decoded(rig, "a", range(8), 5)  # three whole pages
    a.done = True
    assert rig.manager.finish(a)  # three wait: the limit
    rig.copy_stream.complete(0)
    rig.manager.poll()  # the holder's first copy frees two pages: two of a's launch, one still waits
    assert rig.manager.metrics.pages_launched == 4 + 2
    b = decoded(rig, "b", range(300, 308), 1)  # two whole pages
    b.done = True
    assert rig.manager.finish(b)  # 1 + 2 pages wait: within the limit
    c = decoded(rig, "c", range(400, 404), 1)
    c.done = True
    assert not rig.manager.finish(c)  # one more would pass it: dropped
    assert rig.manager.metrics.pages_dropped == 1
    holder.done = True
    rig.manager.finish(holder, kv_length=16)
    settle(rig)
    assert rig.missing_pages(a) == [] and rig.missing_pages(b) == []
    assert rig.manager.metrics.pages_stored == 4 + 3 + 2
