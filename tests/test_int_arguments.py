"""Integer arguments reject bools (``True`` is an int to Python, never a size or an index here)."""

from __future__ import annotations

import tempfile

import pytest
import torch

from kvstage.errors import InvalidArgumentError, KvstageError, is_int
from kvstage.kv_layout import KVLayout
from kvstage.offload.host_pool import HostPool
from kvstage.replay.models import resolve_model
from kvstage.storage import LayoutFingerprint
from kvstage.storage.file_store import FileStore
from kvstage.storage.memory_store import MemoryStore

FINGERPRINT = LayoutFingerprint("rig", KVLayout(2, 2, 1, 4, "int32"), 2)


def test_is_int_is_an_int_that_is_not_a_bool():
    assert is_int(0) and is_int(-3) and is_int(2**80)
    assert not is_int(True) and not is_int(False) and not is_int(1.0) and not is_int("1") and not is_int(None)


@pytest.mark.parametrize("field", range(4))
def test_kv_layout_sizes_reject_bools(field):
    args = [2, 2, 1, 4, "int32"]
    args[field] = True
    with pytest.raises(InvalidArgumentError, match="got True"):
        KVLayout(*args)


@pytest.mark.parametrize("field", ["page_size", "tp_size", "tp_rank", "first_layer"])
def test_layout_fingerprint_ints_reject_bools(field):
    kwargs = {"page_size": 2, "tp_size": 2, "tp_rank": 0, "first_layer": 0, field: True}
    with pytest.raises(InvalidArgumentError, match=f"{field}: .*got True"):
        LayoutFingerprint("rig", KVLayout(2, 2, 1, 4, "int32"), **kwargs)


def test_store_capacities_reject_bools():
    with pytest.raises(InvalidArgumentError, match="capacity_bytes: must be a non-negative int, got True"):
        MemoryStore(FINGERPRINT, capacity_bytes=True)
    with pytest.raises(InvalidArgumentError, match="capacity_pages: must be a non-negative int, got False"):
        MemoryStore(FINGERPRINT, capacity_pages=False)
    with tempfile.TemporaryDirectory() as directory:
        with pytest.raises(InvalidArgumentError, match="capacity_bytes: must be a non-negative int, got True"):
            FileStore(FINGERPRINT, directory, capacity_bytes=True)


def test_host_pool_page_rejects_bools():
    pool = HostPool(KVLayout(1, 1, 1, 4, torch.float16), num_pages=4, page_size=2, pin=False)
    with pytest.raises(InvalidArgumentError, match=r"^host_page_id: must be in \[0, 4\), got True"):
        pool.page(True)


@pytest.mark.parametrize("option", ["layers", "heads", "head_dim"])
def test_model_sizes_reject_bools(option):
    with pytest.raises(KvstageError, match="must be a positive int, got True"):
        resolve_model(None, **{option: True})
