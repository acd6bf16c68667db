"""sglang 0.5.23 is importable in this process (skipped with the reason where it is not installed)."""

from __future__ import annotations

import pytest


def test_sglang_0_5_23_and_its_storage_factory_are_importable(sglang_missing):
    if sglang_missing is not None:
        pytest.skip(sglang_missing)
    import sglang
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    import kvstage.integrations.sglang as adapter

    assert sglang.__version__ == "0.5.23"
    backend_class = StorageBackendFactory._load_backend_class(
        "kvstage.integrations.sglang", "KVStageStorage", "kvstage"
    )
    assert backend_class is adapter.KVStageStorage
