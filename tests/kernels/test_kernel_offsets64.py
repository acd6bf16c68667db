"""A pool whose byte offsets pass 2**31: the kernel's offset arithmetic must be 64-bit.

The pool is one stacked int8 tensor [2 parts, 1 layer, S slots, 1 head, 9 bytes] with
S * 9 > 2**31, so 9-byte rows force 1-byte words: the slot offsets of the high slots and the
V part's table offset are all above 2**31 words. Only the touched rows are written
(``torch.empty`` leaves the rest of the 4.3 GB unbacked on CPU).
"""

from __future__ import annotations

import pytest
import torch

from kvstage.kernels import KVPool, gather, gather_reference, scatter

from kernel_helpers import as_bytes, make_staging, random_bytes_

ROW = 9
SLOTS = (2**31) // ROW + 4096  # the last slots start past byte 2**31 of their part


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_gather_and_scatter_reach_slots_past_2_gib(device, layout):
    if device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory < 8 * 2**30:
        pytest.skip("needs 5 GB of device memory")
    stacked = torch.empty((2, 1, SLOTS, 1, ROW), dtype=torch.int8, device=device)
    pool = KVPool.from_stacked(stacked)
    page = 4
    slot_indices = torch.arange(SLOTS - 3 * page, SLOTS, device=device).flip(
        0
    )  # 3 pages of the highest slots, reversed
    assert int(slot_indices.min()) * ROW > 2**31
    gen = torch.Generator().manual_seed(11)
    for part in range(2):
        rows = random_bytes_(torch.empty((slot_indices.numel(), 1, ROW), dtype=torch.int8), gen)
        stacked[part, 0, slot_indices] = rows.to(device)
    host_page_ids = torch.tensor([2, 0, 3], device=device)
    staging = make_staging(pool, 4, page, layout)
    want = staging.clone()
    gather_reference(pool, want, slot_indices, host_page_ids, page_size=page, layout=layout)
    gather(pool, staging, slot_indices, host_page_ids, page_size=page, layout=layout, backend="triton")
    assert torch.equal(as_bytes(staging), as_bytes(want))
    saved = stacked[:, 0, slot_indices].clone()
    stacked[:, 0, slot_indices] = 0
    scatter(staging, pool, slot_indices, host_page_ids, page_size=page, layout=layout, backend="triton")
    assert torch.equal(stacked[:, 0, slot_indices], saved)
    del stacked, pool
