"""KVPool constructors, attributes and validation; staging_shape."""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import ArgumentTypeError, DeviceMismatchError, InvalidArgumentError
from kvstage.kernels import KVPool, staging_shape
from kvstage.kv_layout import KVLayout

from kernel_helpers import make_pool


def test_mha_pool_reports_its_shape(device):
    k = [torch.zeros(10, 5, 72, dtype=torch.bfloat16, device=device) for _ in range(3)]
    v = [torch.zeros(10, 5, 72, dtype=torch.bfloat16, device=device) for _ in range(3)]
    pool = KVPool.mha(k, v)
    assert (pool.kv_parts, pool.num_layers, pool.num_slots, pool.num_heads, pool.head_dim) == (2, 3, 10, 5, 72)
    assert pool.dtype == torch.bfloat16 and pool.device == torch.device(device)
    assert pool.row_bytes == 5 * 72 * 2
    assert pool.page_bytes(16) == 2 * 3 * 16 * 5 * 72 * 2
    assert pool.layer(1, 2) is v[2] and pool.layer(0, 0) is k[0]
    assert not pool.is_mla


def test_mla_pool_has_one_part(device):
    latent = [torch.zeros(7, 1, 576, dtype=torch.float8_e4m3fn, device=device) for _ in range(2)]
    pool = KVPool.mla(latent)
    assert (pool.kv_parts, pool.num_layers, pool.num_heads, pool.head_dim) == (1, 2, 1, 576)
    assert pool.is_mla and pool.page_bytes(1) == 2 * 576


def test_pool_layout_is_the_shared_layout_value(device):
    pool = make_pool(parts=2, layers=3, num_slots=4, heads=5, dim=72, dtype=torch.bfloat16, device=device)
    assert pool.layout == KVLayout(num_layers=3, kv_parts=2, num_heads=5, head_dim=72, dtype=torch.bfloat16)
    assert pool.row_bytes == pool.layout.row_bytes == 720
    assert pool.page_bytes(16) == pool.layout.page_bytes(16) == 2 * 3 * 16 * 720
    with pytest.raises(InvalidArgumentError, match="^page_size:"):
        pool.page_bytes(0)


def test_from_stacked_views_the_tensor(device):
    t = torch.arange(2 * 3 * 4 * 1 * 8, dtype=torch.float32, device=device).view(2, 3, 4, 1, 8)
    pool = KVPool.from_stacked(t)
    assert (pool.kv_parts, pool.num_layers, pool.num_slots) == (2, 3, 4)
    assert pool.layer(1, 2).data_ptr() == t[1, 2].data_ptr()
    assert torch.equal(pool.layer(1, 2), t[1, 2])


@pytest.mark.parametrize(
    "build, argument, error",
    [
        (lambda d: KVPool.mha([], []), "k_buffers", InvalidArgumentError),
        (lambda d: KVPool.mha([torch.zeros(4, 2, 8, device=d)], []), "v_buffers", InvalidArgumentError),
        (
            lambda d: KVPool.mha([torch.zeros(4, 2, 8, device=d)], [torch.zeros(4, 2, 9, device=d)]),
            "v_buffers[0]",
            InvalidArgumentError,
        ),
        (
            lambda d: KVPool.mha(
                [torch.zeros(4, 2, 8, device=d)], [torch.zeros(4, 2, 8, dtype=torch.float16, device=d)]
            ),
            "v_buffers[0]",
            ArgumentTypeError,
        ),
        (
            lambda d: KVPool.mha([torch.zeros(4, 2, 8, device=d)], [torch.zeros(4, 8, 2, device=d).transpose(1, 2)]),
            "v_buffers[0]",
            InvalidArgumentError,
        ),
        (
            lambda d: KVPool.mha([torch.zeros(4, 16, device=d)], [torch.zeros(4, 16, device=d)]),
            "k_buffers[0]",
            InvalidArgumentError,
        ),
        (lambda d: KVPool.mha(["x"], ["y"]), "k_buffers[0]", ArgumentTypeError),
        (lambda d: KVPool.mla([torch.zeros(4, 2, 8, device=d)]), "latent_buffers[0]", InvalidArgumentError),
        (lambda d: KVPool.from_stacked(torch.zeros(3, 1, 4, 1, 8, device=d)), "t", InvalidArgumentError),
        (lambda d: KVPool.from_stacked(torch.zeros(2, 1, 4, 8, device=d)), "t", InvalidArgumentError),
        (
            lambda d: KVPool.from_stacked(torch.zeros(2, 1, 8, 4, 2, device=d).transpose(2, 3)),
            "t",
            InvalidArgumentError,
        ),
        (lambda d: KVPool.from_stacked([1, 2]), "t", ArgumentTypeError),
    ],
    ids=[
        "mha-empty",
        "mha-layer-count",
        "mha-shape",
        "mha-dtype",
        "mha-not-contiguous",
        "mha-2d",
        "mha-not-tensor",
        "mla-heads",
        "stacked-parts",
        "stacked-4d",
        "stacked-not-contiguous",
        "stacked-not-tensor",
    ],
)
def test_pool_rejects_bad_buffers(device, build, argument, error):
    with pytest.raises(error) as info:
        build(device)
    assert str(info.value).startswith(f"{argument}:")


@pytest.mark.parametrize("other", ["meta"] + (["cuda"] if torch.cuda.is_available() else []))
def test_pool_rejects_buffers_on_two_devices(other):
    with pytest.raises(DeviceMismatchError, match=rf"^v_buffers\[0\]: device must be cpu like the others, got {other}"):
        KVPool.mha([torch.zeros(4, 2, 8)], [torch.zeros(4, 2, 8, device=other)])


def test_mla_pool_names_the_latent_buffer_on_another_device():
    with pytest.raises(
        DeviceMismatchError, match=r"^latent_buffers\[1\]: device must be cpu like the others, got meta"
    ):
        KVPool.mla([torch.zeros(4, 1, 8), torch.zeros(4, 1, 8, device="meta")])


def test_mha_pool_names_the_v_buffer_as_passed():
    with pytest.raises(DeviceMismatchError, match=r"^v_buffers\[1\]: device must be cpu like the others, got meta"):
        KVPool.mha([torch.zeros(4, 2, 8)] * 2, [torch.zeros(4, 2, 8), torch.zeros(4, 2, 8, device="meta")])


def test_staging_shapes_of_both_layouts(device):
    pool = make_pool(parts=2, layers=3, num_slots=8, heads=5, dim=72, dtype=torch.float16, device=device)
    assert staging_shape(pool, 4, 16) == (4, 3, 2, 16, 5, 72)
    assert staging_shape(pool, 4, 16, "layer_first") == (2, 3, 64, 5, 72)
    mla = make_pool(parts=1, layers=2, num_slots=8, heads=1, dim=576, dtype=torch.bfloat16, device=device)
    assert staging_shape(mla, 0, 1) == (0, 2, 1, 1, 1, 576)


@pytest.mark.parametrize(
    "args, argument",
    [((-1, 16, "page_first"), "num_host_pages"), ((1, 0, "page_first"), "page_size"), ((1, 16, "pages"), "layout")],
    ids=["negative-pages", "zero-page-size", "unknown-layout"],
)
def test_staging_shape_rejects_bad_arguments(device, args, argument):
    pool = make_pool(parts=1, layers=1, num_slots=4, heads=1, dim=8, dtype=torch.float16, device=device)
    with pytest.raises(InvalidArgumentError, match=f"^{argument}:"):
        staging_shape(pool, *args)


def test_word_alignment_is_the_widest_word_dividing_rows_and_addresses():
    base = torch.zeros(4 * 64 + 2, dtype=torch.uint8)
    assert KVPool.mla([base[:256].view(4, 1, 64)]).word_alignment == min(16, base.data_ptr() & -base.data_ptr())
    odd = KVPool.mla([base[2:258].view(4, 1, 64)])  # starts 2 bytes in: 2-byte words at most
    assert odd.word_alignment == 2
    assert KVPool.mla([torch.zeros(4, 1, 6, dtype=torch.uint8)]).word_alignment == 2  # 6-byte rows
    assert KVPool.mla([torch.zeros(4, 1, 3, dtype=torch.uint8)]).word_alignment == 1


def test_allocate_makes_an_empty_pool_of_a_layout():
    from kvstage.errors import ArgumentTypeError, InvalidArgumentError
    from kvstage.kv_layout import KVLayout

    layout = KVLayout(3, 2, 2, 8, "bfloat16")
    pool = KVPool.allocate(layout, 40, fill=float("nan"))
    assert pool.layout == layout and pool.num_slots == 40 and len(pool.tensors()) == 6
    assert all(t.shape == (40, 2, 8) and bool(t.isnan().all()) for t in pool.tensors())
    mla = KVPool.allocate(KVLayout(2, 1, 1, 576, "float8_e4m3fn"), 4)
    assert mla.is_mla and mla.row_bytes == 576
    with pytest.raises(InvalidArgumentError, match="^num_slots: must be a positive int"):
        KVPool.allocate(layout, 0)
    with pytest.raises(ArgumentTypeError, match="^layout: must be a KVLayout"):
        KVPool.allocate((3, 2, 2, 8), 4)
