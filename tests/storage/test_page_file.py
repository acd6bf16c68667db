"""The file store's page-file format (kvstage.storage.page_file), without a store: the header
a write leaves, what a read accepts, the names, and removing only the file that was read."""

from __future__ import annotations

import os

import pytest
import torch
import xxhash

from kvstage.kv_layout import KVLayout
from kvstage.storage import LayoutFingerprint
from kvstage.storage.page_file import (
    HASHED,
    HEADER,
    MAGIC,
    NO_PRIOR,
    SUFFIX,
    checksum,
    digest,
    file_size,
    full_key_of,
    owned,
    owner_tag,
    page_file_name,
    parse_header,
    read_page_file,
    remove_if_read,
    remove_page_files,
    tmp_name,
    write_page_file,
)

LAYOUT = KVLayout(2, 2, 1, 4, "float32")
PREFIX = LayoutFingerprint("org/model", LAYOUT, 4).prefix()
KEY = PREFIX + "ab" * 32
PAYLOAD = bytes(range(256)) * 2  # 512 bytes: one page


def read(path, full_key=KEY, page_bytes=None):
    payload = bytearray(len(PAYLOAD) if page_bytes is None else page_bytes)
    with open(path, "rb", buffering=0) as handle:
        ok = read_page_file(handle, os.fstat(handle.fileno()).st_size, full_key, memoryview(payload))
    return ok, bytes(payload)


def test_a_written_page_file_holds_the_documented_header_key_and_payload(tmp_path):
    path = tmp_path / "page"
    prior = digest(PREFIX + "cd" * 32)
    size = write_page_file(path, KEY, PAYLOAD, prior)
    data = path.read_bytes()
    assert size == len(data) == file_size(KEY, len(PAYLOAD)) == 8 + 4 + 8 + 8 + 32 + len(KEY) + 512
    magic, key_length, payload_length, sum_, link = HEADER.unpack_from(data)
    assert (magic, key_length, payload_length, link) == (b"KVSTAGE\x02", len(KEY), 512, prior)
    expected = xxhash.xxh3_64(KEY.encode() + prior + PAYLOAD).intdigest()
    assert sum_ == expected == checksum(KEY.encode(), prior, PAYLOAD)
    assert data[HEADER.size : HEADER.size + len(KEY)] == KEY.encode() and data[-512:] == PAYLOAD
    assert read(path) == (True, PAYLOAD)


def test_a_chain_start_links_to_no_prior_and_parses_as_none(tmp_path):
    path = tmp_path / "page"
    write_page_file(path, KEY, torch.arange(128, dtype=torch.float32).numpy().tobytes(), None)
    data = path.read_bytes()
    assert HEADER.unpack_from(data)[4] == NO_PRIOR == bytes(32)
    assert parse_header(data, len(data), 512) == (KEY, None)
    linked = tmp_path / "linked"
    write_page_file(linked, KEY, PAYLOAD, digest("x"))
    assert parse_header(linked.read_bytes(), linked.stat().st_size, 512) == (KEY, digest("x"))


@pytest.mark.parametrize(
    "damage",
    ["truncated", "flipped payload bit", "flipped link bit", "format 1 magic", "other page size", "header only"],
)
def test_a_damaged_page_file_does_not_read(tmp_path, damage):
    path = tmp_path / "page"
    write_page_file(path, KEY, PAYLOAD, None)
    data = bytearray(path.read_bytes())
    page_bytes = 512
    if damage == "truncated":
        data = data[:-1]
    elif damage == "flipped payload bit":
        data[-3] ^= 0x10
    elif damage == "flipped link bit":
        data[HEADER.size - 1] ^= 1
    elif damage == "format 1 magic":
        data[:8] = b"KVSTAGE\x01"
    elif damage == "other page size":
        page_bytes = 256
    else:
        data = data[: HEADER.size - 1]
    path.write_bytes(bytes(data))
    assert read(path, page_bytes=page_bytes)[0] is False
    assert parse_header(bytes(data), len(data), page_bytes) is None or damage.startswith("flipped")


def test_a_file_of_another_key_does_not_read_as_this_key(tmp_path):
    path = tmp_path / "page"
    other = PREFIX + "ef" * 32
    write_page_file(path, other, PAYLOAD, None)
    assert read(path, full_key=KEY)[0] is False and read(path, full_key=other) == (True, PAYLOAD)


def test_a_failed_write_raises_and_leaves_nothing(tmp_path):
    with pytest.raises(OSError):
        write_page_file(tmp_path / "missing" / "page", KEY, PAYLOAD, None)
    assert not (tmp_path / "missing").exists()


def test_plain_names_are_the_key_and_unusual_or_long_keys_are_hashed_under_the_owner_tag():
    tag = owner_tag(PREFIX)
    assert len(tag) == 16 and tag == owner_tag(PREFIX) != owner_tag(PREFIX + "x")
    assert page_file_name(KEY, PREFIX, tag) == KEY + SUFFIX
    for key in ("../escape", "a@b", "with space", "f" * 300):
        name = page_file_name(PREFIX + key, PREFIX, tag)
        assert name.startswith(tag + HASHED) and name.endswith(SUFFIX) and len(name) < 100
        assert name == page_file_name(PREFIX + key, PREFIX, tag)  # stable
    assert page_file_name(PREFIX + "a@b", PREFIX, tag) != page_file_name(PREFIX + "a@c", PREFIX, tag)


def test_owned_tells_a_key_space_s_pages_and_temporary_files_from_others():
    tag, other = owner_tag(PREFIX), LayoutFingerprint("org/model", LAYOUT, 4, tp_rank=1, tp_size=2).prefix()
    hashed = page_file_name(PREFIX + "a@b", PREFIX, tag)
    assert owned(KEY + SUFFIX, PREFIX, tag) and owned(hashed, PREFIX, tag) and owned(tmp_name(tag), PREFIX, tag)
    assert not owned(other + "ab" * 32 + SUFFIX, PREFIX, tag)
    assert not owned(page_file_name(other + "a@b", other, owner_tag(other)), PREFIX, tag)
    assert not owned(tmp_name(owner_tag(other)), PREFIX, tag)
    assert tmp_name(tag) != tmp_name(tag)


def test_full_key_of_reads_a_hashed_name_s_header_and_remove_page_files_lists_what_it_removed(tmp_path):
    tag = owner_tag(PREFIX)
    odd = PREFIX + "a@b"
    names = [page_file_name(KEY, PREFIX, tag), page_file_name(odd, PREFIX, tag)]
    for name, full_key in zip(names, [KEY, odd]):
        write_page_file(tmp_path / name, full_key, PAYLOAD, None)
    assert [full_key_of(tmp_path / name) for name in names] == [KEY, odd]
    (tmp_path / f"{tag}{HASHED}torn{SUFFIX}").write_bytes(MAGIC)
    assert full_key_of(tmp_path / f"{tag}{HASHED}torn{SUFFIX}") is None
    assert remove_page_files(tmp_path, names + [f"{tag}{HASHED}torn{SUFFIX}", "gone" + SUFFIX]) == [KEY, odd]
    assert os.listdir(tmp_path) == []


def test_remove_if_read_removes_the_file_read_and_keeps_one_written_since(tmp_path):
    path, tag = tmp_path / (KEY + SUFFIX), owner_tag(PREFIX)
    write_page_file(path, KEY, PAYLOAD, None)
    with open(path, "rb") as handle:
        read_stat = os.fstat(handle.fileno())
    assert remove_if_read(path, read_stat, tmp_path / tmp_name(tag)) is True
    assert os.listdir(tmp_path) == []
    assert remove_if_read(path, read_stat, tmp_path / tmp_name(tag)) is False  # gone already

    write_page_file(path, KEY, PAYLOAD, None)
    with open(path, "rb") as handle:
        read_stat = os.fstat(handle.fileno())
        fresh = tmp_path / "fresh"
        write_page_file(fresh, KEY, PAYLOAD[::-1], None)
        os.replace(fresh, path)  # another writer's page under the name, a new inode
    assert remove_if_read(path, read_stat, tmp_path / tmp_name(tag)) is False
    assert os.listdir(tmp_path) == [path.name] and read(path) == (True, PAYLOAD[::-1])
