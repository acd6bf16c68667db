"""sglang 0.5.23's HybridCacheController with KVStageStorage over kvstage's Mooncake store and a
real mooncake_master (loopback only), for the pool sets of sglang's Mamba, Swa, MambaSwa and Dsa
stack strategies: one store client per pool's key space; the writer stays up (Mooncake keeps
pages in the segments its clients mount) while a fresh controller over fresh host pools
prefetches every pool, bytes equal."""

from __future__ import annotations

from array import array

import pytest
from sglang.srt.mem_cache.radix_cache import RadixKey

from kvstage.storage.mooncake.store import INSTALL_HINT, master_binary, mooncake_available

from mooncake_master import LocalMooncakeMaster
from sglang_hybrid_rig import STRATEGIES, Rig, assert_same_pools
from sglang_rig import one_rank_gloo_world


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    if not mooncake_available() or master_binary() is None:
        pytest.skip(f"the Mooncake store is not usable here; {INSTALL_HINT}")
    with LocalMooncakeMaster(tmp_path_factory.mktemp("mooncake") / "master.log") as running:
        yield running


@pytest.fixture(scope="module", autouse=True)
def one_rank_world(tmp_path_factory):
    with one_rank_gloo_world(tmp_path_factory.mktemp("gloo")) as world:
        yield world


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_pool_written_through_is_prefetched_from_mooncake_by_a_fresh_controller(master, strategy):
    url = master.url()
    writer = Rig(strategy, url, seed=21, timeout=60)
    reader = None
    try:
        pages = 2 if strategy == "dsa" else 5
        key = RadixKey(array("q", range(7, 7 + pages * writer.page_size)), extra_key=f"mooncake-{strategy}")
        held = writer.write_through(key)
        reader = Rig(strategy, url, timeout=60)
        restorable, tokens, got = reader.prefetch(key)
        assert tokens == len(key.token_ids)
        assert restorable == ([1, 2] if strategy == "dsa" else [pages])
        assert_same_pools(got, held)
    finally:
        if reader is not None:
            reader.stop()
        writer.stop()
