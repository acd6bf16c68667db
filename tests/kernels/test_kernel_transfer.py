"""gather/scatter against the torch reference, and the reference against plain Python loops.

Every destination is poisoned first (every byte 0xA5), so a target element left unwritten,
or a byte written outside the target pages, shows up in the byte-exact comparison.
"""

from __future__ import annotations

import pytest
import torch

from kernel_helpers import (
    as_bytes,
    expected_staging,
    make_indices,
    make_pool,
    make_staging,
    pool_bytes,
    random_bytes_,
    same_bytes,
)
from kvstage.kernels import gather, gather_reference, scatter, scatter_reference

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


def build(device, shape, *, storage="lists", n_pages=3, seed=0, layout="page_first", index_dtype=torch.int64):
    parts, layers, heads, dim, page, dtype = shape
    n_host = n_pages + 2  # two host pages stay untouched: they must keep their poison
    slots_needed = max(n_pages * page + 5, 8)
    pool = make_pool(parts=parts, layers=layers, slots=slots_needed, heads=heads, dim=dim, dtype=dtype, device=device, storage=storage, seed=seed)
    staging = make_staging(pool, n_host, page, layout)
    slots, pages = make_indices(pool, n_pages, page, n_host, seed=seed, index_dtype=index_dtype)
    return pool, staging, slots, pages


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("shape", SHAPES[:2] + SHAPES[3:4], ids=shape_id)
def test_reference_gather_equals_python_loops(device, shape, layout):
    pool, staging, slots, pages = build(device, shape, n_pages=2, layout=layout)
    want = expected_staging(pool, staging, slots, pages, shape[4], layout)
    gather_reference(pool, staging, slots, pages, page_size=shape[4], layout=layout)
    assert torch.equal(as_bytes(staging), want.view(-1))


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_gather_equals_reference_and_leaves_other_pages_poisoned(device, shape, layout):
    pool, staging, slots, pages = build(device, shape, layout=layout)
    want = staging.clone()
    gather_reference(pool, want, slots, pages, page_size=shape[4], layout=layout)
    before = pool_bytes(pool)
    gather(pool, staging, slots, pages, page_size=shape[4], layout=layout, backend=BACKEND)
    assert same_bytes(staging, want)
    assert all(torch.equal(a, b) for a, b in zip(before, pool_bytes(pool)))  # the source is only read
    # the pages nobody asked for still hold the poison
    untouched = sorted(set(range(pages.numel() + 2)) - set(pages.tolist()))
    for host_page in untouched:
        plane = staging[host_page] if layout == "page_first" else staging[:, :, host_page * shape[4] : (host_page + 1) * shape[4]]
        assert (as_bytes(plane) == 0xA5).all()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_scatter_equals_reference_and_leaves_other_slots_alone(device, shape, layout):
    pool, staging, slots, pages = build(device, shape, layout=layout)
    random_bytes_(staging, torch.Generator().manual_seed(7))
    want = make_pool(parts=shape[0], layers=shape[1], slots=pool.num_slots, heads=shape[2], dim=shape[3], dtype=shape[5], device=device)
    for dst, src in zip(want.tensors(), pool.tensors()):
        dst.copy_(src) if dst.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) else dst.view(torch.uint8).copy_(src.view(torch.uint8))
    scatter_reference(staging, want, slots, pages, page_size=shape[4], layout=layout)
    scatter(staging, pool, slots, pages, page_size=shape[4], layout=layout, backend=BACKEND)
    assert all(same_bytes(a, b) for a, b in zip(pool.tensors(), want.tensors()))


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("storage", ["stacked", "scattered"])
def test_gather_then_scatter_restores_the_pool(device, storage, layout):
    shape = (2, 3, 5, 72, 3, torch.bfloat16)
    pool, staging, slots, pages = build(device, shape, storage=storage, layout=layout, index_dtype=torch.int32)
    original = pool_bytes(pool)
    gather(pool, staging, slots, pages, page_size=3, layout=layout, backend=BACKEND)
    for t in pool.tensors():  # wipe the slots that were gathered, then bring them back
        t.view(torch.uint8)[slots.long()] = 0xA5
    assert not all(torch.equal(a, b) for a, b in zip(original, pool_bytes(pool)))
    scatter(staging, pool, slots, pages, page_size=3, layout=layout, backend=BACKEND)
    assert all(torch.equal(a, b) for a, b in zip(original, pool_bytes(pool)))


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_scatter_of_one_layer_writes_only_that_layer(device, layout):
    shape = (2, 4, 5, 72, 3, torch.float16)
    pool, staging, slots, pages = build(device, shape, layout=layout)
    random_bytes_(staging, torch.Generator().manual_seed(3))
    want = make_pool(parts=2, layers=4, slots=pool.num_slots, heads=5, dim=72, dtype=torch.float16, device=device)
    for dst, src in zip(want.tensors(), pool.tensors()):
        dst.copy_(src)
    before = pool_bytes(pool)
    scatter_reference(staging, want, slots, pages, page_size=3, layout=layout, layer=2)
    scatter(staging, pool, slots, pages, page_size=3, layout=layout, layer=2, backend=BACKEND)
    after = pool_bytes(pool)
    assert all(same_bytes(a, b) for a, b in zip(pool.tensors(), want.tensors()))
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if not torch.equal(a, b)]
    assert changed == [2, 4 + 2]  # K and V of layer 2, in pool.tensors() order


@pytest.mark.parametrize("backend", [BACKEND, "torch"])
def test_empty_batch_writes_nothing(device, backend):
    shape = (2, 2, 1, 72, 16, torch.float16)
    pool, staging, _, _ = build(device, shape, n_pages=1)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    before = pool_bytes(pool)
    gather(pool, staging, empty, empty, page_size=16, backend=backend)
    scatter(staging, pool, empty, empty, page_size=16, backend=backend)
    assert (as_bytes(staging) == 0xA5).all()
    assert all(torch.equal(a, b) for a, b in zip(before, pool_bytes(pool)))
