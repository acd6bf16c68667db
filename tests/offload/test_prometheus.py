"""kvstage.offload.prometheus: each metric reads its own counter, grows by what changed and is
never counted twice, its labels and arguments are checked, and close() keeps the last figures.
(The figures of a whole replay, over HTTP and in multiprocess mode: tests/replay/test_replay_metrics.py.)"""

from __future__ import annotations

import dataclasses
import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.offload.metrics import OffloadMetrics
from kvstage.offload.prometheus import METRICS, PrometheusExporter

from offload_rig import make_rig
from support import REPO_ROOT

# The test's own table: each counter's name and the OffloadMetrics or StorageStats field it is.
MANAGER_COUNTERS = {
    "pages_launched": "pages_launched",
    "pages_offloaded": "pages_offloaded",
    "offloaded_bytes": "bytes_offloaded",
    "pages_stored": "pages_stored",
    "pages_deduplicated": "pages_deduplicated",
    "pages_failed": "pages_failed",
    "pages_discarded": "pages_discarded",
    "pages_dropped": "pages_dropped",
    "storage_failures": "storage_failures",
    "copy_failures": "copy_failures",
    "offloads_rejected": "offloads_rejected",
    "releases": "releases",
    "retractions": "retractions",
    "callback_errors": "callback_errors",
    "lookups": "lookups",
    "pages_looked_up": "pages_looked_up",
    "pages_hit": "pages_hit",
    "prefetches": "prefetches",
    "pages_prefetched": "pages_prefetched",
    "pages_truncated": "pages_truncated",
    "prefetch_failures": "prefetch_failures",
    "loads": "loads",
    "pages_loaded": "pages_loaded",
    "loaded_bytes": "bytes_loaded",
    "load_failures": "load_failures",
}
STORE_COUNTERS = {
    "store_events_dropped": "events_dropped",
    "store_pages_evicted": "pages_evicted",
    "store_pages_removed": "pages_removed",
    "store_written_bytes": "bytes_put",
    "store_pages_read": "pages_read",
    "store_pages_missed": "pages_missed",
    "store_read_bytes": "bytes_got",
}
GAUGES = (
    "requests_live",
    "copies_in_flight",
    "writes_pending",
    "writes_parked",
    "pages_in_flight",
    "host_pages_used",
    "host_pages_high_water",
    "host_pages_capacity",
)


def scrape(registry) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }


def at(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


def set_distinct(rig, base: int) -> None:
    """Give every counter of the manager and its store its own value."""
    counters = rig.manager._counters  # the manager's live record, which ``metrics`` snapshots
    for index, field in enumerate(MANAGER_COUNTERS.values()):
        setattr(counters, field, base + index)
    for index, field in enumerate([*STORE_COUNTERS.values(), "events_stored", "events_evicted", "events_removed"]):
        setattr(rig.storage.stats, field, base + 100 + index)


def test_every_counter_and_gauge_is_in_the_tables():
    named = {f"kvstage_{name}_total" for name in (*MANAGER_COUNTERS, *STORE_COUNTERS)} | {
        f"kvstage_{name}" for name in GAUGES
    }
    named.add("kvstage_store_events_total")
    assert named == {spec.name for spec in METRICS if spec.kind != "histogram"}
    assert len(METRICS) == len({spec.name for spec in METRICS})


def test_each_metric_reads_its_own_counter_and_grows_by_what_changed():
    rig = make_rig()  # store_prompt=False: role "decode"
    registry = CollectorRegistry()
    with PrometheusExporter(rig.manager, registry=registry):
        set_distinct(rig, 10)
        first = scrape(registry)
        labels = {"store": "memory", "role": "decode"}
        for name, field in MANAGER_COUNTERS.items():
            assert at(first, f"kvstage_{name}_total", **labels) == getattr(rig.manager.metrics, field), name
        for name, field in STORE_COUNTERS.items():
            assert at(first, f"kvstage_{name}_total", **labels) == getattr(rig.storage.stats, field), name
        for kind in ("stored", "evicted", "removed"):
            assert at(first, "kvstage_store_events_total", kind=kind, **labels) == getattr(
                rig.storage.stats, f"events_{kind}"
            )
        metrics = rig.manager.metrics
        for name in GAUGES:
            assert at(first, f"kvstage_{name}", **labels) == getattr(metrics, name), name
        assert at(first, "kvstage_host_pages_capacity", **labels) == 16
        # A second scrape adds nothing; a change shows as itself.
        assert scrape(registry) == first
        # A counter moves: set on the manager's live record (``metrics`` is a copy, nothing public writes it).
        rig.manager._counters.pages_stored += 7
        rig.storage.stats.bytes_put += 3
        second = scrape(registry)
        assert (
            at(second, "kvstage_pages_stored_total", **labels) == at(first, "kvstage_pages_stored_total", **labels) + 7
        )
        assert (
            at(second, "kvstage_store_written_bytes_total", **labels)
            == at(first, "kvstage_store_written_bytes_total", **labels) + 3
        )


def test_a_stored_request_is_counted_and_its_copy_and_put_are_timed():
    rig = make_rig(store_prompt=True)
    registry = CollectorRegistry()
    exporter = PrometheusExporter(rig.manager, registry=registry)
    req = rig.new_request("a", list(range(12)), 1)  # 3 whole pages of 4
    rig.manager.finish(req)
    for _ in range(20):
        rig.copy_stream.complete_all()
        rig.manager.poll()
        if not rig.manager.requests_live:
            break
    samples = scrape(registry)
    labels = {"store": "memory", "role": "prefill_decode"}
    assert at(samples, "kvstage_pages_stored_total", **labels) == 3
    assert at(samples, "kvstage_store_written_bytes_total", **labels) == 3 * rig.storage.page_bytes
    assert at(samples, "kvstage_copy_seconds_count", direction="gather", **labels) == 1
    assert at(samples, "kvstage_copy_seconds_sum", direction="gather", **labels) == rig.manager.metrics.copy_seconds
    assert at(samples, "kvstage_store_put_seconds_count", **labels) == 1
    assert at(samples, "kvstage_store_put_seconds_sum", **labels) == rig.storage.stats.put_seconds
    exporter.close()
    # No public view of the listeners: the exporter must have removed its own.
    assert rig.manager.copier._result_listeners == () and rig.storage._timing_listeners == ()
    rig.manager._counters.pages_stored += 5  # after close: not published, the last figures stay
    assert at(scrape(registry), "kvstage_pages_stored_total", **labels) == 3
    exporter.close()  # idempotent


def test_exporters_of_one_registry_need_their_own_label_values():
    registry = CollectorRegistry()
    first, second = make_rig(), make_rig()
    PrometheusExporter(first.manager, registry=registry, labels={"rank": "0"})
    with pytest.raises(InvalidArgumentError, match=r"^labels: another exporter on this registry has the labels"):
        PrometheusExporter(second.manager, registry=registry, labels={"rank": "0"})
    with pytest.raises(InvalidArgumentError, match=r"^labels: must have the label names \['rank'\]"):
        PrometheusExporter(second.manager, registry=registry, labels={"tp": "1"})
    PrometheusExporter(second.manager, registry=registry, labels={"rank": "1"}, role="prefill")
    # Set on the live records: nothing public writes a counter.
    first.manager._counters.pages_hit, second.manager._counters.pages_hit = 4, 9
    samples = scrape(registry)
    assert at(samples, "kvstage_pages_hit_total", store="memory", role="decode", rank="0") == 4
    assert at(samples, "kvstage_pages_hit_total", store="memory", role="prefill", rank="1") == 9


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(role=""), InvalidArgumentError, "role: must be a non-empty str, got ''"),
        (dict(labels={"1x": "a"}), InvalidArgumentError, "labels: '1x' is not a Prometheus label name"),
        (dict(labels={"__x": "a"}), InvalidArgumentError, "labels: '__x' is not a Prometheus label name"),
        (dict(labels={"store": "a"}), InvalidArgumentError, "labels: 'store' is reserved"),
        (dict(labels={"rank": 0}), InvalidArgumentError, "labels: the value of 'rank' must be a str, got int"),
        (
            dict(sync_interval_s=0),
            InvalidArgumentError,
            "sync_interval_s: must be None or a number of seconds > 0, got 0",
        ),
        (
            dict(registry=object()),
            ArgumentTypeError,
            "registry: must be a prometheus_client CollectorRegistry or None, got object",
        ),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument(kwargs, error, message):
    rig = make_rig()
    with pytest.raises(error) as raised:
        PrometheusExporter(rig.manager, **{"registry": CollectorRegistry(), **kwargs})
    assert str(raised.value).startswith(message)
    # No public view of the listeners: the exporter must have removed its own.
    assert rig.manager.copier._result_listeners == () and rig.storage._timing_listeners == ()


def test_a_manager_is_required():
    with pytest.raises(ArgumentTypeError, match=r"^manager: must be a kvstage.offload.OffloadManager, got dict"):
        PrometheusExporter({}, registry=CollectorRegistry())


def test_every_field_of_the_manager_counters_is_exported():
    # A counter added to OffloadMetrics without a metric would go unseen: every int counter
    # but the snapshot's own gauges and the store events is in the test's table.
    fields = {f.name for f in dataclasses.fields(OffloadMetrics)}
    covered = (
        set(MANAGER_COUNTERS.values())
        | set(GAUGES)
        | {"store_events_stored", "store_events_evicted", "store_events_removed", "store_events_dropped"}
    )
    assert fields - covered == {"copy_seconds", "load_seconds"}  # the copy histograms' sums


def test_the_readme_table_lists_every_metric_once_with_its_type_and_labels():
    readme = (REPO_ROOT / "README.md").read_text()
    rows = re.findall(
        r"^\| `(kvstage_[a-z_]+)` \| (counter|gauge|histogram) \| ([^|]+) \| [^|]+ \|$", readme, flags=re.M
    )
    assert [(name, kind, [label.strip(" `") for label in labels.split(",")]) for name, kind, labels in rows] == [
        (spec.name, spec.kind, ["store", "role", *spec.labels]) for spec in METRICS
    ]
