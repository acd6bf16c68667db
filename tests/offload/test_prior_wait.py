"""A ``store_prompt=False`` manager (a disaggregated decode side) puts a decode page again while
the store refuses it for a missing prior (the prefill side's last prompt page, written by
another process), up to ``prior_wait_s``; the engine's thread never waits for it."""

from __future__ import annotations

import time

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.hashing import PageHasher
from kvstage.kernels import KVPool
from kvstage.offload import HostPool, OffloadManager
from kvstage.offload.testing import SimpleRequest
from kvstage.storage import LayoutFingerprint, MissingPriorError, PutStatus, open_storage

PAGE = 4
PROMPT = list(range(1, 9))  # two whole pages: the prefill side's
NAMESPACE = {"extra_key": "lora", "cache_salt": "tenant"}


class DecodeSide:
    """A decode-side manager over a zeroed pool (every request owns slots 0..63), a memory store
    the "prefill side" writes into directly, and the callbacks' records."""

    def __init__(self, store_prompt: bool = False, **kwargs) -> None:
        pool = KVPool.mha([torch.zeros(64, 1, 4) for _ in range(2)], [torch.zeros(64, 1, 4) for _ in range(2)])
        self.storage = open_storage("memory", LayoutFingerprint.of(pool, page_size=PAGE, model_id="toy"))
        self.hasher = PageHasher(page_size=PAGE)
        self.failures, self.stored = [], []
        self.manager = OffloadManager(
            pool, HostPool.like(pool, num_pages=4, page_size=PAGE), self.storage, self.hasher, lambda req: torch.arange(64),
            store_prompt=store_prompt, on_storage_failure=lambda req, keys, error: self.failures.append((keys, error)),
            on_stored=lambda req, ok, failed: self.stored.append((ok, failed)), **kwargs,
        )
        self.prompt_keys = self.hasher.prefill_keys(PROMPT, **NAMESPACE)

    def decode_one_page(self) -> SimpleRequest:
        """A request whose first decode page (positions 8..11) is offloaded and finished; the
        manager drained (which does not wait for a write waiting for its prior)."""
        req = SimpleRequest("r", PROMPT, **NAMESPACE)
        req.output_ids.extend([20, 21, 22, 23, 24])  # KV of 8 + 4 positions: one decode page
        assert self.manager.offload(req)
        req.done = True
        self.manager.finish(req)
        self.manager.drain()
        return req

    def prefill_side_stores_the_prompt(self) -> None:
        page = torch.zeros(self.storage.page_bytes, dtype=torch.uint8)
        assert self.storage.put(self.prompt_keys, [page, page]) == [PutStatus.STORED] * 2

    def decode_key(self, req: SimpleRequest) -> str:
        return self.hasher.prefill_keys(PROMPT + req.output_ids[:4], **NAMESPACE)[2]


def test_drain_returns_while_the_page_waits_and_poll_reports_it_once_the_prior_lands():
    side = DecodeSide(prior_wait_s=30)
    req = side.decode_one_page()
    metrics = side.manager.metrics
    assert (metrics.writes_pending, metrics.pages_stored, metrics.pages_in_flight) == (1, 0, 1)  # parked, host page held
    assert side.stored == [] and side.failures == []
    side.prefill_side_stores_the_prompt()
    deadline = time.monotonic() + 30
    while not side.stored and time.monotonic() < deadline:  # the engine's idle polls
        side.manager.poll()
        time.sleep(0.01)
    assert side.stored == [(1, 0)] and side.failures == []
    assert side.storage.exists([side.decode_key(req)]) == [True]
    metrics = side.manager.metrics
    assert (metrics.pages_stored, metrics.pages_failed, metrics.host_pages_used) == (1, 0, 0)
    side.manager.close()


def test_a_prior_that_never_lands_fails_the_page_after_prior_wait_s_naming_it():
    side = DecodeSide(prior_wait_s=0.3)
    req = side.decode_one_page()
    side.manager.close()  # waits for the parked write: it fails
    ((keys, error),) = side.failures
    assert keys == [side.decode_key(req)]
    assert isinstance(error, MissingPriorError) and error.prior_key == side.prompt_keys[-1]
    assert side.prompt_keys[-1] in str(error) and "prior_wait_s=0.3" in str(error)
    assert side.stored == [(0, 1)]
    metrics = side.manager.metrics
    assert (metrics.pages_failed, metrics.storage_failures, metrics.writes_pending, metrics.host_pages_used) == (1, 1, 0, 0)


def test_flush_fails_a_parked_page_so_nothing_of_the_old_weights_lands_after_it():
    side = DecodeSide(prior_wait_s=30)
    req = side.decode_one_page()
    assert side.manager.metrics.writes_pending == 1
    started = time.monotonic()
    side.manager.flush()
    assert time.monotonic() - started < 15  # it did not wait out the 30 s
    ((keys, error),) = side.failures
    assert isinstance(error, MissingPriorError) and side.manager.metrics.writes_pending == 0
    side.prefill_side_stores_the_prompt()  # the new weights' prompt pages
    time.sleep(0.3)  # longer than the longest pause between attempts
    assert side.storage.exists([side.decode_key(req)]) == [False]
    side.manager.close()
    assert side.stored == [(0, 1)]


def test_prior_wait_s_zero_refuses_at_once():
    side = DecodeSide(prior_wait_s=0)
    side.decode_one_page()
    assert side.manager.metrics.writes_pending == 0 and len(side.failures) == 1
    assert isinstance(side.failures[0][1], MissingPriorError)
    side.manager.close()


@pytest.mark.parametrize("bad", [-1, True, "10", None])
def test_prior_wait_s_must_be_seconds(bad):
    with pytest.raises(InvalidArgumentError, match=r"^prior_wait_s: must be a number of seconds >= 0"):
        DecodeSide(prior_wait_s=bad)


def test_a_manager_that_stores_its_prompts_never_waits_for_a_prior():
    """With ``store_prompt=True`` every prior is the manager's own page or a loaded one: a
    refusal is final at once (here the loaded prefix was cleared by another process)."""
    side = DecodeSide(store_prompt=True)
    a = SimpleRequest("a", PROMPT, **NAMESPACE)
    a.output_ids.append(20)
    a.done = True
    side.manager.finish(a)
    side.manager.drain()
    b = SimpleRequest("b", PROMPT + [30], **NAMESPACE)
    handle = side.manager.prefetch(b, policy="wait_complete")
    handle.wait(5.0)
    side.manager.poll()
    load = side.manager.load(handle, torch.arange(8))
    load.wait()
    side.storage.clear()
    b.output_ids.extend([31, 32, 33, 34])  # KV of 9 + 3 positions: the page after the loaded two
    assert side.manager.offload(b)
    side.manager.drain()
    ((keys, error),) = side.failures
    assert isinstance(error, MissingPriorError) and error.prior_key == side.prompt_keys[-1]
    assert side.manager.metrics.writes_pending == 0
    side.manager.close()
