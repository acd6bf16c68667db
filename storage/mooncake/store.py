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
:mod:`kvstage.storage.mooncake.status`; clear, remove and the watcher:
:mod:`kvstage.storage.mooncake.key_space`; the batch calls and their codes:
:mod:`kvstage.storage.mooncake.calls`; finding the installed Mooncake:
:mod:`kvstage.storage.mooncake.install`.

The ``mooncake`` package is imported lazily, when a store is built, so kvstage imports without it.
Install: ``bash tools/install-mooncake.sh .venv`` (Debian's libibverbs1, librdmacm1, libnuma1 and
``pip install mooncake-transfer-engine-non-cuda``; on CUDA machines ``mooncake-transfer-engine``).
"""

from __future__ import annotations

import bisect
import importlib
import logging
import os
import threading
from typing import Any, Mapping, Sequence
from urllib.parse import urlsplit

import torch

from kvstage.errors import InvalidArgumentError, StorageError
from kvstage.storage.backend import PutStatus, PutStatuses, StorageBackend
from kvstage.storage.events import DEFAULT_EVENT_CAPACITY
from kvstage.storage.fingerprint import LayoutFingerprint
from kvstage.storage.mooncake.admin import PeriodicThread
from kvstage.storage.mooncake.calls import CallsMixin, batches
from kvstage.storage.mooncake.config import MooncakeConfig, parse_mooncake_url, split_host_port
from kvstage.storage.mooncake.gate import BufferPool, ClearGate
from kvstage.storage.mooncake.install import INSTALL_HINT, import_store_class, master_binary, mooncake_available, probe
from kvstage.storage.mooncake.key_space import KeySpaceMixin
from kvstage.storage.mooncake.status import (
    OBJECT_NOT_FOUND,
    MooncakeCodeError,
    describe_code,
)

# The names the rest of kvstage and the tests import from here (install's are re-exported).
__all__ = ["INSTALL_HINT", "MooncakeStore", "master_binary", "mooncake_available", "open_mooncake_store"]

logger = logging.getLogger(__name__)

# Bounce buffers a store makes at most (each bounce_bytes, registered once, kept until close):
# one per call bouncing at once; sglang and the offload manager run two (backup and prefetch).
BOUNCE_BUFFERS_LIMIT = 4


class MooncakeStore(KeySpaceMixin, CallsMixin, StorageBackend):
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

        store_class = import_store_class()
        host, port = split_host_port(config.master_server_address, "master_server_address")
        self._master_host_port = (host, port)
        local_address = probe(host, port, config.connect_timeout_s, "mooncake_master")
        if config.metadata_server.startswith(("http://", "https://")):
            meta = urlsplit(config.metadata_server)
            default_port = 443 if meta.scheme == "https" else 80
            probe(meta.hostname or "", meta.port or default_port, config.connect_timeout_s, "the HTTP metadata server")
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
        self._put_extra: tuple[Any, ...] = ()  # batch_put_from's ReplicateConfig, when it is not the default
        if config.soft_pin_ms is not None:
            module = importlib.import_module(store_class.__module__)
            replicate = module.ReplicateConfig()
            replicate.soft_pin_action = module.SoftPinAction.ENABLE
            replicate.soft_pin_ttl_ms = config.soft_pin_ms
            self._put_extra = (replicate,)
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
                    *self._put_extra,
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
            for batch in batches(bounced, self._bounce_num_pages):
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
                    *self._put_extra,
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
            for batch in batches(bounced, self._bounce_num_pages):
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


def open_mooncake_store(url: str, fingerprint: LayoutFingerprint) -> MooncakeStore:
    """The ``mooncake://`` URL (see :func:`kvstage.storage.open_storage`)."""
    return MooncakeStore(fingerprint, url)
