"""``OffloadManager``: decides what of each request moves when; the copier and store workers move it.

The engine calls, from its scheduler thread:

- store path: :meth:`~OffloadManager.offload` for each running request every step (it launches
  the prompt's whole pages as their KV is written, chunk by chunk under chunked prefill, then
  each new whole stride of decode tokens),
  :meth:`~OffloadManager.finish` / :meth:`~OffloadManager.abort` /
  :meth:`~OffloadManager.retract` when a request leaves the running batch;
- load path: :meth:`~OffloadManager.match_prefix` (lookup),
  :meth:`~OffloadManager.prefetch` (store to host pages on a worker thread),
  :meth:`~OffloadManager.load` (host pages to the request's device slots, layer by layer);
- :meth:`~OffloadManager.poll` once a step: it only collects what finished (copies, store
  writes, reads), frees host pages, calls ``release(req)`` and ``on_stored(req, ...)``; it
  never waits;
- :meth:`~OffloadManager.flush` after a weight update: the store's key space is emptied.

Decisions worth knowing:

- State is keyed by the request *object* (``id(req)``, the object held by the state so the id
  cannot be reused while tracked), never by ``rid``: two requests with one rid are two lifecycles.
- Keys: a request's pages form one hash chain from its namespace seed. The chain continues from
  what the manager knows: pages it stored, pages it loaded (their keys came from the lookup), or,
  with ``store_prompt=False``, the prompt pages the engine says its prefill side stored. Keys are
  computed in ``poll`` (on the engine's thread, in chain order whatever order copies finish in).
- ``release(req)`` is called exactly once per lifecycle, after ``finish``/``abort``/``retract``,
  when no copy of the request's device slots (gather or load) is in flight. Store writes and
  reads in flight touch only host pages and do not hold release back; ``on_stored(req,
  pages_stored, pages_failed)`` comes once per lifecycle after its last write has ended.
- A lifecycle runs from the first call on a request object to its release. A retracted object
  starts a new one when it runs again; a finished or aborted (released) object raises when it
  is offloaded again.
- Every launched page ends exactly once: stored, deduplicated, failed, or discarded (see
  :class:`~kvstage.offload.metrics.OffloadMetrics`); an abort discards nothing launched.
- A call that raises has launched nothing and tracks nothing new: every check (arguments,
  token ids, slot indices) runs before its first launch. Only the launch itself can fail
  after that (on CUDA a kernel launch error): the runs launched before it stay launched and
  tracked (stored, and the release waits for their copies).
- NVTX ranges (domain ``kvstage``): ``offload``, ``offload.finish``, ``poll``, ``lookup``,
  ``prefetch``, ``load``, ``backup`` (a worker's store write).

One thread: the thread of the first call owns the manager; a call from another raises
:class:`~kvstage.errors.ThreadingError` (``close()`` excepted).

Its pieces, each in its own module: what to launch (:mod:`~kvstage.offload.store_plan`) and
where offloading resumes after a load (:mod:`~kvstage.offload.load_plan`), as pure functions;
the checked tokens and slots of each run to launch (:mod:`~kvstage.offload.launch_plan`);
the tracked and released request objects (:mod:`~kvstage.offload.lifecycles`); finished
requests' pages waiting for host pages (:mod:`~kvstage.offload.finish_backlog`); the argument
checks (:mod:`~kvstage.offload.manager_arguments`); the one-thread guard
(:mod:`~kvstage.offload.one_thread`); the per-request records
(:mod:`~kvstage.offload.request_state`). A hybrid model's other components (sliding window,
sidecars, request state) move beside the full pages through :mod:`~kvstage.offload.hybrid`.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable

import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError, require
from kvstage.events.announcer import announcer_for
from kvstage.nvtx_ranges import nvtx_range
from kvstage.offload.backup import Backup
from kvstage.offload.collaborators import CopyStreamLike, KVPoolLike, PageHasherLike, StoreWorkersLike
from kvstage.offload.components import ComponentPools
from kvstage.offload.copier import GATHER, SCATTER, Copier, CopyResult
from kvstage.offload.finish_backlog import FinishBacklog
from kvstage.offload.host_pool import HostPool
from kvstage.offload.hybrid import split_storage
from kvstage.offload.hybrid_calls import HybridCalls
from kvstage.offload.inspection import ManagerInspection
from kvstage.offload.launch_plan import NOTHING, LaunchPlan, LaunchPlanner
from kvstage.offload.lifecycles import Lifecycles
from kvstage.offload.load_path import LoadHandle, PrefetchHandle, PrefixMatch
from kvstage.offload.manager_arguments import (
    check_after,
    check_callbacks,
    check_events_of_model,
    check_prefetch_arguments,
    check_prefetch_handle,
    check_prefetch_request,
    checked_kv_length,
    checked_load_pages,
    checked_stride,
    pending_prefetch_error,
)
from kvstage.offload.metrics import OffloadMetrics
from kvstage.offload.one_thread import OwnerThread, owner_thread_only
from kvstage.offload.prefetcher import Prefetcher
from kvstage.offload.request import SlotIndicesOf, as_int
from kvstage.offload.request import kv_length as kv_length_of
from kvstage.offload.request_state import LoadJob, RequestState, Segment
from kvstage.offload.store_io import StoreWorkers
from kvstage.storage import StorageBackend

__all__ = ["OffloadManager"]

logger = logging.getLogger(__name__)


class OffloadManager(HybridCalls, ManagerInspection):
    """Stores requests' KV pages through a host pool to a store, and loads stored prefixes back.

    Args:
        kv_pool: the device KV pool (:class:`kvstage.kernels.KVPool`).
        host_pool: host pages of the same layout (:class:`HostPool`).
        storage: the store (:class:`kvstage.storage.StorageBackend`); its layout fingerprint
            must describe the host pool's pages.
        hasher: page keys (:class:`kvstage.hashing.PageHasher`), page size as the host pool's.
        slot_indices_of: ``slot_indices_of(req)`` -> the request's device slots
            (:data:`~kvstage.offload.request.SlotIndicesOf`).
        offload_stride: decode tokens per copy, a positive multiple of the page size that the
            host pool can hold (default: one page).
        store_prompt: True (default): the manager stores the prompt's whole pages too, and the
            chain starts at the namespace seed. False: the engine's prefill side stored them
            (sglang's disaggregated decode); the chain continues from their keys.
        release: ``release(req)``: the engine may free the request's device slots now.
        on_storage_failure: ``on_storage_failure(req, failed_keys, error)``: a copy, the page
            keys or a store write failed for these keys (empty when keys could not be made);
            ``error`` is the exception that failed them (e.g. the store's ``OSError`` with its
            errno, or a :class:`~kvstage.storage.MissingPriorError` naming the chain page before
            them that the store lacks, a :class:`~kvstage.offload.PriorFailedError`
            when that page failed in this manager, its ``cause`` the error that failed it) or
            None when the store only answered FAILED (no room).
            Also logged once at WARNING.
        on_stored: ``on_stored(req, pages_stored, pages_failed)``: called from :meth:`poll`
            exactly once per request lifecycle (also aborted and retracted ones, and with
            ``0, 0`` when nothing was launched), after its release and after its last store
            write has ended: every page it launched has then reached the store (deduplicated
            pages count as stored: the store holds them) or failed. Pages discarded by
            ``retract(keep_offloaded=False)`` are in neither count. An engine that sends a
            follow-up turn waits for this, not for ``release``, to find the pages stored.
        backend: the kernels' backend (``"auto"``, ``"triton"``, ``"torch"``).
        copy_stream: where copies run (default: :class:`~kvstage.offload.CopyStream` on the
            pool's device).
        producer: default for each call's ``after``: the stream (or event) after whose work
            the KV is written, e.g. the engine's forward stream (None: the current stream).
        finish_backlog_pages: whole pages that finished requests may wait for host pages
            with (their device slots stay held until launched). None (default): no limit,
            ``finish`` never drops a page. A number opts into dropping the pages beyond it
            (``pages_dropped``, a WARNING) so that a short host pool cannot hold device slots.
        store_workers: where store writes and reads run: anything with ``write(call)`` and
            ``read(call)`` returning a ``concurrent.futures.Future``, and ``close()`` (default:
            :class:`~kvstage.offload.store_io.StoreWorkers`, one writer and one reader thread).
            Writes must run in submission order (one writer): a store refuses a page whose
            predecessor in the chain is not stored yet.
        prior_wait_s: with ``store_prompt=False`` only: seconds (>= 0; default 10) that a store
            write refused because the chain page before it is not stored yet
            (:class:`~kvstage.storage.MissingPriorError`: the prefill side's last prompt page
            may land after the first decode page) is put again, after pauses of 10 ms doubling
            to 200 ms, on the writer thread; between attempts it waits off every thread, so
            other writes go on and :meth:`poll` never waits for it (:meth:`drain`,
            :meth:`close` do). After that long the pages fail, reported to
            ``on_storage_failure`` with a ``MissingPriorError`` naming the missing key. 0: no
            retry. With ``store_prompt=True`` every prior is this manager's own page or a
            loaded one, so a refusal is final at once. Either way a page whose prior failed in
            this manager (its copy or its store write) fails at once, without a store call:
            the ``MissingPriorError`` is a :class:`~kvstage.offload.PriorFailedError`
            naming the failed page and its cause.
        kv_events: router-facing KV events of what this manager stores and its store evicts
            or removes (:mod:`kvstage.events`): None (off), a
            :class:`~kvstage.events.KVEventPublisher`, or an endpoint str to bind one at
            (closed with the manager). The manager then takes the store's events. Not with
            a sliding-window or state component: the events would claim every stored full
            page, and such a model restores only some lengths (refused).

    Raises:
        ArgumentTypeError: ``hasher`` is not a page hasher instance, ``storage`` is not a
            storage backend, or ``producer`` is neither None, an event nor a stream.
        InvalidArgumentError: the stride, page sizes or layouts do not match, the stride
            needs more pages than the host pool holds, a callback is not callable, or
            ``finish_backlog_pages`` is neither None nor an int >= 0, or ``prior_wait_s`` is
            not a number >= 0.

    Call every method but :meth:`close` from one thread (the engine's scheduler): the thread of
    the first call owns the manager, and a call from another raises
    :class:`~kvstage.errors.ThreadingError` naming the method and both threads. The read-only
    inspectors (``metrics``, ``is_tracked``, ``in_flight``, ``offloaded_length``,
    ``requests_live``, ``copies_in_flight``) are not checked: read from another thread, they
    are a racy snapshot.
    """

    def __init__(
        self,
        kv_pool: KVPoolLike,
        host_pool: HostPool,
        storage: StorageBackend,
        hasher: PageHasherLike,
        slot_indices_of: SlotIndicesOf,
        *,
        offload_stride: int | None = None,
        store_prompt: bool = True,
        release: Callable[[Any], None] | None = None,
        on_storage_failure: Callable[[Any, list[str], BaseException | None], None] | None = None,
        on_stored: Callable[[Any, int, int], None] | None = None,
        backend: str = "auto",
        copy_stream: CopyStreamLike | None = None,
        producer: Any = None,
        finish_backlog_pages: int | None = None,
        store_workers: StoreWorkersLike | None = None,
        prior_wait_s: float = 10.0,
        kv_events: Any = None,
        components: ComponentPools | None = None,
    ) -> None:
        page_size = host_pool.page_size
        stride = checked_stride(hasher, host_pool, offload_stride, prior_wait_s)
        storage, self._hybrid = split_storage(storage, components, kv_pool, page_size)
        check_events_of_model(kv_events, components)
        self.copier = Copier(kv_pool, host_pool, copy_stream=copy_stream, backend=backend)
        fingerprint = check_callbacks(
            storage, host_pool, slot_indices_of, release, on_storage_failure, on_stored, producer, finish_backlog_pages
        )
        self.kv_pool = kv_pool
        self.host_pool = host_pool
        self.storage = storage
        self.hasher = hasher
        self.slot_indices_of = slot_indices_of
        self.page_size = page_size
        self.offload_stride = stride
        self.store_prompt = bool(store_prompt)
        self.producer = producer
        self.finish_backlog_pages = finish_backlog_pages
        # An MLA rank other than 0 holds the same latent as rank 0, which writes it.
        self.writes_pages = fingerprint.writes_pages
        self._release_callback = release
        self._on_stored = on_stored
        self._owner = OwnerThread()  # the thread of the first call
        self._owns_workers = store_workers is None
        self._workers = StoreWorkers() if store_workers is None else store_workers
        self._lifecycles = Lifecycles(page_size, self.store_prompt)
        self._planner = LaunchPlanner(page_size, hasher, self.store_prompt, self.copier.check_slot_indices)
        self._states = self._lifecycles.states  # id(req) -> its state, while tracked
        self._retracted = self._lifecycles.retracted  # kept progress of retracted requests
        self._unhandled: deque[CopyResult] = deque()  # copies polled from the copier, not handled yet
        self._backlog = FinishBacklog(finish_backlog_pages)
        self._counters = OffloadMetrics()
        self._closed = False
        self._prefetcher = Prefetcher(self.copier, storage, hasher, self._workers, self._counters, self._hybrid.lookup)
        self._hybrid.attach(
            self.copier.copy_stream, self._workers, hasher, backend, host_pool.pinned, host_pool, self.copier.row_copies
        )
        prior_wait = 0.0 if self.store_prompt else float(prior_wait_s)
        self._backup = Backup(
            self.copier, storage, hasher, self._workers, self._counters, on_storage_failure, prior_wait_s=prior_wait
        )
        self._backup.announcer = self._announcer = announcer_for(kv_events, storage, page_size)
        storage.register_host_buffers(host_pool.buffers)

    # -- store path ---------------------------------------------------------------------------

    @owner_thread_only
    def offload(self, req: Any, *, kv_length: int | None = None, after: Any = None) -> bool:
        """Launch the D2H copy of ``req``'s pages that have KV and are not stored yet: the
        prompt's whole pages (``store_prompt``), then each new whole stride of decode tokens.

        Under chunked prefill, call it after each chunk with ``kv_length``: the prompt's whole
        pages up to it are launched as they come, never a page with a slot not written yet.
        A request whose ``finished()`` is true is handed to :meth:`finish`. A request with a
        pending prefetch is refused: load or cancel the prefetch first.

        Args:
            req: the request object (:class:`~kvstage.offload.OffloadRequest`).
            kv_length: the token positions ``[0, kv_length)`` whose KV is written: an integer
                scalar (an int, a numpy integer or a 0-d integer tensor,
                :func:`~kvstage.offload.request.int_scalar`), at most the request's prompt plus
                output tokens, never below what this lifecycle launched already. None: the
                whole prompt and every output token but the last
                (:func:`~kvstage.offload.request.kv_length`).
            after: the event or stream after which its KV is written (default: ``producer``).

        Returns:
            True when a copy was launched now (as many whole units as the host pool holds,
            oldest first; the rest at later calls). False when there is nothing new, the
            request is ending, this rank does not write (MLA rank > 0), or nothing fits.

        Raises:
            ArgumentTypeError / DeviceMismatchError / InvalidArgumentError: a bad ``kv_length``;
                the request lacks ``extra_key`` or ``cache_salt`` or holds neither a str nor
                None there (:func:`~kvstage.hashing.chain.request_namespace`); ``slot_indices_of``
                returned no 1-D int tensor of the pool's device, too few slots, or (on CPU, where it costs no sync) a slot out of the pool's range; a
                placeholder (negative) token id, or one that is no integer (a float, a bool) or
                above ``2**63-1``, among the tokens to copy; ``after`` is no event
                or stream; a prefetch of the request is pending; the request object was
                released already (finished or aborted: use a new object, or :meth:`retract` a
                request that runs again); the manager is closed.
            ThreadingError: called from another thread than the manager's.
            Nothing was launched and nothing new is tracked then.
            Whatever the copy stream raises at a launch (on CUDA a failed kernel launch, which
                no check foresees): when a later run's launch raises, the runs before it stay
                launched and tracked (their pages are stored, the release waits for their
                copies); when the first run's, nothing changed.
        """
        self._require_open("offload")
        check_after(after, "after")
        with nvtx_range("offload"):
            state, new = self._states.get(id(req)), False
            if state is None:
                state, new = self._lifecycles.state_of(req, released_raises=True)
                if state is None:
                    return False
            elif state.ending:
                return False
            length = (
                kv_length_of(req) if kv_length is None else checked_kv_length(req, kv_length, state.launched_length)
            )
            if req.finished():
                return self._finish_state(state, new, length, after)
            require(
                state.prefetch is None,
                "req",
                lambda: f"rid={req.rid!r} has a prefetch pending: load or cancel it before offloading its pages",
            )
            plan = self._plan(state, self.offload_stride, length)
            if not plan.runs:
                if new:
                    self._lifecycles.commit(state)
                return False
            return self._launch(state, plan, length, after, commit=new) > 0

    @owner_thread_only
    def finish(self, req: Any, *, kv_length: int | None = None, after: Any = None) -> bool:
        """``req`` has ended normally: offload its remaining whole pages, then release it.

        Pages that find no free host page wait for one (the device slots held meanwhile) and
        are launched by later polls; only with ``finish_backlog_pages`` set are the pages
        beyond that limit dropped (``pages_dropped``). A second call, or a call after the
        release, does nothing.

        A pending prefetch of ``req`` (never loaded: the engine computed its tokens itself) is
        cancelled, and the pages with KV are offloaded as usual. A request that ends before it
        ran holds no KV: end it with :meth:`abort` or ``finish(req, kv_length=0)``.

        Args:
            kv_length: as for :meth:`offload` (a request cut short mid-prefill stores the
                pages of its computed chunks).
            after: as for :meth:`offload`.

        Returns:
            True when every remaining whole page was launched or is waiting; False when some
            were dropped.

        Raises:
            As :meth:`offload`; nothing was launched, a pending prefetch is kept, and the
            request is not released then (call :meth:`abort`). When a later run's launch
            raises, the runs before it stay launched and its prefetch is cancelled; the
            request is not ending: :meth:`abort` it (the release waits for those copies) or
            call ``finish`` again. With a prefetch pending, a request with too few slots for
            ``kv_length`` (one that never ran) gets an ``InvalidArgumentError`` naming the
            pending prefetch.
        """
        self._require_open("finish")
        check_after(after, "after")
        with nvtx_range("offload.finish"):
            state, new = self._lifecycles.state_of(req, released_raises=False)
            if state is None:
                return True
            return self._finish_state(state, new, checked_kv_length(req, kv_length, state.launched_length), after)

    @owner_thread_only
    def abort(self, req: Any) -> None:
        """``req`` was aborted: nothing more of it is stored or loaded.

        Its prefetch is cancelled; loads of it in flight are waited for (a queued copy cannot
        be recalled), so no slot of it is written after this returns; gathers in flight complete
        and their pages are stored (a long prefill aborted midway keeps the chunks it
        launched); pages a :meth:`finish` left waiting for host pages are never launched
        (counted in ``pages_dropped``). ``release(req)`` is called once none of its copies is
        in flight: within this call when no gather of it is (also after waiting for its loads),
        else in the :meth:`poll` that collects the last one. After release it does nothing.

        Raises:
            ThreadingError: called from another thread than the manager's.
        """
        state = self._states.get(id(req))
        if state is None:
            if self._lifecycles.has_ended(req):
                return
            state = self._lifecycles.track(req)
        self._end_state(state, aborted=True)

    @owner_thread_only
    def retract(self, req: Any, *, keep_offloaded: bool = True) -> None:
        """``req`` leaves the running batch to run again later (sglang's retraction under
        memory pressure): like :meth:`abort` (its device slots are released once nothing of
        it is in flight), except that the object starts a new lifecycle when it is offloaded
        or prefetched again.

        Args:
            keep_offloaded: True: when it runs again, offloading resumes after the pages
                already stored or launched (their keys continue the chain), and its
                :meth:`prefetch` looks up every token with KV, output tokens too, so it
                reloads what it stored. False: it starts over; pages still copying are
                discarded (pages already in the store are deduplicated).

        Raises:
            ThreadingError: called from another thread than the manager's.
        """
        state = self._states.get(id(req))
        if state is None:
            return
        state.retract_keep = bool(keep_offloaded)
        self._counters.retractions += 1
        if not keep_offloaded:
            self._hybrid.start_over(req)
        self._end_state(state, aborted=not keep_offloaded)

    # -- load path ----------------------------------------------------------------------------

    @owner_thread_only
    def match_prefix(
        self, req: Any = None, *, token_ids: Any = None, extra_key: str | None = None, cache_salt: str | None = None
    ) -> PrefixMatch:
        """Lookup: how many leading whole pages of a token sequence the store holds.

        Give a request (every token with KV, prompt and output, but the last, which the engine
        computes anyway: a resumed request finds what it stored) or ``token_ids`` with their
        namespace. One batched ``exists`` call on the caller's thread, a store round trip: an
        engine's scheduler calls :meth:`prefetch` instead, which looks up on a worker thread.

        Raises:
            InvalidArgumentError: neither or both of ``req`` and ``token_ids``.
            StorageError: the store answered a different number of keys than asked; whatever
                its ``exists`` raises.
            ThreadingError: called from another thread than the manager's.
        """
        self._require_open("match_prefix")
        keys = self._prefetcher.lookup_keys(req, token_ids, extra_key, cache_salt)
        return self._prefetcher.match(keys, None if token_ids is None else len(token_ids))

    @owner_thread_only
    def prefetch(
        self,
        req: Any,
        *,
        policy: str = "best_effort",
        timeout_s: float | None = None,
        min_pages: int | None = None,
        max_pages: int | None = None,
    ) -> PrefetchHandle:
        """Start reading ``req``'s stored prefix into host pages on a worker thread.

        The worker looks up every whole page of the request's tokens with KV (prompt and
        output, all but the last token, which the engine computes anyway; a retracted request
        that runs again reloads every page it stored), then reads the leading hits; the
        handle's ``pages_ready`` grows as batches land. Host pages for the looked-up pages are
        taken when the read starts, as many as are free: a lookup that hits more pages than it
        got host pages for reads only those (the handle's ``num_host_pages``; counted in
        ``pages_truncated``). The next :meth:`poll` after the read ends frees the host pages
        past ``pages_ready``. This is the call for an engine's scheduler: it needs no
        :meth:`match_prefix` before it.

        Args:
            req: a request not yet running (no pages offloaded in this lifecycle).
            policy: when :meth:`PrefetchHandle.ready_to_load` lets the engine load (see
                :data:`~kvstage.offload.load_path.PREFETCH_POLICIES`).
            timeout_s: seconds, for ``policy="timeout"``.
            min_pages: None (default): start at once with the host pages free now. An int
                >= 1 (any integer scalar, as ``max_pages``): wait (no host page taken,
                ``num_host_pages == 0``, :meth:`poll` starts waiting prefetches oldest first)
                until ``min(min_pages, pages_wanted)`` host pages are free, instead of reading
                fewer. Offloads are not held back for it:
                under a steady stream of copies it waits until they leave that many free.
            max_pages: None (default): look up every whole page. An int >= 0 (an integer
                scalar: a numpy integer, a 0-d integer tensor such as an ``all_reduce``'s): the
                first ``max_pages`` pages at most (a hybrid model's restorable lengths up to
                ``max_pages * page_size``): how tensor-parallel ranks that found different
                lengths prefetch again at one they agree on (README).

        Raises:
            InvalidArgumentError: an unknown policy, a missing or non-positive timeout (or one
                given with another policy), a ``min_pages`` that is not an int >= 1 or that the
                host pool can never hold, a ``max_pages`` that is not an int >= 0, a
                placeholder (negative) id among the tokens, a request that has ended, already
                has a prefetch, or already offloaded pages; the manager is closed. Nothing is
                tracked then. With ``store_prompt=False`` a prefetch may load the prompt pages
                the prefill side stored; the chain still continues from the prompt's last page.
            ThreadingError: called from another thread than the manager's.
        """
        min_pages, max_pages = as_int(min_pages), as_int(max_pages)  # an all_reduce's 0-d tensor too
        check_prefetch_arguments(policy, timeout_s, min_pages, max_pages)
        self._require_open("prefetch")
        with nvtx_range("prefetch"):
            keys = self._prefetcher.lookup_keys(req)  # placeholder ids named before anything is tracked
            keys = keys if max_pages is None else keys[:max_pages]
            state = self._states.get(id(req))
            ended = state is None and self._lifecycles.has_ended(req)
            check_prefetch_request(req, state, ended, len(keys), min_pages, self.host_pool.capacity)
            state = state if state is not None else self._lifecycles.track(req)
            state.prefetch = self._prefetcher.start(req, keys, policy, timeout_s, min_pages)
            return state.prefetch

    @owner_thread_only
    def load(
        self,
        handle: PrefetchHandle,
        slot_indices: torch.Tensor,
        *,
        layer_by_layer: bool = False,
        after: Any = None,
        state_slot: int | None = None,
        component_slots: dict[str, torch.Tensor] | None = None,
    ) -> LoadHandle:
        """Scatter prefetched pages into the request's device slots, on the copy stream.

        Loads ``len(slot_indices) // page_size`` leading pages (at most ``handle.pages_ready``);
        the read stops (pages past those are not loaded). The request's chain continues after
        the loaded pages, so the manager stores only what follows them: also when that is less
        than a resumed (retracted) request stored before, so that pages lost from the store
        since are stored again as the engine recomputes them (with ``store_prompt=False``, never
        before the prompt's end). Host pages are freed by :meth:`poll` once the copy completes.

        Args:
            handle: from :meth:`prefetch`, not loaded or cancelled before.
            slot_indices: the device slots of the prefix's first tokens, whole pages.
            layer_by_layer: one copy (and completion) per layer, so layer ``i`` of the forward
                pass waits only for its own KV (:meth:`LoadHandle.wait_layer`).
            after: the event or stream after which the slots may be written.
            state_slot, component_slots: a hybrid model's (:mod:`~kvstage.offload.hybrid`): the
                request's state slot the snapshot goes to (an integer scalar), and per
                sliding-window component the slots of its window pages before the loaded length
                (none for a window of one token); a hybrid load is of the
                prefetched restorable length (``handle.pages_ready`` pages) or nothing, and its
                handle's layers are the model's.

        Raises:
            ArgumentTypeError: ``handle`` is not a :class:`PrefetchHandle`; ``slot_indices`` or a
                window's ``component_slots`` a tensor of no integer dtype; ``layer_by_layer`` no
                bool.
            InvalidArgumentError: the handle was loaded or cancelled already, is another
                manager's, its request has ended; ``slot_indices`` no 1-D tensor (a list
                included), holding more pages than are ready, or not whole pages; a window's
                slots not its window's pages, outside its pool or repeated; ``component_slots`` naming no sliding-window component, or a
                ``state_slot`` for a model without request state. Nothing is written then.
            ThreadingError: called from another thread than the manager's.

        After the forward pass's ``wait_layer``/``wait``, check :attr:`LoadHandle.error`: a
        failed load leaves the slots unwritten and the engine computes those tokens itself.
        """
        check_prefetch_handle(handle, " from prefetch()")
        self._require_open("load")
        check_after(after, "after")
        require(
            isinstance(layer_by_layer, bool),
            "layer_by_layer",
            lambda: f"must be a bool, got {layer_by_layer!r}",
            ArgumentTypeError,
        )
        with nvtx_range("load"):
            state = self._states.get(id(handle.req))
            num_pages = checked_load_pages(handle, state, slot_indices, self.page_size)
            windows = self._hybrid.check_load(handle, num_pages, component_slots, state_slot)
            copy_handles = []
            if num_pages:
                # The copier checks the slots (and raises) before it launches; the handle is
                # taken only after, so a bad tensor changes nothing.
                job = LoadJob(state, num_pages)
                copy_handles = self.copier.scatter(
                    job,
                    handle.host_page_ids[:num_pages],
                    slot_indices,
                    layer_by_layer=layer_by_layer,
                    after=self._after(after),
                )
            components = self._hybrid.load(
                state, handle, num_pages, slot_indices, windows, state_slot, self._after(after), layer_by_layer
            )
            self._prefetcher.take(handle, num_pages)
            state.prefetch = None
            if num_pages:
                state.load_started(job)
                self._counters.loads += 1
            # Offloading resumes after the loaded pages (the prefill side's prompt pages at least).
            prompt_end = 0 if self.store_prompt else len(handle.req.origin_input_ids) // self.page_size * self.page_size
            state.resume_after_load(num_pages, self.page_size, handle.page_keys, prompt_end)
            loaded = LoadHandle(
                handle.req, num_pages, self.page_size, copy_handles, self.kv_pool.num_layers, layer_by_layer
            )
            return self._hybrid.load_handle(loaded, components)

    @owner_thread_only
    def cancel(self, handle: PrefetchHandle) -> None:
        """Stop a prefetch (or its wait for host pages); its host pages are freed once the
        worker is done with them. A loaded or cancelled handle: nothing happens.

        Raises:
            ThreadingError: called from another thread than the manager's.
        """
        self._cancel(handle)

    # -- every step ---------------------------------------------------------------------------

    @owner_thread_only
    def poll(self) -> int:
        """Collect what finished: copies (page keys and store writes for gathers, host pages
        freed for loads), store writes, prefetch reads (host pages past the ready ones freed,
        waiting prefetches started); launch finished requests' waiting pages; release
        requests; call ``on_stored`` for lifecycles whose last write has ended. Never blocks.
        Returns the number of copies handled.

        Raises:
            ThreadingError: called from another thread than the manager's.
        """
        return self._poll()

    @owner_thread_only
    def drain(self) -> None:
        """Block until every copy, store write and read in flight has completed, and finished
        requests' waiting pages are launched, polling as it goes (for shutdown and tests; never
        in the engine's step). Writes parked waiting for a prior page that another process
        writes are waited for too, each up to ``prior_wait_s``: when it returns nothing is in
        flight and every host page of the store path is free.

        Raises:
            ThreadingError: called from another thread than the manager's.
        """
        self._drain()

    @owner_thread_only
    def flush(self) -> int:
        """Empty the store's key space (after a weight update, its pages hold the old weights'
        KV): cancel every prefetch, wait for the copies, store writes and reads in flight (as
        :meth:`drain`; writes parked waiting for their prior page fail now, so that no page of
        the old weights lands after the clear), forget what retracted requests had offloaded
        (they store again from the start), then ``storage.clear()``.

        Requests still running keep their chains: their later pages continue keys whose
        predecessors are gone, which a chain-aware store refuses (counted failed). Flush when
        no request runs, as sglang does before a weight update.

        Returns:
            The pages the store removed.

        Raises:
            ThreadingError: called from another thread than the manager's.
            InvalidArgumentError: the manager is closed.
            Whatever the store's ``clear()`` raises.
        """
        self._require_open("flush")
        for handle in list(self._prefetcher.active):
            self._cancel(handle)
        self._backup.stop_waiting(True)  # no write parked for its prior may land after clear()
        try:
            self._drain()
        finally:
            self._backup.stop_waiting(False)
        self._retracted.clear()
        return self._hybrid.clear() + self.storage.clear()  # components first: their dependents go first

    def close(self) -> None:
        """Cancel prefetches, :meth:`drain`, then stop the worker threads and the copy stream if
        the manager made them. Idempotent; allowed from any thread once the engine's thread has
        stopped calling the manager. Afterwards ``offload``, ``finish``, ``prefetch``, ``load``,
        ``match_prefix`` and ``flush`` raise; ``abort`` and ``retract`` still release requests
        that stayed tracked."""
        if self._closed:
            return
        for handle in list(self._prefetcher.active):
            self._cancel(handle)
        self._drain()  # writes waiting for their prior page: up to prior_wait_s
        self._closed = True
        if self._owns_workers:
            self._workers.close()
        if self._announcer is not None:
            self._announcer.close()
        self._hybrid.close()
        self.copier.close()

    # -- internals: lifecycle -----------------------------------------------------------------

    def _after(self, after: Any) -> Any:
        return self.producer if after is None else after

    def _require_open(self, call: str) -> None:
        if self._closed:
            raise InvalidArgumentError(f"manager: {call}() after close(); make a new OffloadManager")

    def _end_state(self, state: RequestState, *, aborted: bool) -> None:
        state.ending = True
        state.aborted = state.aborted or aborted
        if state.prefetch is not None:
            self._cancel(state.prefetch)
        if state.backlog_pages:  # finish()'s pages still waiting for host pages: never launched now
            dropped = self._backlog.remove(state)
            self._counters.pages_dropped += dropped
            logger.warning(
                "offload: %s of rid=%r drops its %d pages waiting for host pages",
                "abort" if aborted else "retract",
                state.req.rid,
                dropped,
            )
        self._hybrid.wait_loads(state, aborted)  # a component's load outlives its full pages' load
        if aborted and state.loads:
            for load in list(state.loads):  # a queued load cannot be recalled: no slot written after abort returns
                self.copier.synchronize(job=load)
            # Collect those loads alone (so the release comes within this call); every other
            # finished copy waits for the next poll, which owns launches and callbacks.
            self._unhandled.extend(self.copier.poll())
            mine = [result for result in self._unhandled if result.direction == SCATTER and result.job.state is state]
            for result in mine:
                self._unhandled.remove(result)
                self._loaded(result)
        self._maybe_release(state)

    def _finish_state(self, state: RequestState, new: bool, length: int, after: Any) -> bool:
        try:
            plan = self._plan(state, self.page_size, length)  # every check before anything changes
        except InvalidArgumentError as error:
            if state.prefetch is None:
                raise
            raise pending_prefetch_error(state.req, length, error) from error
        launched_before = state.launched_length
        try:
            self._launch(state, plan, length, after, commit=new)
        finally:
            # Never loaded: the engine computed the prompt itself. Kept when the first run's
            # launch raised (nothing changed); cancelled once a run launched.
            if state.prefetch is not None and (state.launched_length != launched_before or not plan.runs):
                self._cancel(state.prefetch)
        if new and not plan.runs:
            self._lifecycles.commit(state)
        state.ending = True
        state.kv_length = length
        remaining = state.pages_to_launch(self.page_size) if self.writes_pages else 0
        if remaining > 0:
            if self._backlog.admit(state, remaining):
                return True
            self._counters.pages_dropped += remaining
            logger.warning(
                "offload: host pool full at finish of rid=%r: %d pages not offloaded (finish_backlog_pages=%d)",
                state.req.rid,
                remaining,
                self.finish_backlog_pages,
            )
            self._maybe_release(state)
            return False
        self._maybe_release(state)
        return True

    def _launch_backlog(self) -> None:
        for state in list(self._backlog.states):
            try:
                self._launch(state, self._plan(state, self.page_size, state.kv_length), state.kv_length, None)
                self._backlog.set_pages(state, state.pages_to_launch(self.page_size))
            except Exception:  # checked at finish: an engine that changed the request since, or a failed launch
                # The runs launched before the one that raised stay launched: drop only the rest.
                not_launched = state.pages_to_launch(self.page_size)
                logger.exception(
                    "offload: %d waiting pages of rid=%r could not be launched; dropped", not_launched, state.req.rid
                )
                self._counters.pages_dropped += not_launched
                self._backlog.set_pages(state, 0)
            if state.backlog_pages == 0:
                self._backlog.remove(state)
                self._maybe_release(state)
            if self.copier.free_pages == 0:
                break

    def _maybe_release(self, state: RequestState) -> None:
        if not state.ending or state.copies_in_flight or state.backlog_pages:
            return
        if not self._lifecycles.release(state):
            return  # released already (a callback that called abort/finish mid-poll)
        req = state.req
        self._counters.releases += 1
        self._backup.end(state.writes)
        if self._release_callback is not None:
            try:
                self._release_callback(req)
            except Exception:
                self._counters.callback_errors += 1
                logger.exception("offload: release callback raised for rid=%r", req.rid)

    # -- internals: every step ----------------------------------------------------------------

    def _poll(self) -> int:
        with nvtx_range("poll"):
            unhandled = self._unhandled
            unhandled.extend(self.copier.poll())
            handled = 0
            while unhandled:  # one at a time: an interrupted poll leaves the rest for the next
                result = unhandled.popleft()
                handled += 1
                if result.direction == GATHER:
                    self._gathered(result)
                else:
                    self._loaded(result)
            self._backup.poll()
            if self._announcer is not None:  # removals between writes (clear, a corrupt page dropped)
                self._announcer.poll()
            self._prefetcher.poll()
            if self._backlog:
                self._launch_backlog()
            for state in self._hybrid.poll(self._states):
                self._maybe_release(state)
            for writes in self._hybrid.writes_ended(self._backup.take_ended() if self._backup.ended else []):
                self._backup.report_stored(self._on_stored, writes)  # after its components' writes too
            return handled

    def _drain(self) -> None:
        """Block until copies, reads, writes (parked ones too) and backlogs are done."""
        while True:
            self.copier.synchronize()
            self._prefetcher.wait()
            self._backup.wait()
            self._hybrid.wait()
            self._poll()
            if not (
                self.copier.copies_in_flight or self._backup.writes_pending or self._backlog or self._hybrid.in_flight
            ):
                return

    def _cancel(self, handle: PrefetchHandle) -> None:
        check_prefetch_handle(handle)
        if handle.cancelled:
            return
        require(handle in self._prefetcher.active, "handle", "is not this manager's prefetch")
        state = self._states.get(id(handle.req))
        if state is not None and state.prefetch is handle:
            state.prefetch = None
        self._prefetcher.cancel(handle)

    # -- internals: store path ----------------------------------------------------------------

    def _plan(self, state: RequestState, unit: int, length: int) -> LaunchPlan:
        """:meth:`LaunchPlanner.plan <kvstage.offload.launch_plan.LaunchPlanner.plan>` with the
        host pages free now (nothing on an MLA rank that writes no pages); counts its rejections."""
        if not self.writes_pages:
            return NOTHING
        plan = self._planner.plan(state, length, unit, self.copier.free_pages, self.slot_indices_of)
        self._counters.offloads_rejected += plan.rejected
        return plan

    def _launch(self, state: RequestState, plan: LaunchPlan, length: int, after: Any, *, commit: bool = False) -> int:
        """Launch planned runs (:meth:`_plan`, with the host pages free then) at a call with
        ``kv_length`` ``length``; pages launched. ``commit``: track the (new) state once its
        first run has launched.

        Raises:
            Whatever the copy stream's submit raises (on CUDA a failed kernel launch, which no
            check can foresee). When the first run raised, nothing changed; runs launched
            before the one that raised stay launched and accounted (in the chain, in flight,
            tracked), so their pages are stored and the release waits for their copies.
        """
        launched = 0
        after = self._after(after)
        self._hybrid.check_runs(state, plan.runs, length)  # a window's slots, before any launch
        for run, slot_indices in plan.runs:
            segment = Segment(state, run)
            host_page_ids = self.copier.gather(segment, slot_indices, after=after, checked=True)
            if host_page_ids is None:  # the plan counted free pages
                raise AssertionError("host pool changed between the plan and the allocation")
            if not launched:
                state.chain = plan.chain
                if commit:
                    self._lifecycles.commit(state)
            # the sidecar and window pages of the run
            self._hybrid.gather_pages(state, run, state.offloaded_length, slot_indices, after, length)
            state.launched(segment)
            pages = len(host_page_ids)
            launched += pages
            self._counters.pages_launched += pages
            self._counters.pages_in_flight += pages
        return launched

    def _gathered(self, result: CopyResult) -> None:
        """A gather finished: settle it and every finished segment after it, in launch order."""
        segment: Segment = result.job
        state = segment.state
        state.copies_in_flight -= 1
        segment.result = result
        try:
            while state.unsettled and state.unsettled[0].result is not None:
                done = state.unsettled.popleft()
                self._backup.settle(
                    state.writes, state.chain, done.run, done.result, discard=state.retract_keep is False
                )
                self._hybrid.settled(done)
        finally:
            self._maybe_release(state)

    def _loaded(self, result: CopyResult) -> None:
        load: LoadJob = result.job
        self.copier.free(result.host_page_ids)
        state = load.state
        counters = self._counters
        if result.ok:
            counters.pages_loaded += load.num_pages
            counters.bytes_loaded += result.bytes
            counters.load_seconds += result.seconds
        else:
            counters.load_failures += 1
            logger.error("offload: load of %d pages of rid=%r failed: %r", load.num_pages, state.req.rid, result.error)
        state.load_ended(load)
        self._maybe_release(state)
