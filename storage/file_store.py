"""``FileStore``: one file a page under a directory, crash-safe and checksummed.

Its parts, each a module of its own: the page-file format (header, checksum, names)
:mod:`kvstage.storage.page_file`; the room accounting (used, held and pinned bytes, chain-aware
eviction) :class:`kvstage.storage.room.Room`; the other key spaces in the directory
:mod:`kvstage.storage.key_spaces`; the directory at open (made, proven writable, swept)
:mod:`kvstage.storage.store_directory`. Here: put, get and clear of pages, the gate that holds puts
while a clear runs, the store's I/O threads, and adoption of pages other processes wrote.

Crash-safe: a page is written to a temporary name and renamed into place (``os.replace``), so a
writer killed mid-write leaves at most a temporary file; a page whose length, key or checksum
does not match reads as a miss and is removed, never as wrong bytes (format 1 files, without a
chain link, too). ``exists`` checks a file's size (one ``stat``): a torn page is absent, but one
corrupted at the right size answers True until a ``get`` reads it (a miss, the file removed) or a
``put`` of its key verifies it (intact: ``DEDUPLICATED``; corrupt: written again, ``STORED``).

Eviction (capacity in bytes) is chain-aware, as in :class:`kvstage.storage.MemoryStore`, never of
a page of the same put nor of its ``prior_key`` page (a page that fits only that way is
``FAILED``, and so are the pages after it in that put). ``get``, ``exists`` and a deduplicated
``put`` count as a use. Recency and links survive a reopen without a sidecar: the recency is each
page file's modification time (the index's nanosecond tick, set on every write and use), the
links are in the headers; opening reads each page file's header and a torn file loses only itself.

Sharing a directory: a store counts, evicts, clears and sweeps only its own key space's files;
opening logs how many page files of other key spaces are there and which settings they differ in
(:meth:`FileStore.evict_key_space` removes one). Processes sharing one key space (prefill writes
prompt pages, decode continues their chains): a ``put`` whose ``prior_key`` this process has not
indexed finds the prior's file and indexes it from its header (adoption); a deduplicated page
found there is indexed too. A reader that finds a corrupt page removes only the file it read (a
tombstone rename and an inode compare; a page rewritten since is put back). Each process evicts
within its own capacity; opening sweeps only temporary files older than :data:`TMP_GRACE_S`.

Store events (tier ``"file"``): ``stored`` for each page a put wrote, ``evicted`` for each page
the capacity evicted, ``removed`` for each page :meth:`FileStore.clear` or ``remove`` removed (``remove``: the later
pages of the chains too) and for each corrupt page a reader or a put dropped. A page not written because of an ``OSError`` (``EROFS``,
``EACCES``, ``ENOSPC``) is ``FAILED`` and ``put``'s answer carries the error; pages refused
because ``prior_key`` is not stored carry a :class:`kvstage.storage.MissingPriorError`.

Several pages at once: a call of more than one page reads or writes ``io_threads`` page files at
once (a put: :func:`kvstage.storage.chain_writes.put_parallel`), answering as page by page
would; by default only for pages of ``PARALLEL_MIN_PAGE_BYTES`` or more, since smaller pages gain
less than handing them to a thread costs (figures: the README's "Storage" section).

URL form for :func:`open_storage`: ``file:DIR``, options ``?capacity_bytes=SIZE&io_threads=N`` (a
size: bytes, or a number with a unit, :mod:`kvstage.storage.sizes`).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from kvstage.errors import InvalidArgumentError, is_int
from kvstage.storage.backend import MissingPriorError, PutStatus, PutStatuses, StorageBackend, page_as_bytes
from kvstage.storage.chain_writes import PutSteps, put_parallel, put_serial
from kvstage.storage.events import DEFAULT_EVENT_CAPACITY
from kvstage.storage.fingerprint import LayoutFingerprint
from kvstage.storage.io_threads import IoThreads
from kvstage.storage.key_spaces import (
    KeySpace,
    describe_format,
    describe_other_key_spaces,
    key_spaces,
    remove_key_space,
)
from kvstage.storage.page_file import (
    HEADER,
    SUFFIX,
    TMP_SUFFIX,
    digest,
    file_size,
    owned,
    owner_tag,
    page_file_name,
    parse_header,
    read_page_file,
    remove_if_read,
    remove_page_files,
    tmp_name,
    unlink,
    write_page_file,
)
from kvstage.storage.room import Room
from kvstage.storage.sizes import parse_size
from kvstage.storage.store_directory import StoreDirectoryError, list_directory, require_writable, sweep_tmp

# Re-exported: the names callers have imported from this module.
__all__ = [
    "DEFAULT_CAPACITY_BYTES",
    "DEFAULT_IO_THREADS",
    "PARALLEL_MIN_PAGE_BYTES",
    "SUFFIX",
    "TMP_GRACE_S",
    "TMP_SUFFIX",
]
__all__ += ["FileStore", "KeySpace", "StoreDirectoryError", "key_spaces", "open_file_store", "remove_key_space"]

logger = logging.getLogger(__name__)

DEFAULT_CAPACITY_BYTES = 16 << 30  # 16 GiB
DEFAULT_IO_THREADS = 2  # for pages of PARALLEL_MIN_PAGE_BYTES or more, capped at the CPUs; see the module doc
PARALLEL_MIN_PAGE_BYTES = 2 << 20  # smaller pages: one thread by default (threads cost more than they save)
TMP_GRACE_S = 600.0  # a temporary file younger than this may be another process's write in progress


class FileStore(StorageBackend):
    """Pages as files under ``directory``.

    Args:
        fingerprint: the KV layout (key prefix and page size in bytes).
        directory: where the page files live; created if missing.
        capacity_bytes: bound on the bytes of this store's page files (headers included).
        fsync: also ``fsync`` each page before renaming it (durable across power loss; slower).
            Without it a power loss may leave a torn page, which the checksum turns into a miss.
        event_capacity: store events kept until ``take_events`` (see :class:`StorageBackend`).
        io_threads: page files one ``get`` reads, or one ``put`` writes, at once (threads of
            this store's, started at the first call of more than one page; 1: all file I/O on
            the calling thread).
            None: ``DEFAULT_IO_THREADS`` (at most the CPUs this process may use) for pages of
            ``PARALLEL_MIN_PAGE_BYTES`` or more, else 1.

    Raises:
        InvalidArgumentError: capacity_bytes is negative, event_capacity is not an int >= 0, or
            io_threads is not None or an int >= 1.
        StoreDirectoryError: (a :class:`~kvstage.errors.StorageError`) the directory cannot be
            created, listed or written (a file created in it and removed at open tells); the
            message names the path and the errno (``EACCES``, ``EROFS``, ...).

    Thread-safe (one lock around index updates; file I/O outside it where possible; a
    :meth:`clear` waits for the puts in flight and holds new ones until it is done).

    Takes strided page views (:attr:`strided_pages`): a ``get`` reads a page file's payload in
    one read into the calling thread's scratch page (one page of memory a thread), checks its
    checksum there, then copies it into the target, whatever its strides, in one copy; a ``put``
    of a strided view copies it into the scratch page once, then checksums and writes it.
    """

    tier = "file"
    strided_pages = True

    def __init__(
        self,
        fingerprint: LayoutFingerprint,
        directory: str | os.PathLike,
        *,
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        fsync: bool = False,
        event_capacity: int = DEFAULT_EVENT_CAPACITY,
        io_threads: int | None = None,
    ) -> None:
        super().__init__(fingerprint, event_capacity=event_capacity)
        if not is_int(capacity_bytes) or capacity_bytes < 0:
            raise InvalidArgumentError(f"capacity_bytes: must be a non-negative int, got {capacity_bytes!r}")
        if io_threads is None:
            big_pages = self.page_bytes >= PARALLEL_MIN_PAGE_BYTES
            io_threads = min(DEFAULT_IO_THREADS, len(os.sched_getaffinity(0))) if big_pages else 1
        if not is_int(io_threads) or io_threads < 1:
            raise InvalidArgumentError(f"io_threads: must be an int >= 1, got {io_threads!r}")
        self.io_threads = int(io_threads)
        self._io = IoThreads(self.io_threads, "kvstage-file-io")  # started by the first call of many pages
        self.directory = Path(directory)
        self.fsync = fsync
        # Names of hashed page files and of temporary files start with this tag of the prefix.
        self._owner_tag = owner_tag(self.prefix)
        self._lock = threading.Lock()  # around every use of self._room
        self._local = threading.local()  # each thread's scratch page
        # Pages by the SHA-256 of their full key (the link a header holds): (file name, page key
        # without the prefix), and their bytes against the capacity.
        self._room: Room[bytes, tuple[str, str]] = Room(capacity_bytes)
        # clear() waits for puts in flight and holds new ones (a put lands wholly after it).
        self._gate = threading.Condition()
        self._puts_active = 0
        self._puts_waiting = 0  # a clear lets these in first, so repeated clears never starve puts
        self._clearing = False
        every = list_directory(self.directory)
        require_writable(self.directory, self._tmp_path())
        if fingerprint.page_format:
            describe_format(self.directory, self.prefix, fingerprint.page_format)
        names = [name for name in every if self._owns(name)]
        others = [name for name in every if name.endswith(SUFFIX) and not self._owns(name)]
        if others and logger.isEnabledFor(logging.INFO):  # naming their settings reads a few files
            differences = describe_other_key_spaces(self.directory, others, self.prefix, fingerprint.page_format)
            logger.info(
                "file store %s: %d page files of other key spaces are there, not counted in this store's "
                "capacity nor read by it; they differ from this store's key space in: %s; list them with "
                "kvstage.storage.key_spaces.key_spaces() or `kvstage store file:%s`, remove one with "
                "FileStore.evict_key_space() or `kvstage store file:%s --evict PREFIX`",
                self.directory,
                len(others),
                differences,
                self.directory,
                self.directory,
            )
        for name in names:
            if name.endswith(TMP_SUFFIX):
                sweep_tmp(self.directory / name, TMP_GRACE_S)
            elif name.endswith(SUFFIX):
                self._load(name)
        self._make_room(0)  # reopened with a smaller capacity: within it from the start

    @property
    def used_bytes(self) -> int:
        """Bytes of this store's page files."""
        return self._room.used

    @property
    def capacity_bytes(self) -> int:
        """Bound on the bytes of this store's page files and of the writes in flight."""
        return self._room.capacity_bytes

    def file_name(self, key: str) -> str:
        """The file name of a page key (no prefix: the fingerprint's prefix is added)."""
        return self._name(self.prefix + key)

    def path_of(self, key: str) -> Path:
        """The path of a page key's file (it may not exist)."""
        return self.directory / self.file_name(key)

    def _name(self, full_key: str) -> str:
        """``full_key``'s file name (see :func:`kvstage.storage.page_file.page_file_name`)."""
        return page_file_name(full_key, self.prefix, self._owner_tag)

    def _owns(self, name: str) -> bool:
        """Whether a directory entry is this fingerprint's (a page or a temporary file)."""
        return owned(name, self.prefix, self._owner_tag)

    def _load(self, name: str) -> None:
        """Index a page file found at open: its link from the header, its recency from its
        modification time. A file whose header is not a page of this layout is removed."""
        path = self.directory / name
        try:
            with open(path, "rb") as handle:
                status = os.fstat(handle.fileno())
                head = handle.read(HEADER.size)
                if len(head) == HEADER.size:
                    head += handle.read(HEADER.unpack_from(head)[1])
                parsed = self._parse_header(head, status.st_size)
                if parsed is None or self._name(parsed[0]) != name:
                    # Torn, corrupt, of format 1, or renamed by hand: never a page here (unless
                    # another process has just written the page again: then kept).
                    remove_if_read(path, status, self._tmp_path())
                    return
        except OSError:
            return
        full_key, prior = parsed
        self._room.add(
            digest(full_key), (name, full_key[len(self.prefix) :]), status.st_size, prior, tick=status.st_mtime_ns
        )

    def _adopt(self, full_key: str, path: Path) -> bool:
        """Index the key's page file when another process wrote it after this store opened
        (its link from the header, used now); whether the key is indexed afterwards. Never
        removes a file (it may be another process's fresh page). Call under ``self._lock``."""
        key = digest(full_key)
        if key in self._room:
            return True
        try:
            with open(path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                head = handle.read(HEADER.size + len(full_key.encode()))
        except OSError:
            return False
        parsed = self._parse_header(head, size)
        if parsed is None or parsed[0] != full_key:
            return False
        self._room.add(key, (path.name, full_key[len(self.prefix) :]), size, parsed[1])
        return True

    def _parse_header(self, head: bytes, size: int) -> tuple[str, bytes | None] | None:
        """(full key, prior digest or None) of a page file of this layout, ``size`` bytes long,
        from its first bytes; None when it is not one (:func:`kvstage.storage.page_file.parse_header`)."""
        return parse_header(head, size, self.page_bytes)

    # -- the storage interface ---------------------------------------------------------------

    def _exists(self, full_keys: list[str]) -> list[bool]:
        return [self._present(full_key) for full_key in full_keys]

    def _present(self, full_key: str) -> bool:
        """Whether the key's file is there at a page's size (a cheap ``stat``; see the module
        doc); a hit counts as a use."""
        path = self.directory / self._name(full_key)
        try:
            if os.stat(path).st_size != file_size(full_key, self.page_bytes):
                return False
        except OSError:
            return False
        self._touch(full_key, path)
        return True

    def _touch(self, full_key: str, path: Path) -> None:
        """Record a use: in the index and as the file's modification time (for a reopen)."""
        with self._lock:
            tick = self._room.touch(digest(full_key))
            if tick is None:  # a page of this fingerprint written by another process
                tick = self._room.tick()
        try:
            os.utime(path, ns=(tick, tick))
        except OSError:
            pass  # evicted or removed meanwhile: nothing to record

    def _put(self, full_keys: list[str], pages: list[torch.Tensor], full_prior_key: str | None = None) -> PutStatuses:
        digests = [digest(key) for key in full_keys]
        prior = None if full_prior_key is None else digest(full_prior_key)
        pinned = digests + ([] if prior is None else [prior])
        with self._gate:
            self._puts_waiting += 1
            while self._clearing:
                self._gate.wait()
            self._puts_waiting -= 1
            self._puts_active += 1
        with self._lock:
            self._room.pin(pinned)  # never evicted while this put runs, by any thread
            if full_prior_key is not None and prior not in self._room:
                # Written by another process after this store opened: index it from its file.
                self._adopt(full_prior_key, self.directory / self._name(full_prior_key))
        statuses = PutStatuses()
        try:
            with self._lock:
                prior_stored = prior is None or prior in self._room
            if self.io_threads > 1 and len(full_keys) > 1 and prior_stored:
                outcomes = put_parallel(self._put_steps(), self._io, full_keys, digests, pages, prior, full_prior_key)
            else:
                outcomes = put_serial(self._put_steps(), full_keys, digests, pages, prior, full_prior_key)
            for status, error in outcomes:
                statuses.append(status)
                if statuses.error is None:
                    statuses.error = error
            return statuses
        finally:
            with self._lock:
                self._room.unpin(pinned)
            with self._gate:
                self._puts_active -= 1
                self._gate.notify_all()

    def _put_steps(self) -> PutSteps:
        """This store's steps of a put (:mod:`kvstage.storage.chain_writes`), as its methods are now."""
        return PutSteps(
            deduplicated=self._deduplicated,
            prior_stored=self._prior_stored,
            size=lambda full_key: file_size(full_key, self.page_bytes),
            reserve=self._make_room,
            give_back=self._give_back,
            write=self._write_tmp,
            commit=self._commit,
            missing=lambda full_key: MissingPriorError(full_key[len(self.prefix) :]),
        )

    def _deduplicated(self, full_key: str) -> bool:
        """Whether the key's page file is there and intact (a corrupt one is removed)."""
        return self._read(full_key, self.directory / self._name(full_key), None, adopt=True)

    def _prior_stored(self, prior: bytes | None) -> bool:
        with self._lock:
            return prior is None or prior in self._room

    def _write_tmp(self, full_key: str, page: torch.Tensor, prior: bytes | None) -> tuple[Path, int] | OSError:
        """The page's file (:func:`kvstage.storage.page_file.write_page_file`) under a temporary
        name of this key space, and its size; or the ``OSError`` that stopped it (nothing left
        behind)."""
        if not page.is_contiguous():  # a strided view: its row-major bytes, made contiguous once
            page = self._scratch_as(page).copy_(page)
        tmp = self._tmp_path()
        try:
            return tmp, write_page_file(tmp, full_key, page_as_bytes(page), prior, fsync=self.fsync)
        except OSError as error:
            return error

    def _commit(
        self, full_key: str, key: bytes, prior: bytes | None, written: tuple[Path, int] | OSError, *, held: int
    ) -> tuple[PutStatus, OSError | None]:
        """Rename a page's temporary file into place and index it: ``STORED``, the ``held``
        bytes of room (:meth:`_make_room`) now the page's own; or ``FAILED`` with the
        ``OSError`` that stopped the write or the rename (the room given back, the temporary
        file removed)."""
        if isinstance(written, OSError):
            self._give_back(held)
            return PutStatus.FAILED, written
        tmp, size = written
        name = self._name(full_key)
        try:
            with self._lock:
                tick = self._room.tick()
            os.utime(tmp, ns=(tick, tick))
            os.replace(tmp, self.directory / name)
        except OSError as error:
            unlink(tmp)
            self._give_back(held)
            return PutStatus.FAILED, error
        with self._lock:  # replacing an entry a reader indexed meanwhile (adopted)
            self._room.commit(key, (name, full_key[len(self.prefix) :]), size, prior, held=held, tick=tick)
            self._record("stored", [full_key])
        return PutStatus.STORED, None

    def _give_back(self, held: int) -> None:
        """Return room held by :meth:`_make_room` for a page that will not land."""
        with self._lock:
            self._room.abort(held)

    def _tmp_path(self) -> Path:
        """A fresh temporary name of this key space (writes and tombstones); swept at open."""
        return self.directory / tmp_name(self._owner_tag)

    def _make_room(self, size: int) -> bool:
        """Reserve ``size`` bytes in the room (:meth:`Room.reserve`), evicting chain tails,
        least recently used first, until they fit beside the page files and the room held for
        writes in flight; held until :meth:`_commit` makes them the page's own or the caller
        gives them back (:meth:`_give_back`), so no other put takes them meanwhile. False
        (nothing held) for a page larger than the capacity (nothing evicted) or when only pages
        of puts in flight are left to evict."""
        if size > self.capacity_bytes:
            return False
        while True:
            with self._lock:
                if self._room.reserve(size):
                    return True
                victim = self._room.evict()
                if victim is None:
                    return False
                name, key = victim[1]
                # Unlinked under the lock: a put of the same key must not find it in between.
                unlink(self.directory / name)
                self.stats.pages_evicted += 1
                self._events.record("evicted", [key])

    def _get(self, full_keys: list[str], into: list[torch.Tensor]) -> list[bool]:
        directory = self.directory

        def read(full_key: str, target: torch.Tensor) -> bool:
            return self._read(full_key, directory / self._name(full_key), target)

        def read_untouched(full_key: str, target: torch.Tensor) -> bool:
            return self._read(full_key, directory / self._name(full_key), target, touch=False)

        if self.io_threads == 1 or len(full_keys) == 1:
            return [read(full_key, target) for full_key, target in zip(full_keys, into)]
        hits = [future.result() for future in self._io.map(read_untouched, full_keys, into)]
        for full_key, hit in zip(full_keys, hits):  # uses in key order, as one thread makes them
            if hit:
                self._touch(full_key, directory / self._name(full_key))
        return hits

    def close(self) -> None:
        """Stop this store's I/O threads (after the reads and writes in flight); a later call
        of many pages, or one in flight on another thread, starts them again. The page files
        stay. Idempotent."""
        self._io.close()

    def _read(
        self, full_key: str, path: Path, target: torch.Tensor | None, *, adopt: bool = False, touch: bool = True
    ) -> bool:
        """Read and verify the key's page file and copy its payload into ``target`` (None:
        verify only). The payload is read in one call into this thread's scratch page and
        reaches ``target`` (any strides) in one copy, only once its checksum matched. A hit
        counts as a use unless ``touch`` is False (the caller records it; ``adopt``: a page
        another process wrote is indexed too); a corrupt or torn file is removed (and
        forgotten), only if it is still the file read."""
        try:
            with open(path, "rb", buffering=0) as handle:
                status = os.fstat(handle.fileno())
                if not read_page_file(handle, status.st_size, full_key, page_as_bytes(self._scratch())):
                    self._drop_corrupt(full_key, path, status)
                    return False
        except OSError:
            return False
        if target is not None:
            target.copy_(self._scratch_as(target))
        if adopt:
            with self._lock:
                self._adopt(full_key, path)
        if touch:
            self._touch(full_key, path)
        return True

    def _scratch(self) -> torch.Tensor:
        """This thread's page-sized ``uint8`` buffer (reads land here before their checksum is
        known; strided pages are made contiguous here before a write), allocated once."""
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = torch.empty(self.page_bytes, dtype=torch.uint8)
        return scratch

    def _scratch_as(self, page: torch.Tensor) -> torch.Tensor:
        """The scratch page viewed with ``page``'s dtype and shape (row-major)."""
        return self._scratch().view(page.dtype).view(page.shape)

    def _drop_corrupt(self, full_key: str, path: Path, read: os.stat_result) -> None:
        """Remove the corrupt page file ``read`` and forget it, unless a writer replaced it at
        ``path`` since (see :func:`kvstage.storage.page_file.remove_if_read`); a ``removed`` event when it went."""
        with self._lock:  # the index entry goes with the file, never with a fresh one
            if not remove_if_read(path, read, self._tmp_path()):
                return
            self._room.remove(digest(full_key))
            self.stats.pages_removed += 1
            self._record("removed", [full_key])

    def _clear(self) -> int:
        # Every page file of this key space: indexed here or written by another process.
        # Removes only what it finds when it starts; another process's put after that stays.
        with self._gate:
            while self._clearing or self._puts_waiting:
                self._gate.wait()
            self._clearing = True
            while self._puts_active:
                self._gate.wait()
        try:
            with self._lock:
                names = {name for name, _ in self._room.values()}
                try:
                    names.update(
                        e.name for e in os.scandir(self.directory) if e.name.endswith(SUFFIX) and self._owns(e.name)
                    )
                except OSError:
                    pass  # the directory is gone: its files with it
                removed = remove_page_files(self.directory, names)
                self._room.clear()
                self._record("removed", removed)
            return len(removed)
        finally:
            with self._gate:
                self._clearing = False
                self._gate.notify_all()

    def _remove(self, full_keys: list[str]) -> int:
        # The indexed pages and those after them in their chains; a key's file another process
        # wrote (not indexed) goes too. Unlinked under the lock, as an eviction: a put of the
        # same key must not find it in between.
        with self._lock:
            room = self._room
            digests = {digest(full_key): full_key for full_key in full_keys}
            removed = []
            for key in room.chains_after(digests):
                name, page_key = room.remove(key)
                unlink(self.directory / name)
                removed.append(page_key)
            gone = {self.prefix + page_key for page_key in removed}
            unindexed = [self._name(full_key) for full_key in full_keys if full_key not in gone]
            removed += [full_key[len(self.prefix) :] for full_key in remove_page_files(self.directory, unindexed)]
            self._events.record("removed", removed)
        return len(removed)

    def key_spaces(self) -> list[KeySpace]:
        """Every key space with page files in this store's directory, this one included;
        see :func:`key_spaces`."""
        return key_spaces(self.directory)

    def evict_key_space(self, prefix: str) -> int:
        """Remove every page file of another key space from this store's directory, e.g. an old
        ``model_id``'s after a weight update; see :func:`remove_key_space`. Each page removed
        records a ``removed`` event whose ``key_space`` is ``prefix`` and counts in
        ``stats.pages_removed``.

        Args:
            prefix: the key space's fingerprint prefix, as :meth:`key_spaces` lists it.

        Returns:
            The number of pages removed.

        Raises:
            InvalidArgumentError: ``prefix`` is not a fingerprint prefix, or is this store's
                own (use :meth:`clear`).
        """
        if prefix == self.prefix:
            raise InvalidArgumentError(f"prefix: {prefix!r} is this store's own key space; clear() removes its pages")
        removed = remove_key_space(self.directory, prefix)
        self.stats.pages_removed += len(removed)
        self._events.record("removed", removed, key_space=prefix)
        return len(removed)


def open_file_store(rest: str, fingerprint: LayoutFingerprint) -> FileStore:
    """The ``file:DIR[?capacity_bytes=SIZE&io_threads=N]`` URL (see
    :func:`kvstage.storage.open_storage` and :class:`FileStore`); ``capacity_bytes`` is a size
    (:mod:`kvstage.storage.sizes`: ``17179869184``, ``16GB``, ``16GiB``).

    Raises:
        InvalidArgumentError: no directory, an unknown option, a ``capacity_bytes`` that is not
            a size or below one page (``fingerprint.page_bytes``), an ``io_threads`` that is not
            an int >= 1; each names ``storage``, the URL and the option.
        StoreDirectoryError: as :class:`FileStore`.
    """
    directory, _, query = rest.partition("?")
    if not directory:
        raise InvalidArgumentError("storage: 'file:DIR' needs a directory")
    options: dict[str, int] = {}
    for part in filter(None, query.split("&")):
        name, _, value = part.partition("=")
        if name == "capacity_bytes":
            options[name] = parse_size(value, f"storage: 'file:{rest}' capacity_bytes")
        elif name == "io_threads":
            try:
                options[name] = int(value)
            except ValueError:
                raise InvalidArgumentError(f"storage: io_threads must be an int, got {value!r}") from None
        else:
            raise InvalidArgumentError(
                f"storage: unknown option {name!r} in 'file:{rest}'; known: capacity_bytes, io_threads"
            )
    if options.get("capacity_bytes", fingerprint.page_bytes) < fingerprint.page_bytes:
        # A store that cannot hold one page would fail every write.
        raise InvalidArgumentError(
            f"storage: 'file:{rest}' holds no page: capacity_bytes must be at least one page, {fingerprint.page_bytes} bytes"
        )
    return FileStore(fingerprint, directory, **options)
