"""RowCopies: copies of many (target, source) pairs split between the caller's thread and helpers.

What must hold: every pair lands byte for byte on random data, with poisoned targets showing no
unwritten byte and the bytes around each target untouched, for odd pair counts (fewer pairs
than threads, one pair, none) and any thread count, rows of unequal sizes shared by bytes (a row
cut at a share's boundary lands whole); a copy that raises is raised to the caller
after every share ended; bad ``threads`` is refused naming the argument.
"""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.offload.row_copies import RowCopies, _shares

POISON = 0xA5


def random_rows(count: int, size: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (count, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("count", [0, 1, 2, 7])
@pytest.mark.parametrize("size", [1000, 100_001])  # one thread below ONE_THREAD_BYTES, shares above
def test_every_pair_lands_and_nothing_around_the_targets_is_written(threads, count, size):
    sources = random_rows(count, size, seed=count)
    page = torch.full((count, size + 200), POISON, dtype=torch.uint8)  # each target: bytes 100..size+100
    copies = RowCopies(threads)
    try:
        copies.copy([(page[index, 100 : size + 100], sources[index]) for index in range(count)])
    finally:
        copies.close()
    assert torch.equal(page[:, 100 : size + 100], sources)
    assert bool((page[:, :100] == POISON).all()) and bool((page[:, size + 100 :] == POISON).all())


def test_rows_of_unequal_sizes_are_shared_by_bytes_and_cut_rows_land_whole():
    # a state snapshot's pattern: small and large rows in turns (taken in turns, one thread got all the large)
    sizes = [3000, 400_000] * 5 + [7]
    sources = [random_rows(1, size, seed=index)[0] for index, size in enumerate(sizes)]
    targets = [torch.full((size,), POISON, dtype=torch.uint8) for size in sizes]
    arrays = [(target.numpy(), source.numpy()) for target, source in zip(targets, sources)]
    total = sum(sizes)
    for count in (2, 3):
        shares = _shares(arrays, total, count)
        assert len(shares) == count
        share_bytes = [sum(target.nbytes for target, _ in share) for share in shares]
        assert sum(share_bytes) == total and max(share_bytes) - min(share_bytes) <= total // count // 100 + 8
    copies = RowCopies(3)
    try:
        copies.copy(list(zip(targets, sources)))
    finally:
        copies.close()
    assert all(torch.equal(target, source) for target, source in zip(targets, sources))


@pytest.mark.parametrize("size", [64, 200_000])  # the caller's thread alone, two shares
def test_a_copy_that_raises_reaches_the_caller_after_every_share_ended(size):
    sources = random_rows(5, size, seed=1)
    targets = torch.full((5, size), POISON, dtype=torch.uint8)
    pairs = [(targets[index], sources[index]) for index in range(5)]
    pairs[4] = (targets[4, :32], sources[4, :31])  # shapes differ: numpy refuses to broadcast
    copies = RowCopies(2)
    try:
        with pytest.raises(ValueError):
            copies.copy(pairs)
    finally:
        copies.close()
    for index in range(4):  # the pairs before it (the first share whole) landed before the error came back
        assert torch.equal(targets[index], sources[index])


def test_after_close_copies_run_on_the_callers_thread():
    copies = RowCopies(2)
    copies.close()
    copies.close()
    sources, targets = random_rows(3, 16, seed=2), torch.zeros(3, 16, dtype=torch.uint8)
    copies.copy([(targets[index], sources[index]) for index in range(3)])
    assert torch.equal(targets, sources)


@pytest.mark.parametrize("threads", [0, -1, 1.5, "2"])
def test_bad_threads_is_refused(threads):
    with pytest.raises(InvalidArgumentError, match="^threads: must be an int >= 1 or None"):
        RowCopies(threads)
