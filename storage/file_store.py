"""``FileStore``: one file a page under a directory, crash-safe and checksummed.

File format (little-endian), written in one ``write``::

    magic  b"KVSTAGE\\x01"           8 bytes
    key length                       u32
    payload length                   u64
    checksum xxh3_64(key + payload)  u64
    key (UTF-8)                      key length bytes
    payload (the page's bytes)       payload length bytes

Why: a page is first written to a temporary name in the same directory and then renamed with
``os.replace`` (atomic on POSIX within one file system), so a writer killed mid-write leaves at
most a temporary file, never a half page under a page's name. The checksum covers the cases
renaming cannot (a torn write after a power loss without ``fsync``, a flipped bit on disk, a
file truncated or edited by hand): a page whose length, key or checksum does not match reads as
a miss and is removed, never as wrong bytes. The key inside the file guards against two keys
sharing a file name (long keys are named by their SHA-256).

Capacity: bounded in bytes; the least recently used pages of this process's index (seeded at
open from the directory, oldest modification time first) are deleted to make room, never a page
of the same put (a page that fits only that way is ``FAILED``). One process
should write a directory; others may read it.

URL form for :func:`open_storage`: ``file:DIR`` or ``file:DIR?capacity_bytes=N``.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import uuid
from collections import OrderedDict
from pathlib import Path

import torch
import xxhash

from kvstage.errors import InvalidArgumentError, StorageError, is_int
from kvstage.storage.backend import PutStatus, StorageBackend, page_as_bytes
from kvstage.storage.fingerprint import LayoutFingerprint

MAGIC = b"KVSTAGE\x01"
_HEADER = struct.Struct("<8sIQQ")  # magic, key length, payload length, checksum
SUFFIX = ".kvpage"
TMP_SUFFIX = ".tmp"
DEFAULT_CAPACITY_BYTES = 16 << 30  # 16 GiB
_MAX_NAME = 200  # file names stay well under the usual 255-byte limit


def _checksum(key: bytes, payload) -> int:
    hasher = xxhash.xxh3_64(key)
    hasher.update(payload)
    return hasher.intdigest()


class FileStore(StorageBackend):
    """Pages as files under ``directory``.

    Args:
        fingerprint: the KV layout (key prefix and page size in bytes).
        directory: where the page files live; created if missing.
        capacity_bytes: bound on the bytes of page files this store keeps (headers included).
        fsync: also ``fsync`` each page before renaming it (durable across power loss; slower).
            Without it a power loss may leave a torn page, which the checksum turns into a miss.

    Raises:
        InvalidArgumentError: capacity_bytes is negative.
        StorageError: the directory cannot be created or listed.

    Thread-safe (one lock around index updates; file I/O outside it where possible).
    """

    def __init__(
        self,
        fingerprint: LayoutFingerprint,
        directory: str | os.PathLike,
        *,
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        fsync: bool = False,
    ) -> None:
        super().__init__(fingerprint)
        if not is_int(capacity_bytes) or capacity_bytes < 0:
            raise InvalidArgumentError(f"capacity_bytes: must be a non-negative int, got {capacity_bytes!r}")
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> size, least recent first
        self._used = 0
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            entries = []
            for entry in os.scandir(self.directory):
                if entry.name.endswith(TMP_SUFFIX):
                    # Left by a writer that died before its rename: never visible, safe to drop.
                    _unlink(entry.path)
                elif entry.name.endswith(SUFFIX) and entry.is_file():
                    stat = entry.stat()
                    entries.append((stat.st_mtime_ns, entry.name, stat.st_size))
        except OSError as error:
            raise StorageError(f"directory: cannot use {str(self.directory)!r}: {error}") from error
        for _, name, size in sorted(entries):
            self._index[name] = size
            self._used += size
        self._make_room(0)  # reopened with a smaller capacity: within it from the start

    @property
    def used_bytes(self) -> int:
        """Bytes of the page files this store knows of."""
        return self._used

    def file_name(self, key: str) -> str:
        """The file name of a page key (no prefix: the fingerprint's prefix is added)."""
        return self._name(self.prefix + key)

    def path_of(self, key: str) -> Path:
        """The path of a page key's file (it may not exist)."""
        return self.directory / self.file_name(key)

    @staticmethod
    def _name(full_key: str) -> str:
        if len(full_key) + len(SUFFIX) > _MAX_NAME:
            return hashlib.sha256(full_key.encode()).hexdigest() + SUFFIX
        return full_key + SUFFIX

    def _present(self, full_key: str, path: Path) -> bool:
        """Whether ``path`` holds a file of the size a page of ``full_key`` has (a cheap stat:
        a torn or truncated file, e.g. after a power loss without fsync, is not a page; the
        checksum still guards the bytes on read)."""
        try:
            size = os.stat(path).st_size
        except OSError:
            return False
        return size == _HEADER.size + len(full_key.encode()) + self.page_bytes

    def _exists(self, full_keys: list[str]) -> list[bool]:
        directory = self.directory
        return [self._present(key, directory / self._name(key)) for key in full_keys]

    def _put(self, full_keys: list[str], pages: list[torch.Tensor]) -> list[PutStatus]:
        statuses = []
        this_call: set[str] = set()  # never evicted to make room for a page of the same call
        for full_key, page in zip(full_keys, pages):
            name = self._name(full_key)
            path = self.directory / name
            this_call.add(name)
            if self._present(full_key, path):
                with self._lock:
                    if name in self._index:
                        self._index.move_to_end(name)
                statuses.append(PutStatus.DEDUPLICATED)
                continue
            statuses.append(self._write(full_key, name, path, page, this_call))
        return statuses

    def _write(self, full_key: str, name: str, path: Path, page: torch.Tensor, keep: set[str] = frozenset()) -> PutStatus:
        key = full_key.encode()
        payload = page_as_bytes(page)
        header = _HEADER.pack(MAGIC, len(key), len(payload), _checksum(key, payload))
        size = len(header) + len(key) + len(payload)
        if size > self.capacity_bytes:
            return PutStatus.FAILED
        if not self._make_room(size, keep):
            return PutStatus.FAILED
        tmp = self.directory / f".{name}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as handle:
                handle.write(header)
                handle.write(key)
                handle.write(payload)
                handle.flush()
                if self.fsync:
                    os.fsync(handle.fileno())
            os.replace(tmp, path)
        except OSError:
            _unlink(tmp)
            return PutStatus.FAILED
        with self._lock:
            old = self._index.pop(name, 0)
            self._index[name] = size
            self._used += size - old
        return PutStatus.STORED

    def _make_room(self, size: int, keep: set[str] = frozenset()) -> bool:
        """Evict least recently used pages until ``size`` more bytes fit; False (nothing more
        evicted) when that would evict a page named in ``keep`` (pages of the current put)."""
        while True:
            with self._lock:
                if self._used + size <= self.capacity_bytes or not self._index:
                    return True
                if next(iter(self._index)) in keep:
                    return False
                name, old = self._index.popitem(last=False)
                self._used -= old
            _unlink(self.directory / name)
            self.stats.pages_evicted += 1

    def _get(self, full_keys: list[str], into: list[torch.Tensor]) -> list[bool]:
        return [self._read(full_key, target) for full_key, target in zip(full_keys, into)]

    def _read(self, full_key: str, target: torch.Tensor) -> bool:
        name = self._name(full_key)
        path = self.directory / name
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError:
            return False
        key = full_key.encode()
        payload = self._verified_payload(data, key)
        if payload is None:
            # Corrupt or torn: drop it so a later put can write the page again.
            self._forget(name)
            _unlink(path)
            return False
        page_as_bytes(target)[:] = payload
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
        return True

    def _verified_payload(self, data: bytes, key: bytes) -> memoryview | None:
        if len(data) < _HEADER.size:
            return None
        magic, key_length, payload_length, checksum = _HEADER.unpack_from(data)
        start = _HEADER.size + key_length
        if magic != MAGIC or payload_length != self.page_bytes or len(data) != start + payload_length:
            return None
        view = memoryview(data)
        if bytes(view[_HEADER.size : start]) != key:
            return None
        payload = view[start:]
        if _checksum(key, payload) != checksum:
            return None
        return payload

    def _forget(self, name: str) -> None:
        with self._lock:
            self._used -= self._index.pop(name, 0)


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def open_file_store(rest: str, fingerprint: LayoutFingerprint) -> FileStore:
    """The ``file:DIR[?capacity_bytes=N]`` URL (see :func:`kvstage.storage.open_storage`)."""
    directory, _, query = rest.partition("?")
    if not directory:
        raise InvalidArgumentError("storage: 'file:DIR' needs a directory")
    options: dict[str, int] = {}
    for part in filter(None, query.split("&")):
        name, _, value = part.partition("=")
        if name != "capacity_bytes":
            raise InvalidArgumentError(f"storage: unknown option {name!r} in 'file:{rest}'; known: capacity_bytes")
        try:
            options[name] = int(value)
        except ValueError:
            raise InvalidArgumentError(f"storage: capacity_bytes must be an int, got {value!r}") from None
    return FileStore(fingerprint, directory, **options)

