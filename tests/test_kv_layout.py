"""KVLayout: the one layout value; dtype names normalized so one layout is one key space."""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.kernels import KVPool
from kvstage.kv_layout import KVLayout, canonical_dtype
from kvstage.offload import HostPool
from kvstage.storage import LayoutFingerprint


@pytest.mark.parametrize(
    "alias, dtype",
    [
        ("float", torch.float32),
        ("float32", torch.float32),
        ("torch.float32", torch.float32),
        (torch.float, torch.float32),
        ("half", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("float8_e4m3fn", torch.float8_e4m3fn),
    ],
)
def test_dtype_aliases_resolve_to_one_dtype(alias, dtype):
    assert canonical_dtype(alias) is dtype
    assert KVLayout(2, 2, 1, 4, alias).dtype is dtype


def test_aliases_give_one_key_space():
    # "float" and "float32" once gave two key spaces for one layout (0% hits between processes).
    a = LayoutFingerprint("m", KVLayout(2, 2, 1, 4, "float"), 16)
    b = LayoutFingerprint("m", KVLayout(2, 2, 1, 4, torch.float32), 16)
    assert a.prefix() == b.prefix() and "@float32@" in a.prefix()


@pytest.mark.parametrize(
    "bad, rule",
    [
        ("Tensor", "'Tensor' names no torch dtype"),
        ("float64x", "'float64x' names no torch dtype"),
        ("", "'' names no torch dtype"),
        (3, "must be a torch.dtype or its name, got int"),
        (torch.Tensor, "must be a torch.dtype or its name"),
    ],
)
def test_non_dtypes_are_rejected_naming_the_argument(bad, rule):
    with pytest.raises(ArgumentTypeError, match=f"^dtype: {rule}"):
        KVLayout(2, 2, 1, 4, bad)


def test_sizes_and_bytes():
    layout = KVLayout(32, 2, 8, 128, "bfloat16")
    assert (layout.row_bytes, layout.token_bytes, layout.page_bytes(64)) == (2048, 131072, 8 << 20)
    assert layout.page_shape(64) == (32, 2, 64, 8, 128) and layout.dtype_name == "bfloat16"
    with pytest.raises(InvalidArgumentError, match="^kv_parts: must be 1"):
        KVLayout(1, 3, 1, 4, "float16")
    with pytest.raises(InvalidArgumentError, match="^page_size: must be a positive int"):
        layout.page_bytes(0)


def test_pool_host_pool_and_fingerprint_share_the_layout():
    kv_pool = KVPool.mla([torch.zeros(8, 1, 576, dtype=torch.bfloat16) for _ in range(3)])
    host_pool = HostPool.like(kv_pool, num_pages=2, page_size=4, pin=False)
    fingerprint = LayoutFingerprint.of(kv_pool, page_size=4, model_id="dsv3")
    assert kv_pool.layout == host_pool.layout == fingerprint.layout == KVLayout(3, 1, 1, 576, torch.bfloat16)
    assert host_pool.page_bytes == fingerprint.page_bytes == kv_pool.page_bytes(4) == 3 * 4 * 576 * 2
    with pytest.raises(ArgumentTypeError, match="^kv_pool: must be a KVPool, HostPool or KVLayout"):
        LayoutFingerprint.of(object(), page_size=4, model_id="x")
