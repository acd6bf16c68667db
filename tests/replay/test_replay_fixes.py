"""Library bugs the replay found, each as the smallest case that failed before its fix."""

from __future__ import annotations

import torch

from kvstage.hashing import PageHasher
from kvstage.kernels import KVPool
from kvstage.offload import HostPool, OffloadManager
from kvstage.offload.testing import SimpleRequest
from kvstage.storage import LayoutFingerprint
from kvstage.storage.memory_store import MemoryStore

PAGE_SIZE = 4


class UnreadableStore(MemoryStore):
    """A memory store whose ``get`` misses one key it holds (a page that ``exists`` but cannot be
    read: a file store's corrupted file)."""

    unreadable = ""

    def _get(self, full_keys, into):
        hits = super()._get(full_keys, into)
        return [hit and key != self.prefix + self.unreadable for key, hit in zip(full_keys, hits)]


def test_a_loaded_prefetch_whose_read_stopped_at_an_unreadable_page_counts_as_a_prefetch_failure():
    kv_pool = KVPool.mha([torch.zeros(32, 1, 8, dtype=torch.float16)], [torch.zeros(32, 1, 8, dtype=torch.float16)])
    host_pool = HostPool.like(kv_pool, num_pages=8, page_size=PAGE_SIZE)
    storage = UnreadableStore(LayoutFingerprint.of(kv_pool, page_size=PAGE_SIZE, model_id="findings"), capacity_pages=8)
    hasher = PageHasher("sglang-v1", PAGE_SIZE)
    tokens = list(range(1, 18))  # 4 whole pages looked up (the last token is left out)
    keys = hasher.prefill_keys(tokens[:16])
    storage.put(keys, [host_pool.page(page) for page in range(4)])
    storage.unreadable = keys[2]
    manager = OffloadManager(kv_pool, host_pool, storage, hasher, lambda req: torch.arange(32), backend="torch")
    try:
        handle = manager.prefetch(SimpleRequest("r", tokens), policy="wait_complete")
        assert handle.wait(10.0)
        assert (handle.pages_hit, handle.pages_ready) == (4, 2)  # the read stopped before the lookup's end
        manager.load(handle, torch.arange(2 * PAGE_SIZE))
        manager.poll()
        metrics = manager.metrics
        assert (metrics.prefetches, metrics.pages_hit, metrics.pages_prefetched) == (1, 4, 2)
        # OffloadMetrics.prefetch_failures: "reads that raised or hit a hole before the lookup's end".
        assert metrics.prefetch_failures == 1
    finally:
        manager.close()
