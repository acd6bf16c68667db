"""A hybrid model's components through the manager: sliding-window and sidecar pages with the
full pages, state snapshots, restorable lengths, loads into poisoned pools (bytes exact)."""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.kernels.state_pool import StatePool
from kvstage.model_layout import FullAttention, ModelLayout, RequestState, SlidingWindow
from kvstage.offload.components import ComponentPools, component_stores
from kvstage.storage import MemoryStore

from hybrid_engine import LAYOUTS, PAGE, POISON, PROMPT, STATE, Engine, kv, load, poison, rows, store


def test_window_pages_stored_only_before_resume_lengths_and_restorable():
    engine = Engine(LAYOUTS["swa"])
    a = engine.request("a", PROMPT)
    store(engine, a, chunks=(8,))  # runs end at 8 and 12: the window before each is stored
    keys = engine.manager.hasher.prefill_keys(PROMPT[:12])
    assert engine.stores["full"].exists(keys) == [True] * 6
    assert engine.stores["swa"].exists(keys) == [False, False, True, True, True, True]
    found = engine.manager.match_prefix(token_ids=PROMPT)
    assert (found.num_tokens, found.lengths) == (12, (8, 10, 12))  # 10: pages 3, 4 are stored too
    assert engine.manager.match_prefix(token_ids=PROMPT[:12]).lengths == (8, 10)  # one token left to compute


def test_window_only_at_run_end_rounds_down():
    engine = Engine(LAYOUTS["swa"])
    store(engine, engine.request("a", PROMPT))  # one run to 12: pages 4, 5 of the window only
    assert engine.manager.match_prefix(token_ids=PROMPT).lengths == (12,)
    assert engine.manager.match_prefix(token_ids=PROMPT[:12]).lengths == ()  # 8 would need pages 2, 3


@pytest.mark.parametrize("name", ["swa", "sidecar"])
def test_pages_of_every_component_load_exactly(name):
    engine = Engine(LAYOUTS[name], seed=1)
    a = engine.request("a", PROMPT)
    store(engine, a, chunks=(8,))
    b = engine.request("b", PROMPT + [5, 6])
    poison(engine, b)
    loaded = load(engine, b, component_slots={"swa": engine.window_slots(b)[4:8]} if name == "swa" else None)
    assert loaded.num_tokens == 12 and loaded.error is None
    assert all(
        torch.equal(x, y)
        for x, y in zip(rows(engine.full, engine.slots(b)[:12]), rows(engine.full, engine.slots(a)[:12]))
    )
    if name == "swa":  # the window before 12: positions 8 .. 11
        pool, mine, theirs = engine.pools["swa"], engine.window_slots(b)[8:12], engine.window_slots(a)[8:12]
        assert all(torch.equal(x, y) for x, y in zip(rows(pool, engine.window_slots(b)[4:8]), rows(pool, theirs)))
        assert all((r == POISON).all() for r in rows(pool, mine))  # never written: the window went to [4:8]
    else:
        pool = engine.pools["indexer"]
        assert all(
            torch.equal(x, y) for x, y in zip(rows(pool, engine.slots(b)[:12]), rows(pool, engine.slots(a)[:12]))
        )
    for layer in range(engine.layout.num_layers):
        loaded.wait_layer(layer)


def test_snapshot_restores_to_the_last_snapshot_and_loads_into_the_state_slot():
    engine = Engine(LAYOUTS["state"], seed=2)
    a = engine.request("a", PROMPT)
    saved = store(engine, a, snapshots=(4, 8))  # pages to 12 stored, snapshots at 4 and 8 only
    assert engine.manager.match_prefix(token_ids=PROMPT).lengths == (4, 8)  # 12 has no snapshot: rounds down
    assert engine.manager.match_prefix(token_ids=PROMPT[:8]).num_tokens == 4  # a prompt of exactly 8
    b = engine.request("b", PROMPT)
    poison(engine, b)
    for t in engine.pools["state"].tensors:
        t[3] = POISON
    loaded = load(engine, b, state_slot=3)
    assert loaded.num_tokens == 8
    assert all(torch.equal(x, y) for x, y in zip(engine.state_of(3), saved[8]))
    assert all(
        torch.equal(x, y)
        for x, y in zip(rows(engine.full, engine.slots(b)[:8]), rows(engine.full, engine.slots(a)[:8]))
    )
    assert (rows(engine.full, engine.slots(b)[8:12])[0] == POISON).all()


def test_evicted_snapshot_and_corrupt_window_page_are_misses():
    engine = Engine(LAYOUTS["state"], seed=3)
    store(engine, engine.request("a", PROMPT), snapshots=(4, 8))
    keys = engine.manager.hasher.prefill_keys(PROMPT[:12])
    engine.stores["state"].evicted.add(keys[3])  # the snapshot at 8
    assert engine.manager.match_prefix(token_ids=PROMPT).lengths == (4,)
    b = engine.request("b", PROMPT)
    assert load(engine, b, state_slot=1).num_tokens == 4

    swa = Engine(LAYOUTS["swa"], seed=4)
    a = swa.request("a", PROMPT)
    store(swa, a, chunks=(8,))
    swa.stores["swa"].corrupt.add(keys[4])  # the lookup sees it, its read fails: neither 12 nor 10 is resumed
    c = swa.request("c", PROMPT)
    poison(swa, c)
    loaded = load(swa, c, component_slots={"swa": swa.window_slots(c)[4:8]})
    assert loaded.num_tokens == 8  # the window before 8 (positions 4 .. 7), never the corrupt page
    pool = swa.pools["swa"]
    assert all(
        torch.equal(x, y) for x, y in zip(rows(pool, swa.window_slots(c)[4:8]), rows(pool, swa.window_slots(a)[4:8]))
    )


@pytest.mark.parametrize("namespace", [{"cache_salt": "tenant-b"}, {"extra_key": "lora-1"}])
def test_tenants_and_extra_keys_separate_every_component(namespace):
    for name in ("swa", "state", "sidecar"):
        engine = Engine(LAYOUTS[name])
        a = engine.request("a", PROMPT)
        store(engine, a, chunks=(8,), snapshots=(4, 8) if name == "state" else ())
        assert engine.manager.match_prefix(token_ids=PROMPT).num_tokens == (8 if name == "state" else 12)
        assert engine.manager.match_prefix(token_ids=PROMPT, **namespace).num_tokens == 0
        other = engine.manager.hasher.prefill_keys(PROMPT[:12], **namespace)
        assert not any(any(store.exists(other)) for store in engine.stores.values())


def test_bad_input_raises_before_anything_is_copied():
    engine = Engine(LAYOUTS["state"])
    a = engine.request("a", PROMPT)
    submitted = engine.stream.submitted
    with pytest.raises(InvalidArgumentError, match="^length: .*multiple of page_size"):
        engine.manager.snapshot(a, 3, 0)
    with pytest.raises(InvalidArgumentError, match="^length: 14 is past"):
        engine.manager.snapshot(a, 14, 0)
    with pytest.raises(InvalidArgumentError, match=r"^state_slot: must be an int in \[0, 4\)"):
        engine.manager.snapshot(a, 4, 4)
    assert engine.stream.submitted == submitted
    plain = Engine(LAYOUTS["swa"])
    with pytest.raises(InvalidArgumentError, match="^snapshot: the layout has no request-state"):
        plain.manager.snapshot(plain.request("a", PROMPT), 4, 0)


def test_construction_checks_pools_and_stores():
    layout = LAYOUTS["state"]
    wider = ModelLayout(
        4, (RequestState((0, 1), STATE), FullAttention((2,), kv(1)), SlidingWindow((3,), kv(1), window=3))
    )
    stores = component_stores(wider, "m", PAGE, MemoryStore)
    with pytest.raises(InvalidArgumentError, match=r"^storage: names component 'swa'"):
        Engine(layout, stores=stores)
    other = ModelLayout(3, (RequestState((0, 1), STATE[:1]), FullAttention((2,), kv(1))))
    with pytest.raises(InvalidArgumentError, match=r"^storage\['full'\]: its layout differs"):
        Engine(layout, stores=component_stores(other, "m", PAGE, MemoryStore))


@pytest.mark.parametrize(
    "arguments,message",
    [
        ({"window_kept": {"swa": 3}}, r"^components\.window_kept\['swa'\]: must be an int of at least the window's 4"),
        ({"window_kept": {"swa": 4.0}}, r"^components\.window_kept\['swa'\]: must be an int"),
        ({"window_kept": {"full": 8}}, r"^components\.window_kept: names 'full'; the layout's sliding-window"),
        ({"slots_of": {"sw": lambda req: None}}, r"^components\.slots_of: names 'sw'; the layout's sliding-window"),
    ],
)
def test_window_arguments_naming_no_window_or_keeping_less_than_it_are_refused(arguments, message):
    engine = Engine(LAYOUTS["swa"])
    slots_of = {"swa": engine.window_slots, **arguments.pop("slots_of", {})}
    components = ComponentPools(LAYOUTS["swa"], engine.pools, slots_of=slots_of, **arguments)
    with pytest.raises(InvalidArgumentError, match=message):
        components.check(engine.full, PAGE)


def test_store_events_name_the_component_and_flush_clears_every_store():
    engine = Engine(LAYOUTS["state"])
    store(engine, engine.request("a", PROMPT), snapshots=(4, 8))
    assert engine.manager.entries_stored == {"state": (2, 0)}
    events = engine.stores["state"].take_events()
    assert [e.kind for e in events] == ["stored", "stored"] and all("@state-" in e.key_space for e in events)
    assert all("@full-" in e.key_space for e in engine.stores["full"].take_events())
    assert engine.manager.flush() == 6 + 2
    assert not any(any(s.exists(engine.manager.hasher.prefill_keys(PROMPT[:12]))) for s in engine.stores.values())
    assert engine.manager.match_prefix(token_ids=PROMPT).lengths == ()


def test_a_snapshot_whose_page_failed_is_not_stored():
    engine = Engine(LAYOUTS["state"])
    a = engine.request("a", PROMPT)
    engine.manager.offload(a, kv_length=4)
    engine.stream.complete(0, error=RuntimeError("copy failed"))  # pages 0, 1 never reach the store
    engine.manager.poll()
    engine.manager.snapshot(a, 4, 0)
    a.done = True
    engine.manager.finish(a, kv_length=4)
    engine.settle()
    assert engine.manager.entries_stored == {"state": (0, 1)}
    assert engine.stores["state"].exists(engine.manager.hasher.prefill_keys(PROMPT[:4])) == [False, False]


def test_a_failed_full_copy_puts_none_of_its_window_pages():
    engine = Engine(LAYOUTS["swa"])
    a = engine.request("a", PROMPT)
    engine.manager.offload(a)
    engine.stream.complete(0, error=RuntimeError("copy failed"))
    a.done = True
    engine.manager.finish(a)
    engine.settle()
    assert engine.manager.entries_stored == {"swa": (0, 2)}
    assert not any(engine.stores["swa"].exists(engine.manager.hasher.prefill_keys(PROMPT[:12])))


def test_bad_window_slots_raise_before_any_launch():
    engine = Engine(LAYOUTS["swa"])
    a = engine.request("a", PROMPT)
    engine.window_slots.release(a)
    engine.window_slots.assign(a, 6)  # 6 slots: positions 0 .. 5 only
    with pytest.raises(InvalidArgumentError, match=r"^slots_of\['swa'\]: must give .* each of the 12 positions"):
        engine.manager.offload(a)
    assert engine.stream.submitted == 0 and not engine.manager.is_tracked(a)


@pytest.mark.parametrize("bad", [64, -3])
def test_window_slots_outside_the_pool_raise_before_any_launch(bad):
    # before: offload() launched, the window's copy failed on the copy thread, counted failed
    # with no warning (and on CUDA the unchecked gather reads outside the pool)
    engine = Engine(LAYOUTS["swa"])
    a = engine.request("a", PROMPT)
    table = engine.window_slots(a)
    table[9] = bad  # page 4, a window page before the run's end at 12
    with pytest.raises(
        InvalidArgumentError, match=rf"^slots_of\['swa'\]\(rid='a'\): every slot must be in \[0, 64\), got {bad}"
    ):
        engine.manager.offload(a)
    assert engine.stream.submitted == 0 and not engine.manager.is_tracked(a)


def test_window_slots_of_pages_no_copy_reads_may_hold_anything():
    # a freed position's slot (here -1) outside the pages to gather is not checked
    engine = Engine(LAYOUTS["swa"], window_kept={"swa": 4})
    a = engine.request("a", PROMPT)
    engine.window_slots(a)[:4] = -1  # pages 0, 1: freed by the engine before this call at 12
    engine.manager.offload(a)
    a.done = True
    engine.manager.finish(a)
    engine.settle()
    assert engine.manager.entries_stored == {"swa": (2, 0)}
    assert engine.manager.match_prefix(token_ids=PROMPT).lengths == (12,)


def test_integer_scalars_are_taken_for_page_counts():
    # an all_reduce's minimum is a 0-d tensor; vLLM's counts are numpy integers
    np = pytest.importorskip("numpy")
    engine = Engine(LAYOUTS["swa"], window_kept={"swa": np.int64(4)})
    a = engine.request("a", PROMPT)
    store(engine, a)
    b = engine.request("b", PROMPT)
    handle = engine.manager.prefetch(b, policy="wait_complete", max_pages=torch.tensor(6), min_pages=np.int32(2))
    handle.wait()
    assert handle.pages_wanted == 6 and handle.lengths == (12,)


def test_window_slots_of_a_load_outside_the_pool_or_repeated_are_refused_before_any_copy():
    engine = Engine(LAYOUTS["swa"])
    store(engine, engine.request("a", PROMPT))
    b = engine.request("b", PROMPT + [5, 6])
    handle = engine.manager.prefetch(b, policy="wait_complete")
    handle.wait()
    engine.manager.poll()
    submitted, slots = engine.stream.submitted, engine.slots(b)[:12]
    num_slots = engine.pools["swa"].num_slots
    window = engine.window_slots(b)[4:8]
    E = InvalidArgumentError
    bad = {  # the full pages' rule and errors (kvstage.offload.slot_indices.check_slots)
        "outside": (
            torch.tensor([0, 1, 2, num_slots]),
            E,
            rf"every slot must be in \[0, {num_slots}\), got {num_slots}",
        ),
        "negative": (torch.tensor([-1, 1, 2, 3]), E, r"every slot must be in \[0, \d+\), got -1"),
        "repeated": (torch.tensor([5, 5, 6, 7]), E, "a slot repeats"),
        "part of a page": (window[:3], E, rf"3 slots is not a whole number of pages of {PAGE}"),
        "a page short": (window[:PAGE], E, r"must hold the window's 2 pages before the length \(4 slots\), got 1"),
        "float": (window.float(), ArgumentTypeError, "must be a 1-D int32/int64 tensor"),
        "missing": (None, ArgumentTypeError, "must be a 1-D int32/int64 tensor, got NoneType"),
    }
    for given, error, message in bad.values():  # the host rows' addresses came from them: written outside the pool
        with pytest.raises(error, match=rf"^component_slots\['swa'\]: {message}"):
            engine.manager.load(handle, slots, component_slots={"swa": given})
    assert engine.stream.submitted == submitted
    loaded = engine.manager.load(handle, slots, component_slots={"swa": window})  # the request still loads
    engine.stream.complete_all()
    loaded.wait()
    assert loaded.error is None and loaded.num_tokens == 12


def test_abort_waits_for_component_loads():
    engine = Engine(LAYOUTS["state"], seed=5)
    saved = store(engine, engine.request("a", PROMPT), snapshots=(4, 8))
    b = engine.request("b", PROMPT)
    handle = engine.manager.prefetch(b, policy="wait_complete")
    handle.wait()
    engine.manager.poll()
    engine.manager.load(handle, engine.slots(b)[:8], state_slot=2)
    engine.manager.abort(b)  # the queued copies run now: nothing of b is written after abort returns
    assert not engine.stream.pending and engine.released[-1] is b
    assert all(torch.equal(x, y) for x, y in zip(engine.state_of(2), saved[8]))


def test_load_refuses_a_partial_hybrid_length_and_a_missing_state_slot():
    engine = Engine(LAYOUTS["state"])
    store(engine, engine.request("a", PROMPT), snapshots=(4, 8))
    b = engine.request("b", PROMPT)
    handle = engine.manager.prefetch(b, policy="wait_complete")
    handle.wait()
    submitted = engine.stream.submitted
    with pytest.raises(InvalidArgumentError, match="^slot_indices: 4 tokens is not the prefetched restorable length 8"):
        engine.manager.load(handle, engine.slots(b)[:4], state_slot=0)
    with pytest.raises(InvalidArgumentError, match=r"^state_slot: must be an int in \[0, 4\)"):
        engine.manager.load(handle, engine.slots(b)[:8])
    assert engine.stream.submitted == submitted


def test_a_tp_rank_that_found_a_longer_length_prefetches_again_at_the_agreed_one():
    # Rank 0 found 8 tokens (snapshots at 4 and 8), another rank 4: they agree on 4. The handle
    # of 8 loads 8 or nothing, so rank 0 prefetches again with max_pages and loads exactly 4.
    engine = Engine(LAYOUTS["state"], seed=19)
    a = engine.request("a", PROMPT)
    saved = store(engine, a, snapshots=(4, 8))
    b = engine.request("b", PROMPT)
    first = engine.manager.prefetch(b, policy="wait_complete")
    first.wait()
    engine.manager.poll()
    assert (first.pages_ready, first.lengths) == (4, (4, 8))
    agreed = 2  # the minimum of the ranks' pages_ready
    with pytest.raises(InvalidArgumentError, match="^slot_indices: 4 tokens is not the prefetched restorable length 8"):
        engine.manager.load(first, engine.slots(b)[: agreed * PAGE], state_slot=1)
    engine.manager.cancel(first)
    engine.manager.poll()
    again = engine.manager.prefetch(b, policy="wait_complete", max_pages=agreed)
    again.wait()
    engine.manager.poll()
    assert (again.pages_wanted, again.pages_ready, again.lengths) == (2, 2, (4,))
    poison(engine, b)
    for t in engine.pools["state"].tensors:
        t[1] = POISON
    loaded = engine.manager.load(again, engine.slots(b)[: agreed * PAGE], state_slot=1)
    engine.stream.complete_all()
    loaded.wait()
    assert loaded.num_tokens == 4 and loaded.error is None
    assert all(map(torch.equal, engine.state_of(1), saved[4]))
    assert all(map(torch.equal, rows(engine.full, engine.slots(b)[:4]), rows(engine.full, engine.slots(a)[:4])))
    assert (rows(engine.full, engine.slots(b)[4:8])[0] == POISON).all()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_a_prefetch_max_pages_that_is_no_count_is_refused(bad):
    engine = Engine(LAYOUTS["state"])
    with pytest.raises(InvalidArgumentError, match=r"^max_pages: must be None or an int >= 0"):
        engine.manager.prefetch(engine.request("b", PROMPT), max_pages=bad)
    assert engine.manager.requests_live == 0


def test_numpy_lengths_and_state_slots_are_taken_as_kv_length_is():
    # vLLM keeps token counts as numpy integers: kv_length took them, length and state_slot did not
    np = pytest.importorskip("numpy")
    engine = Engine(LAYOUTS["state"], seed=21)
    a = engine.request("a", PROMPT)
    engine.manager.offload(a)
    for t in engine.pools["state"].tensors:
        t[0] = torch.randn(t.shape[1:]).to(t.dtype)
    saved = engine.state_of(0)
    engine.manager.snapshot(a, np.int64(8), np.int64(0), kv_length=np.int64(12))
    engine.stream.complete_all()
    a.done = True
    engine.manager.finish(a)
    engine.settle()
    b = engine.request("b", PROMPT)
    loaded = load(engine, b, state_slot=torch.tensor(2))
    assert loaded.num_tokens == 8
    assert all(map(torch.equal, engine.state_of(2), saved))


@pytest.mark.parametrize(
    "layout,arguments,message",
    [
        ("swa", {"component_slots": {"sw": torch.arange(4)}}, r"^component_slots: names 'sw'; the layout's sliding"),
        ("swa", {"component_slots": {"swa": torch.arange(4)}, "state_slot": 0}, r"^state_slot: the layout has no"),
        ("state", {"component_slots": {"swa": torch.arange(4)}, "state_slot": 0}, r"^component_slots: names 'swa'"),
        ("state", {"component_slots": [torch.arange(4)], "state_slot": 0}, r"^component_slots: must map"),
    ],
)
def test_load_arguments_for_components_the_model_lacks_are_refused(layout, arguments, message):
    engine = Engine(LAYOUTS[layout], seed=22)
    store(engine, engine.request("a", PROMPT), chunks=(8,), snapshots=(8,) if layout == "state" else ())
    b = engine.request("b", PROMPT)
    handle = engine.manager.prefetch(b, policy="wait_complete")
    handle.wait()
    engine.manager.poll()
    submitted = engine.stream.submitted
    with pytest.raises(InvalidArgumentError, match=message):
        engine.manager.load(handle, engine.slots(b)[: handle.pages_ready * PAGE], **arguments)
    assert engine.stream.submitted == submitted


def test_a_window_of_one_token_loads_without_window_slots():
    # W = 1: a query attends to itself only, no window page is stored or loaded
    layout = ModelLayout(2, (SlidingWindow((0,), kv(1), window=1), FullAttention((1,), kv(1))))
    engine = Engine(layout, seed=23)
    a = engine.request("a", PROMPT)
    store(engine, a)
    assert engine.manager.entries_stored == {"swa": (0, 0)}
    b = engine.request("b", PROMPT)
    loaded = load(engine, b)
    assert loaded.num_tokens == 12 and loaded.error is None
    assert all(map(torch.equal, rows(engine.full, engine.slots(b)[:12]), rows(engine.full, engine.slots(a)[:12])))


def test_a_state_pool_of_another_shape_is_refused():
    layout = LAYOUTS["state"]
    engine = Engine(layout)
    bad = StatePool.from_layers([[torch.zeros(4, 3, 2), torch.zeros(4, 2, 5)] for _ in range(2)])  # conv in float32
    with pytest.raises(
        InvalidArgumentError, match=r"^components.pools\['state'\]: layers\[0\]\[0\] is \(3, 2\) torch.float32"
    ):
        ComponentPools(layout, {"state": bad}).check(engine.full, PAGE)


def test_readme_manager_example_runs(tmp_path):
    import re
    import subprocess
    import sys

    from support import REPO_ROOT

    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("\n## Hybrid models in the manager\n", 1)[1].split("\n## ", 1)[0]
    (example,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    script = tmp_path / "example.py"
    script.write_text(example)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["(32, 64)", "64 True"]


def test_every_component_at_once_loads_exactly():
    engine = Engine(LAYOUTS["all"], seed=6)
    a = engine.request("a", PROMPT)
    saved = store(engine, a, chunks=(8,), snapshots=(8,))  # windows before 8 and 12, a snapshot at 8
    assert engine.manager.match_prefix(token_ids=PROMPT).lengths == (8,)
    b = engine.request("b", PROMPT)
    poison(engine, b)
    for t in engine.pools["state"].tensors:
        t[1] = POISON
    loaded = load(engine, b, state_slot=1, component_slots={"swa": engine.window_slots(b)[4:8]})
    assert loaded.num_tokens == 8
    same = [
        (engine.full, engine.slots(b)[:8], engine.slots(a)[:8]),
        (engine.pools["indexer"], engine.slots(b)[:8], engine.slots(a)[:8]),
        (engine.pools["swa"], engine.window_slots(b)[4:8], engine.window_slots(a)[4:8]),
    ]
    for pool, mine, theirs in same:
        assert all(torch.equal(x, y) for x, y in zip(rows(pool, mine), rows(pool, theirs)))
    assert all(torch.equal(x, y) for x, y in zip(engine.state_of(1), saved[8]))
    assert len(loaded.layer_handles(1)) == 3 and len(loaded.layer_handles(2)) == 1  # full, sidecar, state; state
    assert loaded.layer_handle(2) is loaded.layer_handles(2)[0]
    with pytest.raises(InvalidArgumentError, match="^layer: 1 waits for 3 copies"):
        loaded.layer_handle(1)
    with pytest.raises(InvalidArgumentError, match=r"^layer: must be an int in \[0, 4\)"):
        loaded.wait_layer(4)


def test_drain_does_not_wait_for_pages_that_never_come_and_flush_drops_the_snapshot():
    engine = Engine(LAYOUTS["state"])
    a = engine.request("a", PROMPT)
    engine.manager.offload(a, kv_length=4)
    engine.manager.snapshot(a, 8, 0)  # pages 2, 3 are not offloaded yet
    engine.settle()  # returns: the snapshot's copy is done, it waits for its pages outside the drain
    assert engine.manager.entries_stored == {"state": (0, 0)}
    engine.manager.flush()
    assert engine.manager.entries_stored == {"state": (0, 1)}
    engine.manager.offload(a)
    a.done = True
    engine.manager.finish(a)
    engine.settle()
    assert not any(engine.stores["state"].exists(engine.manager.hasher.prefill_keys(PROMPT[:12])))


def test_layer_by_layer_a_layer_waits_for_its_own_copy_of_every_component():
    engine = Engine(LAYOUTS["all"], seed=7)
    a = engine.request("a", PROMPT)
    saved = store(engine, a, chunks=(8,), snapshots=(8,))
    b = engine.request("b", PROMPT)
    for t in engine.pools["state"].tensors:
        t[1] = POISON
    handle = engine.manager.prefetch(b, policy="wait_complete")
    handle.wait()
    before = engine.stream.submitted
    loaded = engine.manager.load(
        handle,
        engine.slots(b)[:8],
        layer_by_layer=True,
        state_slot=1,
        component_slots={"swa": engine.window_slots(b)[4:8]},
    )
    assert engine.stream.submitted - before == 2 + 1 + 2 + 2  # full, window, sidecar, state: one per layer
    mine = loaded.layer_handles(1)  # full layer 0, indexer layer 0, state layer 0 (model layer 1)
    assert len(mine) == 3 and len(set(map(id, mine))) == 3
    for copy in mine:
        engine.stream.complete(copy)
    layer1, layer2 = engine.state_of(1)[:2], engine.state_of(1)[2:]
    assert all(torch.equal(x, y) for x, y in zip(layer1, saved[8][:2]))  # its state is in
    assert all((t.float() == POISON).all() for t in layer2)  # layer 2's state copy has not run
    engine.stream.complete_all()
    loaded.wait()
    assert all(torch.equal(x, y) for x, y in zip(engine.state_of(1), saved[8]))


def test_snapshots_taken_one_after_another_keep_their_own_bytes():
    engine = Engine(LAYOUTS["state"], seed=8)
    a = engine.request("a", PROMPT)
    engine.manager.offload(a, kv_length=8)
    saved = {}
    for length in (4, 8):  # the second snapshot's host staging is the first's, reused once its write ended
        for t in engine.pools["state"].tensors:
            t[0] = torch.randn(t.shape[1:]).to(t.dtype)
        saved[length] = engine.state_of(0)
        engine.manager.snapshot(a, length, 0)
        engine.stream.complete_all()
        engine.manager.poll()
        engine.manager.poll()
    a.done = True
    engine.manager.finish(a, kv_length=8)
    engine.settle()
    assert engine.manager.entries_stored == {"state": (2, 0)}
    for length, slot in ((4, 1), (8, 2)):
        b = engine.request(f"b{length}", PROMPT[: length + 1])
        assert load(engine, b, state_slot=slot).num_tokens == length
        assert all(torch.equal(x, y) for x, y in zip(engine.state_of(slot), saved[length]))


def test_every_component_over_one_file_store_directory(tmp_path):
    from kvstage.storage.file_store import FileStore

    layout = LAYOUTS["all"]
    stores = component_stores(layout, "m", PAGE, lambda fingerprint: FileStore(fingerprint, tmp_path))
    engine = Engine(layout, seed=9, stores=stores)
    a = engine.request("a", PROMPT)
    saved = store(engine, a, chunks=(8,), snapshots=(8,))
    assert engine.manager.entries_stored == {"swa": (4, 0), "indexer": (6, 0), "state": (1, 0)}
    reopened = component_stores(layout, "m", PAGE, lambda fingerprint: FileStore(fingerprint, tmp_path))
    fresh = Engine(layout, seed=10, stores=reopened)  # another process: other pools, the same directory
    b = fresh.request("b", PROMPT)
    loaded = load(fresh, b, state_slot=0, component_slots={"swa": fresh.window_slots(b)[4:8]})
    assert loaded.num_tokens == 8
    assert all(
        torch.equal(x, y) for x, y in zip(rows(fresh.full, fresh.slots(b)[:8]), rows(engine.full, engine.slots(a)[:8]))
    )
    pools = [(fresh.pools[n], engine.pools[n]) for n in ("indexer", "swa")]
    assert all(
        torch.equal(x, y) for x, y in zip(rows(pools[0][0], fresh.slots(b)[:8]), rows(pools[0][1], engine.slots(a)[:8]))
    )
    assert all(
        torch.equal(x, y)
        for x, y in zip(rows(pools[1][0], fresh.window_slots(b)[4:8]), rows(pools[1][1], engine.window_slots(a)[4:8]))
    )
    assert all(torch.equal(x, y) for x, y in zip(fresh.state_of(0), saved[8]))
    for s in [*stores.values(), *reopened.values()]:
        s.close()


@pytest.mark.parametrize("namespace", [{}, {"cache_salt": "t"}])
def test_decode_snapshots_key_as_the_prefix_hashed_from_the_start(namespace):
    engine = Engine(LAYOUTS["state"])
    a = engine.request("a", PROMPT[:4], extra=12, **namespace)
    engine.manager.offload(a)
    for token in range(200, 211):  # decode 11 tokens: KV up to 14, snapshots at 6, 8, 12 and again 12
        a.output_ids.append(token)
        length = a.kv_length // PAGE * PAGE
        if length in (6, 8, 12):
            engine.manager.snapshot(a, length, 0)
            engine.stream.complete_all()
        engine.manager.offload(a)
    engine.manager.snapshot(a, 12, 0)
    a.done = True
    engine.manager.finish(a)
    engine.settle()
    keys = engine.manager.hasher.prefill_keys((PROMPT[:4] + list(range(200, 211)))[:12], **namespace)
    assert engine.stores["state"].exists(keys) == [False, False, True, True, False, True]


def test_abort_waits_for_a_component_load_that_outlives_the_full_load():
    engine = Engine(LAYOUTS["state"], seed=11)
    saved = store(engine, engine.request("a", PROMPT), snapshots=(4, 8))
    b = engine.request("b", PROMPT)
    handle = engine.manager.prefetch(b, policy="wait_complete")
    handle.wait()
    engine.manager.load(handle, engine.slots(b)[:8], state_slot=2)
    engine.stream.complete(0)  # the full pages' copy only; the manager polls it
    engine.manager.poll()
    assert len(engine.stream.pending) == 1 and engine.released[-1] is not b
    engine.manager.abort(b)
    assert not engine.stream.pending and engine.released[-1] is b
    assert all(torch.equal(x, y) for x, y in zip(engine.state_of(2), saved[8]))


def test_a_prefetch_with_too_few_host_pages_reads_the_restorable_length_that_fits():
    engine = Engine(LAYOUTS["state"], seed=12)
    saved = store(engine, engine.request("a", PROMPT), snapshots=(4, 8))
    taken = engine.manager.host_pool.alloc(engine.manager.host_pool.free_pages - 3)  # 3 host pages left
    b = engine.request("b", PROMPT)
    handle = engine.manager.prefetch(b, policy="wait_complete")
    handle.wait()
    assert (handle.pages_hit, handle.pages_ready, handle.hole) == (4, 2, False)  # 8 needs 4 pages: 4 fits
    engine.manager.poll()
    assert engine.manager.metrics.pages_truncated == 1 and engine.manager.metrics.prefetch_failures == 0
    loaded = engine.manager.load(handle, engine.slots(b)[:4], state_slot=1)
    engine.stream.complete_all()
    loaded.wait()
    assert all(torch.equal(x, y) for x, y in zip(engine.state_of(1), saved[4]))
    engine.manager.host_pool.free(taken)


@pytest.mark.parametrize("name", ["swa", "state", "all"])
def test_kv_events_for_a_model_restoring_only_some_lengths_are_refused_at_start(name):
    # the announcer claims every full page the store holds; a router would route requests to
    # prefixes whose window or snapshot is not stored (before: accepted, every page claimed)
    from kvstage.events import KVEventPublisher

    publisher = KVEventPublisher("tcp://127.0.0.1:0")
    try:
        kinds = {"swa": "swa", "state": "state", "all": "state and swa"}[name]
        with pytest.raises(
            InvalidArgumentError, match=rf"^kv_events: KV events of a model with {kinds} components are not supported"
        ):
            Engine(LAYOUTS[name], kv_events=publisher)
    finally:
        publisher.close()


def test_kv_events_for_full_pages_with_a_sidecar_announce_them():
    from kvstage.events import KVEventPublisher

    publisher = KVEventPublisher("tcp://127.0.0.1:0")
    try:
        engine = Engine(LAYOUTS["sidecar"], kv_events=publisher)
        store(engine, engine.request("a", PROMPT))
        engine.manager.poll()
        assert publisher.flush(5.0)
        assert engine.manager._announcer.pages_announced == 6
    finally:
        engine.manager.close()
        publisher.close()
