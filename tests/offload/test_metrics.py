"""``metrics_snapshot``: the counters with the gauges read now (host pool, store, manager)."""

from __future__ import annotations

from kvstage.offload.metrics import OffloadMetrics, metrics_snapshot

from offload_rig import make_rig


def test_the_snapshot_copies_the_counters_and_reads_the_gauges():
    rig = make_rig(num_host_pages=16)
    try:
        rig.manager.offload(rig.new_request("a", list(range(9)), 2))  # two prompt pages stored
        rig.manager.drain()
        host_page_ids = rig.host_pool.alloc(5)
        rig.host_pool.free(host_page_ids[:2])  # used 3, high water 5
        counters = OffloadMetrics(pages_stored=7)
        snapshot = metrics_snapshot(
            counters,
            rig.host_pool,
            rig.storage.stats,
            requests_live=2,
            copies_in_flight=1,
            writes_pending=4,
            writes_parked=3,
        )
        assert (snapshot.host_pages_used, snapshot.host_pages_high_water, snapshot.host_pages_capacity) == (3, 5, 16)
        assert (snapshot.requests_live, snapshot.copies_in_flight, snapshot.writes_pending, snapshot.writes_parked) == (
            2,
            1,
            4,
            3,
        )
        assert snapshot.pages_stored == 7 and snapshot.store_events_stored == 2 and snapshot.store_events_evicted == 0
        assert snapshot is not counters and counters.host_pages_used == 0  # the live record is not changed
    finally:
        rig.manager.close()
