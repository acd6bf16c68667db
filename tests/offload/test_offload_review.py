"""Edge cases found in review: storage layouts, misbehaving backends, torn FileStore pages."""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.hashing import PageHasher
from kvstage.kernels import KVPool
from kvstage.offload import HostPool, LayoutFingerprint, MemoryStore, OffloadManager


def _pool_and_host():
    kv_pool = KVPool.from_stacked(torch.zeros((2, 2, 16, 1, 4), dtype=torch.int32))
    return kv_pool, HostPool.like(kv_pool, num_pages=4, page_size=4)


@pytest.mark.parametrize(
    "fingerprint, field",
    [
        (LayoutFingerprint("m", "float32", 2, 2, 1, 4, 4), "dtype"),  # same bytes, another dtype
        (LayoutFingerprint("m", "int32", 4, 2, 1, 4, 2), "num_layers"),  # same bytes: 4 layers x page 2
        (LayoutFingerprint("m", "int32", 2, 2, 2, 2, 4), "head_num"),  # same bytes: 2 heads x dim 2
        (LayoutFingerprint("m", "int32", 2, 1, 2, 4, 4), "kv_parts"),  # same bytes: MLA-shaped
    ],
    ids=["dtype", "layers-and-page", "heads-and-dim", "parts"],
)
def test_a_storage_whose_layout_differs_from_the_pools_is_rejected(fingerprint, field):
    # Pages would be stored under another layout's prefix and read back as that layout.
    kv_pool, host_pool = _pool_and_host()
    assert fingerprint.page_bytes == host_pool.page_bytes
    with pytest.raises(InvalidArgumentError, match=rf"storage: .*{field}"):
        OffloadManager(kv_pool, host_pool, MemoryStore(fingerprint), PageHasher(page_size=4), lambda req: None)


def test_a_storage_with_the_pools_layout_is_accepted_under_a_dtype_alias():
    kv_pool = KVPool.from_stacked(torch.zeros((2, 2, 16, 1, 4), dtype=torch.float16))
    host_pool = HostPool.like(kv_pool, num_pages=4, page_size=4)
    storage = MemoryStore(LayoutFingerprint("m", "half", 2, 2, 1, 4, 4))
    OffloadManager(kv_pool, host_pool, storage, PageHasher(page_size=4), lambda req: None).close()
