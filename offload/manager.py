"""``OffloadManager``: backs up a decoding request's KV pages to storage, stride by stride.

The engine calls :meth:`OffloadManager.offload` for each running request every decode step,
:meth:`OffloadManager.poll` once a step, and :meth:`OffloadManager.finish` or
:meth:`OffloadManager.abort` when a request ends. The manager:

1. finds the tokens whose KV exists and is not offloaded yet (``origin_input_ids +
   output_ids[:-1]``; the last sampled token has no KV yet), in whole strides starting right
   after the last offloaded token, so pages stay aligned to absolute positions;
2. allocates host pages, launches one gather per host-pool chunk on the copy stream and keeps
   the completion event, counted as in flight for that request object;
3. in ``poll``, for each finished copy (in any order): writes the pages to storage under their
   page keys, skipping keys already there, and frees the host pages;
4. calls ``release(req)`` exactly once, when the request has ended and no copy of its device
   slots is in flight; only then may the engine free the request's device slots.

Decisions worth knowing:

- State is keyed by the request *object* (``id(req)``, with the object held by the state so the
  id cannot be reused while tracked), never by ``rid`` and never through the request class's
  ``__eq__``/``__hash__``: two requests with one rid (a retry) are two lifecycles.
- The prompt's page-aligned prefix was stored by prefill. Its last page key (or the namespace
  seed when the prompt is shorter than a page) is the prior of the request's chain, computed
  once per request (when its first segment's keys are needed).
- Page keys are computed in ``poll``, not in ``offload`` (which stays cheap: it copies the
  segment's token ids and launches). A key depends only on tokens, so when a segment completes
  before the one launched before it, ``poll`` computes the earlier segments' keys first, from
  their token ids (each segment links to its predecessor until its keys are known): the chain is
  always hashed in order and no completion waits for another.
- ``finish`` offloads every remaining *whole page*, not only whole strides: the stride batches
  copies during decode; at the end nothing is gained by leaving full pages behind.
- Every page launched ends in exactly one of: stored, deduplicated, failed (the copy or the
  storage write failed; counted, logged, ``on_storage_failure`` called), discarded (its
  request was aborted: freed without a storage write).
- ``poll`` never blocks and costs O(copies finished), not O(live requests): in-flight copies
  sit in a queue in submission order; on an in-order copy stream ``poll`` stops at the first
  unfinished copy, on any other it checks each in-flight copy.
- Host pool short: ``offload`` launches the whole strides that fit, oldest first (the rest
  follow at later calls, as pages are freed); when not one fits it returns False and changes
  nothing. ``finish`` launches the pages that fit, drops the rest (``pages_dropped``) and still
  releases. A request whose ``finished()`` is true is finished by ``offload``.
- After release the manager forgets the request but remembers the object weakly: a late
  ``finish``/``abort``/``offload`` of it is ignored, so release stays exactly once.
- NVTX ranges (domain ``kvstage``): ``offload``, ``offload.finish``, ``poll``, ``backup``
  (the storage write of one segment, inside ``poll``).

Not thread-safe: call offload/poll/finish/abort from one thread (the scheduler's).
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError, StorageError, is_int, require
from kvstage.nvtx_ranges import nvtx_range
from kvstage.offload.host_pool import HostPool
from kvstage.storage import PutStatus, StorageBackend

logger = logging.getLogger(__name__)


@runtime_checkable
class OffloadRequest(Protocol):
    """What the manager reads from an engine's request object (adapt yours to it).

    Attributes:
        rid: the request id (only for log lines; never a key).
        origin_input_ids: the prompt's token ids (list or 1-D int sequence).
        output_ids: the sampled token ids so far; the last one has no KV yet.
        extra_key: namespace part (LoRA adapter and similar), or None.
        cache_salt: namespace part (per-tenant secret), or None.

    The class should support weak references (plain classes do; a ``__slots__`` class needs
    ``"__weakref__"`` in its slots): the manager remembers released requests weakly, so that a
    late ``finish``/``abort``/``offload`` of one is ignored. Without that, such a late call
    starts a new lifecycle for the object.
    """

    rid: Any
    origin_input_ids: Sequence[int]
    output_ids: Sequence[int]
    extra_key: str | None
    cache_salt: str | None

    def finished(self) -> bool:
        """True once the request will produce no more tokens."""
        ...


# slot_indices_of(req) -> 1-D int32/int64 tensor on the KV pool's device whose entry i is the
# device slot holding token i's KV (e.g. sglang's req_to_token[req.req_pool_idx]); at least as
# long as the tokens with KV.
SlotIndicesOf = Callable[[Any], torch.Tensor]


def kv_length(req: OffloadRequest) -> int:
    """Token positions of ``req`` whose KV is in the device pool: the prompt and every output
    token but the last sampled one, which has no KV until the next decode step writes it."""
    return len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)


@dataclass(frozen=True)
class OffloadMetrics:
    """A snapshot of the manager's counters (pages are host pages of ``page_size`` tokens).

    Every launched page is in flight or has ended exactly once::

        pages_launched == pages_in_flight + pages_stored + pages_deduplicated
                          + pages_failed + pages_discarded
    """

    requests_live: int  # request objects tracked (not released yet)
    copies_in_flight: int  # D2H copies launched and not handled by poll yet
    pages_in_flight: int
    pages_launched: int
    pages_offloaded: int  # pages whose D2H copy completed without error
    bytes_offloaded: int
    copy_seconds: float  # summed durations of those copies (GPU time on CUDA)
    pages_stored: int  # written to storage now
    pages_deduplicated: int  # storage had the key already
    pages_failed: int  # copy or storage write failed; reported
    pages_discarded: int  # the request was aborted; freed without a storage write
    pages_dropped: int  # finish() could not get host pages; never launched
    storage_failures: int  # storage writes (segments) with at least one failed page
    copy_failures: int  # copies that raised
    offloads_rejected: int  # offload() returned False because the host pool was full
    releases: int
    callback_errors: int  # release/on_storage_failure callbacks that raised (logged)
    host_pages_used: int
    host_pages_high_water: int
    host_pages_capacity: int

    @property
    def d2h_gbps(self) -> float:
        """D2H throughput over copy time, in GB/s (1e9 bytes)."""
        return self.bytes_offloaded / self.copy_seconds / 1e9 if self.copy_seconds > 0 else 0.0

    @property
    def dedup_hits(self) -> int:
        """Pages not written because storage had them (same as ``pages_deduplicated``)."""
        return self.pages_deduplicated


def _answer_of(answer: Any, expected: int, call: str) -> list:
    """A backend's per-key answer as a list, or StorageError when it does not answer every key
    (zip would silently drop the pages it left out of the accounting)."""
    answer = list(answer)
    if len(answer) != expected:
        raise StorageError(f"storage: {call}() answered {len(answer)} keys of {expected}")
    return answer


class _RequestState:
    __slots__ = ("req", "offloaded_len", "last_segment", "in_flight", "ending", "aborted")

    def __init__(self, req: Any, offloaded_len: int) -> None:
        self.req = req  # held: keeps id(req) from being reused while tracked
        self.offloaded_len = offloaded_len  # tokens [0, offloaded_len) are stored or launched
        self.last_segment: _Segment | None = None  # the latest launched (the chain continues it)
        self.in_flight = 0
        self.ending = False  # finish() or abort() was called
        self.aborted = False


class _Segment:
    """One launched copy: whole pages of one request, their host pages, tokens and keys."""

    __slots__ = ("state", "host_ids", "tokens", "prev", "keys", "event")

    def __init__(self, state: _RequestState, host_ids: list[int], tokens: list[int], prev: "_Segment | None", event: Any) -> None:
        self.state = state
        self.host_ids = host_ids
        self.tokens = tokens  # token ids of the pages; dropped once keys are computed
        self.prev = prev  # the request's previous segment (None: the first, after the prompt)
        self.keys: list[str] | None = None
        self.event = event


_NOTHING, _LAUNCHED, _PARTIAL, _FULL = 0, 1, 2, 3


class OffloadManager:
    """Offloads decoding requests' KV pages through a host pool to a storage backend.

    Args:
        kv_pool: the device KV pool (:class:`kvstage.kernels.KVPool`).
        host_pool: staging pages matching ``kv_pool``'s layout and dtype.
        storage: where pages are backed up; its layout's page bytes must equal the host page's.
        hasher: computes page keys (:class:`kvstage.hashing.PageHasher`); its page_size must
            equal the host pool's.
        slot_indices_of: ``slot_indices_of(req)`` -> the request's device slots (see
            :data:`SlotIndicesOf`).
        offload_stride: tokens per offload unit during decode, a positive multiple of the page
            size (default: one page).
        release: ``release(req)``, called exactly once per request after ``finish``/``abort``
            when none of its copies is in flight: the engine may free its device slots then.
        on_storage_failure: ``on_storage_failure(req, failed_keys, error)``: a copy or storage
            write failed for these page keys (error: the exception, or None when the backend
            answered FAILED; keys are empty when the hasher itself raised).
        backend: the gather's backend (``"auto"``, ``"triton"``, ``"torch"``).
        copy_stream: where copies run (default: :class:`CopyStream` on ``kv_pool.device``);
            anything with ``submit(copy, keep=...) -> event`` and ``in_order``.

    Raises:
        InvalidArgumentError: the stride, page sizes or layouts do not match, or a callback
            is not callable.
    """

    def __init__(
        self,
        kv_pool: Any,
        host_pool: HostPool,
        storage: StorageBackend,
        hasher: Any,
        slot_indices_of: SlotIndicesOf,
        *,
        offload_stride: int | None = None,
        release: Callable[[Any], None] | None = None,
        on_storage_failure: Callable[[Any, list[str], BaseException | None], None] | None = None,
        backend: str = "auto",
        copy_stream: Any = None,
    ) -> None:
        from kvstage.kernels.backend import resolve_backend
        from kvstage.offload.copy_stream import CopyStream

        page_size = host_pool.page_size
        require(
            all(callable(getattr(hasher, name, None)) for name in ("continue_keys", "prefill_keys", "seed"))
            and hasattr(hasher, "page_size"),
            "hasher",
            f"must be a kvstage.hashing.PageHasher (page_size, seed, prefill_keys, continue_keys), got {type(hasher).__name__}",
            ArgumentTypeError,
        )
        require(
            hasher.page_size == page_size,
            "hasher",
            f"page_size {hasher.page_size} must equal the host pool's page_size {page_size}",
        )
        stride = page_size if offload_stride is None else offload_stride
        require(
            is_int(stride) and stride > 0 and stride % page_size == 0,
            "offload_stride",
            f"must be a positive multiple of page_size {page_size}, got {offload_stride!r}",
        )
        for name in ("num_layers", "kv_parts", "num_heads", "head_dim", "dtype"):
            mine, theirs = getattr(host_pool, name), getattr(kv_pool, name)
            require(mine == theirs, "host_pool", f"{name} {mine} must equal the KV pool's {theirs}")
        storage_page_bytes = getattr(storage, "page_bytes", host_pool.page_bytes)
        require(
            storage_page_bytes == host_pool.page_bytes,
            "storage",
            f"its layout's page has {storage_page_bytes} bytes, the host pool's page has {host_pool.page_bytes}",
        )
        fingerprint = getattr(storage, "fingerprint", None)
        if fingerprint is not None:
            # Equal page bytes are not enough: the keys carry the storage's layout prefix, so a
            # page of another dtype or shape would later be read back as that layout.
            require(
                getattr(torch, fingerprint.dtype, None) == host_pool.dtype,
                "storage",
                f"its layout's dtype {fingerprint.dtype} must be the host pool's {host_pool.dtype}",
            )
            for name in ("num_layers", "kv_parts", "num_heads", "head_dim", "page_size"):
                mine, theirs = getattr(host_pool, name), getattr(fingerprint, name)
                require(theirs == mine, "storage", f"its layout's {name} {theirs} must equal the host pool's {mine}")
        require(callable(slot_indices_of), "slot_indices_of", "must be callable")
        require(release is None or callable(release), "release", "must be callable or None")
        require(
            on_storage_failure is None or callable(on_storage_failure), "on_storage_failure", "must be callable or None"
        )
        self.device = torch.device(kv_pool.device)
        resolve_backend(backend, on_cuda=self.device.type == "cuda")  # validates now, not mid-step
        self.kv_pool = kv_pool
        self.host_pool = host_pool
        self.storage = storage
        self.hasher = hasher
        self.slot_indices_of = slot_indices_of
        self.page_size = page_size
        self.offload_stride = stride
        self.backend = backend
        self._owns_copy_stream = copy_stream is None
        self.copy_stream = copy_stream if copy_stream is not None else CopyStream(self.device)
        self._release_callback = release
        self._failure_callback = on_storage_failure
        self._states: dict[int, _RequestState] = {}
        # Released request objects, held weakly (gone when the engine drops them): a late
        # finish/abort/offload of one is ignored instead of releasing it a second time.
        self._ended: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._in_flight: deque[_Segment] = deque()
        self._in_order = bool(getattr(self.copy_stream, "in_order", False))
        storage.register_host_buffers(host_pool.buffers)
        # Counters (see OffloadMetrics).
        self._pages_in_flight = 0
        self._pages_launched = 0
        self._pages_offloaded = 0
        self._copy_seconds = 0.0
        self._pages_stored = 0
        self._pages_deduplicated = 0
        self._pages_failed = 0
        self._pages_discarded = 0
        self._pages_dropped = 0
        self._storage_failures = 0
        self._copy_failures = 0
        self._offloads_rejected = 0
        self._releases = 0
        self._callback_errors = 0

    # -- the engine's calls -----------------------------------------------------------------

    def offload(self, req: Any) -> bool:
        """Launch the D2H copy of ``req``'s new whole strides, if any.

        A request whose ``finished()`` is true is handed to :meth:`finish` instead.

        Returns:
            True when a copy was launched now: of every new whole stride, or of as many as
            the host pool's free pages hold (oldest first; the rest at later calls). For a
            finished request: what :meth:`finish` returns. False when there is no whole stride
            yet, the request has ended (finish/abort called, or released), or not one stride
            fits in the host pool; in each of these cases nothing changed.

        Raises:
            ArgumentTypeError: ``slot_indices_of(req)`` is not a 1-D int32/int64 tensor.
            InvalidArgumentError: ``slot_indices_of(req)`` is too short for the tokens to copy.
            Whatever ``slot_indices_of`` or (on CUDA, where the gather launches here) the gather
            raise; nothing changed then. On CPU the gather runs on the worker thread: its error
            fails the copy (counted and reported in :meth:`poll`).
        """
        with nvtx_range("offload"):
            state = self._live_state(req)
            if state is None:
                return False
            if req.finished():
                return self._finish_state(state)
            return self._launch(state, self.offload_stride) in (_LAUNCHED, _PARTIAL)

    def poll(self) -> int:
        """Handle every copy that has completed: back its pages up, free them, release requests.

        Never blocks. Returns the number of copies handled.
        """
        if not self._in_flight:
            return 0
        with nvtx_range("poll"):
            done: list[_Segment] = []
            in_flight = self._in_flight
            if self._in_order:
                while in_flight and in_flight[0].event.query():
                    done.append(in_flight.popleft())
            else:
                waiting: deque[_Segment] = deque()
                for segment in in_flight:
                    (done if segment.event.query() else waiting).append(segment)
                self._in_flight = waiting
            for index, segment in enumerate(done):
                try:
                    self._complete(segment)
                except BaseException:
                    # Not expected (callbacks and storage errors are caught): keep the copies not
                    # handled yet for the next poll rather than losing their host pages.
                    self._in_flight.extendleft(reversed(done[index + 1 :]))
                    raise
            return len(done)

    def finish(self, req: Any) -> bool:
        """``req`` has ended normally: offload its remaining whole pages, then release it.

        ``release(req)`` is called once no copy of it is in flight: within this call when none
        is, else in the :meth:`poll` that handles its last copy. A second call does nothing
        (also after release, while the engine still holds the object).

        Returns:
            True when every remaining whole page was launched (or there was none); False when
            the host pool could not take them all: it launches those that fit and drops the
            rest (``pages_dropped``).

        Raises:
            As :meth:`offload` (``slot_indices_of`` too short or raising; on CUDA the gather's
            launch errors); nothing changed then and the request is not released: call
            :meth:`abort` to release it.
        """
        with nvtx_range("offload.finish"):
            state = self._live_state(req)
            return True if state is None else self._finish_state(state)

    def abort(self, req: Any) -> None:
        """``req`` was aborted: offload nothing more; copies in flight complete and their host
        pages are freed without storage writes; ``release(req)`` is called once when none is in
        flight (within this call when none is). Also after :meth:`finish`, before release;
        after release it does nothing.
        """
        state = self._states.get(id(req))
        if state is None:
            if self._has_ended(req):
                return
            state = _RequestState(req, 0)
            self._states[id(req)] = state
        state.ending = True
        state.aborted = True
        if state.in_flight == 0:
            self._release(state)

    def drain(self) -> None:
        """Block until every copy in flight has completed, then :meth:`poll` (for shutdown and tests)."""
        for segment in list(self._in_flight):
            segment.event.synchronize()
        self.poll()

    def close(self) -> None:
        """:meth:`drain`, then stop the copy stream if the manager made it. Requests still
        tracked stay tracked (finish or abort them first to release them)."""
        self.drain()
        if self._owns_copy_stream:
            self.copy_stream.close()

    # -- what the engine may inspect ----------------------------------------------------------

    def is_tracked(self, req: Any) -> bool:
        """Whether the manager holds state for this request object (not released yet)."""
        return id(req) in self._states

    def in_flight(self, req: Any) -> int:
        """Copies of this request object in flight (0 when untracked)."""
        state = self._states.get(id(req))
        return 0 if state is None else state.in_flight

    def offloaded_len(self, req: Any) -> int | None:
        """Tokens of this request stored by prefill or launched so far (None when untracked)."""
        state = self._states.get(id(req))
        return None if state is None else state.offloaded_len

    @property
    def requests_live(self) -> int:
        """Requests tracked and not yet released (``metrics.requests_live``, without a snapshot)."""
        return len(self._states)

    @property
    def copies_in_flight(self) -> int:
        """Copies launched and not yet handled by :meth:`poll` (``metrics.copies_in_flight``)."""
        return len(self._in_flight)

    @property
    def metrics(self) -> OffloadMetrics:
        """A snapshot of the counters."""
        pool = self.host_pool
        return OffloadMetrics(
            requests_live=len(self._states),
            copies_in_flight=len(self._in_flight),
            pages_in_flight=self._pages_in_flight,
            pages_launched=self._pages_launched,
            pages_offloaded=self._pages_offloaded,
            bytes_offloaded=self._pages_offloaded * pool.page_bytes,
            copy_seconds=self._copy_seconds,
            pages_stored=self._pages_stored,
            pages_deduplicated=self._pages_deduplicated,
            pages_failed=self._pages_failed,
            pages_discarded=self._pages_discarded,
            pages_dropped=self._pages_dropped,
            storage_failures=self._storage_failures,
            copy_failures=self._copy_failures,
            offloads_rejected=self._offloads_rejected,
            releases=self._releases,
            callback_errors=self._callback_errors,
            host_pages_used=pool.used,
            host_pages_high_water=pool.high_water,
            host_pages_capacity=pool.capacity,
        )

    # -- internals ------------------------------------------------------------------------------

    def _track(self, req: Any) -> _RequestState:
        """New state: the prompt's page-aligned prefix counts as offloaded (prefill stored it)."""
        aligned = len(req.origin_input_ids) // self.page_size * self.page_size
        state = _RequestState(req, aligned)
        self._states[id(req)] = state
        return state

    def _prompt_prior(self, req: Any) -> str | None:
        """The prior of the first decode page: the last key of the prompt's whole pages, or the
        namespace seed when the prompt is shorter than a page (None: no namespace)."""
        prompt = req.origin_input_ids
        aligned = len(prompt) // self.page_size * self.page_size
        if aligned:
            return self.hasher.prefill_keys(prompt[:aligned], extra_key=req.extra_key, cache_salt=req.cache_salt)[-1]
        return self.hasher.seed(req.extra_key, req.cache_salt)

    def _keys_of(self, segment: _Segment) -> list[str]:
        """The segment's page keys, computing its unkeyed predecessors' first (oldest first)."""
        if segment.keys is not None:
            return segment.keys
        unkeyed = []
        link: _Segment | None = segment
        while link is not None and link.keys is None:
            unkeyed.append(link)
            link = link.prev
        for link in reversed(unkeyed):
            prior = link.prev.keys[-1] if link.prev is not None else self._prompt_prior(link.state.req)
            link.keys = self.hasher.continue_keys(link.tokens, prior)
        for link in unkeyed:  # keys known: the links and token ids are no longer needed
            link.prev = None
            link.tokens = None
        return segment.keys

    def _live_state(self, req: Any) -> _RequestState | None:
        """``req``'s state, tracked now if it is new; None once it has ended (finish or abort
        called, or released)."""
        state = self._states.get(id(req))
        if state is None:
            return None if self._has_ended(req) else self._track(req)
        return None if state.ending else state

    def _finish_state(self, state: _RequestState) -> bool:
        """Launch every remaining whole page of a live request, mark it ending, release it when
        nothing of it is in flight; what :meth:`finish` returns."""
        req = state.req
        outcome = self._launch(state, self.page_size)
        state.ending = True
        if outcome in (_FULL, _PARTIAL):
            dropped = (kv_length(req) - state.offloaded_len) // self.page_size
            self._pages_dropped += dropped
            logger.warning("offload: host pool full at finish of rid=%r: %d pages not offloaded", req.rid, dropped)
        if state.in_flight == 0:
            self._release(state)
        return outcome in (_NOTHING, _LAUNCHED)


    @staticmethod
    def _tokens(req: Any, start: int, end: int) -> list[int]:
        prompt, output = req.origin_input_ids, req.output_ids
        n_prompt = len(prompt)
        if end <= n_prompt:
            return list(prompt[start:end])
        if start >= n_prompt:
            return list(output[start - n_prompt : end - n_prompt])
        return list(prompt[start:]) + list(output[: end - n_prompt])

    def _launch(self, state: _RequestState, unit: int) -> int:
        """Launch the copy of the whole ``unit``s after ``state.offloaded_len`` that fit in the
        host pool, oldest first; returns _NOTHING, _LAUNCHED (all), _PARTIAL or _FULL (none fit).
        """
        req = state.req
        start = state.offloaded_len
        page_size = self.page_size
        units = (kv_length(req) - start) // unit
        if units <= 0:
            return _NOTHING
        pages_per_unit = unit // page_size
        # A backlog larger than the free pages goes in the units that fit, so that it still
        # progresses as pages are freed rather than waiting for room for all of it at once.
        fitting = min(units, self.host_pool.free_pages // pages_per_unit)
        if fitting == 0:
            self._offloads_rejected += 1
            return _FULL
        n_tokens = fitting * unit
        n_pages = n_tokens // page_size
        host_ids = self.host_pool.alloc(n_pages)
        assert host_ids is not None  # fitting was computed from free_pages
        try:
            end = start + n_tokens
            tokens = self._tokens(req, start, end)
            slots = self.slot_indices_of(req)
            if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
                # Checked here: on CPU the gather runs on the copy thread, where a bad tensor
                # would only surface later as a failed copy.
                described = f"{slots.dtype} tensor of shape {tuple(slots.shape)}" if isinstance(slots, torch.Tensor) else type(slots).__name__
                raise ArgumentTypeError(
                    f"slot_indices_of: must return a 1-D int32/int64 tensor for rid={req.rid!r}, got {described}"
                )
            if slots.shape[0] < end:
                raise InvalidArgumentError(
                    f"slot_indices_of: {slots.shape[0]} slots for request rid={req.rid!r}, its first {end} tokens have KV"
                )
            copy, keep = self.host_pool.gather_copy(self.kv_pool, slots[start:end], host_ids, backend=self.backend)
            event = self.copy_stream.submit(copy, keep=keep)
        except BaseException:
            self.host_pool.free(host_ids)
            raise
        segment = _Segment(state, host_ids, tokens, state.last_segment, event)
        state.offloaded_len = end
        state.last_segment = segment
        state.in_flight += 1
        self._in_flight.append(segment)
        self._pages_in_flight += n_pages
        self._pages_launched += n_pages
        return _LAUNCHED if fitting == units else _PARTIAL

    def _complete(self, segment: _Segment) -> None:
        state = segment.state
        event = segment.event
        n_pages = len(segment.host_ids)
        state.in_flight -= 1
        self._pages_in_flight -= n_pages
        try:
            if event.error is not None:
                self._copy_failures += 1
                self._pages_failed += n_pages
                logger.error("offload: D2H copy of %d pages of rid=%r failed: %r", n_pages, state.req.rid, event.error)
                try:
                    keys = list(self._keys_of(segment))
                except Exception:
                    keys = []
                self._report_failure(state.req, keys, event.error)
            else:
                self._pages_offloaded += n_pages
                self._copy_seconds += event.seconds or 0.0
                if state.aborted:
                    self._pages_discarded += n_pages
                    return
                try:
                    keys = self._keys_of(segment)
                except Exception as error:  # e.g. a token id the hash scheme cannot encode
                    self._pages_failed += n_pages
                    logger.error("offload: page keys of %d pages of rid=%r failed: %r", n_pages, state.req.rid, error)
                    self._report_failure(state.req, [], error)
                    return
                self._backup(state.req, segment, keys)
        finally:
            self.host_pool.free(segment.host_ids)
            segment.event = None  # drops the index tensors the copy kept alive
            if state.ending and state.in_flight == 0:
                self._release(state)

    def _backup(self, req: Any, segment: _Segment, keys: list[str]) -> None:
        """Write a completed segment's pages to storage, skipping keys it has; count each page."""
        with nvtx_range("backup"):
            stored = deduplicated = 0
            failed: list[str] = []
            error: BaseException | None = None
            todo: list[int] = []
            try:
                seen: set[str] = set()
                answer = _answer_of(self.storage.exists(keys), len(keys), "exists")
                for index, present in enumerate(answer):
                    key = keys[index]
                    if present or key in seen:
                        deduplicated += 1
                    else:
                        seen.add(key)
                        todo.append(index)
                if todo:
                    page = self.host_pool.page
                    host_ids = segment.host_ids
                    statuses = self.storage.put([keys[i] for i in todo], [page(host_ids[i]) for i in todo])
                    statuses = _answer_of(statuses, len(todo), "put")
                    for index, status in zip(todo, statuses):
                        if status is PutStatus.STORED:
                            stored += 1
                        elif status is PutStatus.DEDUPLICATED:
                            deduplicated += 1
                        else:
                            failed.append(keys[index])
            except Exception as raised:  # the backend failed as a whole: no page counts as written
                error = raised
                stored = 0
                deduplicated = len(keys) - len(todo) if todo else 0
                failed = [keys[i] for i in todo] if todo else list(keys)
            self._pages_stored += stored
            self._pages_deduplicated += deduplicated
            if failed:
                self._pages_failed += len(failed)
                self._storage_failures += 1
                logger.warning(
                    "offload: storage write failed for %d of %d pages of rid=%r%s",
                    len(failed), len(keys), req.rid, f": {error!r}" if error is not None else "",
                )
                self._report_failure(req, failed, error)

    def _report_failure(self, req: Any, keys: list[str], error: BaseException | None) -> None:
        if self._failure_callback is None:
            return
        try:
            self._failure_callback(req, keys, error)
        except Exception:
            self._callback_errors += 1
            logger.exception("offload: on_storage_failure callback raised for rid=%r", req.rid)

    def _has_ended(self, req: Any) -> bool:
        if self._ended.get(id(req)) is req:
            logger.debug("offload: rid=%r was released already; call ignored", req.rid)
            return True
        return False

    def _release(self, state: _RequestState) -> None:
        if self._states.get(id(state.req)) is not state:
            return  # released already, e.g. by a callback that called abort/finish mid-poll
        del self._states[id(state.req)]
        try:
            self._ended[id(state.req)] = state.req
        except TypeError:  # a class without weakref support: not remembered
            pass
        self._releases += 1
        if self._release_callback is None:
            return
        try:
            self._release_callback(state.req)
        except Exception:
            self._callback_errors += 1
            logger.exception("offload: release callback raised for rid=%r", state.req.rid)
