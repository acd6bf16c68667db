"""StagingPool: a hybrid model's component staging is reused, bounded, and a steady state of
stores and loads through the manager allocates none."""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.offload.staging_pool import StagingPool

from hybrid_engine import LAYOUTS, PROMPT, Engine, load, store


def test_a_buffer_given_back_is_taken_again_and_rows_round_up_to_a_power_of_two():
    pool = StagingPool(pinned=False)
    buffer = pool.take(3, (2, 5), torch.float32)
    assert buffer.shape == (4, 2, 5) and buffer.dtype == torch.float32 and buffer.is_contiguous()
    assert pool.take(4, (2, 5), torch.float32).data_ptr() != buffer.data_ptr()  # lent: a new one
    pool.give(buffer)
    assert pool.free_bytes == buffer.nbytes
    assert pool.take(4, (2, 5), torch.float32) is buffer  # 3 and 4 rows share a buffer
    assert pool.free_bytes == 0 and pool.allocated == 2
    pool.give(buffer)
    assert pool.take(4, (2, 5), torch.bfloat16) is not buffer  # another dtype, another shape: not shared
    assert pool.take(5, (2, 5), torch.float32) is not buffer
    assert pool.take(1, (10,), torch.float32) is not buffer


def test_buffers_past_max_bytes_are_dropped_and_bad_bounds_raise():
    pool = StagingPool(pinned=False, max_bytes=100)
    small, large = pool.take(1, (16,), torch.uint8), pool.take(1, (96,), torch.uint8)
    pool.give(small)
    pool.give(large)  # 16 + 96 > 100: dropped
    assert pool.free_bytes == 16
    with pytest.raises(InvalidArgumentError, match="^max_bytes: must be an int >= 0"):
        StagingPool(pinned=False, max_bytes=-1)


def test_steady_state_stores_and_loads_of_every_component_allocate_no_staging():
    engine = Engine(LAYOUTS["all"], seed=5)
    staging = engine.manager._hybrid.staging
    counts = []
    for index in range(4):
        prompt = [token + 1000 * index for token in PROMPT]
        a = engine.request(f"s{index}", prompt)
        store(engine, a, chunks=(8,), snapshots=(8, 12))
        b = engine.request(f"l{index}", prompt)
        loaded = load(engine, b, component_slots={"swa": engine.window_slots(b)[8:12]}, state_slot=1)
        assert loaded.num_tokens == 12 and loaded.error is None
        engine.manager.abort(b)
        engine.settle()
        for req in (a, b):
            engine.slots.release(req)
            engine.window_slots.release(req)
        # A buffer a growing memory store adopted (a snapshot's: put_adopting) is that page's
        # memory, which the store would otherwise have allocated itself: not staging's growth.
        counts.append(staging.allocated - sum(store.pages_adopted for store in engine.stores.values()))
    # Round 1 may still grow; then none. Window and sidecar rows are adopted too (one hop), so the
    # net growth may be 0 from the start: that staging was used at all is asserted on its own.
    assert staging.allocated > 0 and counts[1:] == [counts[1]] * 3, counts
    assert engine.stores["state"].pages_adopted == 8 and engine.stores["state"].buffers_allocated == 0
    # Every staging buffer went to a store (none comes back while the stores grow), window and
    # sidecar rows included, not only the snapshots'.
    assert sum(store.pages_adopted for store in engine.stores.values()) > engine.stores["state"].pages_adopted
