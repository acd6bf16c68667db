"""``kvstage replay --storage mooncake://...`` against a real Mooncake master (skips without
Mooncake; fails under CI)."""

from __future__ import annotations

from kvstage.replay.command import replay
from kvstage.replay.engine import ReplayConfig
from kvstage.replay.models import resolve_model
from kvstage.replay.trace import TraceRequest

from support import skip_missing


def test_replay_through_a_real_mooncake_store(tmp_path):
    from kvstage.storage.mooncake import store as store_module

    import mooncake_master as master_module  # tests/mooncake_master.py

    if not store_module.mooncake_available() or master_module.master_binary() is None:
        skip_missing(f"the Mooncake store is not usable here; {store_module.INSTALL_HINT}")
    requests = [
        TraceRequest(0, 0.0, 700, 20, (0, 1)),
        TraceRequest(1, 1.0, 900, 9, (0, 1)),
        TraceRequest(2, 2.0, 520, 40, (0, 2)),
    ]
    model = resolve_model(None, layers=1, heads=1, head_dim=8, dtype="float16")
    master = master_module.LocalMooncakeMaster(tmp_path / "master.log").start()
    try:
        config = ReplayConfig(
            model=model,
            page_size=16,
            max_running=1,
            backend="torch",
            storage=master.url(segment="64MiB", buffer="16MiB"),
        )
        report, _ = replay(config, requests)
    finally:
        master.stop()
    assert report["storage"].startswith("mooncake://")
    # One at a time: request 1 loads request 0's 43 whole prompt pages, request 2 its block 0.
    assert report["pages_hit"] == report["pages_loaded"] == 43 + 32
    assert report["pages_looked_up"] == 43 + 56 + 32
    assert report["verify_pages_checked"] == report["pages_stored"] == 44 + 13 + 2 > 0
    assert report["verify_mismatches"] == 0 and report["lost_pages"] == 0 and report["load_mismatches"] == 0
    assert report["pages_failed"] == 0
