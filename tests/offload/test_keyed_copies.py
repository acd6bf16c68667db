"""KeyedCopies: pages stored and loaded under keys the engine names (vLLM's block hashes), through
the real Copier (kernels on CPU), HostPool, StoreWorkers threads and a MemoryStore.

What must hold: a stored job's pages land in the store under its keys byte for byte; a load puts
them into other slots byte for byte; a load with a key the store lacks fails and lands only the
pages before it; host pages always go back; a job larger than the host pool moves in parts, and a job that
finds too few free host pages waits for them (never refused); bad slot counts and repeated keys
raise before anything starts.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvstage.errors import InvalidArgumentError, StorageError
from kvstage.kernels import KVPool
from kvstage.offload import Copier, HostPool, KeyedCopies, StoreWorkers
from kvstage.storage import LayoutFingerprint, MemoryStore

NUM_BLOCKS, LAYERS, BLOCK_BYTES = 12, 3, 256  # vLLM-like canonical tensors: [num_blocks, page bytes] int8 per layer


@pytest.fixture
def rig():
    generator = torch.Generator().manual_seed(3)
    layers = [
        torch.randint(-128, 128, (NUM_BLOCKS, 1, BLOCK_BYTES), dtype=torch.int8, generator=generator)
        for _ in range(LAYERS)
    ]
    kv_pool = KVPool.mla(layers)
    host_pool = HostPool.like(kv_pool, num_pages=4, page_size=1)
    store = MemoryStore(LayoutFingerprint.opaque("m", page_bytes=host_pool.page_bytes, page_format="test"))
    workers = StoreWorkers()
    copier = Copier(kv_pool, host_pool, backend="torch")
    keyed = KeyedCopies(copier, store, workers)
    yield keyed, layers, store, host_pool
    copier.close()
    workers.close()


def blocks(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def finish(keyed: KeyedCopies, job) -> list:
    keyed.wait([job])
    return keyed.poll()


def test_a_store_writes_each_block_of_every_layer_under_its_key(rig):
    keyed, layers, store, host_pool = rig
    job = object()
    keyed.store(job, blocks(5, 2), ["k5", "k2"])
    [result] = finish(keyed, job)
    assert result.job is job and result.ok and result.is_store and result.bytes == 2 * host_pool.page_bytes
    page = torch.empty(host_pool.page_bytes, dtype=torch.uint8)
    assert store.get(["k2"], [page]) == [True]
    assert torch.equal(page.view(torch.int8).view(LAYERS, BLOCK_BYTES), torch.stack([layer[2, 0] for layer in layers]))
    assert host_pool.free_pages == 4


def test_a_load_puts_stored_blocks_into_other_blocks_byte_for_byte(rig):
    keyed, layers, store, host_pool = rig
    keyed.store("s", blocks(0, 1, 2), ["a", "b", "c"])
    keyed.wait()
    keyed.poll()
    expected = [layer[0:3].clone() for layer in layers]
    keyed.load("l", ["a", "b", "c"], blocks(9, 10, 11))
    [result] = finish(keyed, "l")
    assert result.ok and not result.is_store and result.num_pages == 3
    for layer, want in zip(layers, expected):
        assert torch.equal(layer[9:12], want)
    assert host_pool.free_pages == 4


def test_a_load_with_a_missing_key_fails_and_lands_only_the_pages_before_it(rig):
    keyed, layers, store, host_pool = rig
    keyed.store("s", blocks(0, 2), ["a", "c"])
    keyed.wait()
    keyed.poll()
    before = [layer.clone() for layer in layers]
    keyed.load("l", ["a", "missing", "c"], blocks(9, 10, 11))
    [result] = finish(keyed, "l")
    assert not result.ok and result.error is None and result.loaded_pages == 1 and result.bytes == host_pool.page_bytes
    for layer, was in zip(layers, before):
        assert torch.equal(layer[9], was[0])  # the page before the hole landed
        assert torch.equal(layer[10:12], was[10:12])  # the hole and the page after it (read) did not
    assert host_pool.free_pages == 4


def test_a_load_failing_in_its_second_part_lands_the_first_part_whole(rig):
    keyed, layers, store, host_pool = rig
    keyed.store("s", blocks(0, 1, 2, 3, 4), ["a0", "a1", "a2", "a3", "a4"])
    keyed.wait()
    keyed.poll()
    before = [layer.clone() for layer in layers]
    keyed.load("l", ["a0", "a1", "a2", "a3", "a4", "missing"], blocks(6, 7, 8, 9, 10, 11))  # parts of 4 and 2
    [result] = finish(keyed, "l")
    assert not result.ok and result.loaded_pages == 5
    for layer, was in zip(layers, before):
        assert torch.equal(layer[6:11], was[0:5]) and torch.equal(layer[11], was[11])
    assert host_pool.free_pages == 4


def test_a_load_whose_store_answers_too_few_keys_fails_with_a_storage_error(rig):
    keyed, layers, store, host_pool = rig
    keyed.store("s", blocks(0, 1), ["a", "b"])
    keyed.wait()
    keyed.poll()
    real_get = store.get
    store.get = lambda keys, into: real_get(keys, into)[:-1]  # a broken store drops its last answer
    before = [layer.clone() for layer in layers]
    keyed.load("l", ["a", "b"], blocks(9, 10))
    [result] = finish(keyed, "l")
    assert not result.ok and result.bytes == 0
    assert isinstance(result.error, StorageError) and "get() answered 1 keys of 2" in str(result.error)
    assert all(torch.equal(layer, was) for layer, was in zip(layers, before))
    assert host_pool.free_pages == 4


def test_a_job_larger_than_the_host_pool_moves_in_parts_byte_for_byte(rig):
    keyed, layers, store, host_pool = rig  # 4 host pages
    keys = [f"k{i}" for i in range(10)]
    keyed.store("big", blocks(*range(10)), keys)
    [result] = finish(keyed, "big")
    assert result.ok and result.num_pages == 10 and result.bytes == 10 * host_pool.page_bytes
    assert store.stats.pages_stored == 10 and host_pool.free_pages == 4
    expected = [layer[0:10].clone() for layer in layers]
    for layer in layers:
        layer.zero_()
    keyed.load("back", keys, blocks(*range(10)))
    [result] = finish(keyed, "back")
    assert result.ok and result.bytes == 10 * host_pool.page_bytes
    for layer, want in zip(layers, expected):
        assert torch.equal(layer[0:10], want)
    assert host_pool.free_pages == 4


def test_jobs_wait_for_host_pages_in_submission_order(rig):
    keyed, layers, store, host_pool = rig
    gate = threading.Event()
    keyed.workers.write(gate.wait)  # the first store's write holds its 3 host pages
    keyed.store("first", blocks(0, 1, 2), ["a", "b", "c"])
    keyed.store("second", blocks(3, 4), ["d", "e"])  # 2 pages; 1 is free
    keyed.copier.synchronize()
    assert keyed.poll() == [] and keyed.jobs_in_flight == 2 and host_pool.free_pages == 1
    assert store.exists(["d", "e"]) == [False, False]
    gate.set()
    keyed.wait()
    assert sorted((r.job, r.ok) for r in keyed.poll()) == [("first", True), ("second", True)]
    assert store.exists(list("abcde")) == [True] * 5 and host_pool.free_pages == 4


def test_wait_with_a_timeout_returns_false_while_a_job_runs_and_true_once_it_ends(rig):
    keyed, layers, store, host_pool = rig
    gate = threading.Event()
    keyed.workers.write(gate.wait)  # holds the writer thread: the store's write cannot run yet
    try:
        keyed.store("held", blocks(0), ["a"])
        assert keyed.wait(timeout=0.05) is False
        assert keyed.jobs_in_flight == 1 and store.exists(["a"]) == [False]
    finally:
        gate.set()  # else the fixture's close waits for the writer thread forever
    assert keyed.wait(timeout=30) is True
    assert keyed.jobs_in_flight == 0 and store.exists(["a"]) == [True]


def test_a_failed_load_skips_its_later_parts_and_writes_none_of_their_blocks(rig):
    keyed, layers, store, host_pool = rig
    keyed.store("a", blocks(1, 2, 3, 8, 9, 10, 11), ["a1", "a2", "a3", "a4", "a5", "a6", "a7"])
    keyed.wait()
    keyed.poll()
    before = [layer.clone() for layer in layers]
    reads_before = store.stats.pages_read
    keyed.load(
        "back", ["missing", "a1", "a2", "a3", "a4", "a5", "a6", "a7"], blocks(0, 1, 2, 3, 4, 5, 6, 7)
    )  # 2 parts of 4
    [result] = finish(keyed, "back")
    assert not result.ok and result.bytes == 0
    for layer, old in zip(layers, before):
        assert torch.equal(layer[4:8], old[4:8])  # the second part was neither read nor scattered
    assert store.stats.pages_read - reads_before <= 3  # at most the first part's present pages
    assert host_pool.free_pages == 4


def test_a_load_whose_read_cannot_start_fails_and_gives_its_host_pages_back(rig):
    keyed, layers, store, host_pool = rig
    keyed.workers.close()  # a reader that takes no more calls (submit raises)
    keyed.load("late", ["a"], blocks(0))
    [result] = keyed.poll()
    assert result.job == "late" and not result.ok and isinstance(result.error, RuntimeError)
    assert host_pool.free_pages == 4 and keyed.jobs_in_flight == 0


def test_storing_held_keys_again_succeeds_without_writing(rig):
    keyed, layers, store, host_pool = rig
    keyed.store("one", blocks(0), ["a"])
    keyed.wait()
    keyed.store("two", blocks(0), ["a"])
    keyed.wait()
    results = keyed.poll()
    assert [r.ok for r in results] == [True, True]
    assert store.stats.pages_stored == 1 and store.stats.pages_deduplicated == 1


@pytest.mark.parametrize(
    ("keys", "slots", "message"),
    [
        (["a", "b"], blocks(1), "slot_indices"),
        (["a", "a"], blocks(1, 2), "page_keys"),
        (["a"], blocks(1, 2).view(1, 2), "slot_indices"),
    ],
)
def test_bad_jobs_raise_before_anything_starts(rig, keys, slots, message):
    keyed, layers, store, host_pool = rig
    for submit in (lambda: keyed.store("j", slots, keys), lambda: keyed.load("j", keys, slots)):
        with pytest.raises(InvalidArgumentError, match=message):
            submit()
    assert keyed.jobs_in_flight == 0 and host_pool.free_pages == 4


def test_a_store_of_another_page_size_is_refused(rig):
    keyed, layers, store, host_pool = rig
    other = MemoryStore(LayoutFingerprint.opaque("m", page_bytes=64, page_format="test"))
    with pytest.raises(InvalidArgumentError, match="storage"):
        KeyedCopies(keyed.copier, other, keyed.workers)


def test_a_store_copies_the_blocks_as_the_producer_leaves_them(rig):
    keyed, layers, store, host_pool = rig

    class Producer:
        """A CPU stand-in for the forward stream: its KV lands when synchronize() is waited on."""

        def synchronize(self):
            for layer in layers:
                layer[4] = 42

    keyed.store("s", blocks(4), ["k4"], after=Producer())
    [result] = finish(keyed, "s")
    page = torch.empty(host_pool.page_bytes, dtype=torch.uint8)
    assert result.ok and store.get(["k4"], [page]) == [True]
    assert torch.all(page.view(torch.int8) == 42)  # copied after the producer, never before


def test_stores_whose_gathers_finish_in_one_poll_each_write_their_own_pages(rig):
    # The copies of both jobs end before the first poll: each write must carry its own job's
    # keys and pages (a closure made in the poll's loop would see only the last job's).
    keyed, layers, store, host_pool = rig
    gate = threading.Event()
    keyed.workers.write(gate.wait)  # the writer thread runs no write until both are queued
    keyed.store("first", blocks(1, 2), ["k1", "k2"])
    keyed.store("second", blocks(7, 8), ["k7", "k8"])
    keyed.copier.synchronize()
    assert keyed.poll() == [] and keyed.jobs_in_flight == 2  # both gathers collected, both writes queued
    gate.set()
    keyed.wait()
    results = {result.job: result for result in keyed.poll()}
    assert results["first"].ok and results["second"].ok
    page = torch.empty(host_pool.page_bytes, dtype=torch.uint8)
    for key, block in (("k1", 1), ("k2", 2), ("k7", 7), ("k8", 8)):
        assert store.get([key], [page]) == [True], key
        assert torch.equal(
            page.view(torch.int8).view(LAYERS, BLOCK_BYTES), torch.stack([layer[block, 0] for layer in layers])
        ), key
    assert host_pool.free_pages == 4


def recorded_puts(store) -> list:
    """Record each ``put``'s keys and ``prior_key`` (the call still runs)."""
    calls, put = [], store.put

    def recording(keys, pages, *, prior_key=None):
        calls.append((list(keys), prior_key))
        return put(keys, pages, prior_key=prior_key)

    store.put = recording
    return calls


def test_a_job_larger_than_the_host_pool_is_written_as_one_chain(rig):
    keyed, layers, store, host_pool = rig
    puts = recorded_puts(store)
    keyed.store("s", blocks(0, 1, 2, 3, 4, 5), ["a", "b", "c", "d", "e", "f"])  # parts of 4 and 2 host pages
    assert finish(keyed, "s")[0].ok
    assert puts == [(["a", "b", "c", "d"], None), (["e", "f"], "d")]


def test_prior_keys_link_each_run_to_its_predecessor_in_order(rig):
    keyed, layers, store, host_pool = rig
    puts = recorded_puts(store)
    keyed.store("first", blocks(0, 1), ["a", "b"])
    assert finish(keyed, "first")[0].ok
    # "c" follows "b" (an earlier job's page); "x" starts another chain; "y" follows "x" (None)
    keyed.store("second", blocks(2, 3, 4, 5), ["c", "d", "x", "y"], prior_keys=["b", None, "w", None])
    [result] = finish(keyed, "second")
    assert puts[1:] == [(["c", "d"], "b"), (["x", "y"], "w")]
    assert not result.ok and store.exists(["c", "d", "x", "y"]) == [
        True,
        True,
        False,
        False,
    ]  # "w" is not stored: a chain no lookup reaches


def test_chain_runs_split_where_a_page_does_not_follow_the_one_before():
    from kvstage.offload.keyed_copies import chain_runs

    assert chain_runs(["a", "b", "c"]) == [(0, 3, None)]
    assert chain_runs(["a", "b", "c"], ["p", None, "b"]) == [(0, 3, "p")]
    assert chain_runs(["a", "b", "c"], [None, "q", None]) == [(0, 1, None), (1, 3, "q")]
    assert chain_runs([], []) == []
    with pytest.raises(InvalidArgumentError, match=r"^prior_keys: must give one entry per page key, got 1 for 2 keys"):
        chain_runs(["a", "b"], ["p"])
