"""RowCopies: copies of many (target, source) pairs split between the caller's thread and helpers.

What must hold: every pair lands byte for byte on random data, with poisoned targets showing no
unwritten byte and the bytes around each target untouched, for odd pair counts (fewer pairs
than threads, one pair, none) and any thread count; a bad pair is refused before any pair is
copied; a share that raises is raised to the caller after every share ended; bad ``threads`` is
refused naming the argument.
"""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.offload.row_copies import RowCopies

POISON = 0xA5


def random_rows(count: int, size: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (count, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("count", [0, 1, 2, 7])
def test_every_pair_lands_and_nothing_around_the_targets_is_written(threads, count):
    sources = random_rows(count, 1000, seed=count)
    page = torch.full((count, 1200), POISON, dtype=torch.uint8)  # each target: bytes 100..1100 of a page
    copies = RowCopies(threads)
    try:
        copies.copy([(page[index, 100:1100], sources[index]) for index in range(count)])
    finally:
        copies.close()
    assert torch.equal(page[:, 100:1100], sources)
    assert bool((page[:, :100] == POISON).all()) and bool((page[:, 1100:] == POISON).all())


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

    def run_plan(plan, first=0, step=1):
        if first == 1:
            raise RuntimeError("share 1 failed")
        ended.append(first)

    monkeypatch.setattr(row_copies, "run_plan", run_plan)
    sources = random_rows(4, 16, seed=3)
    copies = RowCopies(3)
    try:
        with pytest.raises(RuntimeError, match="share 1 failed"):
            copies.copy([(torch.zeros(16, dtype=torch.uint8), sources[index]) for index in range(4)])
    finally:
        copies.close()
    assert sorted(ended) == [0, 2]


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
