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


def build(device, shape, *, storage="lists", num_pages=3, seed=0, layout="page_first", index_dtype=torch.int64):
    parts, layers, heads, dim, page, dtype = shape
    num_host_pages = num_pages + 2  # two host pages stay untouched: they must keep their poison
    num_slots = max(num_pages * page + 5, 8)
    pool = make_pool(parts=parts, layers=layers, num_slots=num_slots, heads=heads, dim=dim, dtype=dtype, device=device, storage=storage, seed=seed)
    staging = make_staging(pool, num_host_pages, page, layout)
    slot_indices, host_page_ids = make_indices(pool, num_pages, page, num_host_pages, seed=seed, index_dtype=index_dtype)
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
def test_gather_equals_reference_and_leaves_other_pages_poisoned(device, shape, layout):
    pool, staging, slot_indices, host_page_ids = build(device, shape, layout=layout)
    want = staging.clone()
    gather_reference(pool, want, slot_indices, host_page_ids, page_size=shape[4], layout=layout)
    before = pool_bytes(pool)
    gather(pool, staging, slot_indices, host_page_ids, page_size=shape[4], layout=layout, backend=BACKEND)
    assert same_bytes(staging, want)
    assert all(torch.equal(a, b) for a, b in zip(before, pool_bytes(pool)))  # the source is only read
    # the host pages nobody asked for still hold the poison
    untouched = sorted(set(range(host_page_ids.numel() + 2)) - set(host_page_ids.tolist()))
    for host_page in untouched:
        plane = staging[host_page] if layout == "page_first" else staging[:, :, host_page * shape[4] : (host_page + 1) * shape[4]]
        assert (as_bytes(plane) == 0xA5).all()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_scatter_equals_reference_and_leaves_other_slots_alone(device, shape, layout):
    pool, staging, slot_indices, host_page_ids = build(device, shape, layout=layout)
    random_bytes_(staging, torch.Generator().manual_seed(7))
    want = make_pool(parts=shape[0], layers=shape[1], num_slots=pool.num_slots, heads=shape[2], dim=shape[3], dtype=shape[5], device=device)
    for dst, src in zip(want.tensors(), pool.tensors()):
        dst.copy_(src) if dst.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) else dst.view(torch.uint8).copy_(src.view(torch.uint8))
    scatter_reference(staging, want, slot_indices, host_page_ids, page_size=shape[4], layout=layout)
    scatter(staging, pool, slot_indices, host_page_ids, page_size=shape[4], layout=layout, backend=BACKEND)
    assert all(same_bytes(a, b) for a, b in zip(pool.tensors(), want.tensors()))


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("storage", ["stacked", "scattered"])
def test_gather_then_scatter_restores_the_pool(device, storage, layout):
    shape = (2, 3, 5, 72, 3, torch.bfloat16)
    pool, staging, slot_indices, host_page_ids = build(device, shape, storage=storage, layout=layout, index_dtype=torch.int32)
    original = pool_bytes(pool)
    gather(pool, staging, slot_indices, host_page_ids, page_size=3, layout=layout, backend=BACKEND)
    for t in pool.tensors():  # wipe the slots that were gathered, then bring them back
        t.view(torch.uint8)[slot_indices.long()] = 0xA5
    assert not all(torch.equal(a, b) for a, b in zip(original, pool_bytes(pool)))
    scatter(staging, pool, slot_indices, host_page_ids, page_size=3, layout=layout, backend=BACKEND)
    assert all(torch.equal(a, b) for a, b in zip(original, pool_bytes(pool)))


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_scatter_of_one_layer_writes_only_that_layer(device, layout):
    shape = (2, 4, 5, 72, 3, torch.float16)
    pool, staging, slot_indices, host_page_ids = build(device, shape, layout=layout)
    random_bytes_(staging, torch.Generator().manual_seed(3))
    want = make_pool(parts=2, layers=4, num_slots=pool.num_slots, heads=5, dim=72, dtype=torch.float16, device=device)
    for dst, src in zip(want.tensors(), pool.tensors()):
        dst.copy_(src)
    before = pool_bytes(pool)
    scatter_reference(staging, want, slot_indices, host_page_ids, page_size=3, layout=layout, layer=2)
    scatter(staging, pool, slot_indices, host_page_ids, page_size=3, layout=layout, layer=2, backend=BACKEND)
    after = pool_bytes(pool)
    assert all(same_bytes(a, b) for a, b in zip(pool.tensors(), want.tensors()))
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if not torch.equal(a, b)]
    assert changed == [2, 4 + 2]  # K and V of layer 2, in pool.tensors() order


@pytest.mark.parametrize("backend", [BACKEND, "torch"])
def test_empty_batch_writes_nothing(device, backend):
    shape = (2, 2, 1, 72, 16, torch.float16)
    pool, staging, _, _ = build(device, shape, num_pages=1)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    before = pool_bytes(pool)
    gather(pool, staging, empty, empty, page_size=16, backend=backend)
    scatter(staging, pool, empty, empty, page_size=16, backend=backend)
    assert (as_bytes(staging) == 0xA5).all()
    assert all(torch.equal(a, b) for a, b in zip(before, pool_bytes(pool)))


def expected_pool_after_scatter(pool_before, staging, slot_indices, host_page_ids, page_size, layout):
    """Each buffer's bytes after a scatter, by plain Python loops."""
    out = [t.detach().cpu().clone().view(torch.uint8) for t in pool_before.tensors()]
    host = staging.detach().cpu().view(torch.uint8)
    s, h = slot_indices.cpu().tolist(), host_page_ids.cpu().tolist()
    for i, host_page in enumerate(h):
        for j in range(page_size):
            for p in range(pool_before.kv_parts):
                for layer in range(pool_before.num_layers):
                    row = host[host_page, layer, p, j] if layout == "page_first" else host[p, layer, host_page * page_size + j]
                    out[p * pool_before.num_layers + layer][s[i * page_size + j]] = row
    return out


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
    assert all(torch.equal(as_bytes(t), w.view(-1)) for t, w in zip(pool.tensors(), want_pool))
