"""FileStore ``parallel_reads``: one ``get`` of many pages reads page files on that many threads,
with the answers, bytes and stats of a one-thread read, in key order."""

from __future__ import annotations

import threading

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.kv_layout import KVLayout
from kvstage.storage import FileStore, LayoutFingerprint, open_storage
from kvstage.storage.file_store import DEFAULT_PARALLEL_READS

FP = LayoutFingerprint("tiny/model", KVLayout(2, 2, 1, 4, "float32"), 2)
KEYS = [f"{i:064x}" for i in range(8)]
POISON = -7.0


def page(value: float) -> torch.Tensor:
    return torch.arange(32, dtype=torch.float32).add_(value).reshape(2, 2, 2, 1, 4)


def poisoned(count: int) -> list[torch.Tensor]:
    return [torch.full((2, 2, 2, 1, 4), POISON) for _ in range(count)]


def threads_reading(store: FileStore, monkeypatch, meet: int) -> set[int]:
    """The threads that read page files from now on; the first ``meet`` reads wait for each other
    (a barrier with a timeout), so a get that reads on fewer threads raises instead of passing."""
    seen: set[int] = set()
    barrier = threading.Barrier(meet, timeout=10) if meet > 1 else None
    original = FileStore._read

    def spy(self, *args, **kwargs):
        first = threading.get_ident() not in seen
        seen.add(threading.get_ident())
        if barrier is not None and first and len(seen) <= meet:
            barrier.wait()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FileStore, "_read", spy)
    return seen


@pytest.mark.parametrize("parallel_reads", [1, 2, 3])
def test_a_get_answers_in_key_order_with_misses_and_a_corrupt_page_left_untouched(tmp_path, parallel_reads):
    store = FileStore(FP, tmp_path, parallel_reads=parallel_reads)
    store.put(KEYS[:6], [page(100 * i) for i in range(6)])
    corrupt = store.path_of(KEYS[3])
    data = bytearray(corrupt.read_bytes())
    data[-1] ^= 0x01
    corrupt.write_bytes(bytes(data))

    asked = [KEYS[5], KEYS[7], KEYS[0], KEYS[3], KEYS[2], KEYS[6], KEYS[1], KEYS[4]]
    into = poisoned(len(asked))
    assert store.get(asked, into) == [True, False, True, False, True, False, True, True]
    for key, target, hit in zip(asked, into, [True, False, True, False, True, False, True, True]):
        expected = page(100 * KEYS.index(key)) if hit else torch.full_like(target, POISON)
        assert torch.equal(target, expected), key
    assert (store.stats.pages_read, store.stats.pages_missed) == (5, 3)
    assert not corrupt.exists()  # the corrupt page was removed, on whichever thread read it


def test_a_get_of_many_pages_reads_on_parallel_reads_threads(tmp_path, monkeypatch):
    store = FileStore(FP, tmp_path, parallel_reads=2)
    store.put(KEYS, [page(i) for i in range(8)])
    seen = threads_reading(store, monkeypatch, meet=2)
    into = poisoned(8)
    assert store.get(KEYS, into) == [True] * 8
    assert len(seen) == 2 and threading.get_ident() not in seen
    assert all(torch.equal(target, page(i)) for i, target in enumerate(into))


@pytest.mark.parametrize("parallel_reads, keys", [(1, KEYS), (4, KEYS[:1])])
def test_one_read_at_a_time_stays_on_the_calling_thread(tmp_path, monkeypatch, parallel_reads, keys):
    store = FileStore(FP, tmp_path, parallel_reads=parallel_reads)
    store.put(KEYS, [page(i) for i in range(8)])
    seen = threads_reading(store, monkeypatch, meet=1)
    assert store.get(keys, poisoned(len(keys))) == [True] * len(keys)
    assert seen == {threading.get_ident()}


def test_a_store_closed_still_reads_and_close_stops_its_reader_threads(tmp_path):
    store = FileStore(FP, tmp_path, parallel_reads=2)
    store.put(KEYS, [page(i) for i in range(8)])
    before = threading.active_count()
    assert store.get(KEYS, poisoned(8)) == [True] * 8
    assert threading.active_count() > before
    store.close()
    store.close()  # idempotent
    assert threading.active_count() == before
    assert store.get(KEYS[:2], poisoned(2)) == [True, True]


def test_the_default_is_at_most_the_cpus_this_process_may_use(tmp_path):
    import os

    store = FileStore(FP, tmp_path)
    assert store.parallel_reads == min(DEFAULT_PARALLEL_READS, len(os.sched_getaffinity(0)))


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2"])
def test_a_bad_parallel_reads_is_refused_naming_it(tmp_path, value):
    with pytest.raises(InvalidArgumentError, match="parallel_reads"):
        FileStore(FP, tmp_path, parallel_reads=value)


def test_the_url_sets_parallel_reads_and_refuses_a_bad_one(tmp_path):
    store = open_storage(f"file:{tmp_path}?parallel_reads=3&capacity_bytes=65536", FP)
    assert (store.parallel_reads, store.capacity_bytes) == (3, 65536)
    for bad in ("0", "x"):
        with pytest.raises(InvalidArgumentError, match="parallel_reads"):
            open_storage(f"file:{tmp_path}?parallel_reads={bad}", FP)


def test_a_forked_child_reads_with_reader_threads_of_its_own(tmp_path):
    import multiprocessing

    store = FileStore(FP, tmp_path, parallel_reads=2)
    store.put(KEYS, [page(i) for i in range(8)])
    assert store.get(KEYS, poisoned(8)) == [True] * 8  # the parent's reader threads started

    def child(answers):
        into = poisoned(8)
        answers.put((store.get(KEYS, into), all(torch.equal(t, page(i)) for i, t in enumerate(into))))

    context = multiprocessing.get_context("fork")
    answers = context.Queue()
    process = context.Process(target=child, args=(answers,))
    process.start()
    try:
        assert answers.get(timeout=30) == ([True] * 8, True)  # before: the child waited forever
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    assert process.exitcode == 0
