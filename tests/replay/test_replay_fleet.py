"""``kvstage replay --engines N``: engine processes on one store, the router's policies and index,
an engine killed mid-run, the local tier, the KV events' wire format, a bounded store's
evictions, Dynamo's standalone KV indexer as the router's index (it binds 0.0.0.0: run inside the
network namespace, ``bash tools/in-netns.sh``)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from kvstage.cli import main
from kvstage.errors import BackendUnavailableError, InvalidArgumentError
from kvstage.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, block_hash
from kvstage.replay import command, dynamo_index
from kvstage.replay.engine import ReplayConfig
from kvstage.replay.fleet import DEFAULT_LOCAL_PAGES, Fleet, FleetConfig
from kvstage.replay.fleet_engine import EvictionLog, read_eviction_log, refused_for_room
from kvstage.replay.local_tier import LocalTier
from kvstage.replay.models import resolve_model
from kvstage.replay.prefix_index import PrefixIndex
from kvstage.replay.router import Router
from kvstage.replay.trace import multi_tenant_trace, synthetic_trace
from kvstage.storage import LayoutFingerprint, MemoryStore, PutStatus

from support import skip_missing

TINY = resolve_model(None, layers=1, heads=1, head_dim=8, dtype="float16")


def _config(storage: str) -> ReplayConfig:
    return ReplayConfig(model=TINY, page_size=16, max_running=3, backend="torch", storage=storage)


def _check_clean(report, n, *, rewritable=True):
    assert report["requests_completed"] == report["requests"] == n
    assert report["lost"] == 0 and report["mismatched"] == 0
    assert report["pages_failed"] == 0
    # Every whole page of every request is in the shared store, whole (checked byte for byte),
    # or, where the store cannot take a page a dead writer had started (Mooncake), absent.
    absent = report["absent_killed_writes"] + report["unreachable"]
    assert report["pages_stored"] + absent == report["verify_pages_checked"] > 0
    if rewritable:  # a file store: the survivors stored every page the killed engine had not
        assert absent == 0
    assert len(report["timeline"]) == n
    assert 0.0 < report["fleet_hit_rate"] < 1.0
    assert report["event_batches"] > 0 and report["event_gaps"] == 0


def test_two_engines_on_a_file_store_survive_a_kill(tmp_path):
    requests = synthetic_trace(24, seed=3)
    fleet = FleetConfig(engines=2, policy="kv", kill_at=8, local_pages=64)
    report = Fleet(_config(f"file:{tmp_path / 'store'}"), requests, fleet).run()
    _check_clean(report, 24)
    kill = report["kill"]
    assert kill["after_requests"] == 8 and kill["engine"] in (0, 1)
    assert kill["rerouted"] == len(kill["rerouted_orders"]) >= 1  # the busiest engine had unfinished requests
    finished_on = {order: engine for _, order, engine, _, _ in report["timeline"]}
    assert sorted(finished_on) == list(range(24))
    assert all(finished_on[order] != kill["engine"] for order in kill["rerouted_orders"])  # on the survivor
    assert report["local_pages_read"] + report["store_pages_read"] > 0
    # The router heard both: the managers' STORAGE pages and the local tiers' CPU pages.
    assert report["index_stored_pages"] > 0 and report["index_local_pages"] > 0


def test_the_command_line_runs_each_policy_on_its_own_store(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    code = main(
        [
            "replay",
            "--requests",
            "10",
            "--layers",
            "1",
            "--heads",
            "1",
            "--head-dim",
            "8",
            "--page-size",
            "16",
            "--max-running",
            "2",
            "--backend",
            "torch",
            "--no-progress",
            "--storage",
            f"file:{tmp_path / 'store'}",
            "--engines",
            "2",
            "--router",
            "round-robin,random",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    reports = json.loads(out.read_text())["policies"]
    assert [r["policy"] for r in reports] == ["round-robin", "random"]
    assert [r["storage"] for r in reports] == [f"file:{tmp_path / 'store'}/{p}" for p in ("round-robin", "random")]
    for report in reports:
        _check_clean(report, 10)
    # Round-robin alternates: the first two requests went to engines 0 and 1.
    assert "fleet prefix hit rate" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--storage", "memory"], "--storage: --engines needs a store processes share"),
        (["--router", "nearest"], "--router: unknown policy 'nearest'"),
        (["--router", "kv,kv"], "--router: a policy appears twice"),
        (["--kill-engine-at", "10"], "--kill-engine-at: must be a request count in [1, 9]"),
        (["--engines", "0"], "--engines: must be >= 1"),
        (["--local-pages", "-1"], "--local-pages: must be >= 0"),
        (["--metrics-file", "x.prom"], "--metrics-file: not available with --engines"),
        (["--multi-tenant", "0"], "--multi-tenant: must be >= 1"),
    ],
)
def test_bad_fleet_options_are_named_before_anything_runs(tmp_path, capsys, extra, message):
    args = ["replay", "--requests", "10", "--no-progress", "--storage", f"file:{tmp_path / 's'}", "--engines", "2"]
    assert main(args + extra) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_the_kill_needs_a_survivor():
    with pytest.raises(InvalidArgumentError, match="--kill-engine-at: needs --engines >= 2"):
        Fleet(_config("file:/nonexistent"), synthetic_trace(4), FleetConfig(engines=1, kill_at=2))


def test_the_default_local_tier_is_the_fleet_default():
    assert command.DEFAULT_LOCAL_PAGES == DEFAULT_LOCAL_PAGES


KEYS = ["ab" * 24 + f"{i:016x}" for i in range(1, 6)]  # a chain of five page keys
HASHES = [block_hash(k) for k in KEYS]


def _batch(events):
    return KVEventBatch(time.time(), events)


def block_stored(keys, parent, tokens, block_size, medium, lora_name):
    return BlockStored(
        [block_hash(k) for k in keys], parent and block_hash(parent), tokens, block_size, lora_name, medium
    )


def block_removed(keys, medium):
    return BlockRemoved([block_hash(k) for k in keys], medium)


def test_the_index_matches_local_prefixes_and_forgets_them_on_a_restart():
    index = PrefixIndex(3)
    index.apply(1, 0, _batch([block_stored(KEYS[:3], None, list(range(48)), 16, "CPU", None)]))
    index.apply(2, 0, _batch([block_stored(KEYS[:1], None, list(range(16)), 16, "GPU", None)]))
    index.apply(0, 0, _batch([block_stored(KEYS, None, list(range(80)), 16, "STORAGE", None)]))
    assert [index.local_match(e, HASHES) for e in range(3)] == [0, 3, 1]
    assert index.stored_match(HASHES) == 5  # the shared store: every engine's
    index.apply(1, 1, _batch([block_removed(KEYS[1:2], "CPU")]))
    assert index.local_match(1, HASHES) == 1  # a chain breaks at its first missing page
    index.apply(1, 3, _batch([]))
    assert index.gaps == [0, 2 - 1, 0]
    index.apply(1, 0, _batch([]))  # its sequence went back: a restarted engine holds nothing
    assert index.resets[1] == 1 and index.local_match(1, HASHES) == 0
    assert index.stored_match(HASHES) == 5  # stored pages outlive the engine that wrote them
    index.apply(2, 1, _batch([AllBlocksCleared()]))
    assert index.local_match(2, HASHES) == 0
    assert len(index.lags_s) == 7 and all(lag >= 0 for lag in index.lags_s)


def test_the_kv_router_prefers_the_longest_local_prefix_then_the_least_loaded():
    router = Router("kv", 3, load_slack=4)
    router.index.apply(2, 0, _batch([block_stored(KEYS[:2], None, list(range(32)), 16, "CPU", None)]))
    router.index.apply(0, 0, _batch([block_stored(KEYS, None, list(range(80)), 16, "STORAGE", None)]))
    assert router.pick(HASHES, [0, 1, 2], [0, 0, 3]) == 2
    assert router.pick(HASHES, [0, 1], [1, 0, 0]) == 1  # engine 2 not live; no local prefix: least loaded
    assert router.pick(HASHES, [0, 1, 2], [0, 1, 4]) == 0  # engine 2 four above the least loaded: passed over
    # A request routed to engine 1 and not finished: its pages count there before any event.
    router.index.route(1, HASHES[:3])
    assert router.index.local_match(1, HASHES) == 3
    assert router.pick(HASHES, [0, 1, 2], [0, 1, 1]) == 1
    router.index.finish(1, HASHES[:3])
    assert router.index.local_match(1, HASHES) == 0
    router.index.route(1, HASHES[:3])
    router.index.forget_local(1)  # it died: what it was computing is gone too
    assert router.index.local_match(1, HASHES) == 0
    rr = Router("round-robin", 3)
    assert [rr.pick(HASHES, [0, 2], [0, 0, 0]) for _ in range(4)] == [0, 2, 0, 2]
    picks = {Router("random", 3, seed=s).pick(HASHES, [0, 1, 2], [0, 0, 0]) for s in range(20)}
    assert picks == {0, 1, 2}
    with pytest.raises(InvalidArgumentError, match="--router: unknown policy"):
        Router("nearest", 2)


def _fingerprint(page_bytes_tokens=4):
    pool = torch.zeros(page_bytes_tokens * 2, 1, 8, dtype=torch.float16)
    from kvstage.kernels import KVPool

    return LayoutFingerprint.of(KVPool.mha([pool], [pool.clone()]), page_size=page_bytes_tokens, model_id="t")


def test_the_local_tier_serves_its_pages_and_reports_what_enters_and_leaves():
    fingerprint = _fingerprint()
    inner = MemoryStore(fingerprint, capacity_bytes=1 << 20)
    tier = LocalTier(inner, capacity_pages=2)
    pages = [torch.full((fingerprint.page_bytes,), i, dtype=torch.uint8) for i in range(3)]
    assert tier.put(KEYS[:3], pages) == [PutStatus.STORED] * 3
    assert tier.take_changes() == [
        ("stored", KEYS[0]),
        ("stored", KEYS[1]),
        ("stored", KEYS[2]),
        ("removed", KEYS[0]),
    ]
    into = [torch.empty(fingerprint.page_bytes, dtype=torch.uint8) for _ in range(3)]
    assert tier.get(KEYS[:3], into) == [True] * 3
    assert all(torch.equal(got, want) for got, want in zip(into, pages))
    assert (tier.tier_stats.local_reads, tier.tier_stats.store_reads) == (2, 1)  # key 0 came from the store
    assert tier.take_changes() == [("stored", KEYS[0]), ("removed", KEYS[1])]  # and re-entered the tier
    assert tier.exists(KEYS[:4]) == [True, True, True, False]
    with pytest.raises(InvalidArgumentError, match="capacity_pages"):
        LocalTier(inner, -1)


def test_the_local_tier_passes_on_what_the_shared_store_evicted_right_after_the_put():
    fingerprint = _fingerprint()
    heard: list[list[str]] = []
    tier = LocalTier(MemoryStore(fingerprint, capacity_pages=2), capacity_pages=4, on_evicted=heard.append)
    pages = [torch.full((fingerprint.page_bytes,), i, dtype=torch.uint8) for i in range(3)]
    assert tier.put(KEYS[:2], pages[:2]) == [PutStatus.STORED] * 2
    assert heard == []
    assert tier.put(KEYS[2:3], pages[2:3]) == [PutStatus.STORED]  # a new chain: the store evicts the first's tail
    assert heard == [[KEYS[1]]]
    # The store's events still reach the manager's announcer, in order, the eviction among them.
    assert [(e.kind, e.key) for e in tier.take_events()] == [
        ("stored", KEYS[0]),
        ("stored", KEYS[1]),
        ("evicted", KEYS[1]),
        ("stored", KEYS[2]),
    ]
    assert tier.exists(KEYS[:3]) == [True, True, True]  # the tier still holds the evicted page


def test_two_engines_on_a_bounded_file_store_explain_every_missing_page_by_an_eviction(tmp_path):
    requests = synthetic_trace(16, seed=3)
    fleet = FleetConfig(engines=2, policy="round-robin", kill_at=6, local_pages=64)
    # 256 KiB a process: about 480 pages of 544 B against the trace's 700-odd.
    report = Fleet(_config(f"file:{tmp_path / 'store'}?capacity_bytes=256KiB"), requests, fleet).run()
    assert report["requests_completed"] == 16
    assert report["lost"] == 0 and report["mismatched"] == 0 and report["pages_failed"] == 0
    assert report["store_pages_evicted"] > 0
    # Every page is in the store, whole, or missing because an engine's put evicted it (or the
    # store refused it for want of room, or the killed engine's write of it was cut off).
    assert 0 < report["missing_evicted"] <= report["missing"]
    assert report["pages_stored"] + report["missing"] + report["unreachable"] == report["verify_pages_checked"]
    assert report["pages_stored"] < report["verify_pages_checked"]
    assert 0 <= report["missing_cut_evictions"] <= report["puts_cut_by_kill"]


def test_a_write_refused_for_room_is_told_apart_from_a_failed_one():
    from kvstage.offload import PriorFailedError
    from kvstage.storage import MissingPriorError

    assert refused_for_room(None)  # the store found nothing it could evict
    assert refused_for_room(MissingPriorError("ab"))  # the page before it was evicted
    assert refused_for_room(PriorFailedError("ab", "cd", None, "in this manager"))
    assert not refused_for_room(PriorFailedError("ab", "cd", OSError(28, "No space left"), "in this manager"))
    assert not refused_for_room(OSError(5, "I/O error"))
    from kvstage.storage.mooncake.status import MooncakeCodeError

    assert refused_for_room(MooncakeCodeError("put", -200))  # NO_AVAILABLE_HANDLE: the pool is full
    assert not refused_for_room(MooncakeCodeError("put", -800))
    assert refused_for_room(PriorFailedError("ab", "cd", MooncakeCodeError("put", -200), "in this manager"))


def test_the_eviction_log_counts_the_puts_a_kill_cut_off(tmp_path):
    path = str(tmp_path / "engine-0.evicted")
    log = EvictionLog(path)
    log.put("a", False), log.evicted(["x"]), log.put("a", True)
    log.put("b", False), log.put("c", False), log.evicted(["y", "z"]), log.put("c", True)
    log.put("b", True)
    assert read_eviction_log(path) == ({"x", "y", "z"}, 0)
    log.put("d", False)  # never ended: the kill came mid-put, and cut its next line short
    with open(path, "a") as handle:
        handle.write("+e")
    successor = EvictionLog(path)  # the same file, each line whole again
    successor.evicted(["w"])
    assert read_eviction_log(path) == ({"x", "y", "z", "w"}, 1)
    assert read_eviction_log(str(tmp_path / "none")) == (set(), 0)


def test_the_index_reads_vllm_tagged_maps_too():
    index = PrefixIndex(1)
    stored = {"type": "BlockStored", "block_hashes": HASHES[:2], "parent_block_hash": None, "medium": "CPU"}
    index.apply(0, 0, (time.time(), [stored], 0))
    assert index.local_match(0, HASHES) == 2


def test_two_engines_on_a_real_mooncake_master_survive_a_kill(tmp_path):
    from kvstage.storage.mooncake import store as store_module

    import mooncake_master as master_module  # tests/mooncake_master.py

    if not store_module.mooncake_available() or master_module.master_binary() is None:
        skip_missing(f"the Mooncake store is not usable here; {store_module.INSTALL_HINT}")
    master = master_module.LocalMooncakeMaster(tmp_path / "master.log").start()
    try:
        requests = synthetic_trace(16, seed=4)
        # The router's client holds the pool's memory; the engines bring none, so a killed
        # engine takes no stored page with it.
        fleet = FleetConfig(engines=2, policy="round-robin", kill_at=6, local_pages=64)
        report = Fleet(_config(master.url(segment="256MiB", buffer="16MiB")), requests, fleet).run()
    finally:
        master.stop()
    _check_clean(report, 16, rewritable=False)
    assert report["kill"]["rerouted"] >= 1


def _bounded_mooncake_run(tmp_path, flags=(), watch="0.05", **query):
    """16 requests of 32 KiB pages on 2 engines, killed after 6, over a 16 MiB pool (the router's):
    about 500 of the trace's 700-odd pages fit, so the master evicts; the router's store watches."""
    from kvstage.storage.mooncake import store as store_module

    import mooncake_master as master_module  # tests/mooncake_master.py

    if not store_module.mooncake_available() or master_module.master_binary() is None:
        skip_missing(f"the Mooncake store is not usable here; {store_module.INSTALL_HINT}")
    wide = resolve_model(None, layers=1, heads=8, head_dim=64, dtype="float16")
    master = master_module.LocalMooncakeMaster(tmp_path / "master.log", flags=flags).start()
    try:
        config = ReplayConfig(
            model=wide,
            page_size=16,
            max_running=3,
            backend="torch",
            storage=master.url(segment="16MiB", buffer="16MiB", watch=watch, **query),
        )
        fleet = FleetConfig(engines=2, policy="round-robin", kill_at=6, local_pages=64)
        report = Fleet(config, synthetic_trace(16, seed=4), fleet).run()
    finally:
        master.stop()
    assert report["requests_completed"] == 16 and report["kill"]["rerouted"] >= 1
    assert report["mismatched"] == 0 and report["pages_failed"] == 0
    assert report["evictions_unattributed"] == 0  # no key vanished beyond the master's own count
    assert 0 < report["missing_evicted"] <= report["missing"]
    assert report["pages_stored"] + report["missing"] + report["unreachable"] == report["verify_pages_checked"]
    return report


def test_two_engines_on_a_bounded_mooncake_pool_explain_every_missing_page_by_an_observed_eviction(tmp_path):
    report = _bounded_mooncake_run(tmp_path)
    # Unpinned, a page may be stored and evicted between two listings: a missing page no listing
    # saw vanish counts lost, so a loaded machine may lose up to the unseen count, never more.
    assert report["lost"] <= report["evictions_unseen"]
    assert 0 < report["evictions_vanished"] <= report["master_evicted_keys"]


def test_soft_pinned_pages_make_every_eviction_seen_and_lost_exact(tmp_path):
    # Each put soft-pinned for 2 s on a master that evicts no soft-pinned object: no page goes
    # before a listing (every 0.5 s) has shown it, so the watcher sees each eviction the master
    # counts. (Unpinned, a listing every 0.5 s misses some: this fails without soft_pin.)
    report = _bounded_mooncake_run(
        tmp_path,
        flags=("-allow_evict_soft_pinned_objects=false", "-default_kv_soft_pin_ttl=2000"),
        watch="0.5",
        soft_pin="2000",
    )
    assert report["master_evicted_keys"] > 0
    assert report["evictions_vanished"] == report["master_evicted_keys"]
    assert report["evictions_unseen"] == 0 and report["lost"] == 0


def test_the_multi_tenant_trace_recurs_and_keeps_the_prefix_rule():
    from kvstage.replay.trace import BLOCK_TOKENS, multi_tenant_trace

    trace = multi_tenant_trace(120, tenants=4, seed=1)
    assert trace == multi_tenant_trace(120, tenants=4, seed=1) != multi_tenant_trace(120, tenants=4, seed=2)
    parents: dict[int, tuple[int, ...]] = {}
    for request in trace:
        assert len(request.hash_ids) == -(-request.input_length // BLOCK_TOKENS)
        for i, block in enumerate(request.hash_ids):  # equal ids mean an equal prefix
            assert parents.setdefault(block, request.hash_ids[:i]) == request.hash_ids[:i]
    firsts = [r.hash_ids[0] for r in trace]
    assert len(set(firsts)) == 4  # one system prompt per tenant, each recurring
    assert max(firsts.count(f) for f in set(firsts)) > 120 / 4  # Zipf: the first tenant is busiest
    with pytest.raises(InvalidArgumentError, match="tenants: must be an int >= 1"):
        multi_tenant_trace(10, tenants=0)


def test_two_engines_routed_by_dynamos_indexer_survive_a_kill(tmp_path):
    if dynamo_index.dynamo_python() is None:
        skip_missing(f"Dynamo's KV indexer ({dynamo_index.INSTALL_HINT})")
    # Tenants' system prompts recur, so engines hold prefixes Dynamo can name.
    requests = multi_tenant_trace(24, tenants=2, seed=5)
    fleet = FleetConfig(engines=2, policy="dynamo", kill_at=10, local_pages=256)
    report = Fleet(_config(f"file:{tmp_path / 'store'}"), requests, fleet).run()
    _check_clean(report, 24)
    kill = report["kill"]
    finished_on = {order: engine for _, order, engine, _, _ in report["timeline"]}
    assert all(finished_on[order] != kill["engine"] for order in kill["rerouted_orders"])
    # One query per request routed (re-routed ones twice); Dynamo named an engine's prefix for
    # some of them (it hashed the engines' CPU events' token ids itself).
    assert report["dynamo_queries"] == 24 + kill["rerouted"]
    assert 0 < report["dynamo_prefix_answers"] <= report["dynamo_queries"]
    assert report["local_pages_read"] > 0


def test_without_ai_dynamo_runtime_the_dynamo_router_names_the_option(tmp_path, monkeypatch):
    monkeypatch.setattr(dynamo_index, "dynamo_python", lambda: None)
    fleet = FleetConfig(engines=2, policy="dynamo")
    with pytest.raises(
        BackendUnavailableError, match=r"^--router dynamo: needs Dynamo's KV indexer \(ai-dynamo-runtime"
    ):
        Fleet(_config(f"file:{tmp_path / 'store'}"), multi_tenant_trace(4, tenants=1, seed=1), fleet).run()
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())  # nothing written


def test_the_dynamo_fleets_endpoint_ports_are_distinct():
    """Every engine's publisher and replay socket binds a port of its own: picked one after
    another (bind port 0, close), the kernel may hand out one twice and an engine fails to bind."""
    for _ in range(20):
        ports = dynamo_index.free_ports(8)  # 4 engines
        assert len(set(ports)) == 8 and all(1024 <= port < 65536 for port in ports), ports
