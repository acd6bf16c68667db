"""RowCopies: copies of many (target, source) pairs split between the caller's thread and helpers.

What must hold: every pair lands byte for byte on random data, with poisoned targets showing no
unwritten byte and the bytes around each target untouched, for odd pair counts (fewer pairs
than threads, one pair, none) and any thread count, rows of unequal sizes shared by bytes (a row
cut at a share's boundary lands whole); a bad pair is refused before any pair is
copied; a share that raises is raised to the caller after every share ended; bad ``threads`` is
refused naming the argument.
"""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.kernels.host_copy import plan_rows
from kvstage.offload.row_copies import RowCopies, _shares

POISON = 0xA5


def random_rows(count: int, size: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (count, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("count", [0, 1, 2, 7])
@pytest.mark.parametrize("size", [1000, 1_000_001])  # one thread below ONE_THREAD_BYTES, shares above
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


@pytest.mark.parametrize("count", [2, 3, 4])
def test_rows_of_unequal_sizes_are_shared_by_bytes_and_cut_rows_land_whole(count):
    # a state snapshot's pattern: small and large rows in turns (taken in turns, one thread got all the large)
    sizes = [3000, 1_000_000] * 5 + [7]
    sources = [random_rows(1, size, seed=index)[0] for index, size in enumerate(sizes)]
    targets = [torch.full((size,), POISON, dtype=torch.uint8) for size in sizes]
    plan = plan_rows(targets, sources)
    shares = _shares(plan, sum(sizes), count)
    share_bytes = [int(share.sizes.sum()) for share in shares]
    assert len(shares) == count and sum(share_bytes) == sum(sizes) and max(share_bytes) - min(share_bytes) <= count
    copies = RowCopies(count)
    try:
        copies.copy(list(zip(targets, sources)))
    finally:
        copies.close()
    assert all(torch.equal(target, source) for target, source in zip(targets, sources))


def test_one_row_cut_into_every_share_lands_whole():
    source = random_rows(1, 5_000_003, seed=5)[0]
    target = torch.full_like(source, POISON)
    shares = _shares(plan_rows([target], [source]), source.numel(), 3)
    assert [int(share.sizes.sum()) for share in shares] == [1_666_668, 1_666_668, 1_666_667]
    copies = RowCopies(3)
    try:
        copies.copy([(target, source)])
    finally:
        copies.close()
    assert torch.equal(target, source)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_bad_pair_is_refused_before_any_pair_is_copied(threads):
    sources = random_rows(5, 64, seed=1)
    targets = torch.full((5, 64), POISON, dtype=torch.uint8)
    pairs = [(targets[index], sources[index]) for index in range(5)]
    pairs[3] = (targets[3, :32], sources[3])  # byte sizes differ
    copies = RowCopies(threads)
    try:
        with pytest.raises(
            InvalidArgumentError, match=r"^sources\[3\]: must have as many bytes as targets\[3\] \(32\)"
        ):
            copies.copy(pairs)
    finally:
        copies.close()
    assert bool((targets == POISON).all())


def test_a_share_that_raises_reaches_the_caller_after_every_share_ended(monkeypatch):
    from kvstage.offload import row_copies

    ended = []
    sources = random_rows(3, 2_000_000, seed=3)  # three shares of one row each
    targets = torch.zeros_like(sources)

    def run_plan(plan, first=0, step=1):
        share = [index for index in range(3) if int(plan.targets[0]) == targets[index].data_ptr()][0]
        if share == 1:
            raise RuntimeError("share 1 failed")
        ended.append(share)

    monkeypatch.setattr(row_copies, "run_plan", run_plan)
    copies = RowCopies(3)
    try:
        with pytest.raises(RuntimeError, match="share 1 failed"):
            copies.copy([(targets[index], sources[index]) for index in range(3)])
    finally:
        copies.close()
    assert sorted(ended) == [0, 2]


def test_a_submit_that_raises_still_waits_for_the_shares_queued_before_it(monkeypatch):
    """close() racing a copy: the second helper share cannot be queued; the call raises only
    after the first queued share ended (its caller may free the rows once it returns)."""
    import threading
    import time

    from kvstage.offload import row_copies

    ended = []

    def run_plan(plan, first=0, step=1):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.2)  # the helper's share is still running when the submit fails
        ended.append(threading.current_thread().name)

    monkeypatch.setattr(row_copies, "run_plan", run_plan)
    copies = RowCopies(3)
    submit, calls = copies._helpers.submit, []

    def failing_submit(*args):
        calls.append(args)
        if len(calls) == 2:
            raise RuntimeError("cannot schedule new futures after shutdown")
        return submit(*args)

    monkeypatch.setattr(copies._helpers, "submit", failing_submit)
    sources = random_rows(3, 2_000_000, seed=4)
    try:
        with pytest.raises(RuntimeError, match="after shutdown"):
            copies.copy([(torch.zeros_like(sources[i]), sources[i]) for i in range(3)])
        assert len(ended) == 1 and ended[0] != threading.main_thread().name  # the queued share had ended
    finally:
        copies.close()


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
