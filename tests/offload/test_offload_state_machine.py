"""A hypothesis state machine over the offload manager: random interleavings of new requests
(with reused rids), decode, offload, poll, finish and abort, the load path (lookup, prefetch,
load, cancel, abort during prefetch or load), copies completing (or failing) in a random order,
storage write and read failures, and evictions between lookup and read; the manager's
invariants are checked after every step.

Every page a request's tokens fill must end in the store with its own bytes, unless a fault the
test injected explains its absence: the page was evicted; the request was aborted (any page);
its ``finish`` dropped pages (the host pool was full: the pages after those launched); or a
storage failure was reported for it that an injected fault caused (an injected page or put
failure, an injected copy failure, or an eviction of a page before the failed ones: the
failed pages and those after them). A failure report that no injected fault explains fails
the test, and so does any assertion inside the manager's callbacks (which the manager catches
and counts)."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstage.kv_layout import KVLayout
from kvstage.offload import ManualCopyStream
from kvstage.offload.copier import SCATTER
from kvstage.offload.testing import SimpleRequest
from kvstage.storage import LayoutFingerprint

from offload_rig import FlakyStore, make_rig

PAGE_SIZE = 2
MAX_NEW = 12
MAX_REQUESTS = 6
NAMESPACES = [{}, {"extra_key": "lora"}, {"cache_salt": "t1"}, {"extra_key": "lora", "cache_salt": "t1"}]


class RidEqualRequest(SimpleRequest):
    """Equal and hashed by rid: the manager (and this test) must only use identity."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SimpleRequest) and other.rid == self.rid

    def __hash__(self) -> int:
        return hash(self.rid)


class EvictingStore(FlakyStore):
    """A FlakyStore that, when asked, evicts the last page a lookup found right after answering
    it (an eviction between a prefetch's lookup and its read); ``evicted`` holds the keys (no
    prefix) it evicted."""

    evict_after_lookup = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.evicted: set[str] = set()

    def _exists(self, full_keys):
        answer = super()._exists(full_keys)
        if self.evict_after_lookup and any(answer):
            last = max(index for index, hit in enumerate(answer) if hit)
            with self._lock:
                self._pages.remove(full_keys[last])
            self.evicted.add(full_keys[last])  # a memory store's hooks take page keys
        return answer


class OwnedCopyStream(ManualCopyStream):
    """Records which request each held copy belongs to (the request the test is driving)."""

    def __init__(self) -> None:
        super().__init__()
        self.driving = None
        self.owner: dict[int, object] = {}

    def submit(self, copy, *, keep=(), after=None):
        event = super().submit(copy, keep=keep, after=after)
        self.owner[id(event)] = self.driving
        return event

    def pending_of(self, req) -> int:
        return sum(1 for handle in self.pending if self.owner.get(id(handle)) is req)

    def complete(self, which=0, *, error=None):
        event = super().complete(which, error=error)
        self.owner.pop(id(event))
        return event


def _is_in(req, items) -> bool:
    return any(req is item for item in items)


class OffloadMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.failure_mode = "none"
        fingerprint = LayoutFingerprint("rig", KVLayout(2, 2, 1, 4, "int32"), PAGE_SIZE)
        self.store = EvictingStore(
            fingerprint,
            fail=self._page_fails,
            raise_on_put=lambda: self.failure_mode == "raise",
            fail_get=lambda key: self.read_failures and int(key[-2], 16) % 3 == 0,
        )
        self.read_failures = False
        self.stream = OwnedCopyStream()
        self.rig = make_rig(
            page_size=PAGE_SIZE,
            num_host_pages=7,
            buffer_pages=3,
            num_slots=MAX_REQUESTS * 64,
            storage=self.store,
            copy_stream=self.stream,
            on_storage_failure=self._on_failure,
            store_prompt=True,
        )
        self.rig.on_release = self._on_release
        self.manager = self.rig.manager
        self.prefetching: list[tuple[RidEqualRequest, object]] = []  # (request, prefetch handle)
        self.loading: list[tuple[RidEqualRequest, object, int]] = []  # (request, load handle, pages)
        self.live: list[RidEqualRequest] = []  # may offload
        self.ending: list[RidEqualRequest] = []  # finish/abort called, not released yet
        self.created: list[RidEqualRequest] = []
        self.failed_pages_reported = 0
        self.next_rid = 0
        self.injected_failed_keys: set[str] = set()  # pages whose put an injected fault failed
        self.excused_from: dict[int, int] = {}  # id(request) -> first page an injected fault may have cost it
        self.callback_failures: list[str] = []  # assertions raised inside the manager's callbacks

    # -- callbacks the manager calls -----------------------------------------------------------

    def _page_fails(self, key: str) -> bool:
        fails = self.failure_mode == "all" or (self.failure_mode == "some" and int(key[-1], 16) % 2 == 0)
        if fails:
            self.injected_failed_keys.add(key)
        return fails

    def _excuse(self, req, first_page: int) -> None:
        self.excused_from[id(req)] = min(first_page, self.excused_from.get(id(req), first_page))

    def _on_failure(self, req, keys, error) -> None:
        # The manager catches what a callback raises: record it for the invariant instead.
        try:
            assert _is_in(req, self.created), f"a failure reported for an unknown request {req!r}"
            self.failed_pages_reported += len(keys)
            chain = self.rig.chain(req)
            first = min((chain.index(key) for key in keys if key in chain), default=0)
            injected = (error is not None and "injected" in str(error)) or not self.injected_failed_keys.isdisjoint(
                keys
            )
            prior_evicted = not self.store.evicted.isdisjoint(chain[:first])
            # A run whose first page follows a page that an earlier fault cost: that fault explains it.
            earlier = self.excused_from.get(id(req), len(chain)) <= first
            assert injected or prior_evicted or earlier, (
                f"{req!r}: storage failure of {keys} that no injected fault explains: {error!r}"
            )
            self._excuse(req, first)
        except AssertionError as failure:
            self.callback_failures.append(f"on_storage_failure: {failure}")

    def _on_release(self, req) -> None:
        try:
            assert not _is_in(req, self.rig.released), "released twice"
            assert not _is_in(req, self.live), "released before finish/abort"
            # Its device slots may be reused now: no copy of them may still be pending.
            assert not any(owner is req for owner in self.stream.owner.values()), "released with a copy in flight"
            reading, self.read_failures = self.read_failures, False
            try:
                # Raises if a page stored so far differs from the request's KV; which pages may be
                # missing is judged at teardown, once every write has been collected.
                self.rig.missing_pages(req)
            finally:
                self.read_failures = reading
        except AssertionError as failure:
            self.callback_failures.append(f"release: {failure}")

    def _drive(self, req, call):
        self.stream.driving = req
        try:
            return call(req)
        finally:
            self.stream.driving = None

    def _settle(self) -> None:
        released = self.rig.released
        self.ending = [req for req in self.ending if not _is_in(req, released)]

    # -- rules -------------------------------------------------------------------------------

    @initialize(prompt_len=st.integers(3, 9), namespace=st.sampled_from(NAMESPACES), steps=st.integers(1, 8))
    def a_stored_conversation(self, prompt_len, namespace, steps):
        """A first request whose pages are stored, so that follow-up turns can hit from the start."""
        self.new_request(prompt_len, namespace, 99)
        self.engine_step(0, steps)
        self.run_every_copy()

    @precondition(lambda self: len(self.live) + len(self.ending) < MAX_REQUESTS)
    @rule(prompt_len=st.integers(0, 9), namespace=st.sampled_from([{}, {}] + NAMESPACES), reuse=st.integers(0, 10))
    def new_request(self, prompt_len, namespace, reuse):
        if reuse < len(self.created):
            rid = self.created[reuse].rid  # a retry: same rid, new object
        else:
            rid = f"r{self.next_rid}"
            self.next_rid += 1
        prompt = list(range(prompt_len))  # few distinct prompts: pages repeat across requests
        req = self.rig.new_request(rid, prompt, MAX_NEW, cls=RidEqualRequest, **namespace)
        self.rig.decode(req, 0)  # prefill samples the first token
        self.live.append(req)
        self.created.append(req)

    @precondition(
        lambda self: len(self.live) + len(self.ending) + len(self.prefetching) + len(self.loading) < MAX_REQUESTS
    )
    @rule(source=st.integers(0, 100), cut=st.integers(0, 4), policy=st.sampled_from(["best_effort", "wait_complete"]))
    def new_request_with_prefetch(self, source, cut, policy):
        """A follow-up turn of an earlier request (its tokens, its namespace, maybe fewer) that
        first looks its prompt up and prefetches it (not prefilled yet)."""
        if not self.created:
            return
        earlier = self.created[source % len(self.created)]
        tokens = list(earlier.origin_input_ids) + list(earlier.output_ids)
        prompt = tokens[: max(len(tokens) - cut, 2)] if len(tokens) >= 2 else [0, 1]
        prompt_len = len(prompt)
        namespace = {"extra_key": earlier.extra_key, "cache_salt": earlier.cache_salt}
        rid = f"p{self.next_rid}"
        self.next_rid += 1
        req = RidEqualRequest(rid, prompt, **namespace)
        self.rig.slots.assign(req, prompt_len + MAX_NEW)
        self.rig.stacked[:, :, self.rig.slots(req)] = -1  # poisoned: nothing of it written yet
        matched = self.manager.match_prefix(req).num_pages
        handle = self.manager.prefetch(req, policy=policy)
        assert (
            handle.pages_ready
            <= (handle.pages_hit or 0)
            <= len(handle.page_keys)
            <= max(prompt_len - 1, 0) // PAGE_SIZE
        )
        assert handle.pages_hit is None or handle.pages_hit <= matched or self.store.evict_after_lookup
        self.prefetching.append((req, handle))
        self.created.append(req)

    @precondition(lambda self: self.prefetching)
    @rule(pick=st.integers(0, 100), fewer=st.integers(0, 2), layer_by_layer=st.booleans())
    def load(self, pick, fewer, layer_by_layer):
        req, handle = self.prefetching.pop(pick % len(self.prefetching))
        if not handle.ready_to_load():
            self.manager.cancel(handle)
            self._prefill(req, 0)
            return
        pages = max(handle.pages_ready - fewer, 0)
        slots = self.rig.slots(req)[: pages * PAGE_SIZE]
        load = self._drive(req, lambda r: self.manager.load(handle, slots, layer_by_layer=layer_by_layer))
        assert load.num_pages == pages
        self.loading.append((req, load, pages))

    @precondition(lambda self: self.loading)
    @rule(pick=st.integers(0, 100))
    def finish_load(self, pick):
        """The engine waits for the load, checks it, and prefills the rest of the prompt."""
        req, load, pages = self.loading.pop(pick % len(self.loading))
        while self.stream.pending_of(req):
            handle = next(h for h in self.stream.pending if self.stream.owner.get(id(h)) is req)
            self.stream.complete(handle)
        if load.error is not None:  # the copy failed: the engine computes the prefix itself
            self._prefill(req, 0)
            return
        tokens = pages * PAGE_SIZE
        slots = self.rig.slots(req)
        rows = self.rig.stacked[:, :, slots, 0, :4].permute(2, 0, 1, 3)
        assert torch.equal(rows[:tokens], self.rig.expected_rows(req, 0, tokens)), "loaded bytes differ"
        assert bool((rows[tokens:] == -1).all()), "written past the loaded pages"
        self._prefill(req, tokens)

    def _prefill(self, req, start):
        self.rig.write_kv(req, start, len(req.origin_input_ids))
        self.rig.decode(req, 0)
        self.live.append(req)

    @precondition(lambda self: self.prefetching or self.loading)
    @rule(pick=st.integers(0, 100), cancel_only=st.booleans())
    def abort_during_load_path(self, pick, cancel_only):
        everyone = [(req, handle) for req, handle in self.prefetching] + [(req, load) for req, load, _ in self.loading]
        req, handle = everyone[pick % len(everyone)]
        self.prefetching = [entry for entry in self.prefetching if entry[0] is not req]
        self.loading = [entry for entry in self.loading if entry[0] is not req]
        if cancel_only and hasattr(handle, "pages_ready"):
            self.manager.cancel(handle)
            self._prefill(req, 0)
            return
        self.ending.append(req)
        self._excuse(req, 0)
        self._drive(req, self.manager.abort)
        # Nothing of an aborted request is written to its slots after abort returns.
        assert self.stream.pending_of(req) == 0
        self._settle()

    @rule(read_failures=st.booleans(), evict=st.booleans())
    def read_faults(self, read_failures, evict):
        self.read_failures = read_failures
        self.store.evict_after_lookup = evict

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100), steps=st.integers(1, 4))
    def decode(self, pick, steps):
        req = self.live[pick % len(self.live)]
        for _ in range(steps):
            if len(req.output_ids) < MAX_NEW:
                # Sampled tokens depend only on the position: equal prompts give equal pages.
                self.rig.decode(req, len(req.output_ids) % 3)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100), steps=st.integers(1, 4))
    def engine_step(self, pick, steps):
        """What an engine does: decode, then offload (the most common interleaving)."""
        self.decode(pick, steps)
        self.offload(pick)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100))
    def offload(self, pick):
        req = self.live[pick % len(self.live)]
        pool = self.rig.host_pool
        before = (self.manager.offloaded_length(req), self.manager.in_flight(req), pool.used, self.stream.submitted)
        launched = self._drive(req, self.manager.offload)
        after = (self.manager.offloaded_length(req), self.manager.in_flight(req), pool.used, self.stream.submitted)
        if launched:
            # One copy, or two when the prompt's pages go first (store_prompt).
            assert after[1] - before[1] == after[3] - before[3] in (1, 2) and after[2] > before[2]
            assert after[0] % PAGE_SIZE == 0 and after[0] <= req.kv_length
        else:
            assert after[1:] == before[1:] and (before[0] is None or after[0] == before[0])

    @rule()
    def poll(self):
        self.manager.poll()
        self._settle()

    @precondition(lambda self: self.stream.pending)
    @rule(pick=st.integers(0, 100), fail=st.integers(0, 7), then_poll=st.booleans())
    def complete_copy(self, pick, fail, then_poll):
        error = RuntimeError("injected copy failure") if fail == 0 else None
        self.stream.complete(pick % len(self.stream.pending), error=error)
        if then_poll:
            self.poll()

    @precondition(lambda self: self.stream.pending)
    @rule()
    def run_every_copy(self):
        """The copy stream catches up (so stores fill and later lookups can hit)."""
        self.stream.complete_all()
        self.poll()

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100))
    def finish(self, pick):
        req = self.live.pop(pick % len(self.live))
        self.ending.append(req)
        launched = self.manager.offloaded_length(req) or 0
        if not self._drive(req, self.manager.finish):  # pages past those launched were dropped
            self._excuse(req, launched // PAGE_SIZE)
        self._settle()

    @precondition(lambda self: self.live or self.ending)
    @rule(pick=st.integers(0, 100))
    def abort(self, pick):
        everyone = self.live + self.ending
        req = everyone[pick % len(everyone)]
        if _is_in(req, self.live):
            self.live = [r for r in self.live if r is not req]
            self.ending.append(req)
        self._excuse(req, 0)
        self._drive(req, self.manager.abort)
        self._settle()

    @rule(mode=st.sampled_from(["none", "none", "some", "all", "raise"]))
    def storage_failures(self, mode):
        self.failure_mode = mode

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def callbacks_raised_nothing(self):
        assert self.callback_failures == []
        assert self.manager.metrics.callback_errors == 0

    @invariant()
    def host_pages_are_accounted(self):
        pool, metrics = self.rig.host_pool, self.manager.metrics
        assert pool.used + pool.free_pages == pool.capacity
        # Internals: no public figure splits the host pages held by prefetches and loads.
        prefetched = sum(len(handle.host_page_ids) for handle in self.manager._prefetcher.active)
        loading = sum(len(copy.host_page_ids) for copy in self.manager.copier._copies if copy.direction == SCATTER)
        loading += sum(len(r.host_page_ids) for r in self.manager._unhandled if r.direction == SCATTER)
        assert pool.used == metrics.pages_in_flight + prefetched + loading == metrics.host_pages_used

    @invariant()
    def every_page_ends_exactly_once(self):
        m = self.manager.metrics
        assert m.pages_launched == (
            m.pages_in_flight + m.pages_stored + m.pages_deduplicated + m.pages_failed + m.pages_discarded
        )
        assert m.pages_failed == self.failed_pages_reported

    @invariant()
    def tracked_requests_are_the_unreleased_ones(self):
        released = self.rig.released
        assert self.manager.metrics.releases == len(released)
        for req in self.ending:
            assert self.manager.is_tracked(req)
        for req in released:
            assert not self.manager.is_tracked(req)
        assert self.manager.metrics.requests_live <= len(self.live) + len(self.ending) + len(self.prefetching) + len(
            self.loading
        )
        # A layer-by-layer load is one copy of the manager's and one stream submission per layer.
        # Internals: the stream submissions of the copies in flight have no public count.
        submissions = sum(len(copy.handles) for copy in self.manager.copier._copies)
        submissions += sum(1 for result in self.manager._unhandled)
        assert submissions >= len(self.stream.pending)

    def teardown(self):
        for req, handle in self.prefetching:
            self.manager.cancel(handle)
            self._prefill(req, 0)
        self.prefetching = []
        for _ in list(self.loading):
            self.finish_load(0)
        for _ in list(self.live):
            self.finish(0)
        for _ in range(100):  # finished requests' waiting pages launch as host pages free
            self.stream.complete_all()
            self.poll()
            if not self.stream.pending:
                break
        metrics = self.manager.metrics
        assert (metrics.requests_live, metrics.copies_in_flight, metrics.pages_in_flight) == (0, 0, 0)
        self.manager.poll()
        # Internals: no public view of the prefetches still held.
        assert self.rig.host_pool.used == 0 and self.manager._prefetcher.active == []
        released = self.rig.released
        assert len(released) == len(self.created)
        assert {id(req) for req in released} == {id(req) for req in self.created}
        assert self.ending == []
        self.callbacks_raised_nothing()
        self.every_stored_page_is_there()

    def every_stored_page_is_there(self):
        """Every whole page of every request is in the store with its bytes, unless an injected
        fault excuses that request (see the module doc)."""
        self.read_failures = False  # an injected read failure would hide a stored page
        unexplained = []
        for req in self.created:
            chain, first_excused = self.rig.chain(req), self.excused_from.get(id(req), len(self.rig.chain(req)))
            missing = [
                index
                for index in self.rig.missing_pages(req)
                if index < first_excused and chain[index] not in self.store.evicted
            ]
            if missing:
                unexplained.append(f"{req!r}: pages {missing} of {len(chain)} not stored")
        assert unexplained == []


OffloadMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestOffloadStateMachine = OffloadMachine.TestCase
