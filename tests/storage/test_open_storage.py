"""open_storage refuses what cannot work before anything is made, naming ``storage`` (the config
key engines take the URL from): an unknown scheme, a non-string URL, a capacity that holds no page."""

from __future__ import annotations

import pytest

from kvstage.errors import InvalidArgumentError
from kvstage.storage import LayoutFingerprint, open_storage

FP = LayoutFingerprint.opaque("m", page_bytes=4096, page_format="test")


@pytest.mark.parametrize("url", ["flie:/var/cache/kvstage", "s3://bucket"])
def test_an_unknown_scheme_names_storage_and_the_known_schemes(url):
    with pytest.raises(
        InvalidArgumentError, match=r"^storage: unknown storage scheme .*known: \['file', 'memory', 'mooncake'\]"
    ):
        open_storage(url, FP)


def test_a_url_that_is_not_a_string_names_storage():
    with pytest.raises(InvalidArgumentError, match=r"^storage: must be a storage URL string, got int"):
        open_storage(4096, FP)


@pytest.mark.parametrize("url", ["memory:100", "memory:4095", "memory:0", "file:{dir}?capacity_bytes=4095"])
def test_a_capacity_below_one_page_is_refused_naming_storage_and_the_page_size(url, tmp_path):
    directory = tmp_path / "kv"
    with pytest.raises(InvalidArgumentError, match=r"^storage: .* holds no page: .*at least one page, 4096 bytes"):
        open_storage(url.format(dir=directory), FP)
    assert not directory.exists()  # nothing made


@pytest.mark.parametrize("url", ["memory:4096", "file:{dir}?capacity_bytes=8192"])
def test_a_capacity_of_one_page_or_more_opens(url, tmp_path):
    store = open_storage(url.format(dir=tmp_path / "kv"), FP)
    store.close()
