"""gather/scatter (Triton) and the torch reference, each against plain Python loops
(:mod:`kernel_helpers`), which share no code with the planning both paths go through.

Every destination is poisoned first (every byte 0xA5), so a target element left unwritten,
or a byte written outside the target pages, shows up in the byte-exact comparison.
"""

from __future__ import annotations

import pytest
import torch

from kvstage.kernels import gather, gather_reference, scatter, scatter_reference

from kernel_helpers import (
    as_bytes,
    changed_buffers,
    expected_pool_after_scatter,
    expected_staging,
    make_indices,
    make_pool,
    make_staging,
    poison_,
    pool_bytes,
    pool_equals,
    random_bytes_,
)

BACKEND = "triton"  # the interpreter on CPU (conftest sets TRITON_INTERPRET=1), native on CUDA

# (parts, layers, heads, head_dim, page_size, dtype): the odd shapes of the issue, each dtype at least once.
SHAPES = [
    (2, 1, 1, 72, 1, torch.float16),
    (2, 2, 5, 72, 3, torch.bfloat16),
    (2, 3, 8, 72, 16, torch.float32),
    (1, 5, 1, 576, 64, torch.float8_e4m3fn),
    (1, 4, 1, 576, 3, torch.float8_e5m2),
    (2, 2, 5, 576, 1, torch.int8),
    (2, 2, 1, 9, 3, torch.int8),  # 9-byte rows: byte words
    (2, 2, 1, 9, 3, torch.float16),  # 18-byte rows: 2-byte words
]


def shape_id(shape) -> str:
    parts, layers, heads, dim, page, dtype = shape
    return f"{'mha' if parts == 2 else 'mla'}-L{layers}-h{heads}-d{dim}-p{page}-{str(dtype).removeprefix('torch.')}"


def build(device, shape, *, storage="lists", num_pages=3, seed=0, layout="page_first", index_dtype=torch.int64):
    parts, layers, heads, dim, page, dtype = shape
    num_host_pages = num_pages + 2  # two host pages stay untouched: they must keep their poison
    num_slots = max(num_pages * page + 5, 8)
    pool = make_pool(
        parts=parts,
        layers=layers,
        num_slots=num_slots,
        heads=heads,
        dim=dim,
        dtype=dtype,
        device=device,
        storage=storage,
        seed=seed,
    )
    staging = make_staging(pool, num_host_pages, page, layout)
    slot_indices, host_page_ids = make_indices(
        pool, num_pages, page, num_host_pages, seed=seed, index_dtype=index_dtype
    )
    return pool, staging, slot_indices, host_page_ids


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("shape", SHAPES[:2] + SHAPES[3:4], ids=shape_id)
def test_reference_gather_equals_python_loops(device, shape, layout):
    pool, staging, slot_indices, host_page_ids = build(device, shape, num_pages=2, layout=layout)
    want = expected_staging(pool, staging, slot_indices, host_page_ids, shape[4], layout)
    gather_reference(pool, staging, slot_indices, host_page_ids, page_size=shape[4], layout=layout)
    assert torch.equal(as_bytes(staging), want.view(-1))


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_gather_equals_python_loops_and_leaves_other_pages_poisoned(device, shape, layout):
    pool, staging, slot_indices, host_page_ids = build(device, shape, layout=layout)
    want = expected_staging(pool, staging, slot_indices, host_page_ids, shape[4], layout)
    before = pool_bytes(pool)
    gather(pool, staging, slot_indices, host_page_ids, page_size=shape[4], layout=layout, backend=BACKEND)
    assert torch.equal(as_bytes(staging), want.view(-1))
    assert changed_buffers(before, pool) == []  # the source is only read
    # the host pages nobody asked for still hold the poison
    untouched = sorted(set(range(host_page_ids.numel() + 2)) - set(host_page_ids.tolist()))
    for host_page in untouched:
        plane = (
            staging[host_page]
            if layout == "page_first"
            else staging[:, :, host_page * shape[4] : (host_page + 1) * shape[4]]
        )
        assert (as_bytes(plane) == 0xA5).all()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_scatter_equals_python_loops_and_leaves_other_slots_alone(device, shape, layout):
    pool, staging, slot_indices, host_page_ids = build(device, shape, layout=layout)
    random_bytes_(staging, torch.Generator().manual_seed(7))
    want = expected_pool_after_scatter(pool, staging, slot_indices, host_page_ids, shape[4], layout)
    scatter(staging, pool, slot_indices, host_page_ids, page_size=shape[4], layout=layout, backend=BACKEND)
    assert pool_equals(pool, want)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("storage", ["stacked", "scattered"])
def test_gather_then_scatter_restores_the_pool(device, storage, layout):
    shape = (2, 3, 5, 72, 3, torch.bfloat16)
    pool, staging, slot_indices, host_page_ids = build(
        device, shape, storage=storage, layout=layout, index_dtype=torch.int32
    )
    original = pool_bytes(pool)
    gather(pool, staging, slot_indices, host_page_ids, page_size=3, layout=layout, backend=BACKEND)
    for t in pool.tensors():  # wipe the slots that were gathered, then bring them back
        t.view(torch.uint8)[slot_indices.long()] = 0xA5
    assert changed_buffers(original, pool) != []
    scatter(staging, pool, slot_indices, host_page_ids, page_size=3, layout=layout, backend=BACKEND)
    assert changed_buffers(original, pool) == []


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("backend", [BACKEND, "torch"])
def test_scatter_of_one_layer_writes_only_that_layer(device, layout, backend):
    shape = (2, 4, 5, 72, 3, torch.float16)
    pool, staging, slot_indices, host_page_ids = build(device, shape, layout=layout)
    random_bytes_(staging, torch.Generator().manual_seed(3))
    want = expected_pool_after_scatter(pool, staging, slot_indices, host_page_ids, 3, layout, layer=2)
    before = pool_bytes(pool)
    scatter(staging, pool, slot_indices, host_page_ids, page_size=3, layout=layout, layer=2, backend=backend)
    assert pool_equals(pool, want)
    assert changed_buffers(before, pool) == [2, 4 + 2]  # K and V of layer 2, in pool.tensors() order


@pytest.mark.parametrize("backend", [BACKEND, "torch"])
def test_empty_batch_writes_nothing(device, backend):
    shape = (2, 2, 1, 72, 16, torch.float16)
    pool, staging, _, _ = build(device, shape, num_pages=1)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    before = pool_bytes(pool)
    gather(pool, staging, empty, empty, page_size=16, backend=backend)
    scatter(staging, pool, empty, empty, page_size=16, backend=backend)
    assert (as_bytes(staging) == 0xA5).all()
    assert changed_buffers(before, pool) == []


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("host", ["run", "shuffled-run", "scattered"])
@pytest.mark.parametrize("device_slots", ["aligned-pages", "random-slots"])
@pytest.mark.parametrize("page_size, dim", [(3, 8), (16, 1024)], ids=["p3-small-rows", "p16-32KiB-host_page_ids"])
def test_reference_paths_equal_python_loops(device, layout, host, device_slots, page_size, dim):
    """Every route of the reference (host run or not, device pages aligned or not, direct out or not)."""
    pool = make_pool(parts=2, layers=2, num_slots=8 * page_size, heads=1, dim=dim, dtype=torch.bfloat16, device=device)
    n, num_host_pages = 3, 6
    slot_indices, _ = make_indices(pool, n, page_size, num_host_pages, aligned=device_slots == "aligned-pages")
    host_page_ids = {"run": [2, 3, 4], "shuffled-run": [4, 2, 3], "scattered": [5, 0, 3]}[host]
    host_page_ids = torch.tensor(host_page_ids, device=device)
    staging = make_staging(pool, num_host_pages, page_size, layout)
    want = expected_staging(pool, staging, slot_indices, host_page_ids, page_size, layout)
    gather_reference(pool, staging, slot_indices, host_page_ids, page_size=page_size, layout=layout)
    assert torch.equal(as_bytes(staging), want.view(-1))
    random_bytes_(staging, torch.Generator().manual_seed(9))
    want_pool = expected_pool_after_scatter(pool, staging, slot_indices, host_page_ids, page_size, layout)
    scatter_reference(staging, pool, slot_indices, host_page_ids, page_size=page_size, layout=layout)
    assert pool_equals(pool, want_pool)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_aligned_pages_of_a_pool_whose_slots_are_not_a_page_multiple(device, backend, layout):
    """A pool of 10 slots at page size 3: aligned page runs (0-2, 3-5, 6-8) onto consecutive host pages
    take the torch path's whole-page route, which must not view the pool as [num_slots / 3, ...]."""
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
    """The torch reference's whole-page route on a pool of 11 slots at page size 3 (float8 MLA):
    whole aligned pages copy exactly though the pool is no whole number of pages."""
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
