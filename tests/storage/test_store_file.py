"""FileStore: one checksummed file a page; torn, killed and corrupted writes read as misses."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvstage.errors import InvalidArgumentError, StorageError
from kvstage.kv_layout import KVLayout
from kvstage.storage import FileStore, LayoutFingerprint, PutStatus, open_storage
from kvstage.storage import file_store as file_store_module
from kvstage.storage.file_store import TMP_SUFFIX

from file_store_rig import FP, page
from mount_namespace import run_in_mount_namespace

KEY_A = "a" * 64
KEY_B = "b" * 64


def read(store: FileStore, key: str) -> torch.Tensor | None:
    into = torch.full((32,), -7.0)
    return into if store.get([key], [into]) == [True] else None


def test_roundtrip_and_dedup_and_reopen(tmp_path, file_store):
    store = file_store
    assert store.put([KEY_A, KEY_B], [page(1), page(2)]) == [PutStatus.STORED, PutStatus.STORED]
    assert store.put([KEY_A], [page(9)]) == [PutStatus.DEDUPLICATED]
    assert torch.equal(read(store, KEY_A), page(1).reshape(-1))
    names = sorted(os.listdir(tmp_path))
    assert names == sorted([store.file_name(KEY_A), store.file_name(KEY_B)])
    assert names[0].startswith("tiny_model-d0ee8cd9@float32@L0-1xKV2xH1xD4@P2@tp0of1@")
    reopened = FileStore(FP, tmp_path)
    assert reopened.used_bytes == store.used_bytes > 2 * 128
    assert torch.equal(read(reopened, KEY_B), page(2).reshape(-1))


def test_another_layout_never_reads_the_page(tmp_path):
    FileStore(FP, tmp_path).put([KEY_A], [page(1)])
    other = LayoutFingerprint("tiny/model", KVLayout(2, 2, 1, 4, "int32"), 2)
    store = FileStore(other, tmp_path)
    assert store.exists([KEY_A]) == [False]
    into = torch.zeros(32, dtype=torch.int32)
    assert store.get([KEY_A], [into]) == [False]


def test_flipped_byte_reads_as_a_miss_and_the_page_can_be_written_again(tmp_path, file_store):
    store = file_store
    store.put([KEY_A], [page(1)])
    path = store.path_of(KEY_A)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10  # one bit of the payload
    path.write_bytes(bytes(data))
    assert read(store, KEY_A) is None
    assert store.exists([KEY_A]) == [False]  # the corrupt file was removed
    assert store.put([KEY_A], [page(1)]) == [PutStatus.STORED]
    assert torch.equal(read(store, KEY_A), page(1).reshape(-1))


def test_a_corrupt_payload_leaves_the_target_untouched(tmp_path, file_store):
    """A payload reaches its target only once its checksum matched."""
    store = file_store
    store.put([KEY_A], [page(1)])
    path = store.path_of(KEY_A)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))
    into = torch.full((32,), -7.0)
    assert store.get([KEY_A], [into]) == [False]
    assert torch.all(into == -7.0), into


def test_get_fills_a_target_that_is_a_slice_of_a_larger_buffer(tmp_path, file_store):
    """Targets are views (a host pool's page, a staging slot): only the page's own bytes change."""
    store = file_store
    store.put([KEY_A, KEY_B], [page(1), page(2)])
    pool = torch.full((4, 32), -7.0)
    assert store.get([KEY_B, KEY_A], [pool[1], pool[2]]) == [True, True]
    assert torch.equal(pool[1], page(2).reshape(-1)) and torch.equal(pool[2], page(1).reshape(-1))
    assert torch.all(pool[0] == -7.0) and torch.all(pool[3] == -7.0)


@pytest.mark.parametrize("keep", [0, 10, 40, 100], ids=lambda n: f"first-{n}-bytes")
def test_torn_file_reads_as_a_miss(tmp_path, keep, file_store):
    store = file_store
    store.put([KEY_A], [page(1)])
    path = store.path_of(KEY_A)
    path.write_bytes(path.read_bytes()[:keep])  # a writer without rename, killed mid-write
    into = torch.full((32,), -7.0)
    assert store.get([KEY_A], [into]) == [False]
    assert torch.all(into == -7.0)


def test_file_of_another_key_under_this_name_reads_as_a_miss(tmp_path, file_store):
    store = file_store
    store.put([KEY_B], [page(2)])
    store.path_of(KEY_B).rename(store.path_of(KEY_A))
    assert read(store, KEY_A) is None


def test_writer_killed_between_write_and_rename_leaves_nothing_visible(tmp_path, monkeypatch):
    # A real process dies (os._exit) after writing the temporary file, before os.replace.
    code = textwrap.dedent(
        f"""
        import os, torch
        from kvstage.kv_layout import KVLayout
        from kvstage.storage import FileStore, LayoutFingerprint
        fp = LayoutFingerprint("tiny/model", KVLayout(2, 2, 1, 4, "float32"), 2)
        store = FileStore(fp, {str(tmp_path)!r})
        os.replace = lambda *a: os._exit(9)
        store.put([{KEY_A!r}], [torch.ones(32)])
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 9, result.stderr
    leftovers = os.listdir(tmp_path)
    assert len(leftovers) == 1 and leftovers[0].endswith(TMP_SUFFIX)
    FileStore(FP, tmp_path)  # a young temporary file may be another process's write: kept
    assert os.listdir(tmp_path) == leftovers
    monkeypatch.setattr(file_store_module, "TMP_GRACE_S", 0.0)  # as if TMP_GRACE_S had passed
    store = FileStore(FP, tmp_path)  # opening sweeps the dead writer's temporary file
    assert os.listdir(tmp_path) == []
    assert store.exists([KEY_A]) == [False] and read(store, KEY_A) is None


def test_capacity_evicts_the_least_recently_used_file(tmp_path):
    probe = FileStore(FP, tmp_path / "probe")
    probe.put([KEY_A], [page(0)])
    size = probe.used_bytes
    store = FileStore(FP, tmp_path / "store", capacity_bytes=2 * size)
    keys = ["1" * 64, "2" * 64, "3" * 64]
    store.put(keys[:1], [page(1)])  # two one-page chains (chains: test_chain_eviction.py)
    store.put(keys[1:2], [page(2)])
    assert read(store, keys[0]) is not None  # keys[0] is now the most recent
    assert store.put([keys[2]], [page(3)]) == [PutStatus.STORED]
    assert store.exists(keys) == [True, False, True]
    assert store.used_bytes == 2 * size and store.stats.pages_evicted == 1
    tiny = FileStore(FP, tmp_path / "tiny", capacity_bytes=size - 1)
    assert tiny.put([KEY_A], [page(1)]) == [PutStatus.FAILED] and tiny.exists([KEY_A]) == [False]


def test_page_corrupted_at_its_size_is_rewritten_by_the_next_put(tmp_path, file_store):
    store = file_store
    store.put([KEY_A], [page(1)])
    path = store.path_of(KEY_A)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10  # one bit of the payload: the size stays a page's
    path.write_bytes(bytes(data))
    assert store.exists([KEY_A]) == [True]  # exists checks the size only (see the module doc)
    assert store.put([KEY_A], [page(1)]) == [PutStatus.STORED]
    assert store.stats.pages_stored == 2 and store.stats.pages_deduplicated == 0
    assert torch.equal(read(store, KEY_A), page(1).reshape(-1))
    assert store.put([KEY_A], [page(1)]) == [PutStatus.DEDUPLICATED]  # intact now


def test_exists_is_false_for_a_page_file_of_the_wrong_size(tmp_path, file_store):
    store = file_store
    store.put([KEY_A], [page(1)])
    path = store.path_of(KEY_A)
    path.write_bytes(path.read_bytes() + b"x")
    assert store.exists([KEY_A]) == [False]
    assert store.put([KEY_A], [page(2)]) == [PutStatus.STORED]
    assert torch.equal(read(store, KEY_A), page(2).reshape(-1))


def test_keys_with_path_characters_get_hashed_file_names(tmp_path):
    store = FileStore(FP, tmp_path / "store")
    assert store.put(["../escape", "a@b"], [page(1), page(2)]) == [PutStatus.STORED] * 2
    assert os.listdir(tmp_path) == ["store"] and "~" in store.file_name("../escape") and "~" in store.file_name("a@b")
    assert torch.equal(read(store, "../escape"), page(1).reshape(-1))


def test_long_model_id_gets_hashed_file_names(tmp_path):
    fp = LayoutFingerprint("m" * 300, KVLayout(2, 2, 1, 4, "float32"), 2)
    store = FileStore(fp, tmp_path)
    assert store.put([KEY_A], [page(1)]) == [PutStatus.STORED]
    assert len(store.file_name(KEY_A)) < 100
    assert torch.equal(read(store, KEY_A), page(1).reshape(-1))


def test_open_storage_file_url(tmp_path):
    store = open_storage(f"file:{tmp_path}?capacity_bytes=4096", FP)
    assert isinstance(store, FileStore) and store.capacity_bytes == 4096
    with pytest.raises(InvalidArgumentError, match="unknown option 'size'"):
        open_storage(f"file:{tmp_path}?size=1", FP)
    with pytest.raises(InvalidArgumentError, match="needs a directory"):
        open_storage("file:", FP)


# Opening a directory this process may not write. Root ignores permission bits, so as root the
# script runs with CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped from its bounding set
# (setpriv): the directory's mode then binds it as it binds any user.
UNWRITABLE = textwrap.dedent(
    """
    import json, sys
    from kvstage.kv_layout import KVLayout
    from kvstage.storage import LayoutFingerprint, open_storage
    from kvstage.storage.file_store import StoreDirectoryError

    fp = LayoutFingerprint("tiny/model", KVLayout(2, 2, 1, 4, "float32"), 2)
    try:
        open_storage("file:" + sys.argv[1], fp)
        print(json.dumps(None))
    except StoreDirectoryError as error:
        print(json.dumps(dict(message=str(error), errno=error.errno, path=error.path,
                              cause_errno=getattr(error.__cause__, "errno", None))))
    """
)


def run_without_dac_override(script: str, *args: str) -> object:
    command = [sys.executable, "-c", script, *args]
    if os.geteuid() == 0:
        if subprocess.run(["which", "setpriv"], capture_output=True).returncode != 0:
            pytest.skip("running as root and no setpriv to drop CAP_DAC_OVERRIDE: permission bits would not bind")
        command = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--inh-caps", "-all", *command]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_an_existing_directory_this_process_may_not_write_is_refused_at_open_naming_it_and_the_errno(tmp_path):
    """Was: accepted at open; every put then failed with ``PermissionError(13, ...)`` (the
    manager's WARNING ``4 of 4 pages not stored``), naming no path."""
    directory = tmp_path / "kv"
    directory.mkdir()
    directory.chmod(0o555)  # listable, not writable
    try:
        seen = run_without_dac_override(UNWRITABLE, str(directory))
    finally:
        directory.chmod(0o755)
    assert seen == {
        "message": f"directory: {str(directory)!r} is not writable: EACCES (errno 13: Permission denied); "
        "a file store writes its pages there: give a directory this process may write",
        "errno": errno.EACCES,
        "path": str(directory),
        "cause_errno": errno.EACCES,
    }
    assert os.listdir(directory) == []


def test_a_read_only_mount_is_refused_at_open_naming_it_and_erofs(tmp_path):
    script = (
        textwrap.dedent(
            """
        import subprocess, sys
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", sys.argv[1]], check=True)
        subprocess.run(["mount", "-o", "remount,ro", sys.argv[1]], check=True)
        """
        )
        + UNWRITABLE
    )
    seen = run_in_mount_namespace(script, str(tmp_path))
    assert seen == {
        "message": f"directory: {str(tmp_path)!r} is not writable: EROFS (errno 30: Read-only file system); "
        "a file store writes its pages there: give a directory this process may write",
        "errno": errno.EROFS,
        "path": str(tmp_path),
        "cause_errno": errno.EROFS,
    }


def test_a_directory_that_cannot_be_made_names_it_and_the_errno(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(file_store_module.StoreDirectoryError) as caught:
        FileStore(FP, blocker / "kv")
    assert caught.value.errno == errno.ENOTDIR and caught.value.path == str(blocker / "kv")
    assert str(caught.value).startswith(
        f"directory: cannot use {str(blocker / 'kv')!r}: ENOTDIR (errno 20: Not a directory)"
    )
    assert isinstance(caught.value, StorageError)


@pytest.mark.parametrize("keep", [0, 40, 200], ids=lambda n: f"first-{n}-bytes")
def test_a_torn_file_store_page_is_not_reported_present_and_is_written_again(tmp_path, keep):
    """A page file cut short (0, 40, 200 bytes kept: a power loss without fsync): a reopened store does
    not report it present and a put writes it again. Taken for the page, the manager would
    deduplicate it forever: lost."""
    fingerprint = LayoutFingerprint("tiny/model", KVLayout(2, 2, 1, 4, "float32"), 2)
    key = "c" * 64
    page = torch.arange(32, dtype=torch.float32)
    store = FileStore(fingerprint, tmp_path)
    assert store.put([key], [page]) == [PutStatus.STORED]
    size = store.used_bytes
    path = store.path_of(key)
    path.write_bytes(path.read_bytes()[:keep])
    reopened = FileStore(fingerprint, tmp_path)
    assert reopened.exists([key]) == [False]
    assert reopened.put([key], [page]) == [PutStatus.STORED]
    into = torch.zeros(32)
    assert reopened.get([key], [into]) == [True] and torch.equal(into, page)
    assert reopened.used_bytes == size == path.stat().st_size


def test_a_file_store_reopened_with_a_smaller_capacity_is_within_it_at_once(tmp_path):
    """A file store of 3 pages reopened with room for 2: the oldest page is evicted at open, not later."""
    fingerprint = LayoutFingerprint("tiny/model", KVLayout(2, 2, 1, 4, "float32"), 2)
    keys = [c * 64 for c in "abc"]
    store = FileStore(fingerprint, tmp_path)
    for age, key in enumerate(keys):
        store.put([key], [torch.full((32,), float(age))])
        os.utime(store.path_of(key), ns=(10**18 + age * 10**9,) * 2)  # a is the oldest
    one = store.used_bytes // 3
    reopened = FileStore(fingerprint, tmp_path, capacity_bytes=2 * one)
    assert reopened.used_bytes == 2 * one <= reopened.capacity_bytes
    assert reopened.exists(keys) == [False, True, True]
    assert sorted(os.listdir(tmp_path)) == sorted(reopened.file_name(key) for key in keys[1:])
