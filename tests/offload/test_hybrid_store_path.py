"""A hybrid model's store path: the window pages before every snapshot length are stored (a
snapshot at a length no run ends at is restorable), and ``on_stored`` waits for every component
write of the request."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from kvstage.model_layout import FullAttention, ModelLayout, RequestState, SlidingWindow

from hybrid_engine import LAYOUTS, PAGE, POISON, PROMPT, STATE, Engine, kv, load, poison, rows

# window 5: the 2 pages of 2 before a length; state beside it (gpt-oss's window with Qwen3-Next's state)
WINDOW_AND_STATE = ModelLayout(
    3, (SlidingWindow((0,), kv(1), window=5), FullAttention((1,), kv(1)), RequestState((2,), STATE))
)


def snapshot(engine: Engine, req, length: int, **kwargs) -> list[torch.Tensor]:
    """A snapshot of fresh random state in slot 0 at ``length``; its tensors."""
    for t in engine.pools["state"].tensors:
        t[0] = torch.randn(t.shape[1:]).to(t.dtype)
    saved = engine.state_of(0)
    engine.manager.snapshot(req, length, 0, **kwargs)
    engine.stream.complete_all()  # the slot's state stays until its copy is done
    return saved


def finish(engine: Engine, req) -> None:
    req.done = True
    engine.manager.finish(req)
    engine.settle()


def check_loads_at_8(engine: Engine, a, saved: list[torch.Tensor]) -> None:
    """A new request of the same prompt loads 8 tokens: the full pages, the window before 8
    (positions 4 .. 7) and the snapshot, byte for byte."""
    keys = engine.manager.hasher.prefill_keys(PROMPT[:12])
    assert engine.stores["swa"].exists(keys[2:4]) == [True, True]  # the window before 8
    assert engine.manager.match_prefix(token_ids=PROMPT).lengths == (8,)
    b = engine.request("b", PROMPT)
    poison(engine, b)
    for t in engine.pools["state"].tensors:
        t[2] = POISON
    loaded = load(engine, b, component_slots={"swa": engine.window_slots(b)[4:8]}, state_slot=2)
    assert loaded.num_tokens == 8 and loaded.error is None
    window = engine.pools["swa"]
    assert all(map(torch.equal, rows(window, engine.window_slots(b)[4:8]), rows(window, engine.window_slots(a)[4:8])))
    assert all(map(torch.equal, rows(engine.full, engine.slots(b)[:8]), rows(engine.full, engine.slots(a)[:8])))
    assert all(map(torch.equal, engine.state_of(2), saved))


def test_a_snapshot_taken_after_its_pages_were_offloaded_stores_the_window_before_it():
    # One run to 12 stores the window before 12 only (pages 4, 5); the snapshot at 8 needs
    # pages 2, 3 (before: it was stored and never restorable).
    engine = Engine(WINDOW_AND_STATE, seed=11)
    a = engine.request("a", PROMPT)
    engine.manager.offload(a)
    saved = snapshot(engine, a, 8)
    finish(engine, a)
    check_loads_at_8(engine, a, saved)


def test_a_snapshot_taken_before_its_pages_are_offloaded_stores_the_window_before_it():
    # The snapshot at 8 comes first (the pages to 8 are not offloaded yet); the run to 12 that
    # follows stores the window before 8 as well as before 12.
    engine = Engine(WINDOW_AND_STATE, seed=12)
    a = engine.request("a", PROMPT)
    engine.manager.offload(a, kv_length=4)
    saved = snapshot(engine, a, 8, kv_length=8)
    engine.manager.offload(a)
    finish(engine, a)
    keys = engine.manager.hasher.prefill_keys(PROMPT[:12])
    assert engine.stores["swa"].exists(keys) == [True, True, True, True, True, True]
    check_loads_at_8(engine, a, saved)


def test_window_pages_of_a_run_are_stored_only_before_its_end_and_the_snapshot_lengths():
    engine = Engine(WINDOW_AND_STATE, seed=13)
    prompt = list(range(200, 221))  # 21 tokens: 10 whole pages
    a = engine.request("a", prompt)
    engine.manager.snapshot(a, 8, 0, kv_length=8)  # before any page is offloaded
    engine.manager.offload(a)  # one run to 20: the windows before 8 and 20 (pages 2, 3, 8, 9)
    finish(engine, a)
    keys = engine.manager.hasher.prefill_keys(prompt[:20])
    assert engine.stores["swa"].exists(keys) == [False, False, True, True, False, False, False, False, True, True]
    assert engine.manager.match_prefix(token_ids=prompt).lengths == (8,)


class HeldWrites:
    """Store workers that queue every write until the test runs it (reads run at once)."""

    def __init__(self) -> None:
        self.queued: list[tuple] = []

    def write(self, call) -> Future:
        future: Future = Future()
        self.queued.append((call, future))
        return future

    def read(self, call) -> Future:
        future: Future = Future()
        future.set_result(call())
        return future

    def run(self, count: int | None = None) -> None:
        """Run the oldest ``count`` queued writes (None: all)."""
        count = len(self.queued) if count is None else count
        for call, future in self.queued[:count]:
            future.set_result(call())
        del self.queued[:count]

    def close(self) -> None:
        """Nothing to stop."""


def test_on_stored_waits_until_every_component_write_of_the_request_ended():
    workers, stored = HeldWrites(), []
    engine = Engine(
        WINDOW_AND_STATE,
        seed=14,
        store_workers=workers,
        on_stored=lambda req, pages, failed: stored.append((req.rid, pages, failed)),
    )
    a = engine.request("a", PROMPT)
    engine.manager.offload(a)
    engine.manager.snapshot(a, 12, 0)
    a.done = True
    engine.manager.finish(a)
    for _ in range(5):
        engine.stream.complete_all()
        engine.manager.poll()
    assert len(workers.queued) == 3  # the full pages, the window pages, the snapshot
    workers.run(1)  # the full pages' write ends; the components' have not
    keys = engine.manager.hasher.prefill_keys(PROMPT[:12])
    assert engine.stores["full"].exists(keys) == [True] * 6 and engine.stores["state"].exists(keys[-1:]) == [False]
    for _ in range(5):
        engine.manager.poll()
    assert stored == []  # before: on_stored ran here, with the window and the snapshot unwritten
    # nothing is live, in flight or pending on the full pages' path: only this says a report is due
    metrics = engine.manager.metrics
    assert (metrics.requests_live, metrics.writes_pending, metrics.copies_in_flight) == (0, 0, 0)
    assert engine.manager.reports_pending == 1
    workers.run()
    engine.manager.poll()
    assert stored == [("a", 6, 0)] and engine.manager.reports_pending == 0
    assert engine.stores["state"].exists(keys[-1:]) == [True]
    assert engine.manager.match_prefix(token_ids=PROMPT).lengths == (12,)
    assert engine.manager.entries_stored["swa"][0] == 2 and engine.manager.entries_stored["state"][0] == 1


def test_a_snapshot_polled_before_the_requests_first_offload_waits_for_its_pages():
    # The engine snapshots at 8 and polls before it offloads any page of the request: the
    # snapshot waits for its pages (before: it was put at once, before h_3 was stored, and failed).
    engine = Engine(WINDOW_AND_STATE, seed=15)
    a = engine.request("a", PROMPT)
    saved = snapshot(engine, a, 8, kv_length=8)
    engine.manager.poll()
    assert engine.manager.entries_stored["state"] == (0, 0)
    engine.manager.offload(a)
    finish(engine, a)
    assert engine.manager.entries_stored["state"] == (1, 0)
    check_loads_at_8(engine, a, saved)


def test_a_run_launched_after_the_engine_freed_its_window_pages_stores_none_of_them():
    # sglang frees a request's window slots behind it while it runs (free_swa_out_of_window_slots);
    # with the host pool short, the run to 12 launches at the call at 16, when the engine has
    # freed page 4 (positions 8, 9) and another request wrote there. Before: page 4 was gathered
    # from the reused slots, and 10 and 12 were restorable with its foreign bytes.
    workers, kept = HeldWrites(), 5
    engine = Engine(LAYOUTS["swa"], seed=16, store_workers=workers, host_pages=4, window_kept={"swa": kept})
    prompt = list(range(100, 121))  # 21 tokens: 10 whole pages of 2
    a = engine.request("a", prompt)
    window = engine.pools["swa"]
    original = rows(window, engine.window_slots(a)[:18])

    def call_at(length: int) -> None:
        """The engine at ``length`` tokens with KV: the copies launched before have run; it
        frees the window pages wholly before the ``kept`` positions, another request's KV lands
        there; then its offload call."""
        engine.stream.complete_all()
        engine.manager.poll()
        slots = engine.window_slots(a)
        for page in range(length // PAGE):
            if (page + 1) * PAGE - 1 < length - kept:
                for part in window.buffers:
                    for buffer in part:
                        buffer[slots[page * PAGE : (page + 1) * PAGE]] = torch.randn(PAGE, 1, 4)
        engine.manager.offload(a, kv_length=length)

    call_at(4)  # a run to 4 and the window before it (pages 0, 1)
    call_at(8)  # a run to 8 and pages 2, 3: the 4 host pages are taken (their writes held)
    call_at(12)  # no host page free: nothing launched
    workers.run(1)  # the run to 4 is written: 2 host pages free
    call_at(16)  # the run to 12 launches now; the engine freed pages 0 .. 4 of the window
    workers.run()
    call_at(18)  # the run to 18 and the window before it (pages 7, 8)
    a.done = True
    engine.manager.finish(a, kv_length=18)
    for _ in range(5):
        engine.stream.complete_all()
        engine.manager.poll()
        workers.run()
    engine.settle()
    lengths = engine.manager.match_prefix(token_ids=prompt).lengths
    assert lengths == (2, 4, 6, 8, 14, 16, 18)  # 10 and 12 need page 4, which the store never got
    reader = Engine(LAYOUTS["swa"], seed=17, stores=engine.stores)  # host pages for the longest length
    for length in lengths:
        b = reader.request(f"b{length}", prompt[: length + 1])
        poison(reader, b)
        before = slice(max(0, length - 2 * PAGE), length)  # the window's pages before the length (2 at most)
        loaded = load(reader, b, component_slots={"swa": reader.window_slots(b)[before]})
        assert loaded.num_tokens == length
        got = rows(reader.pools["swa"], reader.window_slots(b)[before])
        assert all(torch.equal(x, y[before]) for x, y in zip(got, original)), length
        reader.settle()  # the load's host pages go back
        reader.slots.release(b), reader.window_slots.release(b)


def test_a_snapshot_taken_after_the_engine_may_have_freed_its_window_is_stored_without_a_length():
    # The engine keeps 6 positions: at 13 tokens (the prompt's), page 2 (positions 4, 5) may be
    # another request's already, so the snapshot at 8 gathers page 3 only and 8 is not restorable.
    engine = Engine(WINDOW_AND_STATE, seed=18, window_kept={"swa": 6})
    a = engine.request("a", PROMPT)
    engine.manager.offload(a)
    snapshot(engine, a, 8)
    finish(engine, a)
    keys = engine.manager.hasher.prefill_keys(PROMPT[:12])
    assert engine.stores["swa"].exists(keys) == [False, False, False, True, True, True]
    assert engine.manager.entries_stored["state"] == (1, 0)
    assert engine.manager.match_prefix(token_ids=PROMPT).lengths == ()


def test_a_request_retracted_to_start_over_gathers_its_window_again_for_a_snapshot():
    # Retracted with keep_offloaded=False while its run to 8 (and window pages 2, 3) copied: the
    # pages are discarded. When it runs again, a snapshot at 8 after a run to 12 gathers pages
    # 2, 3 again (before: they counted as gathered, and 8 was never restorable).
    engine = Engine(WINDOW_AND_STATE, seed=20)
    a = engine.request("a", PROMPT)
    engine.manager.offload(a, kv_length=8)
    engine.manager.retract(a, keep_offloaded=False)
    engine.settle()
    assert engine.released == [a]
    keys = engine.manager.hasher.prefill_keys(PROMPT[:12])
    assert engine.stores["swa"].exists(keys) == [False] * 6  # discarded
    engine.manager.offload(a)  # it runs again from the start: one run to 12
    saved = snapshot(engine, a, 8)
    finish(engine, a)
    check_loads_at_8(engine, a, saved)
