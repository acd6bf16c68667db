"""open_shared_storage: one store per (URL, fingerprint) in a process, closed by its last user."""

from __future__ import annotations

import torch

from kvstage.storage import LayoutFingerprint
from kvstage.storage.shared import open_shared_storage, release_shared_storage

FINGERPRINT = LayoutFingerprint.opaque("m", page_bytes=16, page_format="shared-test")


def test_callers_of_one_url_and_fingerprint_share_one_store_until_the_last_releases_it():
    first = open_shared_storage("memory", FINGERPRINT)
    second = open_shared_storage("memory", FINGERPRINT)
    assert first is second
    first.put(["a"], [torch.ones(16, dtype=torch.uint8)])
    release_shared_storage(first)
    assert second.exists(["a"]) == [True]  # still open for the second user
    release_shared_storage(second)
    third = open_shared_storage("memory", FINGERPRINT)
    assert third is not first and third.exists(["a"]) == [False]  # a new store once all let go
    release_shared_storage(third)


def test_another_fingerprint_or_url_gets_its_own_store():
    other = LayoutFingerprint.opaque("m", page_bytes=16, page_format="other")
    stores = [
        open_shared_storage("memory", FINGERPRINT),
        open_shared_storage("memory", other),
        open_shared_storage("memory:1024", FINGERPRINT),
    ]
    assert len({id(store) for store in stores}) == 3
    for store in stores:
        release_shared_storage(store)
