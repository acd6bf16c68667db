"""The offload manager's counters: one record, each counter defined once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["OffloadMetrics", "metrics_snapshot"]


@dataclass
class OffloadMetrics:
    """The manager's counters (pages are host pages of ``page_size`` tokens; bytes in bytes;
    seconds of copy time, GPU time on CUDA). :attr:`OffloadManager.metrics` is a snapshot.

    Every launched page is in flight or has ended exactly once::

        pages_launched == pages_in_flight + pages_stored + pages_deduplicated
                          + pages_failed + pages_discarded

    and every whole page that ``finish`` was asked to offload is launched or ``pages_dropped``
    (also when an abort or retract ends its wait for host pages).
    """

    # store path
    requests_live: int = 0  # request objects tracked (not released yet); gauge
    copies_in_flight: int = 0  # gathers and scatters launched and not polled yet; gauge
    writes_pending: int = 0  # segments whose store write runs on a worker thread (or waits for its prior page); gauge
    writes_parked: int = 0  # of those, the ones waiting for their chain's prior page (prior_wait_s); gauge
    pages_in_flight: int = 0  # launched pages not ended yet (copying or being written); gauge
    pages_launched: int = 0
    pages_offloaded: int = 0  # pages whose D2H copy completed without error
    bytes_offloaded: int = 0
    copy_seconds: float = 0.0  # summed durations of those copies
    pages_stored: int = 0  # written to storage now
    pages_deduplicated: int = 0  # storage had the key already
    pages_failed: int = 0  # copy, page keys or storage write failed; reported
    pages_discarded: int = 0  # retracted without keep_offloaded while copying; no write
    pages_dropped: int = (
        0  # never launched: finish() found no host pages within its limit, or an abort/retract ended their wait
    )
    storage_failures: int = 0  # store writes (segments) with at least one failed page
    copy_failures: int = 0  # copies that raised
    offloads_rejected: int = 0  # offload() launched nothing because the host pool was full
    releases: int = 0
    retractions: int = 0
    callback_errors: int = 0  # release/on_storage_failure/on_stored callbacks that raised (logged)
    # load path
    lookups: int = 0  # match_prefix calls and prefetch lookups
    pages_looked_up: int = 0  # whole pages asked
    pages_hit: int = 0  # leading pages the store held
    prefetches: int = 0
    pages_prefetched: int = 0  # leading pages read into host pages
    pages_truncated: int = 0  # pages a prefetch's lookup hit but could not read for want of host pages
    prefetch_failures: int = 0  # reads that raised or hit a hole before the lookup's end
    loads: int = 0
    pages_loaded: int = 0  # pages scattered into device slots without error
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    load_failures: int = 0
    # the store's events (kvstage.storage.events), read from its stats; totals since it opened
    store_events_stored: int = 0  # pages the store reported stored
    store_events_evicted: int = 0  # pages its own eviction dropped (Mooncake: those it saw gone)
    store_events_removed: int = 0  # pages clear() or a corrupt-page cleanup removed
    store_events_dropped: int = 0  # events its full queue dropped before take_events() took them
    # host pool; gauges
    host_pages_used: int = 0
    host_pages_high_water: int = 0
    host_pages_capacity: int = 0

    @property
    def d2h_gbps(self) -> float:
        """D2H throughput over copy time, in GB/s (1e9 bytes)."""
        return self.bytes_offloaded / self.copy_seconds / 1e9 if self.copy_seconds > 0 else 0.0

    @property
    def h2d_gbps(self) -> float:
        """H2D (load) throughput over copy time, in GB/s (1e9 bytes)."""
        return self.bytes_loaded / self.load_seconds / 1e9 if self.load_seconds > 0 else 0.0


def metrics_snapshot(counters: OffloadMetrics, host_pool: Any, store_stats: Any, **gauges: int) -> OffloadMetrics:
    """A copy of ``counters`` with the gauges read now: ``gauges`` (the manager's
    ``requests_live``, ``copies_in_flight``, ``writes_pending``, ``writes_parked``), the host
    pool's pages (``used``, ``high_water``, ``capacity``) and the store's event counts
    (``store_stats``: the store's :class:`~kvstage.storage.backend.StorageStats`)."""
    return dataclasses.replace(
        counters,
        host_pages_used=host_pool.used,
        host_pages_high_water=host_pool.high_water,
        host_pages_capacity=host_pool.capacity,
        store_events_stored=store_stats.events_stored,
        store_events_evicted=store_stats.events_evicted,
        store_events_removed=store_stats.events_removed,
        store_events_dropped=store_stats.events_dropped,
        **gauges,
    )
