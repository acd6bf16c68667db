"""kvstage.offload.host_rows: a host-memory KV pool's rows as addresses. The plan is built from
the slot numbers by arithmetic, so a slot outside the pool must be refused before any address is
made (nothing would bound the copy otherwise)."""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.kernels import KVPool
from kvstage.kernels.host_copy import run_plan
from kvstage.offload.host_rows import kv_rows

PAGE = 4


def _pool(num_slots: int = 16) -> KVPool:
    stacked = torch.empty((2, 3, num_slots, 2, 8), dtype=torch.bfloat16).view(torch.uint8).random_(0, 256)
    return KVPool.from_stacked(stacked.view(torch.bfloat16))


def test_rows_of_a_page_land_in_its_host_page_in_plane_order():
    pool = _pool()
    rows = kv_rows(pool, PAGE)
    page = torch.full((pool.num_layers * 2 * PAGE * rows.row_bytes,), 0xA5, dtype=torch.uint8)
    slots = torch.tensor([9, 10, 8, 3])  # not aligned: one row a slot
    run_plan(rows.plan([page], slots, to_host=True))
    planes = page.view(pool.num_layers, 2, PAGE, rows.row_bytes)
    for layer in range(pool.num_layers):
        for part in range(2):
            expected = pool.buffers[part][layer][slots].reshape(PAGE, -1).view(torch.uint8)
            assert torch.equal(planes[layer, part], expected)


@pytest.mark.parametrize("bad", [16, 1000, -1])
def test_a_slot_outside_the_pool_is_refused_before_any_address_is_made(bad):
    pool = _pool()
    rows = kv_rows(pool, PAGE)
    page = torch.zeros(pool.num_layers * 2 * PAGE * rows.row_bytes, dtype=torch.uint8)
    with pytest.raises(InvalidArgumentError, match=rf"^slot_indices: every slot must be in \[0, 16\), got {bad}"):
        rows.plan([page], torch.tensor([0, 1, 2, bad]), to_host=False)
    with pytest.raises(InvalidArgumentError, match=r"^slot_indices: every slot must be in \[0, 16\)"):
        rows.plan([page], torch.tensor([bad, bad + 1, bad + 2, bad + 3]), to_host=True)  # "aligned" runs too
