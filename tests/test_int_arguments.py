"""Integer arguments reject bools (``True`` is an int to Python, never a size or an index here)."""

from __future__ import annotations

import tempfile

import pytest
import torch

from kvstage.errors import InvalidArgumentError, KvstageError, is_int
from kvstage.offload.file_store import FileStore
from kvstage.offload.host_pool import HostPool
from kvstage.offload.memory_store import MemoryStore
from kvstage.offload.storage import LayoutFingerprint
from kvstage.replay.models import resolve_model

FINGERPRINT = LayoutFingerprint("rig", "int32", 2, 2, 1, 4, 2)


def test_is_int_is_an_int_that_is_not_a_bool():
    assert is_int(0) and is_int(-3) and is_int(2**80)
    assert not is_int(True) and not is_int(False) and not is_int(1.0) and not is_int("1") and not is_int(None)


@pytest.mark.parametrize("field", range(2, 7))
def test_layout_fingerprint_sizes_reject_bools(field):
    args = ["rig", "int32", 2, 2, 1, 4, 2]
    args[field] = True
    with pytest.raises(InvalidArgumentError, match="must be a positive int, got True"):
        LayoutFingerprint(*args)


def test_store_capacities_reject_bools():
    with pytest.raises(InvalidArgumentError, match="capacity_bytes: must be a non-negative int, got True"):
        MemoryStore(FINGERPRINT, capacity_bytes=True)
    with pytest.raises(InvalidArgumentError, match="capacity_pages: must be a non-negative int, got False"):
        MemoryStore(FINGERPRINT, capacity_pages=False)
    with tempfile.TemporaryDirectory() as directory:
        with pytest.raises(InvalidArgumentError, match="capacity_bytes: must be a non-negative int, got True"):
            FileStore(FINGERPRINT, directory, capacity_bytes=True)


def test_host_pool_page_rejects_bools():
    pool = HostPool(num_layers=1, kv_parts=1, page_size=2, head_num=1, head_dim=4, dtype=torch.float16, num_pages=4)
    with pytest.raises(InvalidArgumentError, match=r"page: must be in \[0, 4\), got True"):
        pool.page(True)


@pytest.mark.parametrize("option", ["layers", "heads", "head_dim"])
def test_model_sizes_reject_bools(option):
    with pytest.raises(KvstageError, match="must be a positive int, got True"):
        resolve_model(None, **{option: True})
