"""The OffloadManager offloading decode pages through MooncakeStore to a real master, end to end."""

from __future__ import annotations

import time

import torch

from kvstage.hashing import PageHasher
from kvstage.kv_layout import KVLayout
from kvstage.offload import CopyStream
from kvstage.storage import LayoutFingerprint, PutStatus
from kvstage.storage.mooncake.store import MooncakeStore

from offload_rig import make_rig

# The rig's layout (make_rig defaults): int32, 2 layers, K and V, 1 head of 4, 4-token pages.
RIG_FINGERPRINT = LayoutFingerprint("rig", KVLayout(2, 2, 1, 4, "int32"), 4)


def decode(rig, req, tokens) -> None:
    for token in tokens:
        rig.decode(req, token)
        rig.manager.offload(req)
        rig.manager.poll()


def test_manager_stores_decode_pages_in_mooncake_zero_copy(mooncake_master):
    store = MooncakeStore(RIG_FINGERPRINT, mooncake_master.url())
    rig = make_rig(
        page_size=4,
        num_host_pages=16,
        buffer_pages=8,
        storage=store,
        copy_stream=CopyStream("cpu"),
        slot_generator=torch.Generator().manual_seed(3),
    )
    try:
        req = rig.new_request("r1", range(500, 510), 32, cache_salt="tenant-a")  # 2 full pages + 2
        decode(rig, req, range(600, 619))
        assert rig.manager.finish(req)
        rig.manager.drain()

        tokens = (req.origin_input_ids + req.output_ids)[: req.kv_length]
        keys = PageHasher(page_size=4).prefill_keys(tokens, cache_salt="tenant-a")
        assert len(keys) == 7
        # The prompt's 2 pages were put by the rig's prefill side; decode offloaded pages 2..6.
        assert store.exists(keys) == [True] * 7
        metrics = rig.manager.metrics
        assert (metrics.pages_launched, metrics.pages_stored, metrics.pages_failed) == (5, 5, 0)
        assert (metrics.requests_live, metrics.host_pages_used, rig.released) == (0, 0, [req])
        assert (
            store.pages_bounced == 2
        )  # the prefill side's 2 pages (test tensors); every manager put came straight from the registered host pool

        assert rig.check_stored_pages(req) == (5, 5)  # the bytes are the KV of those tokens

        # The same tokens again (a retry of the request): nothing is written twice.
        again = rig.new_request("r1-retry", range(500, 510), 32, cache_salt="tenant-a")
        decode(rig, again, range(600, 619))
        rig.manager.finish(again)
        rig.manager.drain()
        metrics = rig.manager.metrics
        assert (metrics.pages_launched, metrics.pages_stored, metrics.pages_deduplicated) == (10, 5, 5)
        assert store.stats.pages_stored == 7  # 5 decode pages once, 2 prompt pages (prefill side) once
        assert store.stats.pages_deduplicated == 7  # the retry's puts were answered by one put call each
    finally:
        rig.copy_stream.close()
        store.close()


def test_manager_keeps_its_invariants_when_the_master_dies(private_master):
    store = MooncakeStore(RIG_FINGERPRINT, private_master.url(rpc_timeout_ms=1500))
    failures: list[list[str]] = []
    rig = make_rig(
        page_size=4,
        num_host_pages=16,
        storage=store,
        copy_stream=CopyStream("cpu"),
        on_storage_failure=lambda req, keys, error: failures.append(list(keys)),
    )
    try:
        req = rig.new_request("r1", range(10, 18), 40)  # 2 full prompt pages
        decode(rig, req, range(100, 109))  # 16 tokens with KV: pages 2, 3 offloaded
        rig.manager.drain()
        assert rig.manager.metrics.pages_stored == 2

        private_master.kill()
        started = time.monotonic()
        decode(rig, req, range(200, 212))  # 3 more pages
        rig.manager.finish(req)
        rig.manager.drain()
        assert time.monotonic() - started < 10  # writes fail fast; nothing waits on the dead master

        metrics = rig.manager.metrics
        assert metrics.pages_stored == 2 and metrics.pages_failed == 3 and metrics.pages_in_flight == 0
        assert (
            metrics.pages_launched
            == metrics.pages_stored + metrics.pages_deduplicated + metrics.pages_failed + metrics.pages_discarded
        )
        assert metrics.host_pages_used == 0  # every host page was freed
        assert rig.released == [req]  # released once, despite the failures
        assert sum(len(keys) for keys in failures) == 3
        # 2 of the stored pages the prefill side's; of the 3 failed pages only the first reached the
        # store: the 2 after it follow a page this manager knows failed, so they fail without a put
        assert store.stats.pages_stored == 4 and store.stats.pages_failed == 1
        assert store.calls_skipped == 0  # the 2 later pages never reached the store, so none waited on Mooncake
        # Nothing failed is reported as present.
        assert store.exists([key for keys in failures for key in keys]) == [False] * 3
        assert store.put(failures[0][:1], [torch.zeros(RIG_FINGERPRINT.page_bytes // 4, dtype=torch.int32)]) == [
            PutStatus.FAILED
        ]
        assert store.calls_skipped == 2  # that exists and put failed fast, without calling Mooncake
    finally:
        rig.copy_stream.close()
        store.close()
