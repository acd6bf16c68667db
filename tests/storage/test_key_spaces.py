"""Other key spaces in a file store's directory: listed with pages and bytes, never silently
there (opening says so), evicted counted (FileStore.evict_key_space, ``kvstage store``); and
kvstage.storage.key_spaces on its own, over page files written without a store."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from kvstage.cli import main
from kvstage.errors import InvalidArgumentError
from kvstage.kv_layout import KVLayout
from kvstage.storage import FileStore, KeySpace, LayoutFingerprint
from kvstage.storage.file_store import key_spaces
from kvstage.storage.key_spaces import (
    describe_format,
    describe_other_key_spaces,
    format_descriptions,
    format_path,
    prefix_finder,
    remove_key_space,
)
from kvstage.storage.page_file import SUFFIX, owned, owner_tag, page_file_name, write_page_file

LAYOUT = KVLayout(2, 2, 1, 4, "float32")
OLD = LayoutFingerprint("org/model", LAYOUT, 4)  # before a weight update
NEW = LayoutFingerprint("org/model-v2", LAYOUT, 4)
RANK1 = LayoutFingerprint("org/model-v2", LAYOUT, 4, tp_rank=1, tp_size=2)


def page(value: float) -> torch.Tensor:
    return torch.full((64,), float(value))


def fill(directory) -> tuple[FileStore, FileStore, FileStore]:
    old, new, rank1 = FileStore(OLD, directory), FileStore(NEW, directory), FileStore(RANK1, directory)
    old.put(["a" * 64, "b" * 64, "key/with@odd chars"], [page(1), page(2), page(3)])  # one hashed name
    new.put(["a" * 64], [page(4)])
    rank1.put(["c" * 64, "d" * 64], [page(5), page(6)])
    return old, new, rank1


def sizes(directory, store: FileStore) -> int:
    tag = owner_tag(store.prefix)
    return sum(os.path.getsize(directory / name) for name in os.listdir(directory) if owned(name, store.prefix, tag))


def test_key_spaces_lists_each_with_its_pages_and_bytes(tmp_path):
    old, new, rank1 = fill(tmp_path)
    spaces = {space.prefix: space for space in key_spaces(tmp_path)}
    assert spaces == {
        OLD.prefix(): KeySpace(OLD.prefix(), 3, sizes(tmp_path, old)),
        NEW.prefix(): KeySpace(NEW.prefix(), 1, sizes(tmp_path, new)),
        RANK1.prefix(): KeySpace(RANK1.prefix(), 2, sizes(tmp_path, rank1)),
    }
    assert new.key_spaces() == key_spaces(tmp_path)
    assert key_spaces(tmp_path)[0].prefix == OLD.prefix()  # largest first
    assert spaces[OLD.prefix()].bytes == old.used_bytes


def test_opening_a_store_says_how_many_pages_of_other_key_spaces_are_there(tmp_path, caplog):
    fill(tmp_path)
    with caplog.at_level(logging.INFO, logger="kvstage.storage.file_store"):
        FileStore(NEW, tmp_path)
    assert "5 page files of other key spaces" in caplog.text


def test_evict_key_space_removes_that_key_space_only_counted_with_events(tmp_path):
    old, new, rank1 = fill(tmp_path)
    new.take_events()
    assert new.evict_key_space(OLD.prefix()) == 3
    assert old.exists(["a" * 64, "b" * 64, "key/with@odd chars"]) == [False] * 3
    assert new.exists(["a" * 64]) == [True] and rank1.exists(["c" * 64, "d" * 64]) == [True, True]
    events = new.take_events()
    assert sorted(e.key for e in events) == sorted(["a" * 64, "b" * 64, "key/with@odd chars"])
    assert {(e.kind, e.key_space, e.tier) for e in events} == {("removed", OLD.prefix(), "file")}
    assert new.stats.pages_removed == 3
    assert new.evict_key_space(OLD.prefix()) == 0
    assert {space.prefix for space in key_spaces(tmp_path)} == {NEW.prefix(), RANK1.prefix()}


def test_evict_key_space_refuses_its_own_and_a_non_prefix(tmp_path):
    _, new, _ = fill(tmp_path)
    with pytest.raises(InvalidArgumentError, match="prefix: .* is this store's own key space; clear"):
        new.evict_key_space(NEW.prefix())
    with pytest.raises(InvalidArgumentError, match="prefix: must be a fingerprint prefix"):
        new.evict_key_space("org_model")  # a bare name would match more than one key space
    assert len(os.listdir(tmp_path)) == 6


def test_the_store_command_lists_and_evicts_the_other_key_spaces(tmp_path, capsys):
    fill(tmp_path)
    assert main(["store", f"file:{tmp_path}"]) == 0
    listed = capsys.readouterr().out
    assert f"{OLD.prefix()}  3 pages" in listed and f"{RANK1.prefix()}  2 pages" in listed
    assert main(["store", f"file:{tmp_path}", "--evict-other"]) == 2
    assert "--evict-other needs at least one --keep" in capsys.readouterr().err
    assert len(os.listdir(tmp_path)) == 6  # refused before removing anything
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstage",
            "store",
            f"file:{tmp_path}",
            "--evict-other",
            "--keep",
            NEW.prefix(),
            "--keep",
            RANK1.prefix(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert f"evicted {OLD.prefix()}: 3 pages" in result.stdout
    assert {space.prefix for space in key_spaces(tmp_path)} == {NEW.prefix(), RANK1.prefix()}
    assert main(["store", "memory:1024"]) == 2 and "must be file:DIR" in capsys.readouterr().err


OPAQUE = LayoutFingerprint.opaque("org/model-v2", page_bytes=256, page_format="vllm-block-v1|test")  # four '@' fields
OPAQUE_RANK1 = LayoutFingerprint.opaque(
    "org/model-v2", page_bytes=256, page_format="vllm-block-v1|test", tp_rank=1, tp_size=2
)


def test_key_spaces_of_opaque_formats_are_listed_and_evicted_beside_layout_ones(tmp_path):
    fill(tmp_path)
    opaque, rank1 = FileStore(OPAQUE, tmp_path), FileStore(OPAQUE_RANK1, tmp_path)
    opaque.put(
        ["e" * 64, "key/with@odd chars"], [torch.zeros(256, dtype=torch.uint8), torch.ones(256, dtype=torch.uint8)]
    )
    rank1.put(["f" * 64], [torch.zeros(256, dtype=torch.uint8)])
    spaces = {space.prefix: space for space in key_spaces(tmp_path)}
    assert spaces[OPAQUE.prefix()] == KeySpace(OPAQUE.prefix(), 2, sizes(tmp_path, opaque))
    assert spaces[OPAQUE_RANK1.prefix()] == KeySpace(OPAQUE_RANK1.prefix(), 1, sizes(tmp_path, rank1))
    assert spaces[OLD.prefix()].pages == 3 and spaces[NEW.prefix()].pages == 1 and spaces[RANK1.prefix()].pages == 2
    assert FileStore(NEW, tmp_path).evict_key_space(OPAQUE.prefix()) == 2
    assert OPAQUE.prefix() not in {space.prefix for space in key_spaces(tmp_path)}
    assert opaque.exists(["e" * 64]) == [False] and rank1.exists(["f" * 64]) == [True]


@pytest.mark.parametrize(
    "fingerprint", [OLD, RANK1, OPAQUE, OPAQUE_RANK1], ids=["layout", "layout-rank1", "opaque", "opaque-rank1"]
)
def test_prefix_of_finds_every_fingerprint_form(fingerprint):
    from kvstage.storage.fingerprint import prefix_of

    prefix = fingerprint.prefix()
    assert prefix_of(prefix) == prefix
    assert prefix_of(prefix + "0a" * 32) == prefix
    assert prefix_of(prefix[:-1]) is None  # the last field not ended
    assert prefix_of("model@dtype@") is None


def test_opening_a_store_names_the_setting_the_other_key_spaces_differ_in(tmp_path, caplog):
    """Was: two processes sharing a directory with different page sizes got 0% hits and an INFO
    line counting "page files of other key spaces", naming no setting."""
    small = LayoutFingerprint("org/model", LAYOUT, 4)
    FileStore(small, tmp_path).put(["a" * 64, "b" * 64], [page(1), page(2)])
    with caplog.at_level(logging.INFO, logger="kvstage.storage.file_store"):
        FileStore(LayoutFingerprint("org/model", LAYOUT, 16), tmp_path)
    assert (
        f"2 page files of other key spaces are there, not counted in this store's capacity nor read by it; "
        f"they differ from this store's key space in: {small.prefix()} (2 page files): page_size 4 (this store: 16);"
    ) in caplog.text


def test_the_log_names_an_opaque_format_part_that_differs_from_its_description_in_the_directory(tmp_path, caplog):
    ours = LayoutFingerprint.opaque("org/model", page_bytes=256, page_format="vllm-block-v1|dtype=bfloat16|tph=16")
    theirs = LayoutFingerprint.opaque("org/model", page_bytes=256, page_format="vllm-block-v1|dtype=float16|tph=16")
    FileStore(theirs, tmp_path).put(["e" * 64], [torch.zeros(256, dtype=torch.uint8)])  # another process, say
    with caplog.at_level(logging.INFO, logger="kvstage.storage.file_store"):
        store = FileStore(ours, tmp_path)
    assert f"{theirs.prefix()} (1 page files): page_format dtype=float16 (this store: dtype=bfloat16);" in caplog.text
    # the description beside the pages is no page: never counted, listed or removed as one
    assert [space.prefix for space in key_spaces(tmp_path)] == [theirs.prefix()]
    assert store.used_bytes == 0 and store.clear() == 0
    assert FileStore(theirs, tmp_path).exists(["e" * 64]) == [True]


def test_the_log_lists_at_most_four_other_key_spaces(tmp_path, caplog):
    for rank in range(6):
        FileStore(LayoutFingerprint("org/model", LAYOUT, 4, tp_rank=rank, tp_size=8), tmp_path).put(
            ["a" * 64], [page(rank)]
        )
    with caplog.at_level(logging.INFO, logger="kvstage.storage.file_store"):
        FileStore(LayoutFingerprint("org/model", LAYOUT, 4, tp_rank=7, tp_size=8), tmp_path)
    assert "6 page files of other key spaces" in caplog.text
    assert caplog.text.count("shard tp") == 4 and "and 2 more key spaces;" in caplog.text


def write_pages(directory, fingerprint: LayoutFingerprint, keys: list[str]) -> list[str]:
    """Page files of ``keys`` in ``fingerprint``'s key space, written without a store; their names."""
    prefix, names = fingerprint.prefix(), []
    for key in keys:
        name = page_file_name(prefix + key, prefix, owner_tag(prefix))
        write_page_file(directory / name, prefix + key, bytes(fingerprint.page_bytes), None)
        names.append(name)
    return names


def test_the_module_lists_and_removes_key_spaces_of_page_files_written_without_a_store(tmp_path):
    old = write_pages(tmp_path, OLD, ["a" * 64, "odd@key"])
    (new,) = write_pages(tmp_path, NEW, ["b" * 64])
    (tmp_path / ("not-a-page" + SUFFIX)).write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("not a page either")
    old_bytes = sum(os.path.getsize(tmp_path / name) for name in old)
    page_file = os.path.getsize(tmp_path / new)
    assert key_spaces(tmp_path) == [KeySpace(OLD.prefix(), 2, old_bytes), KeySpace(NEW.prefix(), 1, page_file)]
    find = prefix_finder(tmp_path)
    assert [find(name) for name in old] == [OLD.prefix(), OLD.prefix()] and find("not-a-page" + SUFFIX) is None
    assert sorted(remove_key_space(tmp_path, OLD.prefix())) == ["a" * 64, "odd@key"]
    assert key_spaces(tmp_path) == [KeySpace(NEW.prefix(), 1, page_file)]
    assert remove_key_space(tmp_path, OLD.prefix()) == []
    with pytest.raises(InvalidArgumentError, match="prefix: must be a fingerprint prefix"):
        remove_key_space(tmp_path, "org_model")


def test_an_opaque_format_description_is_written_once_and_read_back_only_for_its_prefix(tmp_path):
    opaque = LayoutFingerprint.opaque("org/model", page_bytes=256, page_format="fmt|dtype=bfloat16")
    describe_format(tmp_path, opaque.prefix(), "fmt|dtype=bfloat16")
    describe_format(tmp_path, opaque.prefix(), "fmt|dtype=other")  # there already: kept
    assert format_path(tmp_path, opaque.prefix()).name.startswith(".kvstage-format-")
    assert format_descriptions(tmp_path, [opaque.prefix(), OLD.prefix()]) == {opaque.prefix(): "fmt|dtype=bfloat16"}
    assert [name for name in os.listdir(tmp_path) if name.endswith(".tmp")] == []


def test_describe_other_key_spaces_names_the_largest_and_counts_the_rest(tmp_path):
    others = []
    for rank in range(1, 7):
        fingerprint = LayoutFingerprint("org/model", LAYOUT, 4, tp_rank=rank, tp_size=8)
        others += write_pages(tmp_path, fingerprint, [f"{i:064x}" for i in range(rank)])  # rank r: r pages
    ours = LayoutFingerprint("org/model", LAYOUT, 4, tp_rank=0, tp_size=8).prefix()
    text = describe_other_key_spaces(tmp_path, others, ours, None, shown=2)
    rank6 = LayoutFingerprint("org/model", LAYOUT, 4, tp_rank=6, tp_size=8).prefix()
    assert text.startswith(f"{rank6} (6 page files): shard tp6of8 (this store: tp0of8); ")
    assert text.count("page files)") == 2 and text.endswith("; and 4 more key spaces")
    assert describe_other_key_spaces(tmp_path, [], ours, None) == "(page files whose key space is unreadable)"
