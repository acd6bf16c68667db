"""Edge cases found in review: a pool whose slot count is not a multiple of the page size."""

from __future__ import annotations

import pytest
import torch

from kvstage.kernels import gather, gather_reference, scatter, scatter_reference

from kernel_helpers import as_bytes, expected_staging, make_pool, make_staging, poison_


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_aligned_pages_of_a_pool_whose_slots_are_not_a_page_multiple(device, backend, layout):
    # 10 slots, page size 3: aligned page runs (0-2, 3-5, 6-8) onto consecutive host pages take
    # the torch path's whole-page route, which must not view the pool as [num_slots / 3, ...].
    page_size = 3
    pool = make_pool(
        parts=2, layers=2, num_slots=10, heads=5, dim=72, dtype=torch.bfloat16, device=device, storage="lists", seed=3
    )
    staging = poison_(make_staging(pool, 4, page_size, layout))
    slot_indices = torch.tensor([6, 7, 8, 0, 1, 2], dtype=torch.int64, device=device)
    host_page_ids = torch.tensor([2, 1], dtype=torch.int64)
    want = expected_staging(pool, staging, slot_indices, host_page_ids, page_size, layout)
    gather(pool, staging, slot_indices, host_page_ids, page_size=page_size, layout=layout, backend=backend)
    assert torch.equal(as_bytes(staging), want.view(-1))

    target = make_pool(
        parts=2, layers=2, num_slots=10, heads=5, dim=72, dtype=torch.bfloat16, device=device, storage="lists", seed=4
    )
    before = [as_bytes(t).clone() for t in target.tensors()]
    scatter(staging, target, slot_indices, host_page_ids, page_size=page_size, layout=layout, backend=backend)
    moved = slot_indices.cpu()
    for src, dst, old in zip(pool.tensors(), target.tensors(), before):
        assert torch.equal(as_bytes(dst[moved]), as_bytes(src[moved]))
        kept = torch.tensor([s for s in range(10) if s not in moved.tolist()])
        assert torch.equal(as_bytes(dst[kept]), old.view(10, -1)[kept].view(-1))


def test_reference_whole_page_route_on_a_pool_whose_slots_are_not_a_page_multiple(device):
    pool = make_pool(
        parts=1,
        layers=1,
        num_slots=11,
        heads=1,
        dim=576,
        dtype=torch.float8_e4m3fn,
        device=device,
        storage="lists",
        seed=5,
    )
    staging = poison_(make_staging(pool, 2, 3, "page_first"))
    slot_indices = torch.tensor([3, 4, 5, 0, 1, 2], dtype=torch.int32, device=device)
    host_page_ids = torch.tensor([0, 1], dtype=torch.int32)
    want = expected_staging(pool, staging, slot_indices, host_page_ids, 3, "page_first")
    gather_reference(pool, staging, slot_indices, host_page_ids, page_size=3)
    assert torch.equal(as_bytes(staging), want.view(-1))
    poison_(pool.buffers[0][0])
    scatter_reference(staging, pool, slot_indices, host_page_ids, page_size=3)
    assert torch.equal(as_bytes(pool.buffers[0][0][:6]), want.view(2, 3, -1)[[1, 0]].reshape(-1))
