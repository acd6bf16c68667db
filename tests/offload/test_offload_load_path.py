"""The load path: prompt store, lookup, prefetch (policies, holes, cancel), layer-by-layer load."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError, StorageError
from kvstage.hashing import PageHasher
from kvstage.kernels import KVPool
from kvstage.kv_layout import KVLayout
from kvstage.offload import CopyStream, HostPool, ManualCopyStream, OffloadManager, StoreWorkers
from kvstage.offload.testing import SimpleRequest, SlotTable
from kvstage.storage import LayoutFingerprint, MemoryStore, open_storage

from offload_rig import FlakyStore, make_rig, make_stored_rig, prefetched

PAGE = 4


def stored_request(rig, rid="a", prompt=range(18), outputs=range(100, 110), **namespace):
    """Run one request through prefill, decode and finish; every copy completed and written."""
    req = rig.new_request(rid, list(prompt), len(outputs) + 1, **namespace)
    complete = getattr(rig.copy_stream, "complete_all", lambda: None)  # a real stream runs copies itself
    for token in outputs:
        rig.decode(req, token)
        rig.manager.offload(req)
        complete()
        rig.manager.poll()
    req.done = True
    rig.manager.finish(req)
    complete()
    rig.manager.drain()
    return req


def follow_up(rig, rid, prompt, **namespace):
    """A new request with slots and every slot poisoned (-1): nothing of it is written yet."""
    from kvstage.offload.testing import SimpleRequest

    req = SimpleRequest(rid, list(prompt), **namespace)
    rig.slots.assign(req, len(req.origin_input_ids) + 8)
    rig.stacked[:, :, rig.slots(req)] = -1
    return req


def rows_at(rig, slots, layers=slice(None)):
    """The rig's ``[n, parts, layers, 4]`` rows at device ``slots`` (heads repeat them)."""
    return rig.stacked[:, layers, slots, 0, :4].permute(2, 0, 1, 3)


def loaded_rows_equal(rig, source, target, num_tokens):
    """Whether target's first slots hold exactly the KV rows of source's first tokens."""
    return torch.equal(rows_at(rig, rig.slots(target)[:num_tokens]), rig.expected_rows(source, 0, num_tokens))


def test_prompt_pages_are_stored_by_the_manager_under_the_prefill_chain():
    rig = make_rig(page_size=PAGE, store_prompt=True)
    req = stored_request(rig, cache_salt="t")
    # 18 + 10 - 1 = 27 tokens with KV: 6 whole pages, prompt's 4 and decode's 2, one chain.
    chain = rig.chain(req)
    assert len(chain) == 6 and rig.storage.exists(chain) == [True] * 6
    m = rig.manager.metrics
    assert (m.pages_launched, m.pages_stored, m.host_pages_used) == (6, 6, 0)
    for index in range(6):
        into = torch.empty(rig.host_pool.page_shape, dtype=torch.int32)
        assert rig.storage.get([chain[index]], [into]) == [True]
        assert torch.equal(into, rig.expected_page(req, index))


def test_store_prompt_false_continues_the_chain_from_the_prefill_sides_keys():
    rig = make_rig(page_size=PAGE, store_prompt=False)
    req = stored_request(rig)
    chain = rig.chain(req)
    assert rig.storage.exists(chain) == [True] * 6  # 0-3 put by the rig's prefill side
    assert rig.manager.metrics.pages_launched == 2 and rig.manager.metrics.pages_stored == 2


def test_lookup_prefetch_and_load_bring_the_prefix_back_bitwise():
    rig = make_rig(page_size=PAGE, store_prompt=True, slot_generator=torch.Generator().manual_seed(5))
    a = stored_request(rig, cache_salt="t")
    b = follow_up(rig, "b", range(18), cache_salt="t")
    match = rig.manager.match_prefix(b)
    assert (match.num_pages, match.num_tokens, match.pages_asked) == (4, 16, 4)  # 17 usable tokens
    assert match.page_keys == rig.chain(a)[:4]
    handle = rig.manager.prefetch(b, policy="wait_complete")
    assert handle.wait(5.0) and handle.pages_ready == 4 and handle.ready_to_load()
    load = rig.manager.load(handle, rig.slots(b)[:16])
    assert load.num_tokens == 16 and not load.done()
    rig.copy_stream.complete_all()
    rig.manager.poll()
    assert load.done() and loaded_rows_equal(rig, a, b, 16)
    assert bool((rig.stacked[:, :, rig.slots(b)[16:]] == -1).all())  # nothing past the load written
    m = rig.manager.metrics
    assert (m.pages_loaded, m.bytes_loaded, m.host_pages_used) == (4, 4 * rig.host_pool.page_bytes, 0)
    assert rig.manager.offloaded_length(b) == 16  # its chain continues after the loaded pages


def test_the_chain_continues_after_a_load_so_only_new_pages_are_stored():
    rig = make_rig(page_size=PAGE, store_prompt=True)
    a = stored_request(rig, prompt=range(18), outputs=range(100, 110))
    turn = list(a.origin_input_ids) + list(a.output_ids)  # follow-up turn: A's prompt and output
    b = follow_up(rig, "b", turn)
    assert rig.manager.match_prefix(b).num_pages == 6  # A's decode pages too
    handle = rig.manager.prefetch(b)
    assert handle.wait(5.0)
    rig.manager.load(handle, rig.slots(b)[:24])
    rig.copy_stream.complete_all()
    rig.manager.poll()
    rig.write_kv(b, 24, len(turn))  # prefill of the rest
    b.output_ids.append(7)
    stored_before = rig.manager.metrics.pages_stored
    b.done = True
    rig.manager.finish(b)
    rig.copy_stream.complete_all()
    rig.manager.drain()
    assert rig.manager.metrics.pages_stored == stored_before + 1  # page 6 only (tokens 24..27)
    assert rig.storage.exists(rig.chain(b)) == [True] * 7


@pytest.mark.parametrize("namespace", [{"cache_salt": "other"}, {"extra_key": "lora-2"}, {}])
def test_another_namespace_gets_no_hit(namespace):
    rig = make_rig(page_size=PAGE, store_prompt=True)
    stored_request(rig, cache_salt="t")
    other = follow_up(rig, "x", range(18), **namespace)
    assert rig.manager.match_prefix(other).num_pages == 0
    assert rig.manager.match_prefix(token_ids=list(range(16)), **namespace).num_pages == 0
    assert rig.manager.match_prefix(token_ids=list(range(16)), cache_salt="t").num_pages == 4


def test_a_page_that_exists_but_cannot_be_read_ends_the_hit_before_it():
    fingerprint = LayoutFingerprint("rig", KVLayout(2, 2, 1, 4, "int32"), PAGE)
    store = FlakyStore(fingerprint)
    rig = make_rig(page_size=PAGE, store_prompt=True, storage=store)
    a = stored_request(rig, prompt=range(30), outputs=range(100, 102))
    bad = rig.chain(a)[2]
    store.fail_get = lambda key: key == bad
    b = follow_up(rig, "b", range(30))
    assert rig.manager.match_prefix(b).num_pages == 7  # exists says yes for every page
    handle = rig.manager.prefetch(b)
    assert handle.wait(5.0)
    assert (handle.pages_hit, handle.pages_ready) == (7, 2)  # nothing after the hole
    with pytest.raises(InvalidArgumentError, match=r"^slot_indices: must be a 1-D tensor of at most 2 ready pages"):
        rig.manager.load(handle, rig.slots(b)[:12])
    rig.manager.load(handle, rig.slots(b)[:8])
    rig.copy_stream.complete_all()
    rig.manager.poll()
    assert loaded_rows_equal(rig, a, b, 8) and rig.host_pool.used == 0
    assert rig.manager.metrics.pages_loaded == 2


def test_cancel_and_abort_free_the_host_pages():
    rig = make_rig(page_size=PAGE, store_prompt=True)
    stored_request(rig)
    b = follow_up(rig, "b", range(18))
    handle = rig.manager.prefetch(b)
    assert rig.host_pool.used == 4
    rig.manager.cancel(handle)
    assert handle.wait(5.0)
    rig.manager.poll()
    assert rig.host_pool.used == 0
    with pytest.raises(InvalidArgumentError, match="^handle: was cancelled"):
        rig.manager.load(handle, rig.slots(b)[:16])
    c = follow_up(rig, "c", range(18))
    handle = rig.manager.prefetch(c)
    rig.manager.abort(c)
    assert rig.released[-1] is c
    assert handle.wait(5.0)
    rig.manager.poll()
    assert rig.host_pool.used == 0 and handle.cancelled


def test_load_arguments_are_checked_before_anything_is_written():
    rig = make_rig(page_size=PAGE, store_prompt=True)
    stored_request(rig)
    b = follow_up(rig, "b", range(18))
    with pytest.raises(ArgumentTypeError, match="^handle: must be a PrefetchHandle"):
        rig.manager.load(object(), rig.slots(b)[:4])
    handle = rig.manager.prefetch(b)
    assert handle.wait(5.0)
    for bad in (rig.slots(b)[:6], rig.slots(b)[:20], rig.slots(b)[:8].view(2, 4), [0, 1, 2, 3]):
        with pytest.raises(InvalidArgumentError, match="^slot_indices: must be a 1-D tensor of at most 4 ready pages"):
            rig.manager.load(handle, bad)
    for bad in ("yes", 1, None):  # before: any truthy value loaded layer by layer
        with pytest.raises(ArgumentTypeError, match=rf"^layer_by_layer: must be a bool, got {bad!r}$"):
            rig.manager.load(handle, rig.slots(b)[:16], layer_by_layer=bad)
    assert rig.copy_stream.pending == [] and bool((rig.stacked[:, :, rig.slots(b)] == -1).all())
    rig.manager.load(handle, rig.slots(b)[:16])
    with pytest.raises(InvalidArgumentError, match="^handle: was loaded already"):
        rig.manager.load(handle, rig.slots(b)[:16])
    with pytest.raises(InvalidArgumentError, match="^req: rid='b' has a prefetch|^req: rid='b' has offloaded pages"):
        rig.manager.prefetch(b)
    with pytest.raises(InvalidArgumentError, match="^policy: must be one of"):
        rig.manager.prefetch(follow_up(rig, "c", range(18)), policy="eager")
    with pytest.raises(InvalidArgumentError, match="^timeout_s: must be a positive number"):
        rig.manager.prefetch(follow_up(rig, "d", range(18)), policy="timeout")


def test_a_released_request_cannot_prefetch_or_load():
    rig = make_rig(page_size=PAGE, store_prompt=True)
    stored_request(rig)
    b = follow_up(rig, "b", range(18))
    handle = rig.manager.prefetch(b)
    assert handle.wait(5.0)
    rig.manager.abort(b)
    with pytest.raises(InvalidArgumentError, match="^handle: was cancelled"):
        rig.manager.load(handle, rig.slots(b)[:16] if rig.slots.holds(b) else torch.arange(16))
    with pytest.raises(InvalidArgumentError, match="^req: rid='b' has ended"):
        rig.manager.prefetch(b)


def test_prefetch_policies_say_when_the_engine_may_load():
    rig = make_rig(page_size=PAGE, store_prompt=True, store_workers=StoreWorkers(read_threads=3))
    stored_request(rig)
    gate = threading.Event()
    original_get = rig.storage.get

    def slow_get(keys, into):
        gate.wait(5.0)
        return original_get(keys, into)

    rig.storage.get = slow_get
    handles = {}
    for policy, timeout in (("best_effort", None), ("wait_complete", None), ("timeout", 0.05)):
        handles[policy] = rig.manager.prefetch(follow_up(rig, policy, range(18)), policy=policy, timeout_s=timeout)
    assert handles["best_effort"].ready_to_load() and handles["best_effort"].pages_ready == 0
    assert not handles["wait_complete"].ready_to_load()
    time.sleep(0.06)
    assert handles["timeout"].ready_to_load() and not handles["wait_complete"].ready_to_load()
    gate.set()
    for handle in handles.values():
        assert handle.wait(5.0)
    assert all(h.ready_to_load() and h.pages_ready == 4 for h in handles.values())
    for handle in handles.values():
        rig.manager.cancel(handle)
    rig.manager.poll()
    assert rig.host_pool.used == 0


def test_layer_by_layer_load_completes_each_layer_on_its_own_event():
    rig = make_rig(page_size=PAGE, num_layers=3, store_prompt=True)
    a = stored_request(rig)
    b = follow_up(rig, "b", range(18))
    handle = rig.manager.prefetch(b)
    assert handle.wait(5.0)
    load = rig.manager.load(handle, rig.slots(b)[:16], layer_by_layer=True)
    assert len(rig.copy_stream.pending) == 3 and rig.manager.in_flight(b) == 1
    slots_b = rig.slots(b)[:16]
    expected = rig.expected_rows(a, 0, 16)
    for layer in range(3):
        assert not load.layer_handle(layer).query()
        assert bool((rig.stacked[:, layer, slots_b] == -1).all())  # not copied before its event
        rig.copy_stream.complete(0)
        assert load.layer_handle(layer).query()
        assert torch.equal(rows_at(rig, slots_b, slice(layer, layer + 1)), expected[:, :, layer : layer + 1])
        if layer + 1 < 3:
            assert bool((rig.stacked[:, layer + 1 :, slots_b] == -1).all())
    rig.manager.poll()
    assert load.done() and rig.manager.in_flight(b) == 0 and rig.host_pool.used == 0
    with pytest.raises(InvalidArgumentError, match=r"^layer: must be an int in \[0, 3\)"):
        load.layer_handle(3)


def test_a_slow_copy_never_lets_a_layer_be_read_before_its_event():
    """A real copy stream whose scatters are slowed: a forward pass on another thread waits for
    each layer's event and then reads that layer; it must never see an unwritten slot."""
    from kvstage.kernels import transfer

    rig = make_rig(
        page_size=PAGE, num_layers=4, store_prompt=True, copy_stream=CopyStream("cpu"), store_workers=StoreWorkers()
    )
    a = stored_request(rig)
    b = follow_up(rig, "b", range(18))
    handle = rig.manager.prefetch(b)
    assert handle.wait(5.0)
    original = transfer.scatter

    def slow_scatter(*args, **kwargs):
        time.sleep(0.02)
        return original(*args, **kwargs)

    import kvstage.offload.copier as copier_module

    copier_module.scatter = slow_scatter
    try:
        load = rig.manager.load(handle, rig.slots(b)[:16], layer_by_layer=True)
        seen = []

        expected = rig.expected_rows(a, 0, 16)

        def forward():
            for layer in range(4):
                load.wait_layer(layer)
                rows = rows_at(rig, rig.slots(b)[:16], slice(layer, layer + 1))
                seen.append(not torch.equal(rows, expected[:, :, layer : layer + 1]))

        reader = threading.Thread(target=forward)
        reader.start()
        reader.join(10.0)
    finally:
        copier_module.scatter = original
    assert seen == [False] * 4
    rig.manager.drain()
    rig.manager.close()


def test_prefetch_runs_off_the_engines_thread():
    rig = make_rig(page_size=PAGE, store_prompt=True, store_workers=StoreWorkers())
    stored_request(rig)
    threads = []
    original_get = rig.storage.get

    def get(keys, into):
        threads.append(threading.current_thread().name)
        return original_get(keys, into)

    rig.storage.get = get
    handle = rig.manager.prefetch(follow_up(rig, "b", range(18)))
    assert handle.wait(5.0)
    assert threads and all(name.startswith("kvstage-store-read") for name in threads)


def test_a_store_answering_too_few_keys_to_a_lookup_is_an_error():
    rig = make_rig(page_size=PAGE, store_prompt=True)
    stored_request(rig)
    rig.storage.exists = lambda keys: [True]
    with pytest.raises(StorageError, match=r"exists\(\) answered 1 keys of 4"):
        rig.manager.match_prefix(token_ids=list(range(16)))
    handle = rig.manager.prefetch(follow_up(rig, "b", range(18)))
    assert handle.wait(5.0)
    assert handle.pages_ready == 0 and isinstance(handle.error, StorageError)


def test_manual_stream_records_the_producer_event_of_each_copy():
    class Event:
        def synchronize(self):
            pass

    stream = ManualCopyStream()
    producer = Event()
    rig = make_rig(page_size=PAGE, store_prompt=True, copy_stream=stream, producer=producer)
    req = rig.new_request("r", range(8), 4)
    rig.decode(req, 1)
    mine = Event()
    rig.manager.offload(req, after=mine)  # per call
    rig.decode(req, 2)
    rig.decode(req, 3)
    rig.decode(req, 4)
    rig.decode(req, 5)
    rig.manager.offload(req)  # the manager's default producer
    assert stream.afters == [mine, producer]


def test_cpu_copy_stream_waits_for_the_producer_before_copying():
    order = []

    class SlowProducer:
        def synchronize(self):
            time.sleep(0.05)
            order.append("producer done")

    stream = CopyStream("cpu")
    handle = stream.submit(lambda: order.append("copy"), after=SlowProducer())
    handle.synchronize()
    stream.close()
    assert order == ["producer done", "copy"]


def test_nvtx_ranges_cover_lookup_prefetch_and_load():
    from kvstage.nvtx_ranges import open_ranges

    rig = make_rig(page_size=PAGE, store_prompt=True)
    stored_request(rig)
    seen = {}
    original_exists, original_get = rig.storage.exists, rig.storage.get

    def exists(keys):
        seen.setdefault("exists", open_ranges())
        return original_exists(keys)

    def get(keys, into):
        seen["get"] = open_ranges()
        return original_get(keys, into)

    rig.storage.exists, rig.storage.get = exists, get
    b = follow_up(rig, "b", range(18))
    rig.manager.match_prefix(b)
    handle = rig.manager.prefetch(b)  # inline workers: the read runs inside prefetch()
    original_scatter_submit = rig.copy_stream.submit

    def submit(copy, **options):
        seen["load"] = open_ranges()
        return original_scatter_submit(copy, **options)

    rig.copy_stream.submit = submit
    rig.manager.load(handle, rig.slots(b)[:16])
    assert seen == {"exists": ("lookup",), "get": ("prefetch", "prefetch.read"), "load": ("load",)}


def test_abort_during_a_load_waits_for_it_and_releases_within_the_call():
    rig = make_rig(page_size=PAGE, store_prompt=True)
    a = stored_request(rig)
    b = follow_up(rig, "b", range(18))
    handle = rig.manager.prefetch(b)
    assert handle.wait(5.0)
    rig.manager.load(handle, rig.slots(b)[:16])
    assert rig.copy_stream.pending and rig.released == [a]
    rig.manager.abort(b)
    # The queued load ran before abort returned (nothing of b written afterwards), and b is released.
    assert rig.copy_stream.pending == [] and rig.released == [a, b] and rig.host_pool.used == 0


def test_abort_collects_only_its_own_loads_and_launches_nothing_of_other_requests():
    # Found by the state machine on a fresh example database: abort() ran a whole poll(), which
    # launched another finished request's waiting pages from inside abort.
    rig = make_rig(page_size=PAGE, store_prompt=True, num_host_pages=6)
    stored_request(rig)
    b = follow_up(rig, "b", range(18))
    handle = rig.manager.prefetch(b)
    assert handle.wait(5.0)
    rig.manager.load(handle, rig.slots(b)[:16])  # holds 4 of the 6 host pages until collected
    c = rig.new_request("c", range(40, 60), 8)  # 20 tokens with KV: 5 whole pages
    rig.decode(c, 1)
    c.done = True
    assert rig.manager.finish(c)  # 2 pages launched, 3 wait for host pages
    launched = rig.manager.metrics.pages_launched
    rig.manager.abort(b)
    assert rig.released[-1] is b  # released within the call ...
    assert rig.manager.metrics.pages_launched == launched  # ... and nothing of c launched by it
    rig.copy_stream.complete_all()
    rig.manager.drain()
    assert rig.released[-1] is c and rig.host_pool.used == 0


def test_load_with_float_slot_indices_changes_nothing(stored_rig):
    """``load`` with float slot indices raises naming ``slot_indices`` and leaves the handle loadable:
    the engine's retry with the right tensor loads and the pages are freed."""
    rig = stored_rig
    req, handle = prefetched(rig)
    with pytest.raises(ArgumentTypeError, match=r"^slot_indices"):
        rig.manager.load(handle, rig.slots(req)[:8].float())
    assert not handle.loaded and handle.ready_to_load()
    rig.manager.load(handle, rig.slots(req)[:8])  # the engine retries with the right tensor
    rig.copy_stream.complete_all()
    req.done = True
    rig.manager.finish(req)
    rig.manager.drain()
    assert rig.host_pool.used == 0


def test_finish_of_a_request_whose_prefetch_was_never_loaded_frees_its_host_pages(stored_rig):
    """A request whose finished prefetch is never loaded (the engine computes the prompt instead):
    ``finish`` releases it and frees the prefetch's host pages."""
    rig = stored_rig
    req, _ = prefetched(rig)  # the engine decides to compute the prompt instead (e.g. the wait was too long)
    req.done = True
    rig.manager.finish(req)
    rig.manager.drain()
    assert rig.released[-1] is req
    assert rig.host_pool.used == 0


def test_offload_between_prefetch_and_load_is_refused(stored_rig):
    """``offload`` of a request between its prefetch and its load: refused (either call may refuse;
    not both succeed)."""
    rig = stored_rig
    req, handle = prefetched(rig)
    with pytest.raises(InvalidArgumentError):
        rig.manager.offload(req)  # either call may refuse: the point is that not both succeed
        rig.manager.load(handle, rig.slots(req)[:8])


def test_cancel_of_another_managers_handle_is_refused():
    """``cancel`` of a handle another manager made is refused naming ``handle``."""
    one, two = make_stored_rig(), make_stored_rig()
    req, handle = prefetched(one)
    with pytest.raises(InvalidArgumentError, match=r"^handle"):
        two.manager.cancel(handle)
    one.manager.load(handle, one.slots(req)[:8])


def test_a_prefetch_that_raises_leaves_the_request_untracked():
    """A prefetch of a prompt with a negative token id raises naming the token and the rid, and leaves
    the request untracked."""
    rig = make_rig(page_size=2, store_prompt=True)
    req = SimpleRequest("p", [1, 2, -1, 4, 5])
    with pytest.raises(InvalidArgumentError, match=r"^origin_input_ids\[2\]: rid='p'"):
        rig.manager.prefetch(req)
    assert not rig.manager.is_tracked(req) and rig.manager.requests_live == 0


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_store_then_load_is_byte_exact_for_mla_and_float8(mla, dtype):
    """MHA and MLA pools of bfloat16, float8_e4m3fn and float8_e5m2: a store then a load gives back the
    same bytes."""
    g = torch.Generator().manual_seed(0)

    def buffer(shape):
        return (
            torch.randint(0, 120, shape, generator=g, dtype=torch.uint8).view(dtype)
            if dtype.itemsize == 1
            else torch.randn(shape, generator=g).to(dtype)
        )

    pool = (
        KVPool.mla([buffer((256, 1, 32)) for _ in range(2)])
        if mla
        else KVPool.mha([buffer((256, 2, 16)) for _ in range(2)], [buffer((256, 2, 16)) for _ in range(2)])
    )
    store = open_storage("memory", LayoutFingerprint.of(pool, page_size=8, model_id="m"))
    slots = SlotTable(256, generator=torch.Generator().manual_seed(0))
    manager = OffloadManager(
        pool, HostPool.like(pool, num_pages=16, page_size=8), store, PageHasher(page_size=8), slots, backend="torch"
    )
    a, b = SimpleRequest("a", range(25), [7]), SimpleRequest("b", range(25))
    slots.assign(a, 26)
    a.done = True
    manager.finish(a)
    manager.drain()
    handle = manager.prefetch(b, policy="wait_complete")
    handle.wait()
    load = manager.load(handle, slots.assign(b, handle.tokens_ready))
    load.wait()
    assert load.num_pages == 3 and load.error is None
    for t in pool.tensors():
        assert torch.equal(t[slots(a)[:24]].view(torch.uint8), t[slots(b)[:24]].view(torch.uint8))
    manager.close()


def test_abort_during_a_load_releases_within_the_call_with_nothing_in_flight(stored_rig):
    """``abort`` during a layer-by-layer load releases within the call with nothing in flight; a second
    ``abort`` and a ``finish`` after it release nothing again."""
    rig = stored_rig
    req, handle = prefetched(rig)
    rig.manager.load(handle, rig.slots(req)[:8], layer_by_layer=True)
    rig.manager.abort(req)
    assert rig.released[-1] is req and not rig.copy_stream.pending and rig.host_pool.used == 0
    rig.manager.abort(req)
    rig.manager.finish(req)
    assert sum(r is req for r in rig.released) == 1


def test_cancel_twice_then_load_is_refused_and_frees_the_pages(stored_rig):
    """``cancel`` twice, then ``load`` of the cancelled handle: refused naming ``handle``, its pages freed."""
    rig = stored_rig
    req, handle = prefetched(rig)
    rig.manager.cancel(handle)
    rig.manager.cancel(handle)
    with pytest.raises(InvalidArgumentError, match=r"^handle: was cancelled"):
        rig.manager.load(handle, rig.slots(req)[:8])
    rig.manager.poll()
    assert rig.host_pool.used == 0


def test_loading_more_pages_than_ready_or_another_managers_handle_is_refused():
    """``load`` of more slots than the ready pages, or of another manager's handle: each refused naming
    the argument; the right load still works."""
    one, two = make_stored_rig(), make_stored_rig()
    req, handle = prefetched(one)
    with pytest.raises(InvalidArgumentError, match=r"^slot_indices: must be a 1-D tensor of at most 4 ready pages"):
        one.manager.load(handle, one.slots(req)[:10])
    two.slots.assign(req, 12)
    with pytest.raises(InvalidArgumentError, match=r"^handle: .*not this manager's"):
        two.manager.load(handle, two.slots(req)[:8])
    assert one.manager.load(handle, one.slots(req)[:8]).num_pages == 4


@pytest.mark.parametrize("layer_by_layer", [True, False])
def test_wait_layer_on_a_load_of_no_pages_returns(layer_by_layer):
    """A prefetch whose lookup missed, loaded with zero pages: ``wait_layer`` of every layer returns
    (found integrating a real model)."""
    page_size = 4
    kv_pool = KVPool.mha([torch.zeros(64, 2, 8) for _ in range(2)], [torch.zeros(64, 2, 8) for _ in range(2)])
    host_pool = HostPool.like(kv_pool, num_pages=8, page_size=page_size)
    storage = open_storage("memory", LayoutFingerprint.of(kv_pool, page_size=page_size, model_id="m"))
    slots = SlotTable(64)
    manager = OffloadManager(kv_pool, host_pool, storage, PageHasher(page_size=page_size), slots, backend="torch")
    req = SimpleRequest("b", list(range(18)))  # nothing stored: the lookup misses
    handle = manager.prefetch(req, policy="wait_complete")
    handle.wait()
    manager.poll()
    assert handle.ready_to_load() and handle.pages_ready == 0
    load = manager.load(handle, slots.assign(req, handle.tokens_ready), layer_by_layer=layer_by_layer)
    assert load.num_pages == 0 and load.done()
    try:
        for layer in range(kv_pool.num_layers):  # what the forward pass does before each layer's attention
            load.wait_layer(layer)
    finally:
        manager.abort(req)
        manager.close()


class UnreadableStore(MemoryStore):
    """A memory store whose ``get`` misses one key it holds (a page that ``exists`` but cannot be
    read: a file store's corrupted file)."""

    unreadable = ""

    def _get(self, full_keys, into):
        hits = super()._get(full_keys, into)
        return [hit and key != self.unreadable for key, hit in zip(full_keys, hits)]  # page keys


def test_a_loaded_prefetch_whose_read_stopped_at_an_unreadable_page_counts_as_a_prefetch_failure():
    """A lookup of 4 pages whose read stops at an unreadable third page (a file store's corrupted
    file), loaded with the 2 ready: ``metrics.prefetch_failures`` counts it (found by the replay)."""
    kv_pool = KVPool.mha([torch.zeros(32, 1, 8, dtype=torch.float16)], [torch.zeros(32, 1, 8, dtype=torch.float16)])
    host_pool = HostPool.like(kv_pool, num_pages=8, page_size=PAGE)
    storage = UnreadableStore(LayoutFingerprint.of(kv_pool, page_size=PAGE, model_id="findings"), capacity_pages=8)
    hasher = PageHasher("sglang-v1", PAGE)
    tokens = list(range(1, 18))  # 4 whole pages looked up (the last token is left out)
    keys = hasher.prefill_keys(tokens[:16])
    storage.put(keys, [host_pool.page(page) for page in range(4)])
    storage.unreadable = keys[2]
    manager = OffloadManager(kv_pool, host_pool, storage, hasher, lambda req: torch.arange(32), backend="torch")
    try:
        handle = manager.prefetch(SimpleRequest("r", tokens), policy="wait_complete")
        assert handle.wait(10.0)
        assert (handle.pages_hit, handle.pages_ready) == (4, 2)  # the read stopped before the lookup's end
        manager.load(handle, torch.arange(2 * PAGE))
        manager.poll()
        metrics = manager.metrics
        assert (metrics.prefetches, metrics.pages_hit, metrics.pages_prefetched) == (1, 4, 2)
        # OffloadMetrics.prefetch_failures: "reads that raised or hit a hole before the lookup's end".
        assert metrics.prefetch_failures == 1
    finally:
        manager.close()
