"""OneHopCopies: keyed stores and loads copying each byte once, between CPU block tensors and a
store that adopts and lends pages (tests/adopting_store.py), on real StoreWorkers threads.

What must hold: a store hands the store page buffers holding each block's rows in layer order
(the bytes KeyedCopies' host page has), and the store keeps those very buffers; a load copies
the lent pages into other blocks byte for byte and ends every loan; a store at capacity hands
back its victims' buffers and the next job fills them (nothing allocated); a missing page ends a
load there (the blocks after it untouched); failed puts are reported per key; chain runs and
parts become one put each with the right prior key; bad input raises before anything starts.
"""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import InvalidArgumentError, StorageError
from kvstage.kernels import KVPool
from kvstage.offload import Copier, HostPool, KeyedCopies, StoreWorkers
from kvstage.offload.one_hop_copies import OneHopCopies

from adopting_store import AdoptingStore

NUM_BLOCKS, LAYERS, ROW = 12, 3, 256
PAGE = LAYERS * ROW


@pytest.fixture
def workers():
    workers = StoreWorkers()
    yield workers
    workers.close()


def make_layers(seed: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (NUM_BLOCKS, ROW), dtype=torch.uint8, generator=generator) for _ in range(LAYERS)]


def blocks(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def finish(copies, job) -> list:
    assert copies.wait([job], timeout=30)
    return copies.poll()


def page_of(layers: list[torch.Tensor], block: int) -> torch.Tensor:
    return torch.cat([rows[block] for rows in layers])


def test_a_store_hands_over_buffers_of_each_blocks_rows_and_a_load_copies_them_back(workers):
    layers, store = make_layers(), AdoptingStore(PAGE)
    copies = OneHopCopies(layers, store, workers, part_pages=4)
    job = object()
    copies.store(job, blocks(5, 2), ["k5", "k2"])
    [result] = finish(copies, job)
    assert result.job is job and result.ok and result.is_store and result.bytes == 2 * PAGE
    assert result.failed_keys == ()
    assert torch.equal(store.page("k5"), page_of(layers, 5)) and torch.equal(store.page("k2"), page_of(layers, 2))
    assert store.puts == [(["k5", "k2"], None, True)]  # one put, adopting
    copies.load("l", ["k2", "k5"], blocks(9, 10))
    [loaded] = finish(copies, "l")
    assert loaded.ok and not loaded.is_store and loaded.loaded_pages == 2 and loaded.bytes == 2 * PAGE
    for rows in layers:
        assert torch.equal(rows[9], rows[2]) and torch.equal(rows[10], rows[5])
    assert store.loans_out == 0


def test_a_store_at_capacity_refills_its_victims_buffers_without_allocating(workers):
    layers, store = make_layers(), AdoptingStore(PAGE, capacity_pages=3)
    copies = OneHopCopies(layers, store, workers, part_pages=3)
    for round_ in range(4):
        copies.store(round_, blocks(0, 1, 2), [f"r{round_}b{block}" for block in range(3)])
        [result] = finish(copies, round_)
        assert result.ok
    # round 0 fills the store (3 fresh buffers), round 1 evicts round 0 and gets its buffers back
    # after its put (3 more): from round 2 on every buffer is a victim's
    assert copies.buffers_allocated == 6
    first = {store.page(f"r3b{block}").data_ptr() for block in range(3)}
    assert torch.equal(store.page("r3b1"), page_of(layers, 1)) and len(first) == 3


def test_a_load_ends_at_the_first_page_not_stored_and_leaves_the_later_blocks_untouched(workers):
    layers, store = make_layers(), AdoptingStore(PAGE)
    copies = OneHopCopies(layers, store, workers, part_pages=2)
    copies.store("s", blocks(0, 1, 2), ["a", "b", "c"])
    assert finish(copies, "s")[0].ok
    before = [rows.clone() for rows in layers]
    copies.load("l", ["a", "b", "missing", "c"], blocks(6, 7, 8, 9))
    [result] = finish(copies, "l")
    assert not result.ok and result.loaded_pages == 2 and result.error is None and result.bytes == 2 * PAGE
    for rows, old in zip(layers, before):
        assert torch.equal(rows[6], old[0]) and torch.equal(rows[7], old[1])
        assert torch.equal(rows[8], old[8]) and torch.equal(rows[9], old[9])  # untouched
    assert store.loans_out == 0


def test_a_put_that_raises_fails_every_key_of_its_part_and_later_parts_still_go(workers):
    layers, store = make_layers(), AdoptingStore(PAGE)
    copies = OneHopCopies(layers, store, workers, part_pages=2)
    store.fail_puts = StorageError("disk gone")
    copies.store("s", blocks(0, 1), ["a", "b"])
    [result] = finish(copies, "s")
    assert not result.ok and result.failed_keys == ("a", "b") and result.bytes == 0
    assert isinstance(result.error, StorageError)
    store.fail_puts = None
    copies.store("t", blocks(0, 1), ["a", "b"])
    assert finish(copies, "t")[0].ok and torch.equal(store.page("b"), page_of(layers, 1))


def test_pages_the_store_refuses_are_failed_keys_and_their_buffers_are_reused(workers):
    layers, store = make_layers(), AdoptingStore(PAGE, capacity_pages=1)
    copies = OneHopCopies(layers, store, workers, part_pages=4)
    copies.store("s", blocks(0, 1, 2), ["a", "b", "c"])  # one fits; the others may not evict a page of the call
    [result] = finish(copies, "s")
    assert not result.ok and result.failed_keys == ("b", "c") and result.bytes == PAGE
    allocated = copies.buffers_allocated
    copies.store("t", blocks(4), ["d"])  # fills a refused page's buffer and evicts a: nothing allocated
    [again] = finish(copies, "t")
    assert again.ok and copies.buffers_allocated == allocated == 3 and store.page("a") is None
    copies.store("u", blocks(4), ["d"])  # deduplicated: its buffer stays the worker's
    assert finish(copies, "u")[0].ok and copies.buffers_allocated == 3
    assert torch.equal(store.page("d"), page_of(layers, 4))


def test_chain_runs_and_parts_are_one_put_each_with_the_page_before_as_prior(workers):
    layers, store = make_layers(), AdoptingStore(PAGE)
    copies = OneHopCopies(layers, store, workers, part_pages=2)
    copies.store("s", blocks(0, 1, 2, 3, 4), ["a", "b", "c", "x", "y"], prior_keys=["p", None, None, "q", None])
    assert finish(copies, "s")[0].ok
    assert store.puts == [(["a", "b"], "p", True), (["c"], "b", True), (["x", "y"], "q", True)]


def test_pages_are_the_host_pages_of_keyed_copies_so_either_path_reads_the_other(workers):
    layers = make_layers()
    pool = KVPool.mla([rows.view(NUM_BLOCKS, 1, ROW) for rows in layers])
    host_pool = HostPool.like(pool, num_pages=4, page_size=1)
    store = AdoptingStore(host_pool.page_bytes)
    copier = Copier(pool, host_pool, backend="torch")
    try:
        keyed = KeyedCopies(copier, store, workers)
        keyed.store("two hops", blocks(3, 4), ["k3", "k4"])
        keyed.wait(["two hops"])
        assert keyed.poll()[0].ok
        one_hop = OneHopCopies(layers, store, workers, part_pages=4)
        one_hop.load("one hop", ["k3", "k4"], blocks(10, 11))
        assert finish(one_hop, "one hop")[0].ok
        for rows in layers:
            assert torch.equal(rows[10], rows[3]) and torch.equal(rows[11], rows[4])
        one_hop.store("back", blocks(5), ["k5"])
        assert finish(one_hop, "back")[0].ok
        keyed.load("read", ["k5"], blocks(0))
        keyed.wait(["read"])
        assert keyed.poll()[0].ok
        for rows in layers:
            assert torch.equal(rows[0], rows[5])
    finally:
        copier.close()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.store("j", blocks(0, 1), ["a", "a"]), "^page_keys: a key appears twice"),
        (lambda c: c.store("j", blocks(0, NUM_BLOCKS), ["a", "b"]), r"^slot_indices: every block must be in \[0, 12\)"),
        (lambda c: c.store("j", blocks(0), ["a", "b"]), "^slot_indices: must be a 1-D tensor of 2 pages"),
        (lambda c: c.load("j", ["a", "b"], blocks(3, 3)), "^slot_indices: a block repeats"),
        (lambda c: c.store("j", blocks(0), ["a"], after=object()), "^after: must be None"),
    ],
)
def test_bad_input_raises_before_anything_starts(workers, call, message):
    store = AdoptingStore(PAGE)
    copies = OneHopCopies(make_layers(), store, workers, part_pages=2)
    with pytest.raises(InvalidArgumentError, match=message):
        call(copies)
    assert store.puts == [] and copies.jobs_in_flight == 0 and copies.poll() == []


def test_layers_of_other_blocks_a_store_of_another_page_size_or_without_the_protocol_are_refused(workers):
    short = [*make_layers()[:2], torch.zeros(NUM_BLOCKS - 1, ROW, dtype=torch.uint8)]
    with pytest.raises(InvalidArgumentError, match=r"^layers\[2\]: .* like layers\[0\], got torch.uint8 \(11, 256\)"):
        OneHopCopies(short, AdoptingStore(PAGE), workers, part_pages=2)
    with pytest.raises(InvalidArgumentError, match="^storage: holds pages of 100 bytes, a block's rows are 768"):
        OneHopCopies(make_layers(), AdoptingStore(100), workers, part_pages=2)

    class Copying:  # put and get only, as the file and Mooncake stores
        page_bytes = PAGE

    with pytest.raises(InvalidArgumentError, match="^storage: Copying does not adopt and lend pages"):
        OneHopCopies(make_layers(), Copying(), workers, part_pages=2)


@pytest.mark.parametrize("copy_threads", [1, 2, 3])
def test_odd_block_counts_land_in_every_byte_of_poisoned_pages_and_blocks(workers, copy_threads):
    layers, store = make_layers(seed=11), AdoptingStore(PAGE)
    copies = OneHopCopies(layers, store, workers, part_pages=3, copy_threads=copy_threads)
    try:
        copies._spares = [torch.full((PAGE,), 0xA5, dtype=torch.uint8) for _ in range(3)]  # poisoned buffers
        keys = [f"k{block}" for block in (0, 4, 1, 5, 2)]  # 5 pages: parts of 3 and 2
        copies.store("s", blocks(0, 4, 1, 5, 2), keys)
        [stored] = finish(copies, "s")
        assert stored.ok and stored.bytes == 5 * PAGE
        for key, block in zip(keys, (0, 4, 1, 5, 2)):
            assert torch.equal(store.page(key), page_of(layers, block))
        for rows in layers:
            rows[6:11] = 0xA5  # poisoned targets
        copies.load("l", keys, blocks(10, 6, 9, 7, 8))
        [loaded] = finish(copies, "l")
        assert loaded.ok and loaded.loaded_pages == 5
        for target, source in zip((10, 6, 9, 7, 8), (0, 4, 1, 5, 2)):
            assert torch.equal(page_of(layers, target), page_of(layers, source))
        assert store.loans_out == 0
    finally:
        copies.close()


def test_copy_threads_below_one_is_refused(workers):
    with pytest.raises(InvalidArgumentError, match="^copy_threads: must be an int >= 1 or None, got 0"):
        OneHopCopies(make_layers(), AdoptingStore(PAGE), workers, part_pages=2, copy_threads=0)
