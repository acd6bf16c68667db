"""Every tensor a copy reads or writes by pointer is taken by its strides, or rejected by name.

Index tensors (``slot_indices``, ``host_page_ids``) may be any 1-D view: strided (a column of
``req_to_token``), with a storage offset, or expanded (stride 0). Each view is checked
against plain Python loops over the same values (:mod:`kernel_helpers`), on both backends,
both modes, gather and scatter (every layer and one layer). The values a wrong stride would
read instead are valid but unwanted (slots and host pages outside the batch), so a stride
bug shows as wrong bytes rather than as a fault; every destination is poisoned first.

Staging and pool buffers must be contiguous (a written tensor cannot be silently copied);
a storage offset is fine.
"""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.kernels import KVPool, gather, scatter

from kernel_helpers import (
    as_bytes,
    changed_buffers,
    expected_pool_after_scatter,
    expected_staging,
    make_pool,
    make_staging,
    poison_,
    pool_bytes,
    random_bytes_,
    same_bytes,
)

PAGE, NUM_PAGES, NUM_HOST_PAGES, NUM_SLOTS = 2, 3, 6, 16
SLOTS = [9, 2, 14, 5, 0, 11]  # the batch's slots; the others (e.g. 7, 13) must stay untouched
HOST_PAGE_IDS = [4, 1, 2]  # host pages 0, 3, 5 must keep their poison
UNWANTED = {"slot_indices": 7, "host_page_ids": 5}  # what a view's gaps hold
OPS = ["gather", "scatter", "scatter-layer-1"]


def view_of(values: list[int], kind: str, filler: int, device: torch.device) -> torch.Tensor:
    """A 1-D int64 view holding ``values`` (``expanded``: ``values[0]`` repeated) in a non-plain layout."""
    n = len(values)
    if kind == "strided":  # every other element of a [n, 2] tensor, like req_to_token[:, 0]
        base = torch.full((n, 2), filler, dtype=torch.int64, device=device)
        base[:, 0] = torch.tensor(values, device=device)
        t = base[:, 0]
        assert t.stride() == (2,)
    elif kind == "offset":
        base = torch.full((n + 3,), filler, dtype=torch.int64, device=device)
        base[3:] = torch.tensor(values, device=device)
        t = base[3:]
        assert t.storage_offset() == 3
    else:
        t = torch.tensor(values[:1], dtype=torch.int64, device=device).expand(n)
        assert t.stride() == (0,)
    return t


def case(device):
    pool = make_pool(parts=2, layers=3, num_slots=NUM_SLOTS, heads=1, dim=12, dtype=torch.float16, device=device)
    staging = make_staging(pool, NUM_HOST_PAGES, PAGE, "page_first")
    return pool, staging


def run(op: str, pool, staging, slot_indices, host_page_ids, **options):
    if op == "gather":
        gather(pool, staging, slot_indices, host_page_ids, page_size=PAGE, **options)
    else:
        scatter(
            staging,
            pool,
            slot_indices,
            host_page_ids,
            page_size=PAGE,
            layer=1 if op.endswith("layer-1") else None,
            **options,
        )


def expected(op: str, pool, staging, slot_indices, host_page_ids, layout: str = "page_first"):
    """The destination's bytes after ``op``, by plain Python loops over the indices' values."""
    if op == "gather":
        return [expected_staging(pool, staging, slot_indices, host_page_ids, PAGE, layout)]
    return expected_pool_after_scatter(
        pool, staging, slot_indices, host_page_ids, PAGE, layout, layer=1 if op.endswith("layer-1") else None
    )


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("mode", ["kernel", "staged"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("kind", ["strided", "offset", "expanded"])
@pytest.mark.parametrize("argument", ["slot_indices", "host_page_ids"])
def test_index_views_are_read_by_their_strides(device, argument, kind, op, backend, mode):
    pool, staging = case(device)
    values = {"slot_indices": SLOTS, "host_page_ids": HOST_PAGE_IDS}
    index = {name: torch.tensor(v, device=device) for name, v in values.items()}
    index[argument] = view_of(values[argument], kind, UNWANTED[argument], device)
    if op != "gather":
        random_bytes_(staging, torch.Generator().manual_seed(1))
        for t in pool.tensors():  # the target slots hold poison: a row left unwritten shows
            t.view(NUM_SLOTS, -1).view(torch.uint8)[SLOTS] = 0xA5
    repeats = kind == "expanded" and (argument == "host_page_ids" or op != "gather")
    if repeats:  # an expanded view repeats one value: a host page twice, or (scatter) a slot twice
        before_pool, before_staging = pool_bytes(pool), as_bytes(staging).clone()
        with pytest.raises(InvalidArgumentError, match=f"^{argument}: .*repeat"):
            run(op, pool, staging, index["slot_indices"], index["host_page_ids"], backend=backend, mode=mode)
        assert changed_buffers(before_pool, pool) == []
        assert torch.equal(before_staging, as_bytes(staging))
        return
    want = expected(op, pool, staging, index["slot_indices"], index["host_page_ids"])
    run(op, pool, staging, index["slot_indices"], index["host_page_ids"], backend=backend, mode=mode)
    synchronize(device)
    got = [staging] if op == "gather" else pool.tensors()
    assert all(same_bytes(a, b) for a, b in zip(got, want))
    if op == "gather":  # host pages outside the batch kept their poison
        assert all((as_bytes(staging[h]) == 0xA5).all() for h in (0, 3, 5))


@pytest.mark.parametrize("mode", ["kernel", "staged"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_staging_with_a_storage_offset_is_read_at_its_offset(device, layout, op, backend, mode):
    pool, _ = case(device)
    shape = make_staging(pool, NUM_HOST_PAGES, PAGE, layout).shape
    numel = torch.Size(shape).numel()
    arena = poison_(torch.empty(numel + 5, dtype=pool.dtype, device=device))
    staging = arena[1 : 1 + numel].view(shape)  # starts 2 bytes in: 2-byte words
    if op != "gather":
        random_bytes_(staging, torch.Generator().manual_seed(2))
    slot_indices, host_page_ids = torch.tensor(SLOTS, device=device), torch.tensor(HOST_PAGE_IDS, device=device)
    want = expected(op, pool, staging, slot_indices, host_page_ids, layout)
    run(op, pool, staging, slot_indices, host_page_ids, backend=backend, mode=mode, layout=layout)
    synchronize(device)
    got = [staging] if op == "gather" else pool.tensors()
    assert all(same_bytes(a, b) for a, b in zip(got, want))
    assert (as_bytes(arena[:1]) == 0xA5).all() and (as_bytes(arena[1 + numel :]) == 0xA5).all()


@pytest.mark.parametrize("kind", ["strided", "expanded"])
@pytest.mark.parametrize("op", OPS)
def test_staging_that_is_not_contiguous_is_rejected(device, op, kind):
    pool, staging = case(device)
    if kind == "strided":  # every other host page of a buffer twice as long
        bad = make_staging(pool, 2 * NUM_HOST_PAGES, PAGE, "page_first")[::2]
    else:
        bad = staging[:1].expand(NUM_HOST_PAGES, *staging.shape[1:])
    before = pool_bytes(pool)
    with pytest.raises(InvalidArgumentError, match="^staging: must be contiguous"):
        run(op, pool, bad, torch.tensor(SLOTS, device=device), torch.tensor(HOST_PAGE_IDS, device=device))
    assert changed_buffers(before, pool) == []


@pytest.mark.parametrize("kind", ["strided", "expanded"])
def test_pool_buffers_that_are_not_contiguous_are_rejected(device, kind):
    k = torch.zeros(NUM_SLOTS, 1, 12, dtype=torch.float16, device=device)
    bad = (
        torch.zeros(NUM_SLOTS * 2, 1, 12, dtype=torch.float16, device=device)[::2]
        if kind == "strided"
        else k[:1].expand(NUM_SLOTS, 1, 12)
    )
    with pytest.raises(InvalidArgumentError, match=r"^v_buffers\[0\]: must be contiguous"):
        KVPool.mha([k], [bad])


@pytest.mark.parametrize("mode", ["kernel", "staged"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("op", OPS)
def test_pool_buffers_with_storage_offsets_are_used_at_their_offsets(device, op, backend, mode):
    pool = make_pool(
        parts=2, layers=3, num_slots=NUM_SLOTS, heads=1, dim=12, dtype=torch.float16, device=device, storage="scattered"
    )
    assert all(t.storage_offset() > 0 for t in pool.tensors())
    arena = pool.tensors()[0]._base  # the one allocation the buffers are carved from, gaps between them
    gaps = torch.ones(arena.numel(), dtype=torch.bool)
    for t in pool.tensors():
        gaps[t.storage_offset() : t.storage_offset() + t.numel()] = False
    gaps_before = arena.detach().cpu()[gaps].view(torch.uint8).clone()
    staging = make_staging(pool, NUM_HOST_PAGES, PAGE, "page_first")
    if op != "gather":
        random_bytes_(staging, torch.Generator().manual_seed(4))
    slot_indices, host_page_ids = torch.tensor(SLOTS, device=device), torch.tensor(HOST_PAGE_IDS, device=device)
    want = expected(op, pool, staging, slot_indices, host_page_ids)
    run(op, pool, staging, slot_indices, host_page_ids, backend=backend, mode=mode)
    synchronize(device)
    got = [staging] if op == "gather" else pool.tensors()
    assert all(same_bytes(a, b) for a, b in zip(got, want))
    assert torch.equal(arena.detach().cpu()[gaps].view(torch.uint8), gaps_before)  # nothing written between buffers


def test_scatter_rejects_a_repeated_slot_it_can_see(device):
    """Two tokens into one slot would leave it unspecified (a mix of both rows on a GPU): checked
    wherever the slots are checked (check_bounds, the default for a CPU pool)."""
    pool, staging = case(device)
    slot_indices = torch.tensor([9, 2, 14, 9, 0, 11], device=device)
    before = pool_bytes(pool)
    with pytest.raises(InvalidArgumentError, match="^slot_indices: .*repeat"):
        scatter(
            staging, pool, slot_indices, torch.tensor(HOST_PAGE_IDS, device=device), page_size=PAGE, check_bounds=True
        )
    assert changed_buffers(before, pool) == []
    gather(
        pool, staging, slot_indices, torch.tensor(HOST_PAGE_IDS, device=device), page_size=PAGE, check_bounds=True
    )  # gather may repeat
