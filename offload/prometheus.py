"""kvstage's own counters as Prometheus metrics (``prometheus_client``), in its multiprocess mode too.

:class:`PrometheusExporter` publishes one :class:`~kvstage.offload.OffloadManager`'s counters
(:class:`~kvstage.offload.OffloadMetrics`) and its store's (:class:`~kvstage.storage.StorageStats`)
under the names of :data:`METRICS` (the README's table lists them), each labelled ``store``
(the store's tier: ``memory``, ``file``, ``mooncake``) and ``role`` (see :class:`PrometheusExporter`).

Counters and gauges are read from the manager when they are published, never counted twice:
in one process at each scrape (the exporter's collector reads the live counters and adds what
changed since the last read); in prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``
set before prometheus_client is first imported, as sglang and vLLM do) the process serving
``/metrics`` is another one, so a thread writes the changes to the multiprocess files every
``sync_interval_s``. Latencies are histograms observed where they are measured: each copy as
the copier's poll returns it, each store put and get as it returns; nothing else runs on the
hot path.
"""

from __future__ import annotations

import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, values

from kvstage.errors import ArgumentTypeError, InvalidArgumentError, require
from kvstage.offload.copier import CopyResult
from kvstage.offload.manager import OffloadManager

__all__ = ["LATENCY_BUCKETS", "METRICS", "MetricSpec", "PrometheusExporter", "multiprocess_mode"]

# Seconds: a page copy on CPU takes tens of microseconds, a Mooncake or file put of a long
# segment up to seconds.
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
BASE_LABELS = ("store", "role")
ROLE_PREFILL_DECODE = "prefill_decode"  # store_prompt=True: the manager stores prompt and decode pages
ROLE_DECODE = "decode"  # store_prompt=False: a prefill side stored the prompt; this one decode pages
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric.

    Attributes:
        name: the name as exposed (counters end in ``_total``; histograms add ``_bucket``,
            ``_sum``, ``_count``).
        kind: ``"counter"``, ``"gauge"`` or ``"histogram"``.
        labels: its label names beyond ``store``, ``role`` and the exporter's own ``labels``.
        source: where the value comes from: ``manager.<OffloadMetrics field>``,
            ``store.<StorageStats field>``, or what a histogram observes.
        help: the meaning, as the HELP line says it.
    """

    name: str
    kind: str
    labels: tuple[str, ...]
    source: str
    help: str


def _counter(name: str, field: str, help: str) -> MetricSpec:
    return MetricSpec(f"kvstage_{name}_total", "counter", (), f"manager.{field}", help)


def _store_counter(name: str, field: str, help: str) -> MetricSpec:
    return MetricSpec(f"kvstage_store_{name}_total", "counter", (), f"store.{field}", help)


def _gauge(name: str, field: str, help: str) -> MetricSpec:
    return MetricSpec(f"kvstage_{name}", "gauge", (), f"manager.{field}", help)


# Every metric, once. Pages are host pages of the manager's page size.
METRICS: tuple[MetricSpec, ...] = (
    # store path
    _counter("pages_launched", "pages_launched", "Pages whose device-to-host copy was launched."),
    _counter("pages_offloaded", "pages_offloaded", "Pages whose device-to-host copy completed without error."),
    _counter("offloaded_bytes", "bytes_offloaded", "Bytes of those copies."),
    _counter("pages_stored", "pages_stored", "Pages written to the store."),
    _counter("pages_deduplicated", "pages_deduplicated", "Pages the store held already (nothing written)."),
    _counter(
        "pages_failed",
        "pages_failed",
        "Pages whose copy, page keys or store write failed (reported to on_storage_failure).",
    ),
    _counter(
        "pages_discarded", "pages_discarded", "Pages retracted without keep_offloaded while copying (not written)."
    ),
    _counter(
        "pages_dropped",
        "pages_dropped",
        "Pages never launched: finish() found no host pages within finish_backlog_pages, or an abort or retract ended their wait.",
    ),
    _counter("storage_failures", "storage_failures", "Store writes (segments) with at least one failed page."),
    _counter("copy_failures", "copy_failures", "Device-to-host copies that raised."),
    _counter(
        "offloads_rejected",
        "offloads_rejected",
        "offload() calls that launched nothing because the host pool was full.",
    ),
    _counter("releases", "releases", "Requests released to the engine."),
    _counter("retractions", "retractions", "Requests retracted."),
    _counter("callback_errors", "callback_errors", "release, on_storage_failure or on_stored callbacks that raised."),
    # load path
    _counter("lookups", "lookups", "Lookups (match_prefix calls and prefetch lookups)."),
    _counter("pages_looked_up", "pages_looked_up", "Whole pages asked by lookups (the pages wanted)."),
    _counter("pages_hit", "pages_hit", "Leading pages the store held, of those asked."),
    _counter("prefetches", "prefetches", "Prefetches started."),
    _counter("pages_prefetched", "pages_prefetched", "Pages read from the store into host pages."),
    _counter(
        "pages_truncated", "pages_truncated", "Pages a prefetch's lookup hit but could not read for want of host pages."
    ),
    _counter(
        "prefetch_failures", "prefetch_failures", "Prefetch reads that raised or hit a hole before the lookup's end."
    ),
    _counter("loads", "loads", "Loads (host-to-device scatters) launched."),
    _counter("pages_loaded", "pages_loaded", "Pages scattered into device slots without error."),
    _counter("loaded_bytes", "bytes_loaded", "Bytes of those scatters."),
    _counter("load_failures", "load_failures", "Host-to-device scatters that failed."),
    # the store
    MetricSpec(
        "kvstage_store_events_total",
        "counter",
        ("kind",),
        "store.events_<kind>",
        "Store events recorded, by kind: stored, evicted (the store's own eviction), removed (clear() or a corrupt page).",
    ),
    _store_counter(
        "events_dropped", "events_dropped", "Store events a full event queue dropped before they were taken."
    ),
    _store_counter("pages_evicted", "pages_evicted", "Pages the store's own eviction dropped."),
    _store_counter("pages_removed", "pages_removed", "Pages clear() or a corrupt-page cleanup removed."),
    _store_counter("written_bytes", "bytes_put", "Bytes the store wrote (pages stored x page bytes)."),
    _store_counter("pages_read", "pages_read", "Pages the store read intact."),
    _store_counter(
        "pages_missed", "pages_missed", "Pages asked of a store read that it did not have or could not read."
    ),
    _store_counter("read_bytes", "bytes_got", "Bytes the store read."),
    # latencies
    MetricSpec(
        "kvstage_copy_seconds",
        "histogram",
        ("direction",),
        "each copy that completed without error",
        "Duration of each copy that completed without error, by direction: gather (device to host) or scatter (host to device); GPU time on CUDA.",
    ),
    MetricSpec(
        "kvstage_store_put_seconds",
        "histogram",
        (),
        "each store put",
        "Wall-clock time of each store put (one segment of a request's pages).",
    ),
    MetricSpec(
        "kvstage_store_get_seconds",
        "histogram",
        (),
        "each store get",
        "Wall-clock time of each store get (one prefetch read).",
    ),
    # gauges
    _gauge("requests_live", "requests_live", "Requests tracked and not released yet."),
    _gauge("copies_in_flight", "copies_in_flight", "Copies launched and not handled yet."),
    _gauge("writes_pending", "writes_pending", "Store writes running or waiting for their chain's prior page."),
    _gauge(
        "writes_parked", "writes_parked", "Of those, store writes waiting for their chain's prior page (prior_wait_s)."
    ),
    _gauge("pages_in_flight", "pages_in_flight", "Launched pages not ended yet (copying or being written)."),
    _gauge("host_pages_used", "host_pages_used", "Host pool pages in use."),
    _gauge("host_pages_high_water", "host_pages_high_water", "Most host pool pages in use at once."),
    _gauge("host_pages_capacity", "host_pages_capacity", "Host pool pages."),
)

_EVENT_KINDS = ("stored", "evicted", "removed")
# In multiprocess mode the files of every live process are combined: summed, but the high-water
# mark is the highest of them.
_GAUGE_MODES = {"kvstage_host_pages_high_water": "livemax"}


def multiprocess_mode() -> bool:
    """Whether prometheus_client runs in its multiprocess mode in this process (it decides at
    its first import, from ``PROMETHEUS_MULTIPROC_DIR``)."""
    return values.ValueClass is not values.MutexValue


class _Families:
    """The metric objects of one registry (or of none), shared by its exporters, each exporter
    being one set of label values; registered on the registry as one collector."""

    def __init__(self, extra_labels: tuple[str, ...]) -> None:
        self.extra_labels = extra_labels
        self.exporters: dict[tuple[str, ...], PrometheusExporter] = {}
        self.lock = threading.Lock()
        self.metrics: dict[str, Any] = {}
        for spec in METRICS:
            labelnames = (*BASE_LABELS, *extra_labels, *spec.labels)
            if spec.kind == "counter":
                self.metrics[spec.name] = Counter(spec.name, spec.help, labelnames, registry=None)
            elif spec.kind == "gauge":
                mode = _GAUGE_MODES.get(spec.name, "livesum")
                self.metrics[spec.name] = Gauge(spec.name, spec.help, labelnames, registry=None, multiprocess_mode=mode)
            else:
                self.metrics[spec.name] = Histogram(
                    spec.name, spec.help, labelnames, registry=None, buckets=LATENCY_BUCKETS
                )

    def describe(self) -> Iterator[Any]:
        for metric in self.metrics.values():
            yield from metric.describe()

    def collect(self) -> Iterator[Any]:
        with self.lock:
            exporters = list(self.exporters.values())
        for exporter in exporters:
            exporter.update()
        for metric in self.metrics.values():
            yield from metric.collect()


# One _Families per registry, and one for exporters registered nowhere (registry=None).
_families: "weakref.WeakKeyDictionary[Any, _Families]" = weakref.WeakKeyDictionary()
_unregistered: list[_Families] = []
_families_lock = threading.Lock()


def _families_of(registry: Any, extra_labels: tuple[str, ...]) -> _Families:
    with _families_lock:
        if registry is None:
            families = _unregistered[0] if _unregistered else None
        else:
            families = _families.get(registry)
        if families is None:
            families = _Families(extra_labels)
            if registry is None:
                _unregistered.append(families)
            else:
                registry.register(families)
                _families[registry] = families
        elif families.extra_labels != extra_labels:
            raise InvalidArgumentError(
                f"labels: must have the label names {list(families.extra_labels)} of the exporters already on this "
                f"registry (one metric has one set of label names), got {list(extra_labels)}"
            )
        return families


class PrometheusExporter:
    """Publishes an :class:`OffloadManager`'s counters and its store's as Prometheus metrics
    (:data:`METRICS`; the README's table), labelled ``store`` and ``role``.

    Single process: the metrics are on ``registry`` (default prometheus_client's ``REGISTRY``,
    which ``prometheus_client.start_http_server(port)`` serves) and read from the manager at
    each scrape. Multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set before prometheus_client's
    first import; the serving process reads the directory with
    ``prometheus_client.multiprocess.MultiProcessCollector``): a daemon thread writes the
    changes every ``sync_interval_s``, and :meth:`update` / :meth:`close` write them at once.
    Counters of several processes with the same labels are summed there; gauges too
    (``livesum``), but ``kvstage_host_pages_high_water`` is the highest (``livemax``).

    Args:
        manager: the :class:`OffloadManager` (read through ``metrics``, ``storage``,
            ``copier``, ``store_prompt``: the manager itself is not changed).
        registry: where the metrics are registered (a ``prometheus_client.CollectorRegistry``),
            or None: nowhere (multiprocess mode needs none in the writing process). Exporters of
            one registry share its metrics, each with its own label values.
        role: the ``role`` label; default from the manager: ``"prefill_decode"`` when it
            stores prompt and decode pages (``store_prompt=True``), ``"decode"`` when a
            prefill side stores the prompt (``store_prompt=False``). An engine may name its
            own (e.g. ``"prefill"``).
        labels: more constant labels, ``{name: value}`` (e.g. ``{"rank": "0"}``): every
            exporter of one registry must use the same names.
        sync_interval_s: seconds (> 0) between the thread's writes; default 1.0 in
            multiprocess mode, None otherwise (no thread: a scrape reads the manager).

    Raises:
        ArgumentTypeError: ``manager`` is not an :class:`OffloadManager`, or ``registry`` is
            neither None nor a registry.
        InvalidArgumentError: ``role`` is not a non-empty str; a label name is not a
            Prometheus label name, is reserved (``store``, ``role``, ``kind``, ``direction``,
            ``le``) or its value is not a str; the label names differ from those of the
            registry's other exporters; another live exporter of the registry has the same
            label values; ``sync_interval_s`` is not None or a number > 0.

    The ``kvstage_store_*`` metrics are the store object's own totals: a store object shared
    by several managers reports them under each manager's labels.

    Use as a context manager, or call :meth:`close` (before the manager's close, or after it:
    either way the last figures are published and stay).
    """

    def __init__(
        self,
        manager: OffloadManager,
        *,
        registry: Any = REGISTRY,
        role: str | None = None,
        labels: Mapping[str, str] | None = None,
        sync_interval_s: float | None = None,
    ) -> None:
        require(
            isinstance(manager, OffloadManager),
            "manager",
            lambda: f"must be a kvstage.offload.OffloadManager, got {type(manager).__name__}",
            ArgumentTypeError,
        )
        require(
            registry is None or callable(getattr(registry, "register", None)),
            "registry",
            lambda: f"must be a prometheus_client CollectorRegistry or None, got {type(registry).__name__}",
            ArgumentTypeError,
        )
        role = (ROLE_PREFILL_DECODE if manager.store_prompt else ROLE_DECODE) if role is None else role
        require(isinstance(role, str) and role != "", "role", lambda: f"must be a non-empty str, got {role!r}")
        labels = dict(labels or {})
        reserved = {*BASE_LABELS, "kind", "direction", "le"}
        for name, value in labels.items():
            require(
                isinstance(name, str) and _LABEL_NAME.match(name) is not None and not name.startswith("__"),
                "labels",
                lambda: f"{name!r} is not a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*, not starting with __)",
            )
            require(
                name not in reserved, "labels", lambda: f"{name!r} is reserved (the exporter sets {sorted(reserved)})"
            )
            require(
                isinstance(value, str),
                "labels",
                lambda: f"the value of {name!r} must be a str, got {type(value).__name__}",
            )
        if sync_interval_s is None and multiprocess_mode():
            sync_interval_s = 1.0
        require(
            sync_interval_s is None
            or (
                isinstance(sync_interval_s, (int, float))
                and not isinstance(sync_interval_s, bool)
                and sync_interval_s > 0
            ),
            "sync_interval_s",
            lambda: f"must be None or a number of seconds > 0, got {sync_interval_s!r}",
        )
        self.manager = manager
        self.storage = manager.storage
        self.store = str(getattr(manager.storage, "tier", "store"))
        self.role = role
        self.labels = {"store": self.store, "role": role, **labels}
        self._families = families = _families_of(registry, tuple(labels))
        values_key = tuple(self.labels.values())
        self._values_key = values_key
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._closed = False
        metrics = families.metrics
        self._children = {spec.name: metrics[spec.name].labels(*values_key) for spec in METRICS if not spec.labels}
        self._events = {kind: metrics["kvstage_store_events_total"].labels(*values_key, kind) for kind in _EVENT_KINDS}
        self._copy_seconds = {
            direction: metrics["kvstage_copy_seconds"].labels(*values_key, direction)
            for direction in ("gather", "scatter")
        }
        with families.lock:
            require(
                values_key not in families.exporters,
                "labels",
                lambda: (
                    f"another exporter on this registry has the labels {self.labels}: give each manager its own (e.g. labels={{'rank': '1'}})"
                ),
            )
            families.exporters[values_key] = self
        manager.copier.add_result_listener(self._copied)
        self.storage.add_timing_listener(self._timed)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if sync_interval_s is not None:
            self._thread = threading.Thread(
                target=self._sync_every, args=(float(sync_interval_s),), name="kvstage-prometheus", daemon=True
            )
            self._thread.start()

    def update(self) -> None:
        """Publish the counters now: each counter grows by what the manager's grew since the
        last update, each gauge is set. A scrape of the registry calls it; in multiprocess mode
        the thread does. Safe from any thread (it reads the manager's ``metrics`` snapshot)."""
        with self._lock:
            if self._closed:
                return
            self._publish()

    def close(self) -> None:
        """Publish a last time, stop the thread, stop observing latencies; the metrics stay
        with their last values. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._publish()
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.manager.copier.remove_result_listener(self._copied)
        self.storage.remove_timing_listener(self._timed)
        families = self._families
        with families.lock:
            if families.exporters.get(self._values_key) is self:
                del families.exporters[self._values_key]

    def __enter__(self) -> "PrometheusExporter":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _publish(self) -> None:
        counters = self.manager.metrics
        stats = self.storage.stats
        for spec in METRICS:
            if spec.labels or spec.kind == "histogram":
                continue
            owner, field = spec.source.split(".")
            value = getattr(counters if owner == "manager" else stats, field)
            if spec.kind == "gauge":
                self._children[spec.name].set(value)
            else:
                self._grow(spec.name, self._children[spec.name], value)
        for kind, child in self._events.items():
            self._grow(f"events_{kind}", child, getattr(stats, f"events_{kind}"))

    def _grow(self, key: str, child: Any, value: float) -> None:
        delta = value - self._last.get(key, 0)
        if delta > 0:  # the sources only grow; a counter never goes down
            child.inc(delta)
            self._last[key] = value

    def _copied(self, result: CopyResult) -> None:
        if result.ok:
            self._copy_seconds[result.direction].observe(result.seconds)

    def _timed(self, op: str, num_pages: int, seconds: float) -> None:
        self._children["kvstage_store_put_seconds" if op == "put" else "kvstage_store_get_seconds"].observe(seconds)

    def _sync_every(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.update()
