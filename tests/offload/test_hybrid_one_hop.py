"""A hybrid model's snapshots over memory stores move with one copy each way: the store adopts
the filled staging buffer (and hands back its victim's), a load scatters straight from the
store's lent page. Bytes exact with poisoned staging, eviction during a lent load, cancel, flush."""

from __future__ import annotations

import torch

from kvstage.storage import MemoryStore

from hybrid_engine import LAYOUTS, PAGE, POISON, Engine, HidingStore, load, poison, rows, store

STATE_CAPACITY = 2


def _engine(seed: int, full_pages: int | None = None, state_pages: int = STATE_CAPACITY) -> Engine:
    layout = LAYOUTS["state"]
    stores = {
        name: (HidingStore(fp) if full_pages is None else MemoryStore(fp, capacity_pages=full_pages))
        if name == "full"
        else MemoryStore(fp, capacity_pages=state_pages)
        for name, fp in layout.fingerprints("m", page_size=PAGE).items()
    }
    return Engine(layout, seed=seed, stores=stores)


def _prompt(i: int) -> list[int]:
    return [1000 * (i + 1) + t for t in range(9)]  # 4 whole pages of 2, a snapshot at 8


def _poison_free_staging(engine: Engine) -> None:
    for buffers in engine.manager._hybrid.staging._free.values():
        for buffer in buffers:
            buffer.view(torch.uint8).fill_(0x5A)


def _run_except(engine: Engine, held: list) -> None:
    """Complete every pending copy but ``held`` (a load's scatter left in flight)."""
    for handle in [h for h in engine.stream.pending if all(h is not kept for kept in held)]:
        engine.stream.complete(handle)


def _store_snapshot(engine: Engine, rid: str, prompt: list[int], held: list = ()) -> list[torch.Tensor]:
    """Offload ``prompt``'s pages and its snapshot at 8 (fresh random state in slot 0) without
    completing ``held``; the snapshot's tensors."""
    req = engine.request(rid, prompt)
    engine.manager.offload(req)
    for t in engine.pools["state"].tensors:
        t[0] = torch.randn(t.shape[1:]).to(t.dtype)
    saved = engine.state_of(0)
    engine.manager.snapshot(req, 8, 0)
    _run_except(engine, held)
    req.done = True
    engine.manager.finish(req)
    for _ in range(10):
        _run_except(engine, held)
        engine.manager.poll()
    engine.slots.release(req)  # its copies are done: the slots go back (the pools are small)
    engine.window_slots.release(req)
    return saved


def _state_key(engine: Engine, prompt: list[int]) -> str:
    return engine.manager.hasher.prefill_keys(prompt[:8])[3]


def test_snapshots_are_adopted_and_poisoned_staging_never_reaches_a_stored_one():
    engine = _engine(seed=11)
    state_store = engine.stores["state"]
    saved = {}
    for i in range(6):
        saved[i] = _store_snapshot(engine, f"s{i}", _prompt(i))
        _poison_free_staging(engine)  # what the staging pool hands out next: no stored bytes in it
    assert engine.manager.entries_stored == {"state": (6, 0)}
    assert state_store.pages_adopted == 6 and state_store.buffers_allocated == 0  # no copy into the store
    assert engine.manager._hybrid.staging.allocated == STATE_CAPACITY + 1  # the victims' buffers come back
    assert state_store.exists([_state_key(engine, _prompt(i)) for i in range(6)]) == [False] * 4 + [True] * 2
    for slot, i in ((1, 4), (2, 5)):
        for t in engine.pools["state"].tensors:
            t[slot] = POISON
        loaded = load(engine, engine.request(f"b{i}", _prompt(i)), state_slot=slot)
        assert loaded.num_tokens == 8 and loaded.error is None
        assert all(torch.equal(x, y) for x, y in zip(engine.state_of(slot), saved[i]))
    assert state_store.pages_on_loan == 1  # the last load's loan ends at the poll after its copy
    engine.manager.poll()
    assert state_store.pages_lent == 2 and state_store.pages_on_loan == 0


def test_snapshots_removed_with_their_pages_give_their_memory_back_to_staging():
    engine = _engine(seed=16, full_pages=8, state_pages=100)  # two requests' pages: a third evicts the first's
    staging, counts, saved = engine.manager._hybrid.staging, [], {}
    for i in range(6):
        saved[i] = _store_snapshot(engine, f"s{i}", _prompt(i))
        _poison_free_staging(engine)
        counts.append(staging.allocated)
    state_store = engine.stores["state"]
    assert len(state_store) == 2 and state_store.stats.pages_removed == 4  # linked: left with their pages
    assert counts[2:] == [counts[2]] * 4, counts  # the removed snapshots' memory is reused, none allocated
    for slot, i in ((1, 4), (2, 5)):
        for t in engine.pools["state"].tensors:
            t[slot] = POISON
        assert load(engine, engine.request(f"b{i}", _prompt(i)), state_slot=slot).num_tokens == 8
        assert all(torch.equal(x, y) for x, y in zip(engine.state_of(slot), saved[i]))


def test_a_lent_snapshot_survives_eviction_until_its_scatter_is_done():
    engine = _engine(seed=12)
    state_store = engine.stores["state"]
    saved = _store_snapshot(engine, "a", _prompt(0))
    handle = engine.manager.prefetch(engine.request("b", _prompt(0)), policy="wait_complete")
    handle.wait()
    engine.manager.poll()
    assert state_store.pages_on_loan == 1  # read by lending, not into a staging copy
    for t in engine.pools["state"].tensors:
        t[1] = POISON
    before = list(engine.stream.pending)
    loaded = engine.manager.load(handle, engine.slots(handle.req)[: 4 * PAGE], state_slot=1)
    held = [h for h in engine.stream.pending if all(h is not old for old in before)]
    for i in (1, 2, 3):  # at capacity: each put evicts, never the lent snapshot
        _store_snapshot(engine, f"c{i}", _prompt(i), held)
        _poison_free_staging(engine)
    assert state_store.exists([_state_key(engine, _prompt(0)), _state_key(engine, _prompt(3))]) == [True, True]
    assert state_store.pages_on_loan == 1
    engine.stream.complete_all()
    loaded.wait()
    assert all(torch.equal(x, y) for x, y in zip(engine.state_of(1), saved))
    engine.manager.poll()
    assert state_store.pages_on_loan == 0
    _store_snapshot(engine, "d", _prompt(4))  # evictable again: the least recently used goes
    assert state_store.exists([_state_key(engine, _prompt(0))]) == [False]


def test_a_cancelled_prefetch_ends_its_loan():
    engine = _engine(seed=13)
    _store_snapshot(engine, "a", _prompt(0))
    handle = engine.manager.prefetch(engine.request("b", _prompt(0)), policy="wait_complete")
    handle.wait()
    engine.manager.poll()
    assert engine.stores["state"].pages_on_loan == 1
    engine.manager.cancel(handle)
    engine.manager.poll()
    assert engine.stores["state"].pages_on_loan == 0 and handle.entries is None


def test_a_missed_lend_drops_to_a_shorter_length_and_lends_nothing():
    engine = _engine(seed=14)
    _store_snapshot(engine, "a", _prompt(0))
    engine.stores["state"].remove([_state_key(engine, _prompt(0))])  # gone between the lookup and the read
    handle = engine.manager.prefetch(engine.request("b", _prompt(0)), policy="wait_complete")
    handle.wait()
    engine.manager.poll()
    assert handle.pages_ready == 0 and engine.stores["state"].pages_on_loan == 0


def test_flush_and_close_during_a_lent_load_keep_its_bytes():
    engine = _engine(seed=15)
    saved = _store_snapshot(engine, "a", _prompt(0))
    handle = engine.manager.prefetch(engine.request("b", _prompt(0)), policy="wait_complete")
    handle.wait()
    engine.manager.poll()
    for t in engine.pools["state"].tensors:
        t[2] = POISON
    loaded = engine.manager.load(handle, engine.slots(handle.req)[: 4 * PAGE], state_slot=2)
    assert engine.manager.flush() >= 1  # the lent snapshot leaves the store; its borrower keeps reading it
    assert len(engine.stores["state"]) == 0
    engine.stream.complete_all()
    loaded.wait()
    assert all(torch.equal(x, y) for x, y in zip(engine.state_of(2), saved))
    engine.manager.poll()
    assert engine.stores["state"].pages_on_loan == 0
    again = _store_snapshot(engine, "c", _prompt(1))
    loading = engine.manager.prefetch(engine.request("d", _prompt(1)), policy="wait_complete")
    loading.wait()
    engine.manager.poll()
    engine.manager.load(loading, engine.slots(loading.req)[: 4 * PAGE], state_slot=3)  # in flight at close
    waiting = engine.manager.prefetch(engine.request("e", _prompt(1)), policy="wait_complete")
    waiting.wait()  # read and lent, never loaded
    assert engine.stores["state"].pages_on_loan == 2
    engine.manager.close()
    assert engine.stores["state"].pages_on_loan == 0  # the stores outlive the manager: nothing stays kept
    assert all(torch.equal(x, y) for x, y in zip(engine.state_of(3), again))
    assert engine.stores["state"].pages_adopted == 2


def test_window_pages_are_lent_to_their_load_and_land_in_poisoned_slots():
    engine = Engine(LAYOUTS["swa"], seed=14)
    window_store = engine.stores["swa"]
    a = engine.request("a", list(range(100, 113)))
    store(engine, a)  # one run to 12: the window's pages 4, 5
    b = engine.request("b", list(range(100, 113)) + [5, 6])
    poison(engine, b)
    handle = engine.manager.prefetch(b, policy="wait_complete")
    handle.wait()
    engine.manager.poll()
    assert window_store.pages_on_loan == 2  # both window pages read by lending, no staging copy
    loaded = engine.manager.load(handle, engine.slots(b)[:12], component_slots={"swa": engine.window_slots(b)[8:12]})
    engine.stream.complete_all()
    loaded.wait()
    assert loaded.error is None and loaded.num_tokens == 12
    window = engine.pools["swa"]
    assert all(
        torch.equal(x, y)
        for x, y in zip(rows(window, engine.window_slots(b)[8:12]), rows(window, engine.window_slots(a)[8:12]))
    )
    engine.manager.poll()
    assert window_store.pages_on_loan == 0  # the loan ended with the scatter


def test_window_pages_are_adopted_by_their_store_and_their_victims_memory_comes_back():
    layout = LAYOUTS["swa"]
    stores = {
        name: MemoryStore(fp, capacity_pages=4 if name == "swa" else 64)
        for name, fp in layout.fingerprints("m", page_size=PAGE).items()
    }
    engine = Engine(layout, seed=15, stores=stores)
    window_store = stores["swa"]
    for i in range(5):  # each request's window pages 4, 5; at capacity from the third on
        prompt = [1000 * (i + 1) + t for t in range(13)]
        a = engine.request(f"a{i}", prompt)
        store(engine, a)
        _poison_free_staging(engine)  # what the staging pool hands out next: no stored bytes in it
        if i < 4:
            engine.slots.release(a)
            engine.window_slots.release(a)
    assert window_store.pages_adopted == 10 and window_store.buffers_allocated == 0  # kept, never copied in
    # 4 fill the store, 2 more for the first request at capacity; then the victims' buffers come back
    assert engine.manager._hybrid.staging.allocated == 6
    b = engine.request("b", prompt + [5, 6])
    poison(engine, b)
    loaded = load(engine, b, component_slots={"swa": engine.window_slots(b)[8:12]})
    assert loaded.error is None and loaded.num_tokens == 12
    window = engine.pools["swa"]
    assert all(
        torch.equal(x, y)
        for x, y in zip(rows(window, engine.window_slots(b)[8:12]), rows(window, engine.window_slots(a)[8:12]))
    )
