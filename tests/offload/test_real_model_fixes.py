"""Bugs found while integrating kvstage with a real model (tests/offload/test_real_model.py),
each as the smallest case that failed before its fix."""

from __future__ import annotations

import pytest
import torch

from kvstage.hashing import PageHasher
from kvstage.kernels import KVPool
from kvstage.offload import HostPool, OffloadManager
from kvstage.offload.testing import SimpleRequest, SlotTable
from kvstage.storage import LayoutFingerprint, open_storage


@pytest.mark.parametrize("layer_by_layer", [True, False])
def test_wait_layer_on_a_load_of_no_pages_returns(layer_by_layer):
    page_size = 4
    kv_pool = KVPool.mha([torch.zeros(64, 2, 8) for _ in range(2)], [torch.zeros(64, 2, 8) for _ in range(2)])
    host_pool = HostPool.like(kv_pool, num_pages=8, page_size=page_size)
    storage = open_storage("memory", LayoutFingerprint.of(kv_pool, page_size=page_size, model_id="m"))
    slots = SlotTable(64)
    manager = OffloadManager(kv_pool, host_pool, storage, PageHasher(page_size=page_size), slots, backend="torch")
    req = SimpleRequest("b", list(range(18)))  # nothing stored: the lookup misses
    handle = manager.prefetch(req, policy="wait_complete")
    handle.wait()
    manager.poll()
    assert handle.ready_to_load() and handle.pages_ready == 0
    load = manager.load(handle, slots.assign(req, handle.tokens_ready), layer_by_layer=layer_by_layer)
    assert load.num_pages == 0 and load.done()
    try:
        for layer in range(kv_pool.num_layers):  # what the forward pass does before each layer's attention
            load.wait_layer(layer)
    finally:
        manager.abort(req)
        manager.close()
