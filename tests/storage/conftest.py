"""Fixtures of the storage tests: a file store of the tiny layout of ``file_store_rig``."""

from __future__ import annotations

import pytest

from kvstage.storage import FileStore

from file_store_rig import FP


@pytest.fixture
def file_store(tmp_path):
    """A :class:`FileStore` of ``file_store_rig.FP`` (128-byte pages) in ``tmp_path``, one I/O
    thread by default, closed after the test."""
    store = FileStore(FP, tmp_path)
    yield store
    store.close()
