"""Helpers of the file store's tests (tests/storage: test_store_file.py, test_file_io_threads.py and
the ``file_store`` fixture): a tiny layout, its pages and keys, and what a test checks in a
store's directory."""

from __future__ import annotations

import os

import torch

from kvstage.kv_layout import KVLayout
from kvstage.storage import LayoutFingerprint
from kvstage.storage.page_file import HEADER, TMP_SUFFIX

FP = LayoutFingerprint("tiny/model", KVLayout(2, 2, 1, 4, "float32"), 2)  # 128-byte pages
KEYS = [f"{i:064x}" for i in range(8)]  # one chain's keys, in order
OTHER = [f"{i + 100:064x}" for i in range(8)]  # another chain's
POISON = -7.0  # what a target holds until a get writes it

# A page file of FP under a key of KEYS' length: header, full key, payload (bytes).
PAGE_FILE_BYTES = HEADER.size + len((FP.prefix() + KEYS[0]).encode()) + FP.page_bytes


def page(value: float) -> torch.Tensor:
    """A page of FP (page-first ``[num_layers, kv_parts, page_size, num_heads, head_dim]``,
    float32): ``value``, ``value + 1``, ... ``value + 31``."""
    return torch.arange(32, dtype=torch.float32).add_(value).reshape(2, 2, 2, 1, 4)


def poisoned(count: int) -> list[torch.Tensor]:
    """``count`` get targets of FP's page shape, every element :data:`POISON`."""
    return [torch.full((2, 2, 2, 1, 4), POISON) for _ in range(count)]


def values(statuses) -> list[str]:
    """A put's :class:`kvstage.storage.PutStatus` list as their values (``"stored"``, ...)."""
    return [status.value for status in statuses]


def temporary_files(directory) -> list[str]:
    """The names of the temporary files in ``directory``, sorted."""
    return sorted(name for name in os.listdir(directory) if name.endswith(TMP_SUFFIX))


def directory_bytes(directory) -> int:
    """Bytes of every file in ``directory``: page files and temporary files (one renamed or
    removed while listed is skipped)."""
    total = 0
    for entry in os.scandir(directory):
        try:
            total += entry.stat().st_size
        except FileNotFoundError:
            pass
    return total
