"""An engine developer trying to break the engine-facing API: misuse the way a real engine would.

The first group failed before their fixes (each the smallest case of a problem found this
way); the second group are attacks the library handled from the start.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.hashing import PageHasher
from kvstage.kernels import KVPool
from kvstage.offload import CopyStream, HostPool, OffloadManager
from kvstage.offload.testing import SimpleRequest, SlotTable
from kvstage.storage import LayoutFingerprint, open_storage

from offload_rig import make_rig

PROMPT = list(range(1, 10))  # 9 tokens: 4 whole pages of 2 (a lookup asks all but the last token)


def stored_rig(**kwargs):
    """A rig (page 2, the manager stores prompts) whose store holds request 'a''s 4 prompt pages."""
    rig = make_rig(page_size=2, store_prompt=True, **kwargs)
    a = rig.new_request("a", PROMPT, 4)
    rig.manager.offload(a)
    rig.copy_stream.complete_all()
    rig.manager.poll()
    a.done = True
    rig.manager.finish(a)
    rig.copy_stream.complete_all()
    rig.manager.drain()
    assert rig.manager.metrics.pages_stored == 4 and rig.host_pool.used == 0
    return rig


def prefetched(rig, rid="b"):
    """A request with PROMPT whose prefetch of the 4 stored pages has finished, and 12 slots."""
    req = SimpleRequest(rid, PROMPT)
    handle = rig.manager.prefetch(req, policy="wait_complete")
    handle.wait()
    rig.manager.poll()
    assert handle.pages_ready == 4
    rig.slots.assign(req, 12)
    return req, handle


# -- problems found, now fixed ------------------------------------------------------------------------------


def test_load_with_float_slot_indices_changes_nothing():
    rig = stored_rig()
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


def test_finish_of_a_request_whose_prefetch_was_never_loaded_frees_its_host_pages():
    rig = stored_rig()
    req, _ = prefetched(rig)  # the engine decides to compute the prompt instead (e.g. the wait was too long)
    req.done = True
    rig.manager.finish(req)
    rig.manager.drain()
    assert rig.released[-1] is req
    assert rig.host_pool.used == 0


def test_offload_between_prefetch_and_load_is_refused():
    rig = stored_rig()
    req, handle = prefetched(rig)
    with pytest.raises(InvalidArgumentError):
        rig.manager.offload(req)  # either call may refuse: the point is that not both succeed
        rig.manager.load(handle, rig.slots(req)[:8])


def test_cancel_of_another_managers_handle_is_refused():
    one, two = stored_rig(), stored_rig()
    req, handle = prefetched(one)
    with pytest.raises(InvalidArgumentError, match=r"^handle"):
        two.manager.cancel(handle)
    one.manager.load(handle, one.slots(req)[:8])


def test_an_after_that_is_no_event_or_stream_is_an_error_of_the_call():
    rig = make_rig(page_size=2, store_prompt=True, copy_stream=CopyStream("cpu"))
    req = rig.new_request("a", PROMPT, 4)
    try:
        with pytest.raises(ArgumentTypeError, match=r"^after"):
            rig.manager.offload(req, after="garbage")
        assert rig.host_pool.used == 0
    finally:
        rig.manager.drain()
        rig.copy_stream.close()


def test_offload_after_close_is_a_clear_error():
    rig = make_rig(page_size=2, store_prompt=True, copy_stream=CopyStream("cpu"), store_workers=None)
    rig.manager.close()
    req = rig.new_request("a", PROMPT, 4)
    try:
        with pytest.raises(InvalidArgumentError, match="close"):
            rig.manager.offload(req)
    finally:
        rig.copy_stream.close()
    assert rig.manager.metrics.pages_launched == 0


def test_a_prefetch_that_raises_leaves_the_request_untracked():
    rig = make_rig(page_size=2, store_prompt=True)
    req = SimpleRequest("p", [1, 2, -1, 4, 5])
    with pytest.raises(InvalidArgumentError, match=r"^origin_input_ids\[2\]: rid='p'"):
        rig.manager.prefetch(req)
    assert not rig.manager.is_tracked(req) and rig.manager.requests_live == 0


def test_prefetch_with_store_prompt_false_loads_the_prefill_sides_pages_and_the_chain_continues():
    rig = make_rig(page_size=2)  # store_prompt=False: the rig's prefill side stores prompts
    a = rig.new_request("a", PROMPT, 4)
    b = SimpleRequest("b", PROMPT)
    rig.slots.assign(b, len(PROMPT) + 4)
    handle = rig.manager.prefetch(b)
    assert handle.wait(5.0)
    assert handle.pages_ready == (len(PROMPT) - 1) // 2 and rig.manager.is_tracked(b)
    rig.manager.load(handle, rig.slots(b)[: handle.tokens_ready])
    rig.copy_stream.complete_all()
    rig.manager.poll()
    assert rig.manager.offloaded_length(b) == len(PROMPT) // 2 * 2  # the prefill side's pages
    assert torch.equal(rig.stacked[:, :, rig.slots(b)[:4]], rig.stacked[:, :, rig.slots(a)[:4]])


def test_out_of_range_slots_are_an_error_of_offload_itself():
    rig = make_rig(page_size=2, store_prompt=True)
    req = rig.new_request("a", PROMPT, 4)
    rig.manager.slot_indices_of = lambda r: torch.full((16,), 10_000)
    with pytest.raises(InvalidArgumentError, match=r"^slot_indices_of\(rid='a'\)"):
        rig.manager.offload(req)
    assert rig.host_pool.used == 0 and not rig.copy_stream.pending


def test_a_hasher_class_instead_of_an_instance_is_named_as_such():
    rig = make_rig(page_size=2)
    with pytest.raises(ArgumentTypeError, match=r"^hasher"):
        OffloadManager(rig.kv_pool, rig.host_pool, rig.storage, PageHasher, rig.slots)


def test_host_pool_free_of_a_numpy_page_id():
    pool = HostPool.like(make_rig(page_size=2).kv_pool, num_pages=4, page_size=2, pin=False)
    ids = pool.alloc(1)
    pool.free([np.int64(ids[0])])
    assert pool.used == 0


# -- attacks the library handled -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["strided", "offset", "int32"])
def test_slot_views_from_slot_indices_of_store_the_right_bytes(kind):
    rig = make_rig(page_size=4, store_prompt=True, slot_generator=torch.Generator().manual_seed(1))
    req = rig.new_request("a", list(range(1, 18)), 8)
    row = rig.slots(req)
    if kind == "strided":
        view = torch.stack([torch.zeros_like(row), row, torch.zeros_like(row)], 1)[:, 1]
        assert not view.is_contiguous()
    elif kind == "offset":
        view = torch.cat([torch.tensor([999, 998, 997]), row])[3:]
    else:
        view = row.to(torch.int32)
    rig.manager.slot_indices_of = lambda r: view
    for token in range(100, 106):
        rig.decode(req, token)
        rig.manager.offload(req)
    req.done = True
    rig.manager.finish(req)
    rig.copy_stream.complete_all()
    rig.manager.drain()
    keys = rig.chain(req)
    page = torch.empty(rig.host_pool.page_shape, dtype=torch.int32)
    for index, key in enumerate(keys):
        assert rig.storage.get([key], [page]) == [True]
        assert torch.equal(page, rig.expected_page(req, index)), index
    assert rig.manager.metrics.pages_stored == len(keys) == 5


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_store_then_load_is_byte_exact_for_mla_and_float8(mla, dtype):
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


@pytest.mark.parametrize("kind", ["tuple", "numpy-output", "numpy-prompt", "tensor-prompt"])
def test_sequence_types_of_a_request_give_the_same_keys(kind):
    rig = make_rig(page_size=4, store_prompt=True)
    req = rig.new_request("a", PROMPT, 8)
    for token in range(100, 106):
        rig.decode(req, token)
    expected = rig.chain(req)
    if kind == "tuple":
        req.output_ids = tuple(req.output_ids)
    elif kind == "numpy-output":
        req.output_ids = np.array(req.output_ids, dtype=np.int64)
    elif kind == "numpy-prompt":
        req.origin_input_ids = np.array(req.origin_input_ids)
    else:
        req.origin_input_ids = torch.tensor(req.origin_input_ids)
    req.done = True
    rig.manager.finish(req)
    rig.copy_stream.complete_all()
    rig.manager.drain()
    assert rig.storage.exists(expected) == [True, True, True]
    assert rig.manager.match_prefix(SimpleRequest("b", PROMPT)).num_pages == 2


def test_abort_during_a_load_releases_within_the_call_with_nothing_in_flight():
    rig = stored_rig()
    req, handle = prefetched(rig)
    rig.manager.load(handle, rig.slots(req)[:8], layer_by_layer=True)
    rig.manager.abort(req)
    assert rig.released[-1] is req and not rig.copy_stream.pending and rig.host_pool.used == 0
    rig.manager.abort(req)
    rig.manager.finish(req)
    assert sum(r is req for r in rig.released) == 1


def test_cancel_twice_then_load_is_refused_and_frees_the_pages():
    rig = stored_rig()
    req, handle = prefetched(rig)
    rig.manager.cancel(handle)
    rig.manager.cancel(handle)
    with pytest.raises(InvalidArgumentError, match=r"^handle: was cancelled"):
        rig.manager.load(handle, rig.slots(req)[:8])
    rig.manager.poll()
    assert rig.host_pool.used == 0


def test_loading_more_pages_than_ready_or_another_managers_handle_is_refused():
    one, two = stored_rig(), stored_rig()
    req, handle = prefetched(one)
    with pytest.raises(InvalidArgumentError, match=r"^slot_indices: must be a 1-D tensor of at most 4 ready pages"):
        one.manager.load(handle, one.slots(req)[:10])
    two.slots.assign(req, 12)
    with pytest.raises(InvalidArgumentError, match=r"^handle: .*not this manager's"):
        two.manager.load(handle, two.slots(req)[:8])
    assert one.manager.load(handle, one.slots(req)[:8]).num_pages == 4


def test_two_requests_with_one_rid_keep_their_keys_and_releases_apart():
    rig = make_rig(page_size=2, store_prompt=True)
    old = rig.new_request("x", [1, 2, 3, 4, 5], 4)
    rig.manager.offload(old)
    rig.manager.abort(old)  # its gather is still in flight
    new = rig.new_request("x", [9, 8, 7, 6, 5], 4)
    rig.manager.offload(new)
    rig.copy_stream.complete_all()
    rig.manager.poll()
    assert rig.released == [old]
    new.done = True
    rig.manager.finish(new)
    rig.manager.drain()
    assert rig.released == [old, new]
    # an abort keeps what it launched (issue 17): both chains stored, apart
    assert rig.storage.exists(rig.chain(new)) == [True, True] and rig.storage.exists(rig.chain(old)) == [True, True]
    assert rig.chain(new) != rig.chain(old)
    m = rig.manager.metrics
    assert (m.pages_stored, m.pages_discarded) == (4, 0)


def test_a_long_prompt_with_a_small_host_pool_prefetches_what_fits_and_the_chain_continues():
    rig = make_rig(page_size=2, store_prompt=True, num_host_pages=4)
    a = rig.new_request("a", list(range(1, 42)), 4)
    a_slots = rig.slots(a)[:8].clone()  # freed at a's release
    a_kv = rig.stacked[:, :, a_slots].clone()
    for _ in range(10):
        rig.manager.offload(a)
        rig.copy_stream.complete_all()
        rig.manager.poll()
    a.done = True
    rig.manager.finish(a)
    rig.copy_stream.complete_all()
    rig.manager.drain()
    assert rig.manager.metrics.pages_stored == 20
    b = SimpleRequest("b", list(range(1, 42)))
    handle = rig.manager.prefetch(b, policy="wait_complete")
    handle.wait()
    # the lookup wants 20, the host pool holds 4: 4 read, 16 counted truncated (issue 17)
    assert (handle.pages_wanted, handle.num_host_pages, handle.pages_ready) == (20, 4, 4)
    rig.slots.assign(b, 45)
    rig.manager.load(handle, rig.slots(b)[:8])
    rig.copy_stream.complete_all()
    assert torch.equal(rig.stacked[:, :, rig.slots(b)[:8]], a_kv)
    rig._write_kv(b, 8, 41)
    b.output_ids.append(5)
    for _ in range(10):
        rig.manager.offload(b)
        rig.copy_stream.complete_all()
        rig.manager.poll()
    b.done = True
    rig.manager.finish(b)
    rig.manager.drain()
    m = rig.manager.metrics
    assert (m.pages_stored, m.pages_deduplicated, m.pages_failed, m.host_pages_used) == (20, 16, 0, 0)
