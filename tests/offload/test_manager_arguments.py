"""The manager's argument checks on their own: each names the argument and the rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
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
