"""Sliding-window and sidecar pages go through the same gather/scatter as full-attention KV.

A sliding-window layer group is a KV pool of its own (fewer layers, its own slots); a DSA
indexer sidecar is a per-token row of its own size and dtype (index K in fp8 e4m3 plus an
fp32 scale: 132 bytes at ``index_head_dim`` 128, 20 bytes at 16), or, as sglang's
``DSATokenToKVPool`` keeps it, one uint8 row per *page* (``page_size * index_head_dim`` K
bytes, then ``page_size`` fp32 scales). Each is checked byte for byte against plain Python
loops (:mod:`kernel_helpers`) on both backends, with every destination poisoned first.
"""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.kernels import KVPool, gather, scatter

from kernel_helpers import (
    as_bytes,
    changed_buffers,
    expected_pool_after_scatter,
    expected_staging,
    make_indices,
    make_pool,
    make_staging,
    pool_bytes,
    pool_equals,
    random_bytes_,
)

BACKENDS = ["triton", "torch"]

# (name, parts, layers, heads, head_dim, dtype, page_size): rows of their own size and dtype.
SIDECARS = [
    ("dsa-index-k-and-scale-132B", 1, 3, 1, 132, torch.uint8, 4),  # 128 fp8 + 4-byte fp32 scale
    ("dsa-tiny-index-20B", 1, 2, 1, 20, torch.uint8, 3),  # index_head_dim 16 + scale
    ("dsa-index-k-fp8", 1, 2, 1, 16, torch.float8_e4m3fn, 3),  # the K alone, as fp8
    ("dsa-scale-fp32", 1, 2, 1, 1, torch.float32, 3),  # the scale alone: 4-byte rows
    ("three-byte-rows", 1, 2, 1, 3, torch.uint8, 2),
    ("swa-group-bf16", 2, 2, 2, 16, torch.bfloat16, 4),  # a gpt-oss-like SWA group: 2 of 4 layers
    ("swa-group-fp8", 2, 1, 1, 20, torch.float8_e4m3fn, 1),
]


def sidecar_id(case) -> str:
    return case[0]


def build(device, case, *, storage="lists", num_pages=3, layout="page_first", seed=0):
    _, parts, layers, heads, dim, dtype, page = case
    pool = make_pool(
        parts=parts,
        layers=layers,
        num_slots=num_pages * page + 7,
        heads=heads,
        dim=dim,
        dtype=dtype,
        device=device,
        storage=storage,
        seed=seed,
    )
    staging = make_staging(pool, num_pages + 2, page, layout)
    slot_indices, host_page_ids = make_indices(pool, num_pages, page, num_pages + 2, seed=seed)
    return pool, staging, slot_indices, host_page_ids


@pytest.mark.parametrize("case", SIDECARS, ids=sidecar_id)
def test_pool_describes_the_row(device, case):
    _, parts, layers, heads, dim, dtype, page = case
    pool = build(device, case)[0]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    assert (pool.kv_parts, pool.num_layers, pool.dtype) == (parts, layers, dtype)
    assert pool.row_bytes == heads * dim * itemsize
    assert pool.page_bytes(page) == parts * layers * page * heads * dim * itemsize


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SIDECARS, ids=sidecar_id)
def test_gather_writes_exactly_the_pages_asked_for(device, case, backend, layout):
    pool, staging, slot_indices, host_page_ids = build(device, case, layout=layout)
    page = case[-1]
    want = expected_staging(pool, staging, slot_indices, host_page_ids, page, layout)
    before = pool_bytes(pool)
    gather(pool, staging, slot_indices, host_page_ids, page_size=page, layout=layout, backend=backend)
    assert torch.equal(as_bytes(staging), want.view(-1))
    assert changed_buffers(before, pool) == []
    for host_page in sorted(set(range(host_page_ids.numel() + 2)) - set(host_page_ids.tolist())):
        plane = (
            staging[host_page] if layout == "page_first" else staging[:, :, host_page * page : (host_page + 1) * page]
        )
        assert (as_bytes(plane) == 0xA5).all()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SIDECARS, ids=sidecar_id)
def test_scatter_writes_exactly_the_slots_asked_for(device, case, backend, layout):
    pool, staging, slot_indices, host_page_ids = build(device, case, layout=layout)
    page = case[-1]
    random_bytes_(staging, torch.Generator().manual_seed(5))
    want = expected_pool_after_scatter(pool, staging, slot_indices, host_page_ids, page, layout)
    scatter(staging, pool, slot_indices, host_page_ids, page_size=page, layout=layout, backend=backend)
    assert pool_equals(pool, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [SIDECARS[0], SIDECARS[4], SIDECARS[5]], ids=sidecar_id)
def test_buffers_at_odd_offsets_and_strided_indices(device, case, backend):
    """Buffers carved out of one allocation at odd offsets (so no wide words), slots given as a
    column of a ``req_to_token``-like table, host page ids with a storage offset."""
    pool, staging, slot_indices, host_page_ids = build(device, case, storage="scattered")
    page = case[-1]
    table = torch.full((slot_indices.numel(), 3), 10**6, dtype=torch.int64, device=device)
    table[:, 1] = slot_indices
    strided_slots = table[:, 1]
    padded = torch.full((host_page_ids.numel() + 2,), 10**6, dtype=torch.int64, device=device)
    padded[2:] = host_page_ids
    offset_ids = padded[2:]
    want = expected_staging(pool, staging, slot_indices, host_page_ids, page)
    gather(pool, staging, strided_slots, offset_ids, page_size=page, backend=backend)
    assert torch.equal(as_bytes(staging), want.view(-1))
    random_bytes_(staging, torch.Generator().manual_seed(6))
    want_pool = expected_pool_after_scatter(pool, staging, slot_indices, host_page_ids, page)
    scatter(staging, pool, strided_slots, offset_ids, page_size=page, backend=backend)
    assert pool_equals(pool, want_pool)


@pytest.mark.parametrize("backend", BACKENDS)
def test_swa_group_scatter_of_one_layer(device, backend):
    """Layer-by-layer loading of a window: one SWA layer of the group, nothing else."""
    case = SIDECARS[5]
    pool, staging, slot_indices, host_page_ids = build(device, case)
    random_bytes_(staging, torch.Generator().manual_seed(8))
    want = expected_pool_after_scatter(pool, staging, slot_indices, host_page_ids, case[-1], layer=1)
    before = pool_bytes(pool)
    scatter(staging, pool, slot_indices, host_page_ids, page_size=case[-1], layer=1, backend=backend)
    assert pool_equals(pool, want)
    assert changed_buffers(before, pool) == [1, 3]  # K and V of layer 1


def packed_indexer_pages(num_pages: int, page_size: int, index_head_dim: int, layers: int, device, seed: int):
    """sglang's DSA indexer buffers: per layer ``[num_pages, page_size * (index_head_dim + 4)]``
    uint8, each page its tokens' fp8 K rows then their fp32 scales; returned with the K and
    scale values each page holds (fp8 bytes and fp32 values), by layer."""
    gen = torch.Generator().manual_seed(seed)
    buffers, contents = [], []
    for _ in range(layers):
        k = random_bytes_(torch.empty(num_pages, page_size, index_head_dim, dtype=torch.uint8), gen)
        scale = torch.rand(num_pages, page_size, generator=gen, dtype=torch.float32) + 0.5
        packed = torch.cat([k.view(num_pages, -1), scale.view(torch.uint8).view(num_pages, -1)], dim=1)
        buffers.append(packed.to(device))
        contents.append((k, scale))
    return buffers, contents


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size, index_head_dim", [(4, 16), (1, 16), (3, 128)])
def test_sglang_packed_indexer_pages_move_as_one_row_per_page(device, backend, page_size, index_head_dim):
    """A packed indexer page is one row of ``page_size * (index_head_dim + 4)`` bytes: a pool of
    ``[num_pages, 1, page_bytes]`` buffers moved at page_size 1, with the device pages as slots."""
    num_pages, layers = 9, 2
    buffers, contents = packed_indexer_pages(num_pages, page_size, index_head_dim, layers, device, seed=1)
    pool = KVPool.from_rows(buffers)  # sglang's 2-D buffers as they are: views, no copy
    assert pool.row_bytes == page_size * (index_head_dim + 4)
    assert [t.data_ptr() for t in pool.tensors()] == [b.data_ptr() for b in buffers]
    device_pages = torch.tensor([7, 2, 5], device=device)
    host_page_ids = torch.tensor([1, 3, 0], device=device)
    staging = make_staging(pool, 5, 1, "page_first")
    gather(pool, staging, device_pages, host_page_ids, page_size=1, backend=backend)
    for host, dev in zip(host_page_ids.tolist(), device_pages.tolist()):
        for layer, (k, scale) in enumerate(contents):
            row = as_bytes(staging[host, layer, 0, 0, 0])
            k_bytes = page_size * index_head_dim
            assert torch.equal(row[:k_bytes], k[dev].reshape(-1))
            assert torch.equal(row[k_bytes:].view(torch.float32), scale[dev])
    for host in (2, 4):
        assert (as_bytes(staging[host]) == 0xA5).all()
    # back into other device pages of fresh buffers: the pages land whole, the rest stays poisoned
    fresh = [torch.full_like(b, 0xA5) for b in buffers]
    target = KVPool.from_rows(fresh)
    scatter(staging, target, torch.tensor([0, 8, 4], device=device), host_page_ids, page_size=1, backend=backend)
    for layer in range(layers):
        got = fresh[layer].cpu()
        for dst, src in zip((0, 8, 4), device_pages.tolist()):
            assert torch.equal(got[dst], buffers[layer][src].cpu())
        others = [p for p in range(num_pages) if p not in (0, 8, 4)]
        assert (got[others] == 0xA5).all()


@pytest.mark.parametrize(
    "rows, argument, rule",
    [
        ([], "row_buffers", "at least one layer"),
        ([torch.zeros(4, 1, 8)], "row_buffers[0]", "must be [num_slots, row_elems]"),
        ([torch.zeros(4, 8), "x"], "row_buffers[1]", "must be a torch.Tensor"),
        ([torch.zeros(4, 8), torch.zeros(8, 4).t()], "row_buffers[1]", "must be contiguous"),
        ([torch.zeros(4, 8), torch.zeros(4, 9)], "row_buffers[1]", "shape must be (4, 1, 8)"),
        ([torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.uint8)], "row_buffers[1]", "dtype must be torch.float32"),
    ],
    ids=["empty", "3-d", "not-a-tensor", "not-contiguous", "shape", "dtype"],
)
def test_from_rows_rejects_bad_buffers(rows, argument, rule):
    with pytest.raises((InvalidArgumentError, ArgumentTypeError)) as info:
        KVPool.from_rows(rows)
    assert str(info.value).startswith(f"{argument}: ") and rule in str(info.value), str(info.value)
