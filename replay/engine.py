"""The replay loop: a small prefill-and-decode engine around kvstage's manager, kernels, hashing
and storage.

What one replay does, per request of the trace (in timestamp order, as fast as it can: arrival
times order the requests but are not waited for):

1. *Admission*: when fewer than ``max_running`` requests prefetch or run, the device KV pool has
   free pages for the whole request (prompt + output) and the host pool has free pages for its
   prompt's lookup, it is admitted: ``OffloadManager.prefetch`` (policy ``wait_complete``) reads
   its stored prefix into host pages on a worker thread, and it waits in the *prefetching* list.
2. *Load and prefill*: once ``ready_to_load()``, the prefetched pages are loaded into its first
   device slots (``OffloadManager.load``) and checked byte for byte (load mismatches); the KV of
   the remaining prompt tokens is written (content: :mod:`kvstage.replay.kv_content`, a function
   of the page key and position) and the first output token is sampled.
3. *Decode*: each step, every running request writes the KV of its last token and samples the
   next; ``OffloadManager.offload(req)`` is called for each (the first call stores the prompt's
   whole pages past the loaded ones, later ones every whole stride), then ``poll()`` once. A
   request that has all its output tokens is handed to ``OffloadManager.finish`` (which offloads
   its remaining whole pages) and leaves the batch; its device pages are freed when the manager
   calls ``release``.

After the run (:func:`kvstage.replay.command.replay`), every stored page is loaded back through
the same prefetch and load path into idle device slots and compared
(:func:`kvstage.replay.verify.verify_pages`).

Every page key a request will ever have (prompt and decode, whole pages only) is computed at
admission with the same hasher the manager uses, and is what the KV content is made from; the
verify step loads these keys back, so a key computed differently by the manager shows up as a
lost page.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.offload.request import kv_length
from kvstage.replay.device_pages import DevicePagePool, pick_device
from kvstage.replay.kv_content import KVContent
from kvstage.replay.replay_config import (  # noqa: F401 (ReplayConfig and the defaults are imported from here too)
    DEFAULT_CPU_POOL_BYTES,
    DEFAULT_GPU_POOL_FRACTION,
    MEMORY_STORE_SHARE,
    POISON_WORD,
    PREFETCH_POLICY,
    ReplayConfig,
    ReplayStats,
    _available_host_bytes,
)
from kvstage.replay.replay_request import ReplayRequest, RequestFeed
from kvstage.replay.tokens import TokenSource
from kvstage.replay.trace import TraceRequest


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class ReplayEngine:
    """Runs a trace through the offload manager; see the module docstring for the flow.

    Args:
        config: the replay's settings.
        requests: the trace (any order; replayed in timestamp order, ties in trace order).
        on_progress: ``on_progress(engine)`` called about every 0.1 s while running.
        open_store: ``open_store(url, fingerprint)`` -> the store the manager uses (a fleet
            engine's local tier in front of the shared store); None: ``open_storage``.
        kv_events: the manager's ``kv_events`` (a :class:`kvstage.events.KVEventPublisher`:
            what it stores, as router-facing KV events); None: none.

    Attributes:
        run_metrics: the manager's counters when :meth:`run` returned (verification loads
            through the same manager afterwards).
        request_keys: each request's page keys, in replay order.

    Raises:
        InvalidArgumentError: the device or host pool is too small for a request, or an
            option is out of range.
        BackendUnavailableError: the copy backend cannot run here.
    """

    def __init__(
        self,
        config: ReplayConfig,
        requests: Sequence[TraceRequest],
        on_progress: Callable[["ReplayEngine"], None] | None = None,
        open_store: Callable[[str, Any], Any] | None = None,
        kv_events: Any = None,
    ) -> None:
        from kvstage.hashing import PageHasher
        from kvstage.kernels import KVPool
        from kvstage.kernels.backend import resolve_backend
        from kvstage.offload import HostPool, OffloadManager
        from kvstage.storage import LayoutFingerprint, open_storage

        self.config = config
        self.model = model = config.model
        ps = self.page_size = config.page_size
        self.stride = config.stride or ps
        self.device = pick_device(config.device)
        self.on_cuda = self.device.type == "cuda"
        self.backend_used = resolve_backend(config.backend, on_cuda=self.on_cuda)
        self.trace = sorted(requests, key=lambda r: (r.timestamp, r.index))
        self.on_progress = on_progress
        self.tokens = TokenSource(config.seed)
        self.content = KVContent(model, ps, config.seed, self.device)
        self.stats = ReplayStats()

        # Device KV pool.
        needs = sorted((_pages(r.input_length + r.output_length, ps) for r in self.trace), reverse=True)
        if config.pool_tokens is not None:
            pool_pages = _pages(config.pool_tokens, ps)
            if pool_pages < needs[0]:
                raise InvalidArgumentError(
                    f"--pool-tokens: {config.pool_tokens} tokens cannot hold the largest request "
                    f"({needs[0] * ps} tokens with page size {ps})"
                )
        else:
            if self.on_cuda:
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * DEFAULT_GPU_POOL_FRACTION)
            else:
                budget = DEFAULT_CPU_POOL_BYTES
            pool_pages = max(needs[0], min(sum(needs[: config.max_running]), budget // model.page_bytes(ps)))
        self.device_pages = DevicePagePool(pool_pages)
        num_slots = pool_pages * ps
        shape = (num_slots, model.num_heads, model.head_dim)
        # Uninitialized: a slot is always written (load, prefill or decode) before a gather reads it.
        if model.kv_parts == 2:
            k = [torch.empty(shape, dtype=model.dtype, device=self.device) for _ in range(model.num_layers)]
            v = [torch.empty(shape, dtype=model.dtype, device=self.device) for _ in range(model.num_layers)]
            self.kv_pool = KVPool.mha(k, v)
        else:
            self.kv_pool = KVPool.mla(
                [torch.empty(shape, dtype=model.dtype, device=self.device) for _ in range(model.num_layers)]
            )
        word, width = self.content.word, self.content.words_per_row
        # Word views of each layer and part: the engine writes and checks KV as machine words.
        self._words = [
            [
                self.kv_pool.layer(part, layer).view(num_slots, -1).view(word).view(num_slots, width)
                for layer in range(model.num_layers)
            ]
            for part in range(model.kv_parts)
        ]

        # Host pool, storage, hasher, manager.
        longest = max((r.input_length + r.output_length - 1) // ps for r in self.trace)
        num_host_pages = config.num_host_pages or (2 * max(longest, 1) + 4 * config.max_running * (self.stride // ps))
        if num_host_pages < longest:
            raise InvalidArgumentError(
                f"--num-host-pages: {num_host_pages} pages cannot hold the longest request's {longest} whole pages "
                "(a prefetch and a verify load take a whole prefix at once)"
            )
        self.host_pool = HostPool.like(self.kv_pool, num_pages=num_host_pages, page_size=ps)
        self.fingerprint = LayoutFingerprint.of(self.kv_pool, page_size=ps, model_id=model.name)
        self.notes: list[str] = []  # things the command line should tell the user
        self.expected_pages_bound = sum(
            (r.input_length + r.output_length - 1) // ps for r in self.trace
        )  # every whole page any request will have: a store this large never evicts
        self.hasher = PageHasher(config.hash_scheme, ps)
        storage, components = self._open_storage(open_store or open_storage)
        self.manager = OffloadManager(
            self.kv_pool,
            self.host_pool,
            storage,
            self.hasher,
            lambda req: req.slot_indices,
            offload_stride=self.stride,
            release=self._release,
            on_storage_failure=self._storage_failed,
            on_stored=self._stored,
            backend=config.backend,
            kv_events=kv_events,
            components=components,
        )
        self.run_metrics = self.manager.metrics

        # Namespaces.
        rng = np.random.default_rng([config.seed, 0x7E4A])
        self.namespaces: list[tuple[str | None, str | None]] = []  # (extra_key, cache_salt) in replay order
        for _ in self.trace:
            salt = f"tenant-{int(rng.integers(config.tenants))}" if config.tenants > 0 else None
            extra = "lora-adapter-0" if rng.random() < config.lora_share else None
            self.namespaces.append((extra, salt))

        # What verify loads back: every whole page key, with the namespaces that produced it.
        self.expected_keys: dict[str, set[tuple[str | None, str | None]]] = {}
        self.request_keys: list[list[str]] = [[] for _ in self.trace]
        self.requests_done = 0
        self.started = 0.0
        self.feed: RequestFeed | None = None

    # -- setup helpers ------------------------------------------------------------------------

    def _open_storage(self, open_store: Callable[[str, Any], Any]) -> tuple[Any, Any]:
        """Open :attr:`storage`; ``(the manager's storage, its components)`` (a hybrid engine's differ)."""
        self.storage_url = self._storage_url(self.config.storage)
        self.storage = open_store(self.storage_url, self.fingerprint)
        return self.storage, None

    def _storage_url(self, url: str) -> str:
        """``memory`` becomes ``memory:BYTES``: the trace's every whole page, but at most
        :data:`MEMORY_STORE_SHARE` of the host memory available now (then pages may be evicted,
        and :attr:`notes` says so)."""
        if url != "memory":
            return url
        page_bytes = self.model.page_bytes(self.page_size)
        need = max(self.expected_pages_bound, 1) * page_bytes
        available = _available_host_bytes()
        if available is not None and need > available * MEMORY_STORE_SHARE:
            capped = max(page_bytes, int(available * MEMORY_STORE_SHARE) // page_bytes * page_bytes)
            self.notes.append(
                f"storage: the trace may store {need / 2**30:.1f} GiB, more than {MEMORY_STORE_SHARE:.0%} of the "
                f"{available / 2**30:.1f} GiB of host memory available; the memory store is capped at "
                f"{capped / 2**30:.1f} GiB and may evict pages (use file:DIR to keep them all)"
            )
            need = capped
        return f"memory:{need}"

    def _release(self, req: Any) -> None:
        if not isinstance(req, ReplayRequest):
            return  # a verify request: its scratch slots belong to no request
        self.device_pages.free(req.device_pages)
        req.device_pages = []
        req.slot_indices = None

    def _stored(self, req: Any, pages_stored: int, pages_failed: int) -> None:
        if self.feed is not None and isinstance(req, ReplayRequest):
            self.feed.stored(req)

    def _storage_failed(self, req: Any, keys: list[str], error: BaseException | None) -> None:
        self.stats.storage_failure_keys.extend(keys)

    # -- the loop -------------------------------------------------------------------------------

    def run(self, feed: RequestFeed | None = None) -> ReplayStats:
        """Replay every request (``feed`` None), or the requests ``feed`` assigns until it is
        exhausted; returns the counters (the manager's are in :attr:`run_metrics`)."""
        self.started = time.perf_counter()
        self.feed = feed
        pending = deque(enumerate(self.trace)) if feed is None else deque()
        prefetching: list[ReplayRequest] = []  # admitted, reading their stored prefix
        running: list[ReplayRequest] = []
        finishing: list[ReplayRequest] = []  # finished, waiting for host pages to offload their tail
        last_progress = 0.0
        while True:
            busy = bool(pending or prefetching or running or finishing or self.manager.requests_live)
            if feed is not None:
                pending.extend((order, self.trace[order]) for order in feed.take(wait=not busy))
                busy = busy or bool(pending)
                if not busy and not feed.exhausted:
                    self.manager.poll()  # released requests' last writes end: on_stored
                    continue
            if not busy:
                break
            admitted = self._admit(pending, prefetching, len(running))
            ready = [req for req in prefetching if req.prefetch.ready_to_load()]
            if ready:
                prefetching = [req for req in prefetching if req not in ready]
                for req in ready:
                    self._load_and_prefill(req)
                running.extend(ready)
            if running:
                self._decode_step(running)
                for req in running:
                    if not req.finished():
                        self.manager.offload(req)
                done = [req for req in running if req.finished()]
                if done:
                    running = [req for req in running if not req.finished()]
                    finishing.extend(done)
            self.manager.poll()
            finishing = [req for req in finishing if not self._try_finish(req)]
            if not running and not admitted:
                # Nothing to compute: wait for reads and copies in flight (they free host and device pages).
                self.manager.drain()
                if finishing and not pending and not prefetching and self.manager.copies_in_flight == 0:
                    for req in finishing:  # the host pool is idle and still too small: finish anyway
                        self._try_finish(req, force=True)
                    finishing = []
            if self.on_progress is not None and time.perf_counter() - last_progress > 0.1:
                last_progress = time.perf_counter()
                self.on_progress(self)
        self.manager.drain()
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
        self.stats.run_seconds = time.perf_counter() - self.started
        self.run_metrics = self.manager.metrics
        if self.on_progress is not None:
            self.on_progress(self)
        return self.stats

    def _admit(self, pending: deque, prefetching: list[ReplayRequest], num_running: int) -> int:
        """Admit pending requests (head of line first) and start their prefetch; returns how many."""
        admitted = 0
        ps = self.page_size
        while pending and len(prefetching) + num_running < self.config.max_running:
            order, trace = pending[0]
            if (trace.input_length - 1) // ps > self.host_pool.free_pages:
                break  # its lookup would be cut short: wait for host pages
            pages = self.device_pages.alloc(_pages(trace.input_length + trace.output_length, ps))
            if pages is None:
                break  # wait for released device pages
            pending.popleft()
            req = self._make_request(order, trace)
            if self.feed is not None:
                self.feed.admitted(req)
            req.device_pages = pages
            device_page_ids = torch.tensor(pages, dtype=torch.int64)
            req.slot_indices = (device_page_ids.view(-1, 1) * ps + torch.arange(ps)).view(-1).to(self.device)
            req.prefetch = self.manager.prefetch(req, policy=PREFETCH_POLICY)
            prefetching.append(req)
            admitted += 1
        return admitted

    def _make_request(self, order: int, trace: TraceRequest) -> ReplayRequest:
        extra, salt = self.namespaces[order]
        req = ReplayRequest(trace, self.tokens.prompt(trace), self.tokens.output(trace), extra, salt)
        req.order = order
        ps = self.page_size
        tokens = req.kv_tokens
        keys = req.page_keys = self._expect(order, tokens)
        # The partial last page has no key; its content only needs to be deterministic.
        mask_keys = req.page_keys + [f"partial:{req.rid}"] * (_pages(len(tokens), ps) - len(keys))
        req.mask_values = [self.content.mask(key) for key in mask_keys]
        req.masks = torch.tensor(req.mask_values, dtype=self.content.word).to(self.device)
        self.stats.requests += 1
        self.stats.prompt_tokens += len(req.origin_input_ids)
        self.stats.prompt_pages += len(req.origin_input_ids) // ps
        self.stats.output_tokens += req.output_length
        return req

    def _expect(self, order: int, tokens: array) -> list[str]:
        """Hash the whole pages of ``tokens`` (the request at ``order``'s tokens with KV) and
        record their keys as ones verify must find; returns the keys."""
        extra, salt = self.namespaces[order]
        full = len(tokens) // self.page_size * self.page_size
        started = time.perf_counter()
        keys = list(self.hasher.prefill_keys(tokens[:full], extra_key=extra, cache_salt=salt)) if full else []
        self.stats.hash_seconds += time.perf_counter() - started
        self.stats.hashed_tokens += full
        self.request_keys[order] = keys
        for key in keys:
            self.expected_keys.setdefault(key, set()).add((extra, salt))
        return keys

    def expect(self, order: int) -> list[str]:
        """Record the page keys of the request at ``order`` (timestamp order) as ones verify must
        find, without running it: a fleet verifies, in one process, what its engines stored.
        Returns the keys."""
        trace = self.trace[order]
        extra, salt = self.namespaces[order]
        tokens = ReplayRequest(trace, self.tokens.prompt(trace), self.tokens.output(trace), extra, salt).kv_tokens
        return self._expect(order, tokens)

    def _write_kv(self, slot_indices: torch.Tensor, masks: torch.Tensor, offsets: torch.Tensor | None) -> None:
        """Write KV words: whole pages (``offsets`` None: masks per page, slot indices per token) or single tokens."""
        for part, layers in enumerate(self._words):
            for layer, words in enumerate(layers):
                if offsets is None:
                    rows = self.content.page_words_for_layer(masks, layer, part)[: slot_indices.shape[0]]
                else:
                    rows = self.content.token_rows(masks, offsets, layer, part)
                words.index_copy_(0, slot_indices, rows)

    def poison(self, slot_indices: torch.Tensor) -> None:
        """Fill these device slots (every layer and part) with :data:`POISON_WORD` words.

        Device pages are reused, so slots about to be loaded may already hold the very KV a
        load should bring; poisoned first, a load that writes nothing cannot pass the check.
        """
        for layers in self._words:
            for words in layers:
                words.index_fill_(0, slot_indices, POISON_WORD)

    def mismatched_pages(self, slot_indices: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        """Which pages of the device KV differ from the content they must hold.

        Args:
            slot_indices: ``[P * page_size]`` device slots, page by page.
            masks: ``[P]`` the pages' KV content masks (:meth:`KVContent.masks`), on the pool's device.

        Returns:
            A bool tensor ``[P]`` on the pool's device: True where any word of the page (any
            layer, part or token) differs.
        """
        num_pages = masks.shape[0]
        wrong = torch.zeros(num_pages, dtype=torch.bool, device=self.device)
        for part, layers in enumerate(self._words):
            for layer, words in enumerate(layers):
                expected = self.content.page_words_for_layer(masks, layer, part)
                wrong |= (words.index_select(0, slot_indices) != expected).view(num_pages, -1).any(dim=1)
        return wrong

    def _load_and_prefill(self, req: ReplayRequest) -> None:
        """Load the prefetched prefix into the request's first slots and check its bytes, write
        the remaining prompt tokens' KV, sample token 0."""
        ps = self.page_size
        handle, req.prefetch = req.prefetch, None
        num_pages = handle.pages_ready
        slots = req.slot_indices[: num_pages * ps]
        if num_pages:
            self.poison(slots)
        load = self.manager.load(handle, slots)  # also with 0 pages: it ends the prefetch
        if num_pages:
            load.wait()
            self.stats.load_mismatches += int(self.mismatched_pages(slots, req.masks[:num_pages]).sum())
        self.stats.prefill_tokens_saved += load.num_tokens
        req.loaded_pages = load.num_pages
        prompt_length = len(req.origin_input_ids)
        self._write_kv(
            req.slot_indices[load.num_tokens : prompt_length],
            req.masks[load.num_pages : _pages(prompt_length, ps)],
            None,
        )
        req.sample_next()

    def _decode_step(self, running: list[ReplayRequest]) -> None:
        """One token for every running request: write the KV of its last token, sample the next."""
        ps = self.page_size
        active = [req for req in running if not req.finished()]
        if not active:
            return
        # One host array of (slot, mask, offset) per token, one H2D copy: per-request tensors
        # would cost a launch each.
        rows = np.empty((3, len(active)), dtype=np.int64)
        for i, req in enumerate(active):
            position = kv_length(req)  # the last sampled token's position
            page, offset = divmod(position, ps)
            rows[0, i] = req.device_pages[page] * ps + offset
            rows[1, i] = req.mask_values[page]
            rows[2, i] = offset
        host = torch.from_numpy(rows).to(self.device)
        slots, offsets = host[0], host[2]
        masks = host[1].to(self.content.word)  # masks fit the word: the cast keeps their bits
        self._write_kv(slots, masks, offsets)
        for req in active:
            req.sample_next()
        self.stats.decode_steps += 1

    def _try_finish(self, req: ReplayRequest, force: bool = False) -> bool:
        """Hand a finished request to ``manager.finish`` once the host pool can take its tail."""
        offloaded = self.manager.offloaded_length(req) or 0
        remaining = kv_length(req) // self.page_size - offloaded // self.page_size
        if not force and remaining > self.host_pool.free_pages and remaining <= self.host_pool.capacity:
            return False
        self.manager.finish(req)
        self.requests_done += 1
        return True

    def close(self) -> None:
        """Close the manager (its workers and copy stream) and the storage."""
        self.manager.close()
        self.storage.close()
