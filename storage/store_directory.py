"""A file store's directory at open: made and listed, proven writable, dead writers' temporary
files swept (:class:`kvstage.storage.file_store.FileStore`).

Each refusal is a :class:`StoreDirectoryError` naming the path and the errno, at open: a
directory that exists but is read-only would otherwise fail every write later, naming neither.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

from kvstage.errors import StorageError
from kvstage.storage.page_file import unlink

__all__ = ["StoreDirectoryError", "list_directory", "require_writable", "sweep_tmp"]


class StoreDirectoryError(StorageError):
    """A file store's directory cannot be made, listed or written: refused at open, naming the
    path and the errno (a directory that exists but is read-only would otherwise fail every
    write later, naming neither).

    Attributes:
        path: the directory, as given (``str``).
        errno: the ``OSError``'s errno (e.g. ``errno.EACCES``, ``errno.EROFS``); the
            ``OSError`` itself is ``__cause__``.
    """

    def __init__(self, path: str, error: OSError, message: str) -> None:
        code = error.errno
        name = errno.errorcode.get(code, "?") if code is not None else "?"
        reason = f"{name} (errno {code}: {os.strerror(code) if code is not None else error})"
        super().__init__(message.format(path=repr(path), reason=reason))
        self.path = path
        self.errno = code


def list_directory(directory: Path) -> list[str]:
    """Make ``directory`` (and its parents) if it is not there; the names of its entries.

    Raises:
        StoreDirectoryError: it cannot be made or listed (``ENOTDIR``, ``EACCES``, ...).
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
        return [entry.name for entry in os.scandir(directory)]
    except OSError as error:
        raise StoreDirectoryError(str(directory), error, "directory: cannot use {path}: {reason}") from error


def require_writable(directory: Path, probe: Path) -> None:
    """Create and remove ``probe`` (a fresh temporary name in ``directory``): an existing
    directory that this process may not write (its mode, a read-only mount, an ACL or security
    module: whatever decides, a real write finds out) is refused now, not at every put.

    Raises:
        StoreDirectoryError: the probe cannot be created (``EROFS``, ``EACCES``, ...).
    """
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except OSError as error:
        raise StoreDirectoryError(
            str(directory),
            error,
            "directory: {path} is not writable: {reason}; a file store writes its pages there: "
            "give a directory this process may write",
        ) from error
    unlink(probe)


def sweep_tmp(path: Path, grace_s: float) -> bool:
    """Remove a temporary file (a dead writer's, or a tombstone) unless it may be another
    process's write in progress: changed (ctime, set by a rename too) within ``grace_s``
    seconds. Whether it was old enough to remove (False also when it cannot be read)."""
    try:
        if time.time_ns() - os.stat(path).st_ctime_ns < grace_s * 1e9:
            return False
    except OSError:
        return False
    unlink(path)
    return True
