"""A ``store_prompt=False`` manager (a disaggregated decode side) puts a decode page again while
the store refuses it for a missing prior (the prefill side's last prompt page, written by
another process), up to ``prior_wait_s``; ``poll`` never waits for it, ``drain`` and ``close``
do. A page whose prior failed in this same manager (its copy or its store write) will never
have a stored prior: it fails at once, naming that page and why it failed."""

from __future__ import annotations

import errno
import threading
import time

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.hashing import PageHasher
from kvstage.kernels import KVPool
from kvstage.kv_layout import KVLayout
from kvstage.offload import HostPool, OffloadManager, StoreWorkers
from kvstage.offload.testing import SimpleRequest
from kvstage.storage import LayoutFingerprint, MemoryStore, MissingPriorError, PutStatus, PutStatuses, open_storage

from offload_rig import make_rig

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
            pool,
            HostPool.like(pool, num_pages=4, page_size=PAGE),
            self.storage,
            self.hasher,
            lambda req: torch.arange(64),
            store_prompt=store_prompt,
            on_storage_failure=lambda req, keys, error: self.failures.append((keys, error)),
            on_stored=lambda req, ok, failed: self.stored.append((ok, failed)),
            **kwargs,
        )
        self.prompt_keys = self.hasher.prefill_keys(PROMPT, **NAMESPACE)

    def decode_one_page(self, *, parked: bool = True) -> SimpleRequest:
        """A request whose first decode page (positions 8..11) is offloaded and finished; the
        engine polls until its copy is done and released and (``parked``) its write waits
        for its prior."""
        req = SimpleRequest("r", PROMPT, **NAMESPACE)
        req.output_ids.extend([20, 21, 22, 23, 24])  # KV of 8 + 4 positions: one decode page
        assert self.manager.offload(req)
        req.done = True
        self.manager.finish(req)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the engine's idle polls
            self.manager.poll()
            metrics = self.manager.metrics
            if (
                metrics.requests_live == 0
                and metrics.copies_in_flight == 0
                and (not parked or metrics.writes_parked == 1)
            ):
                return req
            time.sleep(0.005)
        raise AssertionError(f"the decode page did not park: {self.manager.metrics}")

    def prefill_side_stores_the_prompt(self) -> None:
        page = torch.zeros(self.storage.page_bytes, dtype=torch.uint8)
        assert self.storage.put(self.prompt_keys, [page, page]) == [PutStatus.STORED] * 2

    def decode_key(self, req: SimpleRequest) -> str:
        return self.hasher.prefill_keys(PROMPT + req.output_ids[:4], **NAMESPACE)[2]


def test_poll_reports_a_parked_page_once_the_prior_lands():
    side = DecodeSide(prior_wait_s=30)
    req = side.decode_one_page()
    metrics = side.manager.metrics
    assert (metrics.writes_pending, metrics.writes_parked, metrics.pages_stored, metrics.pages_in_flight) == (
        1,
        1,
        0,
        1,
    )  # host page held
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
    assert (metrics.pages_failed, metrics.storage_failures, metrics.writes_pending, metrics.host_pages_used) == (
        1,
        1,
        0,
        0,
    )


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


def test_drain_waits_for_a_parked_page_until_its_prior_lands():
    """``drain`` used to return at once with the page still parked (its host page held, 1 page
    in flight); now it returns once the write has ended, here stored when the prior lands."""
    side = DecodeSide(prior_wait_s=5)
    req = side.decode_one_page()
    threading.Timer(0.3, side.prefill_side_stores_the_prompt).start()
    started = time.monotonic()
    side.manager.drain()
    waited = time.monotonic() - started
    metrics = side.manager.metrics
    assert (metrics.writes_pending, metrics.writes_parked, metrics.pages_in_flight, metrics.host_pages_used) == (
        0,
        0,
        0,
        0,
    )
    assert (metrics.pages_stored, side.stored, side.failures) == (1, [(1, 0)], [])
    assert side.storage.exists([side.decode_key(req)]) == [True]
    assert 0.25 < waited < 4  # it waited for the prior, not for prior_wait_s
    side.manager.close()


def test_drain_waits_out_prior_wait_s_for_a_prior_that_never_lands():
    side = DecodeSide(prior_wait_s=0.3)
    req = side.decode_one_page()
    side.manager.drain()
    metrics = side.manager.metrics
    assert (metrics.writes_pending, metrics.pages_in_flight, metrics.host_pages_used, metrics.pages_failed) == (
        0,
        0,
        0,
        1,
    )
    ((keys, error),) = side.failures
    assert keys == [side.decode_key(req)] and isinstance(error, MissingPriorError)
    assert side.stored == [(0, 1)]
    side.manager.close()


def _decode_rig(storage, **kwargs):
    """A decode-side rig (``store_prompt=False``) over a chain-aware store, ``prior_wait_s=5``,
    and the failures reported with the time they came."""
    reports = []
    rig = make_rig(
        page_size=2,
        storage=storage,
        prior_wait_s=5,
        on_storage_failure=lambda req, keys, error: reports.append((time.monotonic(), keys, error)),
        **kwargs,
    )
    return rig, reports


def poll_until_reported(rig, reports, count: int, *, deadline: float) -> None:
    """Poll ``rig``'s manager until ``reports`` holds ``count`` failures or ``time.monotonic()``
    passes ``deadline``."""
    while len(reports) < count and time.monotonic() < deadline:
        rig.manager.poll()
        time.sleep(0.01)


RIG_FINGERPRINT = LayoutFingerprint("rig", KVLayout(2, 2, 1, 4, "int32"), 2)


def test_a_page_after_a_failed_copy_fails_at_once_naming_the_failed_page():
    """A decode side: page 2's device-to-host copy fails, page 3's succeeds. Page 3's write used
    to wait ``prior_wait_s`` for a prior this manager knows it never writes, holding a host page
    (and ``drain`` returned with it parked). Now it fails in the same poll, with a
    ``MissingPriorError`` naming page 2 whose cause is the copy's error."""
    storage = MemoryStore(RIG_FINGERPRINT, capacity_pages=64)
    rig, reports = _decode_rig(storage)
    req = rig.new_request("r", [1, 2, 3, 4], 20)  # prompt pages 0 and 1: the prefill side's
    decode_steps(rig, req, [5, 6, 7, 8, 9])  # KV of 8 positions: pages 2 and 3, one copy each
    broke = RuntimeError("copy broke")
    rig.copy_stream.complete(0, error=broke)
    rig.copy_stream.complete(0)
    started = time.monotonic()
    rig.manager.poll()
    poll_until_reported(rig, reports, 2, deadline=started + 3)
    keys = rig.chain(req)
    assert [report_keys for _, report_keys, _ in reports] == [[keys[2]], [keys[3]]]
    assert reports[0][2] is broke
    (at, _, error) = reports[1]
    assert at - started < 1  # at once, not after prior_wait_s=5
    assert isinstance(error, MissingPriorError) and error.prior_key == keys[2] and error.__cause__ is broke
    assert keys[2] in str(error) and "copy broke" in str(error)
    metrics = rig.manager.metrics
    assert (metrics.copy_failures, metrics.storage_failures, metrics.pages_failed, metrics.pages_stored) == (1, 1, 2, 0)
    assert (metrics.writes_pending, metrics.pages_in_flight, metrics.host_pages_used) == (0, 0, 0)
    assert storage.exists(keys[2:4]) == [False, False]
    started = time.monotonic()
    req.done = True
    rig.manager.finish(req)
    rig.manager.drain()
    assert time.monotonic() - started < 1
    assert rig.released == [req]
    rig.manager.close()


class GatedStore(MemoryStore):
    """A memory store whose put of ``failing_key`` waits for ``gate`` and then fails it with
    ``ENOSPC`` (so the next page's write is already queued behind it on the writer thread)."""

    def __init__(self, fingerprint) -> None:
        super().__init__(fingerprint, capacity_pages=64)
        self.gate = threading.Event()
        self.failing_key: str | None = None
        self.error = OSError(errno.ENOSPC, "No space left on device")

    def _put(self, full_keys, pages, full_prior_key=None):
        if self.failing_key is not None and self.failing_key in full_keys:  # page keys
            assert self.gate.wait(10)
            return PutStatuses([PutStatus.FAILED] * len(full_keys), error=self.error)
        return super()._put(full_keys, pages, full_prior_key)


def test_a_page_after_a_failed_store_write_fails_at_once_naming_the_failed_page():
    """Page 2's store write fails (``ENOSPC``) while page 3's write waits behind it on the writer
    thread: page 3 will never have a stored prior, so it fails at once (it used to wait
    ``prior_wait_s``), with a ``MissingPriorError`` naming page 2 whose cause is the store's error."""
    storage = GatedStore(RIG_FINGERPRINT)
    workers = StoreWorkers()
    rig, reports = _decode_rig(storage, store_workers=workers)
    req = rig.new_request("r", [1, 2, 3, 4], 20)
    decode_steps(rig, req, [5, 6, 7, 8, 9])
    keys = rig.chain(req)
    storage.failing_key = keys[2]
    rig.copy_stream.complete_all()
    rig.manager.poll()  # both writes submitted: page 2's waits for the gate
    started = time.monotonic()
    storage.gate.set()
    poll_until_reported(rig, reports, 2, deadline=started + 3)
    assert [report_keys for _, report_keys, _ in reports] == [[keys[2]], [keys[3]]]
    assert reports[0][2] is storage.error
    (at, _, error) = reports[1]
    assert at - started < 1  # at once, not after prior_wait_s=5
    assert isinstance(error, MissingPriorError) and error.prior_key == keys[2] and error.__cause__ is storage.error
    assert keys[2] in str(error) and "No space left" in str(error)
    metrics = rig.manager.metrics
    assert (metrics.storage_failures, metrics.pages_failed, metrics.pages_stored) == (2, 2, 0)
    assert (metrics.writes_pending, metrics.pages_in_flight, metrics.host_pages_used) == (0, 0, 0)
    rig.manager.close()
    workers.close()


def test_prior_wait_s_zero_refuses_at_once():
    side = DecodeSide(prior_wait_s=0)
    side.decode_one_page(parked=False)
    side.manager.drain()
    assert side.manager.metrics.writes_pending == 0 and len(side.failures) == 1
    assert isinstance(side.failures[0][1], MissingPriorError)
    side.manager.close()


def decode_steps(rig, req, tokens):
    for token in tokens:
        rig.decode(req, token)
        rig.manager.offload(req)


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
