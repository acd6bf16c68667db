"""kvstage's Prometheus metrics after a replay hold the replay's own figures: scraped from the
registry, from ``kvstage replay --metrics-file``, over HTTP, and in multiprocess mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from kvstage.cli import build_parser
from kvstage.offload.prometheus import METRICS

from replay_helpers import PAGE_BYTES, run_in_process, tiny_trace

LABELS = {"store": "memory", "role": "prefill_decode"}
# Each counter and gauge, and the report field (or, where the report has none, the manager's
# counter of the run, which the report is built from) that must equal it: the test's own table.
FROM_REPORT = {
    "kvstage_pages_launched_total": "pages_launched",
    "kvstage_pages_offloaded_total": "pages_offloaded",
    "kvstage_offloaded_bytes_total": "bytes_offloaded",
    "kvstage_pages_stored_total": "pages_stored",
    "kvstage_pages_deduplicated_total": "pages_deduplicated",
    "kvstage_pages_failed_total": "pages_failed",
    "kvstage_pages_dropped_total": "pages_dropped",
    "kvstage_offloads_rejected_total": "offloads_rejected",
    "kvstage_pages_looked_up_total": "pages_looked_up",
    "kvstage_pages_hit_total": "pages_hit",
    "kvstage_prefetch_failures_total": "prefetch_failures",
    "kvstage_pages_loaded_total": "pages_loaded",
    "kvstage_loaded_bytes_total": "bytes_loaded",
    "kvstage_load_failures_total": "load_failures",
    "kvstage_store_pages_evicted_total": "storage_pages_evicted",
    "kvstage_store_written_bytes_total": "stored_bytes",
    "kvstage_host_pages_high_water": "host_pool_high_water_pages",
    "kvstage_host_pages_capacity": "host_pool_capacity_pages",
}
FROM_RUN_METRICS = {
    "kvstage_pages_discarded_total": "pages_discarded",
    "kvstage_storage_failures_total": "storage_failures",
    "kvstage_copy_failures_total": "copy_failures",
    "kvstage_releases_total": "releases",
    "kvstage_retractions_total": "retractions",
    "kvstage_callback_errors_total": "callback_errors",
    "kvstage_lookups_total": "lookups",
    "kvstage_prefetches_total": "prefetches",
    "kvstage_pages_prefetched_total": "pages_prefetched",
    "kvstage_pages_truncated_total": "pages_truncated",
    "kvstage_loads_total": "loads",
    "kvstage_store_events_dropped_total": "store_events_dropped",
    "kvstage_requests_live": "requests_live",
    "kvstage_copies_in_flight": "copies_in_flight",
    "kvstage_writes_pending": "writes_pending",
    "kvstage_writes_parked": "writes_parked",
    "kvstage_pages_in_flight": "pages_in_flight",
    "kvstage_host_pages_used": "host_pages_used",
}
FROM_STORE_STATS = {  # the store's counters at the end of the run (not in the report)
    "kvstage_store_pages_removed_total": "pages_removed",
    "kvstage_store_pages_read_total": "pages_read",
    "kvstage_store_pages_missed_total": "pages_missed",
    "kvstage_store_read_bytes_total": "bytes_got",
}
# A store of 40 pages: the tiny trace's 110 distinct pages overflow it, so pages are evicted
# and writes fail; every counter the replay can move moves. One request at a time: its hits
# do not depend on when the writes before it land.
SMALL_STORE = f"memory:{PAGE_BYTES * 40}"


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a scrape, parsed by prometheus_client."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(scrape: dict, name: str, **extra: str) -> float:
    return scrape[(name, tuple(sorted({**LABELS, **extra}.items())))]


def expected(report: dict, run_metrics, store_stats) -> dict[str, float]:
    figures = {name: report[field] for name, field in FROM_REPORT.items()}
    figures.update({name: getattr(run_metrics, field) for name, field in FROM_RUN_METRICS.items()})
    figures.update({name: getattr(store_stats, field) for name, field in FROM_STORE_STATS.items()})
    for kind in ("stored", "evicted", "removed"):
        figures[f"kvstage_store_events_total[{kind}]"] = getattr(run_metrics, f"store_events_{kind}")
    return figures


def scraped(scrape: dict) -> dict[str, float]:
    figures = {name: value(scrape, name) for name in (*FROM_REPORT, *FROM_RUN_METRICS, *FROM_STORE_STATS)}
    for kind in ("stored", "evicted", "removed"):
        figures[f"kvstage_store_events_total[{kind}]"] = value(scrape, "kvstage_store_events_total", kind=kind)
    return figures


def test_the_tables_name_every_counter_and_gauge_once():
    named = [*FROM_REPORT, *FROM_RUN_METRICS, *FROM_STORE_STATS, "kvstage_store_events_total"]
    assert len(set(named)) == len(named)
    assert sorted(named) == sorted(spec.name for spec in METRICS if spec.kind != "histogram")


def test_a_scrape_after_a_replay_holds_the_report_figures(tmp_path):
    registry = CollectorRegistry()
    metrics_file = tmp_path / "metrics" / "replay.prom"
    report, engine = run_in_process(
        tiny_trace(), storage=SMALL_STORE, max_running=1, metrics_registry=registry, metrics_file=str(metrics_file)
    )
    try:
        store_stats = engine.storage.stats
        at_run_end = samples(metrics_file.read_text())
        after_verify = samples(generate_latest(registry).decode())
    finally:
        engine.close()
    assert (
        report["pages_failed"] > 0 and report["storage_pages_evicted"] > 0 and report["pages_hit"] > 0
    )  # the figures move
    # The file: the end of the run, as the report.
    want = expected(report, engine.run_metrics, store_stats)
    got = scraped(at_run_end)
    # The store's read counters also count verification's reads, made after the file.
    for name in FROM_STORE_STATS:
        want.pop(name), got.pop(name)
    assert got == want
    gather_sum = value(at_run_end, "kvstage_copy_seconds_sum", direction="gather")
    assert gather_sum == pytest.approx(report["copy_seconds"], rel=1e-9, abs=1e-12)
    assert value(at_run_end, "kvstage_copy_seconds_sum", direction="scatter") == pytest.approx(
        report["load_seconds"], rel=1e-9, abs=1e-12
    )
    # One put per segment written; a segment after one whose write failed fails without a put.
    puts = value(at_run_end, "kvstage_store_put_seconds_count")
    assert 0 < puts <= value(at_run_end, "kvstage_copy_seconds_count", direction="gather") <= report["pages_launched"]
    # The registry after verification: the store path as the report; the loads with verification's.
    assert value(after_verify, "kvstage_pages_stored_total") == report["pages_stored"]
    assert value(after_verify, "kvstage_pages_failed_total") == report["pages_failed"]
    assert value(after_verify, "kvstage_loaded_bytes_total") == report["bytes_loaded"] + report["verify_bytes_loaded"]
    assert value(after_verify, "kvstage_store_read_bytes_total") == store_stats.bytes_got
    assert value(after_verify, "kvstage_store_pages_read_total") == store_stats.pages_read
    assert value(after_verify, "kvstage_store_get_seconds_sum") == pytest.approx(store_stats.get_seconds, rel=1e-9)
    assert value(after_verify, "kvstage_store_put_seconds_sum") == pytest.approx(store_stats.put_seconds, rel=1e-9)


def test_a_scrape_over_http_holds_the_report_figures():
    registry = CollectorRegistry()
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        report, engine = run_in_process(tiny_trace(), max_running=1, metrics_registry=registry)
        engine.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=30) as answer:
            scrape = samples(answer.read().decode())
    finally:
        server.shutdown()
        thread.join()
    assert report["pages_stored"] > 0 and report["pages_hit"] > 0
    assert value(scrape, "kvstage_pages_stored_total") == report["pages_stored"]
    assert value(scrape, "kvstage_pages_deduplicated_total") == report["pages_deduplicated"]
    assert value(scrape, "kvstage_pages_hit_total") > report["pages_hit"]  # verification's lookups hit too
    assert value(scrape, "kvstage_store_written_bytes_total") == report["stored_bytes"]
    assert value(scrape, "kvstage_loaded_bytes_total") == report["bytes_loaded"] + report["verify_bytes_loaded"]
    assert value(scrape, "kvstage_host_pages_used") == 0


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvstage", "replay", "--no-progress", *args], capture_output=True, text=True, timeout=300
    )


def test_the_metrics_file_of_kvstage_replay_holds_its_json_report(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": r.timestamp,
                    "input_length": r.input_length,
                    "output_length": r.output_length,
                    "hash_ids": list(r.hash_ids),
                }
            )
            + "\n"
            for r in tiny_trace()
        )
    )
    result = run_cli(
        str(trace),
        "--page-size",
        "16",
        "--layers",
        "1",
        "--heads",
        "1",
        "--head-dim",
        "8",
        "--dtype",
        "float16",
        "--max-running",
        "1",
        "--backend",
        "torch",
        "--storage",
        f"file:{tmp_path / 'pages'}",
        "--json",
        str(tmp_path / "report.json"),
        "--metrics-file",
        str(tmp_path / "replay.prom"),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    scrape = samples((tmp_path / "replay.prom").read_text())
    labels = {"store": "file", "role": "prefill_decode"}
    for name, field in FROM_REPORT.items():
        assert scrape[(name, tuple(sorted(labels.items())))] == report[field], name
    assert report["pages_hit"] > 0 and report["pages_stored"] > 0


def test_kvstage_replay_refuses_a_metrics_port_out_of_range(capsys):
    args = build_parser().parse_args(["replay", "--requests", "1", "--no-progress", "--metrics-port", "70000"])
    assert args.handler(args) == 2
    assert (
        "kvstage replay: error: --metrics-port: must be a TCP port in [0, 65535], got 70000" in capsys.readouterr().err
    )


def test_kvstage_replay_says_where_a_busy_metrics_port_is(capsys):
    server, thread = start_http_server(0, addr="127.0.0.1", registry=CollectorRegistry())
    try:
        args = build_parser().parse_args(
            ["replay", "--requests", "1", "--no-progress", "--metrics-port", str(server.server_port)]
        )
        assert args.handler(args) == 2
    finally:
        server.shutdown()
        thread.join()
    assert (
        f"kvstage replay: error: --metrics-port: cannot serve on 127.0.0.1:{server.server_port}: "
        in capsys.readouterr().err
    )


CHILD = textwrap.dedent("""
    import json, os, sys, time
    import torch
    from kvstage.offload.prometheus import PrometheusExporter, multiprocess_mode
    from kvstage.replay.engine import ReplayConfig, ReplayEngine
    from kvstage.replay.models import resolve_model
    from kvstage.replay.report import build_report
    from kvstage.replay.trace import synthetic_trace
    from kvstage.replay.verify import VerifyResult

    torch.set_num_threads(1)
    assert multiprocess_mode()
    model = resolve_model(None, layers=1, heads=1, head_dim=8, dtype="float16")
    engine = ReplayEngine(ReplayConfig(model=model, page_size=16, max_running=2, backend="torch", seed=int(sys.argv[1])), synthetic_trace(4, seed=int(sys.argv[1])))
    exporter = PrometheusExporter(engine.manager, registry=None, sync_interval_s=0.05)
    engine.run()
    report = build_report(engine, VerifyResult(), trace_name="t", elapsed_s=0.0)
    json.dump(report, open(sys.argv[2], "w"))
    if sys.argv[3] == "close":
        exporter.close()
    else:  # leave it to the thread, then exit with no cleanup at all
        time.sleep(0.5)
        os._exit(0)
    engine.close()
""")


def test_multiprocess_mode_sums_the_processes_figures(tmp_path):
    from prometheus_client.multiprocess import MultiProcessCollector

    metrics_dir = tmp_path / "multiproc"
    metrics_dir.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    paths = [tmp_path / "report0.json", tmp_path / "report1.json"]
    children = [  # at once: two processes writing one directory
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(seed), str(paths[seed]), ending],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed, ending in ((0, "close"), (1, "exit"))
    ]
    for child in children:
        _, stderr = child.communicate(timeout=300)
        assert child.returncode == 0, stderr
    reports = [json.loads(path.read_text()) for path in paths]
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(metrics_dir))
    scrape = samples(generate_latest(registry).decode())
    assert all(r["pages_stored"] > 0 for r in reports)
    for name, field in FROM_REPORT.items():
        if name == "kvstage_host_pages_high_water":  # livemax: the highest process's
            assert value(scrape, name) == max(r[field] for r in reports)
        else:
            assert value(scrape, name) == sum(r[field] for r in reports), name
    assert value(scrape, "kvstage_copy_seconds_sum", direction="gather") == pytest.approx(
        sum(r["copy_seconds"] for r in reports), rel=1e-9
    )
