"""A storage backend on the Mooncake distributed store (``mooncake.store.MooncakeDistributedStore``).

Pages go to a Mooncake cluster: one ``mooncake_master`` (object placement and metadata) and the
memory segments that clients contribute. This process is a client that also contributes
``global_segment_size`` bytes of its own memory to the pool, as in Mooncake's "embedded" mode.

Zero-copy: :meth:`MooncakeStore.register_host_buffers` registers the host pool's host buffers
with Mooncake once (``register_buffer``); a page that lies inside a registered buffer is moved with
``batch_put_from`` / ``batch_get_into`` straight from / into its memory. A page outside every
registered buffer is copied through a registered bounce buffer (``bounce_bytes``, allocated on
first use), so RDMA never sees unregistered memory. Each call that bounces borrows a bounce
buffer of its own (up to ``BOUNCE_BUFFERS_LIMIT`` are made and registered, each once; a call
finding all of them lent waits for one), so threads bouncing at once do not share bytes.

Concurrency: Mooncake's calls run outside the store's lock, so one thread's get (sglang's
prefetch) runs while another's put (its backup) is on the network. The lock covers only what
this client keeps: the registered ranges, the keys it stored, its counters and whether the
master is suspect. A :class:`~kvstage.storage.mooncake.gate.ClearGate` lets exists, put and get
run together and gives ``clear`` and ``close`` the store alone: a put racing a clear lands
whole after it or not at all.

Eviction is Mooncake's own (the master evicts objects when its segments fill up), so the chain
link ``put`` takes (``prior_key``) is accepted and ignored here.

Statuses: keys that exist (``batch_is_exist`` returns 1) are not written and count as
``DEDUPLICATED``; ``batch_put_from`` returns 0 for a page that is stored; any negative code makes
that page ``FAILED`` and is logged with its name and meaning (the table is Mooncake's
``ErrorCode`` enum in ``mooncake-store/include/types.h``, plus ``-901`` RPC_TIMEOUT observed from
the 0.3.13 client). A get is a hit only when it returned exactly ``page_bytes``.

Failure causes: ``put``'s answer (:class:`kvstage.storage.PutStatuses`) carries the first
failed page's cause: a :class:`MooncakeCodeError` (``.code``), the exception a binding call
raised, or a :class:`kvstage.errors.StorageError` when the master was unreachable.

``clear`` removes every object whose key starts with this store's prefix, so pages of this key
space that other clients stored go as well, and other key spaces stay: by name
(``batch_remove(..., force=True)``) the keys the master's admin server listed, with
``admin_address``; else with ``remove_by_regex(..., force=True)`` (force: an object read within
its lease is removed too).

Store events (tier ``"mooncake"``): ``stored`` for each page this client stored; ``removed`` for
each page ``remove`` removed (by name, :mod:`kvstage.storage.mooncake.removal`) and each page ``clear`` removed: with ``admin_address`` (the master's admin HTTP server,
:mod:`kvstage.storage.mooncake.admin`) every one, other clients' included (it removes them by
name), else only this client's; ``evicted`` for a page this client stored that
a later ``exists``, ``get`` or ``clear`` found gone (the master evicted it; it tells no client
when), and with ``watch_s`` for any page of the key space, other clients' included, that one
listing showed and the next did not (a page stored and evicted between two listings goes
unseen; one another client's ``clear`` removed also reads as evicted here). Each disappearance
is announced once per client. The client remembers the keys it stored, at most
``KNOWN_KEYS_LIMIT`` (the oldest are forgotten first; their eviction then goes unreported).

Configuration: :mod:`kvstage.storage.mooncake.config`; return codes:
:mod:`kvstage.storage.mooncake.status`.

The ``mooncake`` package is imported lazily, when a store is built, so kvstage imports without it.
Install: ``bash tools/install-mooncake.sh .venv`` (Debian's libibverbs1, librdmacm1, libnuma1 and
``pip install mooncake-transfer-engine-non-cuda``; on CUDA machines ``mooncake-transfer-engine``).
"""

from __future__ import annotations

import bisect
import importlib.util
import logging
import os
import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Sequence
from urllib.parse import urlsplit

import torch

from kvstage.errors import BackendUnavailableError, InvalidArgumentError, StorageError
from kvstage.storage.backend import PutStatus, PutStatuses, StorageBackend
from kvstage.storage.events import DEFAULT_EVENT_CAPACITY
from kvstage.storage.fingerprint import LayoutFingerprint
from kvstage.storage.mooncake.admin import PeriodicThread, list_keys
from kvstage.storage.mooncake.config import MooncakeConfig, parse_mooncake_url, split_host_port
from kvstage.storage.mooncake.gate import BufferPool, ClearGate
from kvstage.storage.mooncake.removal import remove_named
from kvstage.storage.mooncake.status import (
    MASTER_DOWN_CODES,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    MooncakeCodeError,
    describe_code,
)

logger = logging.getLogger(__name__)

KNOWN_KEYS_LIMIT = 1 << 20  # keys this client stored and remembers, for its evicted/removed events
# Bounce buffers a store makes at most (each bounce_bytes, registered once, kept until close):
# one per call bouncing at once; sglang and the offload manager run two (backup and prefetch).
BOUNCE_BUFFERS_LIMIT = 4
_REGEX_SYNTAX = frozenset("\\^$.|?*+()[]{}")  # ECMAScript's syntax characters (std::regex's default)


def _regex_literal(text: str) -> str:
    """``text`` as a literal in an ECMAScript regular expression (Mooncake's ``std::regex``):
    only syntax characters escaped (escaping others is an error in some ``std::regex``s)."""
    return "".join("\\" + c if c in _REGEX_SYNTAX else c for c in text)


INSTALL_HINT = (
    "install it with `bash tools/install-mooncake.sh .venv` (Debian packages libibverbs1 librdmacm1 "
    "libnuma1, then `pip install mooncake-transfer-engine-non-cuda`, or `pip install '.[mooncake]'` in the kvstage checkout)"
)


def _import_mooncake_store() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as error:
        text = str(error)
        if ".so" in text:  # the wheel is there but a Debian library is not
            raise BackendUnavailableError(
                f"mooncake: the Mooncake wheel is installed but cannot load ({text}); {INSTALL_HINT}"
            ) from error
        raise BackendUnavailableError(
            f"mooncake: the optional Mooncake store is not installed; {INSTALL_HINT}"
        ) from error
    return MooncakeDistributedStore


def mooncake_available() -> bool:
    """Whether ``mooncake.store`` imports here (the wheel and its Debian libraries are present)."""
    try:
        _import_mooncake_store()
    except BackendUnavailableError:
        return False
    return True


def master_binary() -> Path | None:
    """Path of the executable ``mooncake_master`` inside the installed ``mooncake`` package, or None.

    Found without importing ``mooncake`` (so without loading its native libraries).
    """
    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / "mooncake_master"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def _probe(host: str, port: int, timeout: float, what: str) -> str:
    """Connect to host:port and return the local address of the connection.

    Raises:
        StorageError: nothing answers within ``timeout`` seconds.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout) as connection:
            return connection.getsockname()[0]
    except OSError as error:
        raise StorageError(
            f"mooncake: {what} at {host}:{port} is unreachable ({error.__class__.__name__}: {error}); "
            f"start mooncake_master (e.g. `mooncake_master -port={port} -enable_http_metadata_server=true`) "
            "or fix the address"
        ) from None


class MooncakeStore(StorageBackend):
    """Pages in the Mooncake distributed store.

    Args:
        fingerprint: the KV layout (key prefix and page size).
        config: a ``mooncake://`` URL (:func:`parse_mooncake_url`), a dict with
            :class:`MooncakeConfig`'s field names, or a :class:`MooncakeConfig`.
        event_capacity: store events kept until ``take_events`` (see :class:`StorageBackend`).

    Raises:
        BackendUnavailableError: ``mooncake`` is not installed or its libraries are missing.
        InvalidArgumentError: a bad config value, or event_capacity is not an int >= 0.
        StorageError: the master (or the HTTP metadata server) does not answer, or Mooncake's
            ``setup`` fails; the message says which and what to do.

    Thread-safe: exists, put and get from several threads run their Mooncake calls at once
    (each bouncing call with a bounce buffer of its own); ``clear`` and ``close`` wait for the
    calls in flight and hold new ones until done. Every Mooncake call is bounded: an absent master answers
    RPC_FAIL at once (later calls would each wait about 4 s on Mooncake's reconnect, so after
    a call that reached no master, operations first check the master's port and fail at once
    while it refuses connections: see ``calls_skipped``); a hung master answers RPC_TIMEOUT
    after ``rpc_timeout_ms`` (30 s by default). With ``watch_s`` a daemon thread lists the key
    space on the admin server every ``watch_s`` seconds (holding the gate shared, so a ``clear``
    waits for a listing in progress); ``close`` stops it.
    """

    tier = "mooncake"

    def __init__(
        self,
        fingerprint: LayoutFingerprint,
        config: str | Mapping[str, Any] | MooncakeConfig,
        *,
        event_capacity: int = DEFAULT_EVENT_CAPACITY,
    ) -> None:
        super().__init__(fingerprint, event_capacity=event_capacity)
        if isinstance(config, str):
            config = parse_mooncake_url(config)
        elif isinstance(config, Mapping):
            config = MooncakeConfig.from_mapping(config)
        elif not isinstance(config, MooncakeConfig):
            raise InvalidArgumentError(
                f"config: must be a mooncake:// URL, a dict or a MooncakeConfig, got {type(config).__name__}"
            )
        self.config = config
        self._lock = threading.Lock()  # this client's state below; never held across a Mooncake call
        self._gate = ClearGate()  # exists/put/get shared; clear and close exclusive
        self._register_lock = threading.Lock()  # one registration check-and-register at a time
        self._store: Any = None
        self._registered: list[tuple[int, int, torch.Tensor]] = []  # (start, end, tensor), sorted by start
        self._bounce_num_pages = max(1, config.bounce_bytes // self.page_bytes)
        self._bounces: BufferPool[torch.Tensor] = BufferPool(self._make_bounce_buffer, BOUNCE_BUFFERS_LIMIT)
        self.pages_bounced = 0  # pages copied through the bounce buffer (not zero-copy)
        self.calls_skipped = 0  # operations failed without calling Mooncake: the master was down
        # Set when every key of a call failed with RPC_FAIL/RPC_TIMEOUT: the master is suspect.
        # While set, each operation first checks that the master's port accepts a connection
        # and fails at once when it does not, instead of waiting on Mooncake's reconnect
        # (about 4 s a call). Cleared by the first call that reaches the master.
        self._master_suspect = False
        self._last_skip_log = 0.0
        self._known: dict[str, None] = {}  # full keys this client stored, oldest first (an ordered set)
        self._seen: set[str] = set()  # full keys of this key space the watcher's last listing showed
        self.watch_rounds = 0  # listings the watcher compared (for tests and logs)
        self._watch_failing = False  # the watcher's last listing failed (logged once)
        self._watcher: PeriodicThread | None = None

        store_class = _import_mooncake_store()
        host, port = split_host_port(config.master_server_address, "master_server_address")
        self._master_host_port = (host, port)
        local_address = _probe(host, port, config.connect_timeout_s, "mooncake_master")
        if config.metadata_server.startswith(("http://", "https://")):
            meta = urlsplit(config.metadata_server)
            default_port = 443 if meta.scheme == "https" else 80
            _probe(meta.hostname or "", meta.port or default_port, config.connect_timeout_s, "the HTTP metadata server")
        self.local_hostname = config.local_hostname or local_address
        if config.rpc_timeout_ms is not None:
            os.environ["MC_RPC_TIMEOUT_MS"] = str(config.rpc_timeout_ms)
        if config.setup_retries is not None:
            os.environ["MC_STORE_CLIENT_SETUP_RETRIES"] = str(config.setup_retries)

        store = store_class()
        # The positional form of setup is the one every release since 0.3 has.
        rc = store.setup(
            self.local_hostname,
            config.metadata_server,
            config.global_segment_size,
            config.local_buffer_size,
            config.protocol,
            config.device_name,
            config.master_server_address,
        )
        if rc != 0:
            # Not kept: calls on a store whose setup failed crashed the process (0.3.13).
            raise StorageError(
                f"mooncake: setup failed with {describe_code(rc)} (master {config.master_server_address}, "
                f"metadata {config.metadata_server}, protocol {config.protocol}, local_hostname {self.local_hostname}, "
                f"global_segment_size {config.global_segment_size}, local_buffer_size {config.local_buffer_size}); "
                "Mooncake's log above says why"
            )
        self._store = store
        logger.info(
            "mooncake: connected to master %s (metadata %s, %s, segment %d B, local buffer %d B)",
            config.master_server_address,
            config.metadata_server,
            config.protocol,
            config.global_segment_size,
            config.local_buffer_size,
        )
        if config.watch_s is not None:
            self._watcher = PeriodicThread(config.watch_s, self._watch_once, "kvstage-mooncake-watch").start()

    # -- registration ----------------------------------------------------------------------

    def register_host_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        """Register host memory (the host pool's host buffers) with Mooncake, once each.

        A buffer already registered, or lying inside one, is skipped. Pages inside a
        registered buffer then move without a copy.

        Args:
            buffers: contiguous CPU tensors (pinned or not), any dtype.

        Raises:
            InvalidArgumentError: a buffer is not a contiguous CPU tensor, or overlaps a
                registered (or given) buffer without lying inside it. Nothing is registered then.
            StorageError: the store is closed, or Mooncake refused a registration (the
                buffers registered before it stay registered).
        """
        buffers = list(buffers)
        for index, buffer in enumerate(buffers):
            if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu" or not buffer.is_contiguous():
                raise InvalidArgumentError(f"buffers[{index}]: must be a contiguous CPU tensor")
        with self._gate.shared(), self._register_lock:
            store = self._require_open()
            # Check every buffer before registering any; the largest first, so a view inside
            # another buffer of the same call is skipped rather than refused.
            ranges = sorted(
                ((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size(), i, b) for i, b in enumerate(buffers)),
                key=lambda entry: entry[0] - entry[1],
            )
            accepted: list[tuple[int, int, int, torch.Tensor]] = []
            for start, end, index, buffer in ranges:
                if end == start or self._inside_registered(start, end - start):
                    continue
                if any(other[0] <= start and end <= other[1] for other in accepted):
                    continue
                known = [(s, e) for s, e, _ in self._registered] + [(s, e) for s, e, _, _ in accepted]
                for other_start, other_end in known:
                    if start < other_end and other_start < end:
                        raise InvalidArgumentError(
                            f"buffers[{index}]: [{start:#x}, {end:#x}) overlaps [{other_start:#x}, {other_end:#x}), "
                            "registered or given, without lying inside it"
                        )
                accepted.append((start, end, index, buffer))
            for start, end, _, buffer in accepted:
                self._register(store, buffer, start, end)

    def _register(self, store: Any, buffer: torch.Tensor, start: int, end: int) -> None:
        """Register one host buffer with Mooncake and index it. Under ``self._register_lock``
        (the overlap checks and the insertion are one step); the call itself is not under
        ``self._lock``."""
        rc = store.register_buffer(start, end - start)
        if rc != 0:
            raise StorageError(
                f"mooncake: register_buffer of {end - start} bytes at {start:#x} failed with {describe_code(rc)}"
            )
        with self._lock:
            bisect.insort(self._registered, (start, end, buffer), key=lambda entry: entry[0])

    def _split_registered(self, indices, pages: list[torch.Tensor]) -> tuple[list[int], list[int]]:
        """``indices`` split into pages that lie in a registered buffer (zero-copy transfer)
        and pages that must go through a bounce buffer."""
        direct: list[int] = []
        bounced: list[int] = []
        with self._lock:
            for i in indices:
                (direct if self._inside_registered(pages[i].data_ptr(), self.page_bytes) else bounced).append(i)
        return direct, bounced

    def _inside_registered(self, start: int, size: int) -> bool:
        index = bisect.bisect_right(self._registered, start, key=lambda entry: entry[0]) - 1
        return index >= 0 and start + size <= self._registered[index][1]

    def _make_bounce_buffer(self) -> torch.Tensor | None:
        """A new registered bounce buffer (for :class:`BufferPool`); None when Mooncake refuses
        to register it (the pages that needed it then fail, logged)."""
        bounce = torch.empty(self._bounce_num_pages * self.page_bytes, dtype=torch.uint8)
        store = self._store
        if store is None:  # closed meanwhile (close waits for calls in flight; kept for safety)
            return None
        rc = store.register_buffer(bounce.data_ptr(), bounce.numel())
        if rc != 0:
            logger.warning(
                "mooncake: register_buffer of a %d-byte bounce buffer failed with %s; pages outside registered buffers fail",
                bounce.numel(),
                describe_code(rc),
            )
            return None
        return bounce

    def _require_open(self) -> Any:
        if self._store is None:
            raise StorageError("mooncake: the store is closed")
        return self._store

    # -- the storage interface ---------------------------------------------------------------

    def _exists(self, full_keys: list[str]) -> list[bool]:
        if not full_keys:
            return []
        with self._gate.shared():
            store = self._require_open()
            if not self._master_reachable("exists", len(full_keys)):
                return [False] * len(full_keys)
            codes = self._call("batch_is_exist", len(full_keys), store.batch_is_exist, full_keys)
            with self._lock:
                self._note_master(codes)
                self._note_gone([key for key, code in zip(full_keys, codes) if code == 0])
        self._log_failures("exists", full_keys, [c for c in codes if c < 0])
        return [code == 1 for code in codes]

    def _put(
        self, full_keys: list[str], pages: list[torch.Tensor], full_prior_key: str | None = None
    ) -> list[PutStatus]:
        # full_prior_key (the chain link) is not used: the master evicts on its own (by its
        # lease and high-water mark), with no notion of chains.
        statuses = PutStatuses([PutStatus.FAILED] * len(full_keys))
        if not full_keys:
            return statuses
        failures: list[int] = []
        errors: list[BaseException] = []  # what this put's binding calls raised
        with self._gate.shared():
            store = self._require_open()
            if not self._master_reachable("put", len(full_keys)):
                statuses.error = StorageError(f"mooncake: master {self.config.master_server_address} is unreachable")
                return statuses
            exist = self._call("batch_is_exist", len(full_keys), store.batch_is_exist, full_keys, errors=errors)
            with self._lock:
                master_down = self._note_master(exist)
            if master_down:
                self._log_failures("put", full_keys, exist)
                statuses.error = MooncakeCodeError("batch_is_exist", exist[0])
                return statuses  # the master did not answer: a put would not either
            todo: list[int] = []
            for index, code in enumerate(exist):
                if code == 1:
                    statuses[index] = PutStatus.DEDUPLICATED
                else:
                    # 0: absent. Another negative code: unknown; try the put.
                    todo.append(index)
            direct, bounced = self._split_registered(todo, pages)
            if direct:
                codes = self._call(
                    "batch_put_from",
                    len(direct),
                    store.batch_put_from,
                    [full_keys[i] for i in direct],
                    [pages[i].data_ptr() for i in direct],
                    [self.page_bytes] * len(direct),
                    errors=errors,
                )
                with self._lock:
                    self._note_master(codes)
                failures += self._apply_put_codes(direct, codes, statuses)
            if bounced:
                failures += self._put_bounced(store, full_keys, pages, bounced, statuses, errors)
            stored = [key for key, status in zip(full_keys, statuses) if status is PutStatus.STORED]
            with self._lock:
                self._remember(stored)
                self._record("stored", stored)
            if failures:
                statuses.error = errors[0] if errors else MooncakeCodeError("put", failures[0])
        self._log_failures("put", full_keys, failures)
        return statuses

    def _put_bounced(
        self,
        store: Any,
        full_keys: list[str],
        pages: list[torch.Tensor],
        bounced: list[int],
        statuses: list[PutStatus],
        errors: list[BaseException],
    ) -> list[int]:
        """Put ``pages[i]`` for ``i`` in ``bounced`` through a bounce buffer lent to this call;
        the failed codes."""
        failures: list[int] = []
        with self._bounces.lend() as buffer:
            for batch in _batches(bounced, self._bounce_num_pages):
                if buffer is None:
                    failures += [-1] * len(batch)  # statuses stay FAILED
                    continue
                bounce = buffer.view(self._bounce_num_pages, self.page_bytes)
                for bounce_index, index in enumerate(batch):
                    bounce[bounce_index].copy_(pages[index].reshape(-1).view(torch.uint8))
                codes = self._call(
                    "batch_put_from",
                    len(batch),
                    store.batch_put_from,
                    [full_keys[i] for i in batch],
                    [bounce[s].data_ptr() for s in range(len(batch))],
                    [self.page_bytes] * len(batch),
                    errors=errors,
                )
                failures += self._apply_put_codes(batch, codes, statuses)
                with self._lock:
                    self._note_master(codes)
                    self.pages_bounced += len(batch)
        return failures

    def _get(self, full_keys: list[str], into: list[torch.Tensor]) -> list[bool]:
        hits = [False] * len(full_keys)
        if not full_keys:
            return hits
        failures: list[int] = []
        with self._gate.shared():
            store = self._require_open()
            if not self._master_reachable("get", len(full_keys)):
                return hits
            direct, bounced = self._split_registered(range(len(full_keys)), into)
            if direct:
                codes = self._call(
                    "batch_get_into",
                    len(direct),
                    store.batch_get_into,
                    [full_keys[i] for i in direct],
                    [into[i].data_ptr() for i in direct],
                    [self.page_bytes] * len(direct),
                )
                for index, code in zip(direct, codes):
                    hits[index] = self._get_ok(code, into[index], failures)
                with self._lock:
                    self._note_master(codes)
                    self._note_gone([full_keys[i] for i, code in zip(direct, codes) if code == OBJECT_NOT_FOUND])
            if bounced:
                failures += self._get_bounced(store, full_keys, into, bounced, hits)
        self._log_failures("get", full_keys, failures)
        return hits

    def _get_bounced(
        self,
        store: Any,
        full_keys: list[str],
        into: list[torch.Tensor],
        bounced: list[int],
        hits: list[bool],
    ) -> list[int]:
        """Get the pages ``bounced`` through a bounce buffer lent to this call; the failed codes."""
        failures: list[int] = []
        with self._bounces.lend() as buffer:
            for batch in _batches(bounced, self._bounce_num_pages):
                if buffer is None:
                    failures += [-1] * len(batch)  # misses
                    continue
                bounce = buffer.view(self._bounce_num_pages, self.page_bytes)
                codes = self._call(
                    "batch_get_into",
                    len(batch),
                    store.batch_get_into,
                    [full_keys[i] for i in batch],
                    [bounce[s].data_ptr() for s in range(len(batch))],
                    [self.page_bytes] * len(batch),
                )
                for bounce_index, (index, code) in enumerate(zip(batch, codes)):
                    if self._get_ok(code, None, failures):
                        into[index].reshape(-1).view(torch.uint8).copy_(bounce[bounce_index])
                        hits[index] = True
                with self._lock:
                    self._note_master(codes)
                    self._note_gone([full_keys[i] for i, code in zip(batch, codes) if code == OBJECT_NOT_FOUND])
                    self.pages_bounced += len(batch)
        return failures

    def _clear(self) -> int:
        """Remove every object under this store's prefix.

        With ``admin_address``: the keys listed on the master's admin server (and those this
        client stored) are removed by name (``batch_remove``, forced), so each removed page is
        announced, whoever stored it; a page another client puts after the listing lands after
        the clear. Without one, or when the listing fails: ``remove_by_regex`` on the prefix
        (forced), announcing only this client's pages. Forced: an object read within its lease
        is removed too.

        Holds the store alone (its gate): puts, gets and lookups in flight finish first, and
        those that arrive wait until it is done.

        Raises:
            StorageError: the store is closed, or Mooncake answered an error (nothing is
                known removed then; this client's pages are still reported as before).
        """
        with self._gate.exclusive():
            store = self._require_open()
            listed = self._list_key_space() if self.config.admin_address else None
            with self._lock:
                known = list(self._known)
            present = self._call("batch_is_exist", len(known), store.batch_is_exist, known) if known else []
            if listed is None:
                removed = self._remove_by_regex(store)
                with self._lock:
                    self._known.clear()
                    self._seen.clear()  # all gone: the watcher must not announce them again
                    self._record("evicted", [key for key, code in zip(known, present) if code == 0])
                    self._record("removed", [key for key, code in zip(known, present) if code == 1])
                return removed
            names = list(dict.fromkeys(listed + [key for key, code in zip(known, present) if code == 1]))
            codes = self._call("batch_remove", len(names), store.batch_remove, names, True) if names else []
            if codes and all(code in MASTER_DOWN_CODES for code in codes):
                raise MooncakeCodeError("batch_remove", codes[0])
            gone = [key for key, code in zip(known, present) if code == 0]
            gone += [key for key, code in zip(names, codes) if code == OBJECT_NOT_FOUND]  # evicted meanwhile
            failed = [code for code in codes if code not in (0, OBJECT_NOT_FOUND)]
            swept = self._remove_by_regex(store) if failed else 0  # what batch_remove left, unnamed
            named = [key for key, code in zip(names, codes) if code == 0]
            with self._lock:
                for key in named:
                    self._known.pop(key, None)
                    self._seen.discard(key)
                self._note_gone(gone)
                self._record("removed", named)
        if failed:
            self._log_failures("clear's batch_remove", names, failed)
            logger.warning("mooncake: clear swept %d more pages by regex, unnamed in its events", swept)
        return len(named) + swept

    def _remove(self, full_keys: list[str]) -> int:
        return remove_named(self, full_keys)  # only the keys named: the master keeps no chains

    def _remove_by_regex(self, store: Any) -> int:
        """``remove_by_regex`` (forced) of every key under this store's prefix; how many went.

        Raises:
            StorageError: the binding raised, or Mooncake answered an error code.
        """
        try:
            removed = store.remove_by_regex("^" + _regex_literal(self.prefix), True)
        except Exception as error:  # the binding raises on a broken client
            raise StorageError(f"mooncake: remove_by_regex raised {error.__class__.__name__}: {error}") from error
        if removed < 0:
            raise MooncakeCodeError("remove_by_regex", removed)
        return removed

    def _list_key_space(self) -> list[str] | None:
        """Full keys of this key space on the master's admin server, for ``clear``; None
        (logged) when it does not answer. Not under ``self._lock``."""
        try:
            return list_keys(self.config.admin_address, self.prefix)
        except StorageError as error:
            logger.warning("mooncake: clear: %s; announcing only this client's pages", error)
            return None

    def _watch_once(self) -> None:
        """One watcher round: list the key space and announce as ``evicted`` the keys of the
        last listing that are gone. Holds the gate shared, so no ``clear`` of this client
        runs between the listing and the comparison."""
        with self._gate.shared():
            if self._store is None:
                return
            try:
                listed = list_keys(self.config.admin_address, self.prefix)
            except StorageError as error:
                if not self._watch_failing:  # once per outage, not once per round
                    logger.warning("mooncake: watch: %s; evictions are announced once it answers again", error)
                self._watch_failing = True
                return
            if self._watch_failing:
                logger.info("mooncake: watch: the admin server %s answers again", self.config.admin_address)
                self._watch_failing = False
            now = set(listed)
            with self._lock:
                gone = sorted(self._seen - now)
                self._seen = now
                for key in gone:
                    self._known.pop(key, None)  # announced here: not again when this client asks
                self._record("evicted", gone)
                self.watch_rounds += 1
        self._tell_changes()  # the evictions it noticed, to the change listeners (off the store's locks)

    def close(self) -> None:
        """Unregister every buffer this store registered (the bounce buffers too) and close
        the Mooncake client. Waits for the calls in flight.

        Idempotent. With the master gone this still returns (Mooncake gives up after its RPC
        timeouts, a few seconds); failures are logged, not raised.
        """
        if self._watcher is not None:
            self._watcher.stop()  # before the gate: a round waiting for it would never end
        with self._gate.exclusive():
            with self._lock:
                store, self._store = self._store, None
                registered, self._registered = self._registered, []
            if store is None:
                return
            starts = [start for start, _, _ in registered] + [bounce.data_ptr() for bounce in self._bounces.drain()]
            for start in starts:
                rc = store.unregister_buffer(start)
                if rc != 0:
                    logger.warning("mooncake: unregister_buffer at %#x failed with %s", start, describe_code(rc))
            rc = store.close()
            if rc != 0:
                logger.warning("mooncake: close failed with %s", describe_code(rc))

    # -- helpers ------------------------------------------------------------------------------

    def _remember(self, full_keys: list[str]) -> None:
        """Remember keys this client stored (for their evicted/removed events), at most
        KNOWN_KEYS_LIMIT, forgetting the oldest first. Under ``self._lock``."""
        known = self._known
        for key in full_keys:
            known[key] = None
        while len(known) > KNOWN_KEYS_LIMIT:
            del known[next(iter(known))]

    def _note_gone(self, full_keys: list[str]) -> None:
        """Keys Mooncake answered absent: those this client stored or its watcher saw listed
        were evicted by the master (an ``evicted`` event each, once). Under ``self._lock``."""
        gone = []
        for key in full_keys:
            stored = self._known.pop(key, 0) is None
            if stored or key in self._seen:
                self._seen.discard(key)  # announced here: not again by the watcher
                gone.append(key)
        self._record("evicted", gone)

    def _call(
        self, name: str, count: int, function: Any, *args: Any, errors: list[BaseException] | None = None
    ) -> list[int]:
        """Run a batch call (not under ``self._lock``); an exception or a malformed answer
        becomes INTERNAL_ERROR for every key (the exception is appended to ``errors``, the
        calling put's, for its answer)."""
        try:
            codes = list(function(*args))
        except Exception as error:  # the binding raises on bad arguments or a broken client
            logger.warning("mooncake: %s raised %s: %s", name, error.__class__.__name__, error)
            if errors is not None:
                errors.append(error)
            return [-1] * count
        if len(codes) != count or not all(isinstance(code, int) for code in codes):
            logger.warning("mooncake: %s answered %d codes for %d keys", name, len(codes), count)
            return [-1] * count
        return codes

    def _note_master(self, codes: list[int]) -> bool:
        """Track whether the master answers; True when every code says it did not. Under ``self._lock``."""
        down = bool(codes) and all(code in MASTER_DOWN_CODES for code in codes)
        if down:
            self._master_suspect = True
        elif any(code not in MASTER_DOWN_CODES for code in codes):
            self._master_suspect = False
        return down

    def _master_reachable(self, operation: str, count: int) -> bool:
        """False (and the operation fails without calling Mooncake) when the master is suspect
        and its port refuses a connection. The probe runs outside ``self._lock``."""
        with self._lock:
            suspect = self._master_suspect
        if not suspect:
            return True
        try:
            socket.create_connection(self._master_host_port, timeout=min(self.config.connect_timeout_s, 0.5)).close()
            return True
        except OSError as error:
            with self._lock:
                self.calls_skipped += 1
                now = time.monotonic()
                log = now - self._last_skip_log > 5.0  # one line per 5 s, not one per call
                if log:
                    self._last_skip_log = now
            if log:
                logger.warning(
                    "mooncake: master %s:%d unreachable (%s); %s of %d pages fails without calling Mooncake",
                    *self._master_host_port,
                    error.__class__.__name__,
                    operation,
                    count,
                )
            return False

    def _apply_put_codes(self, indices: list[int], codes: list[int], statuses: list[PutStatus]) -> list[int]:
        failures = []
        for index, code in zip(indices, codes):
            if code == 0:
                statuses[index] = PutStatus.STORED
            elif code == OBJECT_ALREADY_EXISTS:  # another writer stored it between exist and put
                statuses[index] = PutStatus.DEDUPLICATED
            else:
                statuses[index] = PutStatus.FAILED
                failures.append(code)
        return failures

    def _get_ok(self, code: int, target: torch.Tensor | None, failures: list[int]) -> bool:
        if code == self.page_bytes:
            return True
        if code >= 0:
            # An object of another size: never a page of this layout. Its bytes may be in target.
            if target is not None:
                target.reshape(-1).view(torch.uint8).zero_()
            logger.warning("mooncake: get read %d bytes, a page has %d; counted as a miss", code, self.page_bytes)
        elif code != OBJECT_NOT_FOUND:
            failures.append(code)
        return False

    def _log_failures(self, operation: str, full_keys: list[str], codes: list[int]) -> None:
        if not codes:
            return
        summary = ", ".join(f"{describe_code(code)} x{count}" for code, count in Counter(codes).most_common())
        logger.warning("mooncake: %s failed for %d of %d pages: %s", operation, len(codes), len(full_keys), summary)


def _batches(items: list[int], size: int) -> list[list[int]]:
    return [items[start : start + size] for start in range(0, len(items), size)]


def open_mooncake_store(url: str, fingerprint: LayoutFingerprint) -> MooncakeStore:
    """The ``mooncake://`` URL (see :func:`kvstage.storage.open_storage`)."""
    return MooncakeStore(fingerprint, url)
