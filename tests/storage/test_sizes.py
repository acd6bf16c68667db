"""One size syntax for every storage URL (``kvstage.storage.sizes.parse_size``): ``memory:SIZE``,
``file:DIR?capacity_bytes=SIZE`` and Mooncake's ``segment`` / ``buffer`` / ``bounce`` take the
same strings with the same meaning, and a bad one names the URL parameter and the rule."""

from __future__ import annotations

import pytest

from kvstage.errors import InvalidArgumentError
from kvstage.storage import LayoutFingerprint, open_storage
from kvstage.storage.mooncake.config import MooncakeConfig, parse_mooncake_url
from kvstage.storage.sizes import SIZE_RULE, parse_size

FP = LayoutFingerprint.opaque("m", page_bytes=4096, page_format="test")


@pytest.mark.parametrize(
    "text,size",
    [
        ("4096", 4096),
        (4096, 4096),
        ("0", 0),
        ("7B", 7),
        ("7b", 7),
        ("2KB", 2000),
        ("16MB", 16 * 10**6),
        ("8GB", 8 * 10**9),
        ("8gb", 8 * 10**9),
        ("8Gb", 8 * 10**9),
        ("1TB", 10**12),
        ("3KiB", 3 << 10),
        ("512MiB", 512 << 20),
        ("8GiB", 8 << 30),
        ("8gib", 8 << 30),
        ("8GIB", 8 << 30),
        ("1TiB", 1 << 40),
        ("8 GiB", 8 << 30),
        (" 8GB ", 8 * 10**9),
        ("1.5GiB", 3 << 29),
        ("0.5KB", 500),
        ("2.25KiB", 2304),
    ],
)
def test_a_size_is_bytes_or_a_number_with_a_decimal_or_binary_unit(text, size):
    assert parse_size(text, "capacity") == size


@pytest.mark.parametrize("text", ["lots", "8XB", "-1", "", "1.5", "8GB8", "GB", "0x10", "8 G B", "1e9"])
def test_a_string_that_is_no_size_names_the_argument_and_the_rule(text):
    with pytest.raises(InvalidArgumentError) as caught:
        parse_size(text, "capacity")
    assert str(caught.value) == f"capacity: must be a size, got {text!r}; {SIZE_RULE}"


@pytest.mark.parametrize(
    "text,hint",
    [
        ("8G", "'8GB' (8 * 1000**3) or '8GiB' (8 * 1024**3)"),
        ("512m", "'512MB' (512 * 1000**2) or '512MiB' (512 * 1024**2)"),
        ("4k", "'4KB'"),
    ],
)
def test_a_bare_k_m_g_t_is_refused_as_ambiguous_naming_both_spellings(text, hint):
    with pytest.raises(InvalidArgumentError, match=r"^segment: .* is ambiguous") as caught:
        parse_size(text, "segment")
    assert hint in str(caught.value)


@pytest.mark.parametrize("text", ["0.3B", "1.0000001KB"])
def test_a_size_that_is_not_a_whole_number_of_bytes_is_refused(text):
    with pytest.raises(InvalidArgumentError, match=r"^capacity: .* is not a whole number of bytes"):
        parse_size(text, "capacity")


@pytest.mark.parametrize("value", [True, 1.5, None, -1])
def test_a_value_that_is_no_int_or_string_is_refused(value):
    with pytest.raises(InvalidArgumentError, match=r"^capacity: must be"):
        parse_size(value, "capacity")


def test_memory_takes_a_size_with_a_unit():
    """Was: ``memory:8GB`` refused ("the capacity must be an int number of bytes") while
    Mooncake's ``segment=4GB`` was accepted."""
    assert open_storage("memory:8GB", FP).capacity_pages == 8 * 10**9 // 4096
    assert open_storage("memory:8GiB", FP).capacity_pages == (8 << 30) // 4096
    assert open_storage("memory:40960", FP).capacity_pages == 10


def test_file_takes_a_size_with_a_unit(tmp_path):
    store = open_storage(f"file:{tmp_path}?capacity_bytes=1MiB&io_threads=1", FP)
    assert store.capacity_bytes == 1 << 20
    store.close()


def test_every_url_reads_one_size_string_alike(tmp_path):
    memory = open_storage("memory:3GiB", FP)
    file = open_storage(f"file:{tmp_path}?capacity_bytes=3GiB", FP)
    mooncake = parse_mooncake_url("mooncake://127.0.0.1:50051?segment=3GiB&buffer=3GiB&bounce=3GiB")
    assert memory.capacity_pages * 4096 == file.capacity_bytes == 3 << 30
    assert mooncake.global_segment_size == mooncake.local_buffer_size == mooncake.bounce_bytes == 3 << 30
    assert parse_mooncake_url("mooncake://127.0.0.1:50051?segment=4GB").global_segment_size == 4 * 10**9
    file.close()


def test_a_bad_memory_size_names_the_url_and_the_rule():
    with pytest.raises(InvalidArgumentError) as caught:
        open_storage("memory:8XB", FP)
    assert str(caught.value) == f"storage: 'memory:8XB' capacity: must be a size, got '8XB'; {SIZE_RULE}"


def test_a_bad_file_capacity_names_the_url_parameter_and_the_rule(tmp_path):
    url = f"file:{tmp_path / 'kv'}?capacity_bytes=8G"
    with pytest.raises(
        InvalidArgumentError, match=r"^storage: '.*\?capacity_bytes=8G' capacity_bytes: '8G' is ambiguous"
    ):
        open_storage(url, FP)
    assert not (tmp_path / "kv").exists()  # refused before anything is made


@pytest.mark.parametrize(
    "key,field",
    [
        ("segment", "global_segment_size"),
        ("buffer", "local_buffer_size"),
        ("bounce", "bounce_bytes"),
        ("global_segment_size", "global_segment_size"),
    ],
)
def test_a_bad_mooncake_size_names_the_query_name_the_user_typed(key, field):
    with pytest.raises(InvalidArgumentError) as caught:
        parse_mooncake_url(f"mooncake://127.0.0.1:50051?{key}=lots")
    assert str(caught.value) == f"url: {key}: must be a size, got 'lots'; {SIZE_RULE}"


def test_a_mooncake_dict_size_names_its_field():
    with pytest.raises(InvalidArgumentError, match=r"^local_buffer_size: must be a size, got '64 M B'"):
        MooncakeConfig.from_mapping({"master_server_address": "h:1", "local_buffer_size": "64 M B"})
    with pytest.raises(InvalidArgumentError, match=r"^local_buffer_size: must be positive, got '0GB'"):
        MooncakeConfig(master_server_address="h:1", local_buffer_size="0GB")
    # a client may bring no memory to the pool (test_mooncake_config.py)
    assert MooncakeConfig(master_server_address="h:1", global_segment_size="0GB").global_segment_size == 0
