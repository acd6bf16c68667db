"""A hypothesis state machine over the offload manager: random interleavings of new requests
(with reused rids), decode, offload, poll, finish and abort, copies completing (or failing) in a
random order, and storage failures; the manager's invariants are checked after every step."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstage.kv_layout import KVLayout
from kvstage.offload import ManualCopyStream
from kvstage.storage import LayoutFingerprint
from kvstage.offload.testing import SimpleRequest
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
        store = FlakyStore(fingerprint, fail=self._page_fails, raise_on_put=lambda: self.failure_mode == "raise")
        self.stream = OwnedCopyStream()
        self.rig = make_rig(
            page_size=PAGE_SIZE, host_pages=7, buffer_pages=3, num_slots=MAX_REQUESTS * 24,
            storage=store, copy_stream=self.stream, on_storage_failure=self._on_failure,
        )
        self.rig.on_release = self._on_release
        self.manager = self.rig.manager
        self.live: list[RidEqualRequest] = []  # may offload
        self.ending: list[RidEqualRequest] = []  # finish/abort called, not released yet
        self.created: list[RidEqualRequest] = []
        self.failed_pages_reported = 0
        self.next_rid = 0

    # -- callbacks the manager calls -----------------------------------------------------------

    def _page_fails(self, key: str) -> bool:
        return self.failure_mode == "all" or (self.failure_mode == "some" and int(key[-1], 16) % 2 == 0)

    def _on_failure(self, req, keys, error) -> None:
        assert _is_in(req, self.created)
        self.failed_pages_reported += len(keys)

    def _on_release(self, req) -> None:
        assert not _is_in(req, self.rig.released), "released twice"
        assert not _is_in(req, self.live), "released before finish/abort"
        # Its device slots may be reused now: no copy of them may still be pending.
        assert not any(owner is req for owner in self.stream.owner.values()), "released with a copy in flight"
        self.rig.check_stored_pages(req)  # stored bytes are the request's KV, page by page

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

    @precondition(lambda self: len(self.live) + len(self.ending) < MAX_REQUESTS)
    @rule(prompt_len=st.integers(0, 4), namespace=st.sampled_from([{}, {}] + NAMESPACES), reuse=st.integers(0, 10))
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
            assert after[1] == before[1] + 1 and after[3] == before[3] + 1 and after[2] > before[2]
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

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100))
    def finish(self, pick):
        req = self.live.pop(pick % len(self.live))
        self.ending.append(req)
        self._drive(req, self.manager.finish)
        self._settle()

    @precondition(lambda self: self.live or self.ending)
    @rule(pick=st.integers(0, 100))
    def abort(self, pick):
        everyone = self.live + self.ending
        req = everyone[pick % len(everyone)]
        if _is_in(req, self.live):
            self.live = [r for r in self.live if r is not req]
            self.ending.append(req)
        self._drive(req, self.manager.abort)
        self._settle()

    @rule(mode=st.sampled_from(["none", "none", "some", "all", "raise"]))
    def storage_failures(self, mode):
        self.failure_mode = mode

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def host_pages_are_accounted(self):
        pool, metrics = self.rig.host_pool, self.manager.metrics
        assert pool.used + pool.free_pages == pool.capacity
        assert pool.used == metrics.pages_in_flight == metrics.host_pages_used

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
        assert self.manager.metrics.requests_live <= len(self.live) + len(self.ending)
        assert self.manager.metrics.copies_in_flight >= len(self.stream.pending)

    def teardown(self):
        for req in list(self.live):
            self.finish(0)
        for _ in range(100):  # finished requests' waiting pages launch as host pages free
            self.stream.complete_all()
            self.poll()
            if not self.stream.pending:
                break
        metrics = self.manager.metrics
        assert (metrics.requests_live, metrics.copies_in_flight, metrics.pages_in_flight) == (0, 0, 0)
        assert self.rig.host_pool.used == 0
        released = self.rig.released
        assert len(released) == len(self.created)
        assert {id(req) for req in released} == {id(req) for req in self.created}
        assert self.ending == []


OffloadMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestOffloadStateMachine = OffloadMachine.TestCase
