"""The file store's page-file format: one page a file, its header, checksum and name.

Pure functions of bytes, paths and names; no store state (:class:`kvstage.storage.file_store.FileStore`
decides what to write, read, keep and remove).

File format (little-endian), written in one go::

    magic  b"KVSTAGE\\x02"                           8 bytes
    key length                                       u32
    payload length                                   u64
    checksum xxh3_64(key + prior digest + payload)   u64
    prior digest                                     32 bytes
    key (UTF-8)                                      key length bytes
    payload (the page's bytes)                       payload length bytes

The key is the full key (the fingerprint's prefix and the page key). The prior digest is the
SHA-256 of the full key of the chain's page right before this one (:func:`digest`), 32 zero
bytes (:data:`NO_PRIOR`) at a chain's start: the chain link, fixed-size so every page file of
one key length has one size (:func:`file_size`). Files of format 1 (no link) do not parse.

Why a checksum: a page is written to a temporary name and renamed into place (atomic on POSIX
within one file system), so a killed writer leaves at most a temporary file; the checksum covers
what renaming cannot (a torn write after a power loss without ``fsync``, a flipped bit, a file
truncated or edited by hand). The key inside the file guards against two keys sharing a file
name: long keys, or keys with characters outside ``[A-Za-z0-9._-]``, are named by the owner tag
of their prefix (:func:`owner_tag`) and their SHA-256 (:func:`page_file_name`).
"""

from __future__ import annotations

import hashlib
import os
import string
import struct
import uuid
from pathlib import Path

import xxhash

MAGIC = b"KVSTAGE\x02"
HEADER = struct.Struct("<8sIQQ32s")  # magic, key length, payload length, checksum, prior digest
NO_PRIOR = bytes(32)  # the prior digest of a chain's first page
SUFFIX = ".kvpage"  # a page file's name ends so
TMP_SUFFIX = ".tmp"  # a temporary file's (a write in progress, or a tombstone)
HASHED = "~"  # separates the owner tag from the SHA-256 in a hashed name; never in a plain one
MAX_NAME = 200  # file names stay well under the usual 255-byte limit
_SAFE_KEY = frozenset(string.ascii_letters + string.digits + "._-")  # hex keys; no "@", which ends a prefix


def checksum(key: bytes, prior: bytes, payload) -> int:
    """xxh3_64 of ``key`` (the full key, UTF-8), ``prior`` (32 bytes) and ``payload`` (any
    buffer), as the header holds it."""
    hasher = xxhash.xxh3_64(key)
    hasher.update(prior)
    hasher.update(payload)
    return hasher.intdigest()


def digest(full_key: str) -> bytes:
    """The SHA-256 of a full key (32 bytes): the link a successor's header holds."""
    return hashlib.sha256(full_key.encode()).digest()


def owner_tag(prefix: str) -> str:
    """16 hex digits of the SHA-256 of a key space's prefix: what its hashed page names and its
    temporary names start with."""
    return hashlib.sha256(prefix.encode()).hexdigest()[:16]


def file_size(full_key: str, page_bytes: int) -> int:
    """Bytes of the page file of ``full_key`` holding a payload of ``page_bytes``."""
    return HEADER.size + len(full_key.encode()) + page_bytes


def page_file_name(full_key: str, prefix: str, tag: str) -> str:
    """``full_key`` (``prefix`` + a page key) as a file name: itself and :data:`SUFFIX`, or
    ``tag`` (:func:`owner_tag` of ``prefix``), :data:`HASHED` and its SHA-256 when it is long or
    the page key has a character outside ``[A-Za-z0-9._-]`` (so a plain name's prefix is always
    exactly the key space's)."""
    key = full_key[len(prefix) :]
    if len(full_key) + len(SUFFIX) > MAX_NAME or not all(c in _SAFE_KEY for c in key):
        return f"{tag}{HASHED}{hashlib.sha256(full_key.encode()).hexdigest()}{SUFFIX}"
    return full_key + SUFFIX


def tmp_name(tag: str) -> str:
    """A fresh temporary name of the key space whose owner tag is ``tag``."""
    return f".{tag}{HASHED}{uuid.uuid4().hex[:12]}{TMP_SUFFIX}"


def owned(name: str, prefix: str, tag: str) -> bool:
    """Whether a directory entry (a page or a temporary file) is of the key space ``prefix``
    (owner tag ``tag``)."""
    if name.endswith(TMP_SUFFIX):
        return name.startswith(f".{tag}{HASHED}")
    return name.startswith(f"{tag}{HASHED}") or (name.startswith(prefix) and HASHED not in name)


def parse_header(head: bytes, size: int, page_bytes: int) -> tuple[str, bytes | None] | None:
    """(full key, prior digest or None at a chain's start) from a page file's first bytes (at
    least the header and the key), or None when they are not the header of a page of
    ``page_bytes`` whose file is ``size`` bytes long."""
    if len(head) < HEADER.size:
        return None
    magic, key_length, payload_length, _, prior = HEADER.unpack_from(head)
    key_end = HEADER.size + key_length
    if magic != MAGIC or payload_length != page_bytes or size != key_end + payload_length or len(head) < key_end:
        return None
    try:
        full_key = head[HEADER.size : key_end].decode()
    except UnicodeDecodeError:
        return None
    return full_key, (None if prior == NO_PRIOR else prior)


def write_page_file(path: Path, full_key: str, payload, prior: bytes | None, *, fsync: bool = False) -> int:
    """Write one page file at ``path`` (header, key, ``payload``: a contiguous buffer), linked to
    ``prior`` (a :func:`digest`, None at a chain's start); ``fsync`` it too when asked. Returns
    its size in bytes.

    Raises:
        OSError: the write failed; nothing is left at ``path``.
    """
    key = full_key.encode()
    link = prior or NO_PRIOR
    header = HEADER.pack(MAGIC, len(key), len(payload), checksum(key, link, payload), link)
    try:
        with open(path, "wb") as handle:
            handle.write(header)
            handle.write(key)
            handle.write(payload)
            handle.flush()
            if fsync:
                os.fsync(handle.fileno())
    except BaseException:
        unlink(path)
        raise
    return len(header) + len(key) + len(payload)


def read_into(handle, buffer: memoryview) -> bool:
    """Fill ``buffer`` from ``handle`` (an unbuffered file); False when the file ends first."""
    done = 0
    while done < len(buffer):
        count = handle.readinto(buffer[done:])
        if not count:
            return False
        done += count
    return True


def read_page_file(handle, size: int, full_key: str, payload: memoryview) -> bool:
    """Read a page file from ``handle`` (opened unbuffered, at its start; the file is ``size``
    bytes) into ``payload`` (``len(payload)``: the page's bytes). Whether it is ``full_key``'s
    page, whole, and its checksum matches; when False, ``payload`` may hold any bytes."""
    head = handle.read(HEADER.size + len(full_key.encode()))
    parsed = parse_header(head, size, len(payload))
    if parsed is None or parsed[0] != full_key or not read_into(handle, payload):
        return False
    return checksum(full_key.encode(), parsed[1] or NO_PRIOR, payload) == HEADER.unpack_from(head)[3]


def full_key_of(path: Path) -> str | None:
    """A page file's full key: its name, or (hashed names) its header; None when a hashed
    file's header cannot be read."""
    name = path.name
    if HASHED not in name:
        return name[: -len(SUFFIX)]
    try:
        with open(path, "rb") as handle:
            head = handle.read(HEADER.size)
            if len(head) < HEADER.size:
                return None
            key = handle.read(HEADER.unpack_from(head)[1])
        return key.decode()
    except (OSError, UnicodeDecodeError):
        return None


def remove_page_files(directory: Path, names) -> list[str]:
    """Unlink the page files ``names`` in ``directory``; the full keys of those this call
    removed (one removed by another process meanwhile is not counted twice; a hashed name whose
    header cannot be read is removed but not listed)."""
    removed = []
    for name in names:
        full_key = full_key_of(directory / name)
        try:
            os.unlink(directory / name)
        except OSError:
            continue
        if full_key is not None:
            removed.append(full_key)
    return removed


def remove_if_read(path: Path, read: os.stat_result, tombstone: Path) -> bool:
    """Remove ``path`` if it is still the file ``read`` (its stat, taken while the file is held
    open, so its inode is not reused): rename it to ``tombstone`` (a fresh temporary name in the
    same directory), compare inodes, put a different (fresh) file back. Whether the file read
    was removed (False also when ``path`` is gone already: another reader, a clear)."""
    try:
        os.rename(path, tombstone)
    except OSError:
        return False
    try:
        moved = os.stat(tombstone)
    except OSError:
        return False
    if (moved.st_ino, moved.st_dev) != (read.st_ino, read.st_dev):
        try:
            os.link(tombstone, path)  # the fresh page back; a newer one there wins
        except OSError:
            pass
        unlink(tombstone)
        return False
    unlink(tombstone)
    return True


def unlink(path) -> None:
    """Remove ``path`` if it is there (any ``OSError`` ignored)."""
    try:
        os.unlink(path)
    except OSError:
        pass
