"""A file store's directory at open on its own: made and listed, proven writable, temporary files
swept only once older than the grace period; each refusal names the path and the errno."""

from __future__ import annotations

import errno
import os

import pytest

from kvstage.errors import StorageError
from kvstage.storage.store_directory import StoreDirectoryError, list_directory, require_writable, sweep_tmp


def test_a_missing_directory_is_made_with_its_parents_and_listed_empty(tmp_path):
    directory = tmp_path / "a" / "b"
    assert list_directory(directory) == [] and directory.is_dir()


def test_an_existing_directory_lists_its_entries(tmp_path):
    (tmp_path / "x.kvpage").write_bytes(b"1")
    (tmp_path / "y.tmp").write_bytes(b"2")
    assert sorted(list_directory(tmp_path)) == ["x.kvpage", "y.tmp"]


def test_a_directory_under_a_file_names_the_path_and_enotdir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreDirectoryError) as caught:
        list_directory(blocker / "kv")
    error = caught.value
    assert isinstance(error, StorageError) and isinstance(error.__cause__, OSError)
    assert error.errno == errno.ENOTDIR and error.path == str(blocker / "kv")
    assert str(error) == f"directory: cannot use {str(blocker / 'kv')!r}: ENOTDIR (errno 20: Not a directory)"


def test_a_writable_directory_passes_and_the_probe_is_removed(tmp_path):
    require_writable(tmp_path, tmp_path / "probe.tmp")
    assert os.listdir(tmp_path) == []


def test_a_probe_that_cannot_be_created_is_refused_naming_the_directory(tmp_path):
    with pytest.raises(StoreDirectoryError) as caught:
        require_writable(tmp_path, tmp_path / "missing" / "probe.tmp")  # ENOENT: as a failed write would be
    error = caught.value
    assert error.errno == errno.ENOENT and error.path == str(tmp_path)
    assert str(error) == (
        f"directory: {str(tmp_path)!r} is not writable: ENOENT (errno 2: No such file or directory); "
        "a file store writes its pages there: give a directory this process may write"
    )


def test_an_error_without_an_errno_says_so():
    error = StoreDirectoryError("/d", OSError("odd"), "directory: cannot use {path}: {reason}")
    assert error.errno is None and str(error) == "directory: cannot use '/d': ? (errno None: odd)"


def test_a_young_temporary_file_is_kept_and_an_old_one_swept(tmp_path):
    path = tmp_path / "w.tmp"
    path.write_bytes(b"partial")
    assert sweep_tmp(path, 600.0) is False and path.exists()  # may be a write in progress
    assert sweep_tmp(path, 0.0) is True and not path.exists()


def test_sweeping_a_file_gone_meanwhile_does_nothing(tmp_path):
    assert sweep_tmp(tmp_path / "gone.tmp", 0.0) is False
