"""A put's write order (kvstage.storage.chain_writes) on a store of in-memory steps: the pages
page by page, and on I/O threads with the same answers, commits in chain order, at most
``threads`` writes in flight, the room given back and no temporary file left on any path."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kvstage.storage.backend import MissingPriorError, PutStatus
from kvstage.storage.chain_writes import PutSteps, put_parallel, put_serial
from kvstage.storage.io_threads import IoThreads
from kvstage.storage.page_file import digest

SIZE = 10  # bytes of every page file here
KEYS = [f"p@{i:02d}" for i in range(8)]
DIGESTS = [digest(key) for key in KEYS]
PAGES = [torch.full((4,), float(i)) for i in range(8)]


class Steps:
    """A store's steps over a directory of plain files: room by a byte counter (no eviction),
    writes as temporary files, commits as renames; records commit order and writes in flight."""

    def __init__(self, directory, capacity_pages=8, there=(), stored=(), failing=(), raising=()):
        self.directory, self.capacity = directory, capacity_pages * SIZE
        self.there, self.failing, self.raising = set(there), set(failing), set(raising)
        self.stored = {digest(key) for key in stored}
        self.used = self.held = 0
        self.committed: list[str] = []
        self.in_flight = self.peak = 0
        self.lock = threading.Lock()

    def steps(self) -> PutSteps:
        return PutSteps(
            deduplicated=lambda key: key in self.there,
            prior_stored=lambda d: d is None or d in self.stored,
            size=lambda key: SIZE,
            reserve=self.reserve,
            give_back=self.give_back,
            write=self.write,
            commit=self.commit,
            missing=lambda key: MissingPriorError(key),
        )

    def reserve(self, size):
        with self.lock:
            if self.used + self.held + size > self.capacity:
                return False
            self.held += size
            return True

    def give_back(self, size):
        with self.lock:
            self.held -= size

    def write(self, key, page, prior):
        with self.lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            if key in self.raising:
                raise KeyboardInterrupt  # not an OSError: raised through the put
            if key in self.failing:
                return OSError(28, "No space left on device")
            path = self.directory / f".{key}.tmp"
            path.write_bytes(bytes(SIZE))
            return path, SIZE
        finally:
            with self.lock:
                self.in_flight -= 1

    def commit(self, key, key_digest, prior, written, *, held):
        if isinstance(written, OSError):
            self.give_back(held)
            return PutStatus.FAILED, written
        os.replace(written[0], self.directory / key)
        with self.lock:
            self.held -= held
            self.used += written[1]
            self.stored.add(key_digest)
            self.committed.append(key)
        return PutStatus.STORED, None

    def leftovers(self) -> list[str]:
        return sorted(name for name in os.listdir(self.directory) if name.endswith(".tmp"))


def both(tmp_path, keys=KEYS, prior=None, prior_key=None, **setup):
    """The outcomes of put_serial and of put_parallel (2 threads) on two fresh stores alike."""
    answers = []
    for mode in ("serial", "parallel"):
        directory = tmp_path / mode
        directory.mkdir()
        store = Steps(directory, **setup)
        count = len(keys)
        if mode == "serial":
            outcomes = put_serial(store.steps(), keys, DIGESTS[:count], PAGES[:count], prior, prior_key)
        else:
            io = IoThreads(2, "test-put")
            try:
                outcomes = put_parallel(store.steps(), io, keys, DIGESTS[:count], PAGES[:count], prior, prior_key)
            finally:
                io.close()
        assert store.held == 0 and store.leftovers() == []
        assert store.committed == [key for key, (status, _) in zip(keys, outcomes) if status is PutStatus.STORED]
        answers.append(([status for status, _ in outcomes], [type(error) for _, error in outcomes], store))
    return answers


def test_a_whole_chain_is_stored_and_committed_in_chain_order_with_at_most_two_writes_in_flight(tmp_path):
    serial, parallel = both(tmp_path)
    assert serial[0] == parallel[0] == [PutStatus.STORED] * 8
    assert parallel[2].committed == KEYS and parallel[2].peak <= 2 and serial[2].peak == 1


def test_pages_already_there_are_deduplicated_and_the_rest_linked_after_them(tmp_path):
    serial, parallel = both(tmp_path, there={KEYS[2], KEYS[5]}, stored={KEYS[2], KEYS[5]})
    expected = [PutStatus.STORED] * 8
    expected[2] = expected[5] = PutStatus.DEDUPLICATED
    assert serial[0] == parallel[0] == expected


def test_no_room_for_a_page_fails_it_and_refuses_the_pages_after_it(tmp_path):
    serial, parallel = both(tmp_path, capacity_pages=3)
    assert serial[:2] == parallel[:2] == ([PutStatus.STORED] * 3 + [PutStatus.FAILED] * 5, [type(None)] * 8)
    assert parallel[2].used == 3 * SIZE


def test_a_full_disk_fails_the_page_and_refuses_the_rest_as_page_by_page(tmp_path):
    serial, parallel = both(tmp_path, failing={KEYS[3]})
    assert serial[0] == parallel[0] == [PutStatus.STORED] * 3 + [PutStatus.FAILED] * 5
    assert serial[1] == parallel[1] == [type(None)] * 3 + [OSError] + [type(None)] * 4


def test_a_put_whose_prior_is_not_stored_names_it_on_its_first_page(tmp_path):
    outcomes = put_serial(Steps(tmp_path).steps(), KEYS[:3], DIGESTS[:3], PAGES[:3], digest("p@prior"), "p@prior")
    assert [status for status, _ in outcomes] == [PutStatus.FAILED] * 3
    assert isinstance(outcomes[0][1], MissingPriorError) and outcomes[1][1] is None is outcomes[2][1]


@pytest.mark.parametrize("mode", ["serial", "parallel"])
def test_an_exception_from_a_write_is_raised_with_the_room_given_back_and_no_file_left(tmp_path, mode):
    store = Steps(tmp_path, raising={KEYS[4]})
    io = IoThreads(2, "test-put")
    try:
        with pytest.raises(KeyboardInterrupt):
            if mode == "serial":
                put_serial(store.steps(), KEYS, DIGESTS, PAGES, None, None)
            else:
                put_parallel(store.steps(), io, KEYS, DIGESTS, PAGES, None, None)
    finally:
        io.close()
    assert store.held == 0 and store.leftovers() == []
    assert store.committed == KEYS[:4] and store.used == 4 * SIZE  # the pages before it landed
