"""The manager's argument checks, on their own and through OffloadManager's calls: each names the
argument and the rule, before anything changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.hashing import PageHasher
from kvstage.kernels import KVPool
from kvstage.kv_layout import KVLayout
from kvstage.offload import CopyStream, HostPool, OffloadManager
from kvstage.offload.load_path import PrefetchHandle
from kvstage.offload.manager_arguments import (
    check_after,
    check_prefetch_arguments,
    check_prefetch_handle,
    check_prefetch_request,
    checked_kv_length,
    checked_load_pages,
    pending_prefetch_error,
)
from kvstage.offload.request_state import RequestState
from kvstage.offload.testing import SimpleRequest
from kvstage.storage import LayoutFingerprint, MemoryStore

from offload_rig import STORED_PROMPT, make_rig

PAGE = 4


def request():
    return SimpleRequest("r", list(range(10)), [50, 51, 52])  # 13 tokens, 12 with KV


def test_kv_length_defaults_to_the_requests_and_accepts_integer_scalars():
    req = request()
    assert checked_kv_length(req, None, 0) == 12
    assert checked_kv_length(req, np.int64(13), 0) == 13
    assert checked_kv_length(req, torch.tensor(8), 8) == 8


@pytest.mark.parametrize(
    ("kv_length", "launched", "message"),
    [
        (-1, 0, r"^kv_length: must be an int >= 0 .*got -1$"),
        (2.0, 0, r"^kv_length: must be an int >= 0 .*got 2.0$"),
        (14, 0, r"^kv_length: 14 exceeds the 13 tokens of rid='r' \(prompt and output\)$"),
        (7, 8, r"^kv_length: 7 is below the 8 tokens of rid='r' launched already"),
    ],
)
def test_bad_kv_length_names_the_rule(kv_length, launched, message):
    with pytest.raises(InvalidArgumentError, match=message):
        checked_kv_length(request(), kv_length, launched)


class SynchronizingStream:
    """What a CPU copy stream accepts as ``after``: anything with ``synchronize()``."""

    def synchronize(self) -> None:
        """Nothing to wait for."""


def test_after_must_be_none_or_something_with_synchronize():
    check_after(None, "after")
    check_after(SynchronizingStream(), "after")
    with pytest.raises(ArgumentTypeError, match=r"^producer: must be None, a torch.cuda.Event .*got int$"):
        check_after(3, "producer")


def test_prefetch_arguments():
    check_prefetch_arguments("best_effort", None, None)
    check_prefetch_arguments("timeout", 0.5, 2)
    with pytest.raises(InvalidArgumentError, match=r"^policy: must be one of"):
        check_prefetch_arguments("eager", None, None)
    with pytest.raises(
        InvalidArgumentError, match=r"^timeout_s: must be a positive number of seconds for policy 'timeout', got 0$"
    ):
        check_prefetch_arguments("timeout", 0, None)
    with pytest.raises(InvalidArgumentError, match=r"^min_pages: must be None or an int >= 1, got True$"):
        check_prefetch_arguments("best_effort", None, True)
    for policy in ("best_effort", "wait_complete"):  # a timeout no policy reads: it was ignored
        with pytest.raises(
            InvalidArgumentError,
            match=rf"^timeout_s: is read by policy 'timeout' only: must be None with policy '{policy}', got 5$",
        ):
            check_prefetch_arguments(policy, 5, None)


def test_prefetch_request_rules():
    req = request()
    check_prefetch_request(req, None, False, 3, 3, 3)
    check_prefetch_request(req, RequestState(req, 0), False, 3, None, 3)
    with pytest.raises(
        InvalidArgumentError,
        match=r"^min_pages: 4 of the 5 pages looked up can never be free: the host pool holds 3 pages$",
    ):
        check_prefetch_request(req, None, False, 5, 4, 3)
    with pytest.raises(InvalidArgumentError, match=r"^req: rid='r' has ended"):
        check_prefetch_request(req, None, True, 3, None, 3)
    offloaded = RequestState(req, 0)
    offloaded.copies_in_flight = 1
    with pytest.raises(
        InvalidArgumentError, match=r"^req: rid='r' has offloaded pages already; prefetch before it runs$"
    ):
        check_prefetch_request(req, offloaded, False, 3, None, 3)


def test_load_pages_are_whole_ready_pages_of_a_live_handle():
    req = request()
    handle = PrefetchHandle(req, "best_effort", None, ["k0", "k1", "k2"], PAGE)
    handle.pages_ready = 2
    state = RequestState(req, 0)
    state.prefetch = handle
    assert checked_load_pages(handle, state, torch.arange(8), PAGE) == 2
    assert checked_load_pages(handle, state, torch.arange(0), PAGE) == 0
    with pytest.raises(
        InvalidArgumentError,
        match=r"^slot_indices: must be a 1-D tensor of at most 2 ready pages x 4 slots, got \(12,\)$",
    ):
        checked_load_pages(handle, state, torch.arange(12), PAGE)
    with pytest.raises(InvalidArgumentError, match=r"^slot_indices: .*got \(6,\)$"):
        checked_load_pages(handle, state, torch.arange(6), PAGE)
    with pytest.raises(InvalidArgumentError, match=r"^handle: rid='r' has ended, or the handle is not this manager's$"):
        checked_load_pages(handle, None, torch.arange(8), PAGE)
    handle.loaded = True
    with pytest.raises(InvalidArgumentError, match=r"^handle: was loaded already"):
        checked_load_pages(handle, state, torch.arange(8), PAGE)


def test_an_after_that_is_no_event_or_stream_is_an_error_of_the_call():
    """``offload(after='garbage')``: an ``after`` that is no event or stream raises naming ``after``,
    with no host page taken."""
    rig = make_rig(page_size=2, store_prompt=True, copy_stream=CopyStream("cpu"))
    req = rig.new_request("a", STORED_PROMPT, 4)
    try:
        with pytest.raises(ArgumentTypeError, match=r"^after"):
            rig.manager.offload(req, after="garbage")
        assert rig.host_pool.used == 0
    finally:
        rig.manager.drain()
        rig.copy_stream.close()


def test_out_of_range_slots_are_an_error_of_offload_itself():
    """``slot_indices_of`` answering slots past the pool (10_000): ``offload`` raises naming it, before
    any host page or copy."""
    rig = make_rig(page_size=2, store_prompt=True)
    req = rig.new_request("a", STORED_PROMPT, 4)
    rig.manager.slot_indices_of = lambda r: torch.full((16,), 10_000)
    with pytest.raises(InvalidArgumentError, match=r"^slot_indices_of\(rid='a'\)"):
        rig.manager.offload(req)
    assert rig.host_pool.used == 0 and not rig.copy_stream.pending


def test_a_hasher_class_instead_of_an_instance_is_named_as_such():
    """``OffloadManager(..., PageHasher, ...)``: the class instead of an instance is an error naming ``hasher``."""
    rig = make_rig(page_size=2)
    with pytest.raises(ArgumentTypeError, match=r"^hasher"):
        OffloadManager(rig.kv_pool, rig.host_pool, rig.storage, PageHasher, rig.slots)


def _pool_and_host():
    kv_pool = KVPool.from_stacked(torch.zeros((2, 2, 16, 1, 4), dtype=torch.int32))
    return kv_pool, HostPool.like(kv_pool, num_pages=4, page_size=4)


@pytest.mark.parametrize(
    "fingerprint, field",
    [
        (LayoutFingerprint("m", KVLayout(2, 2, 1, 4, "float32"), 4), "dtype"),  # same bytes, another dtype
        (LayoutFingerprint("m", KVLayout(4, 2, 1, 4, "int32"), 2), "num_layers"),  # same bytes: 4 layers x page 2
        (LayoutFingerprint("m", KVLayout(2, 2, 2, 2, "int32"), 4), "num_heads"),  # same bytes: 2 heads x dim 2
        (LayoutFingerprint("m", KVLayout(2, 1, 2, 4, "int32"), 4), "kv_parts"),  # same bytes: MLA-shaped
    ],
    ids=["dtype", "layers-and-page", "heads-and-dim", "parts"],
)
def test_a_storage_whose_layout_differs_from_the_pools_is_rejected(fingerprint, field):
    """A storage whose fingerprint has the pool's page bytes but another layout (dtype, layers and page,
    heads and dim, parts) is refused naming the field: pages would be stored under another layout's
    prefix and read back as that layout."""
    kv_pool, host_pool = _pool_and_host()
    assert fingerprint.page_bytes == host_pool.page_bytes
    with pytest.raises(InvalidArgumentError, match=rf"storage: .*{field}"):
        OffloadManager(kv_pool, host_pool, MemoryStore(fingerprint), PageHasher(page_size=4), lambda req: None)


def test_a_storage_with_the_pools_layout_is_accepted_under_a_dtype_alias():
    """A storage fingerprint naming the pool's dtype by an alias (``half`` for float16) is accepted."""
    kv_pool = KVPool.from_stacked(torch.zeros((2, 2, 16, 1, 4), dtype=torch.float16))
    host_pool = HostPool.like(kv_pool, num_pages=4, page_size=4)
    storage = MemoryStore(LayoutFingerprint("m", KVLayout(2, 2, 1, 4, "half"), 4))
    OffloadManager(kv_pool, host_pool, storage, PageHasher(page_size=4), lambda req: None).close()


@pytest.mark.parametrize(
    "slots",
    [list(range(32)), torch.arange(32, dtype=torch.float32), torch.arange(32).view(4, 8)],
    ids=["list", "float-tensor", "2-d"],
)
def test_bad_slot_indices_are_an_error_of_offload_itself(slots):
    """Slot indices that are a list, a float tensor or 2-D: ``offload`` raises naming ``slot_indices_of``.
    On CPU the gather runs on the copy thread: without a check here a wrong slot tensor would only
    show up later as a failed copy (and a list as an AttributeError)."""
    rig = make_rig(page_size=4)
    req = rig.new_request("r", range(4), 8)
    for token in range(100, 106):
        rig.decode(req, token)
    rig.manager.slot_indices_of = lambda r: slots
    with pytest.raises(ArgumentTypeError, match=r"^slot_indices_of\(rid='r'\): must be a 1-D int32/int64 tensor"):
        rig.manager.offload(req)
    # a call that raises tracks nothing new (issue 17)
    assert rig.host_pool.used == 0 and rig.manager.offloaded_length(req) is None and not rig.copy_stream.pending


def test_a_missing_hasher_is_named():
    """``hasher=None``: the error names ``hasher`` and the type it got."""
    kv_pool, host_pool = _pool_and_host()
    storage = MemoryStore(LayoutFingerprint("m", KVLayout(2, 2, 1, 4, "int32"), 4))
    with pytest.raises(ArgumentTypeError, match=r"^hasher: must be a kvstage.hashing.PageHasher .* got NoneType"):
        OffloadManager(kv_pool, host_pool, storage, None, lambda req: None)


def test_a_prefetch_handle_check_names_the_type_it_got_and_where_handles_come_from():
    with pytest.raises(ArgumentTypeError, match=r"^handle: must be a PrefetchHandle from prefetch\(\), got dict"):
        check_prefetch_handle({}, " from prefetch()")
    with pytest.raises(ArgumentTypeError, match=r"^handle: must be a PrefetchHandle, got NoneType"):
        check_prefetch_handle(None)


def test_the_pending_prefetch_error_names_the_request_the_length_the_cause_and_the_way_out():
    cause = InvalidArgumentError("slot_indices_of(rid='r'): 0 slots, its first 12 tokens have KV")
    error = pending_prefetch_error(request(), 12, cause)
    assert isinstance(error, InvalidArgumentError)
    assert str(error) == (
        "req: rid='r' has a prefetch pending (never loaded), and its KV up to kv_length=12 cannot be offloaded "
        f"({cause}); a request that ends before it runs: abort(req) or finish(req, kv_length=0), which cancel the prefetch"
    )
