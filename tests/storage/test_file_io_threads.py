"""FileStore ``io_threads``: one ``get`` or ``put`` of many pages reads or writes page files on
that many threads, with the answers, bytes, links, events and stats of one thread, in key order."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.kv_layout import KVLayout
from kvstage.storage import FileStore, LayoutFingerprint, open_storage
from kvstage.storage.file_store import DEFAULT_IO_THREADS, PARALLEL_MIN_PAGE_BYTES

from file_store_rig import FP, KEYS, POISON, page, poisoned, temporary_files, values


def threads_doing(method: str, monkeypatch, meet: int) -> set[int]:
    """The threads that run ``FileStore.<method>`` from now on; the first ``meet`` of them wait
    for each other (a barrier with a timeout), so a call on fewer threads raises instead of passing."""
    seen: set[int] = set()
    barrier = threading.Barrier(meet, timeout=10) if meet > 1 else None
    original = getattr(FileStore, method)

    def spy(self, *args, **kwargs):
        first = threading.get_ident() not in seen
        seen.add(threading.get_ident())
        if barrier is not None and first and len(seen) <= meet:
            barrier.wait()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FileStore, method, spy)
    return seen


@pytest.mark.parametrize("io_threads", [1, 2, 3])
def test_a_get_answers_in_key_order_with_misses_and_a_corrupt_page_left_untouched(tmp_path, io_threads):
    store = FileStore(FP, tmp_path, io_threads=io_threads)
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


def test_a_get_of_many_pages_reads_on_io_threads(tmp_path, monkeypatch):
    store = FileStore(FP, tmp_path, io_threads=2)
    store.put(KEYS, [page(i) for i in range(8)])
    seen = threads_doing("_read", monkeypatch, meet=2)
    into = poisoned(8)
    assert store.get(KEYS, into) == [True] * 8
    assert len(seen) == 2 and threading.get_ident() not in seen
    assert all(torch.equal(target, page(i)) for i, target in enumerate(into))


@pytest.mark.parametrize("io_threads, keys", [(1, KEYS), (4, KEYS[:1])])
def test_one_read_at_a_time_stays_on_the_calling_thread(tmp_path, monkeypatch, io_threads, keys):
    store = FileStore(FP, tmp_path, io_threads=io_threads)
    store.put(KEYS, [page(i) for i in range(8)])
    seen = threads_doing("_read", monkeypatch, meet=1)
    assert store.get(keys, poisoned(len(keys))) == [True] * len(keys)
    assert seen == {threading.get_ident()}


def test_a_store_closed_still_reads_and_close_stops_its_io_threads(tmp_path, monkeypatch):
    store = FileStore(FP, tmp_path, io_threads=2)
    store.put(KEYS, [page(i) for i in range(8)])
    seen = threads_doing("_read", monkeypatch, meet=2)
    assert store.get(KEYS, poisoned(8)) == [True] * 8
    alive = lambda: {thread.ident for thread in threading.enumerate()} & seen  # noqa: E731
    assert len(alive()) == 2
    store.close()
    store.close()  # idempotent
    assert alive() == set()
    assert store.get(KEYS[:2], poisoned(2)) == [True, True]


BIG = LayoutFingerprint("big/model", KVLayout(32, 2, 8, 128, "bfloat16"), 16)  # 2 MiB pages


def test_the_default_is_two_threads_for_pages_of_2_mib_and_at_most_the_cpus_this_process_may_use(tmp_path):
    """Two threads by default for pages of PARALLEL_MIN_PAGE_BYTES or more; one in a process
    allowed a single CPU (its affinity)."""
    assert (DEFAULT_IO_THREADS, PARALLEL_MIN_PAGE_BYTES, BIG.page_bytes) == (2, 2 << 20, 2 << 20)
    assert FileStore(BIG, tmp_path / "all").io_threads == min(2, len(os.sched_getaffinity(0)))
    one_cpu = textwrap.dedent(
        """
        import os, sys
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        from kvstage.kv_layout import KVLayout
        from kvstage.storage import FileStore, LayoutFingerprint
        print(FileStore(LayoutFingerprint("big/model", KVLayout(32, 2, 8, 128, "bfloat16"), 16), sys.argv[1]).io_threads)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", one_cpu, str(tmp_path / "one")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1"]


def test_the_default_is_one_thread_for_pages_under_2_mib_and_an_explicit_count_is_kept(tmp_path):
    """Below PARALLEL_MIN_PAGE_BYTES, handing pages to threads cost more than it saved (see the
    module doc); an explicit io_threads is the caller's choice, whatever the page size."""
    small = LayoutFingerprint("big/model", KVLayout(32, 2, 8, 128, "bfloat16"), 8)  # 1 MiB pages
    assert FileStore(small, tmp_path / "default").io_threads == 1
    assert FileStore(FP, tmp_path / "tiny").io_threads == 1
    assert FileStore(FP, tmp_path / "asked", io_threads=2).io_threads == 2


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2"])
def test_a_bad_io_threads_is_refused_naming_it(tmp_path, value):
    with pytest.raises(InvalidArgumentError, match="io_threads"):
        FileStore(FP, tmp_path, io_threads=value)


def test_the_url_sets_io_threads_and_refuses_a_bad_one(tmp_path):
    store = open_storage(f"file:{tmp_path}?io_threads=3&capacity_bytes=65536", FP)
    assert (store.io_threads, store.capacity_bytes) == (3, 65536)
    for bad in ("0", "x"):
        with pytest.raises(InvalidArgumentError, match="io_threads"):
            open_storage(f"file:{tmp_path}?io_threads={bad}", FP)


def test_a_forked_child_reads_with_io_threads_of_its_own(tmp_path):
    import multiprocessing

    store = FileStore(FP, tmp_path, io_threads=2)
    store.put(KEYS, [page(i) for i in range(8)])
    assert store.get(KEYS, poisoned(8)) == [True] * 8  # the parent's I/O threads started

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


def stored_chain(store: FileStore, keys: list[str]) -> list[bytes]:
    """Each key's page file header's prior digest (the chain link), in key order."""
    from kvstage.storage.page_file import HEADER

    return [HEADER.unpack_from(store.path_of(key).read_bytes())[4] for key in keys]


def test_a_put_of_many_pages_writes_on_io_threads_with_the_links_and_events_of_one_thread(tmp_path, monkeypatch):
    one = FileStore(FP, tmp_path / "one", io_threads=1)
    two = FileStore(FP, tmp_path / "two", io_threads=2)
    one.put(KEYS[:1], [page(0)])
    two.put(KEYS[:1], [page(0)])
    one.take_events(), two.take_events()
    seen = threads_doing("_write_tmp", monkeypatch, meet=2)
    pages = [page(i).transpose(0, 1) for i in range(1, 8)]  # strided views: each thread's own scratch page
    assert values(two.put(KEYS[1:], pages, prior_key=KEYS[0])) == ["stored"] * 7
    assert len(seen) == 2 and threading.get_ident() not in seen
    assert values(one.put(KEYS[1:], pages, prior_key=KEYS[0])) == ["stored"] * 7
    assert stored_chain(two, KEYS) == stored_chain(one, KEYS) and len(set(stored_chain(two, KEYS))) == 8
    assert (
        [(e.kind, e.key) for e in two.take_events()]
        == [(e.kind, e.key) for e in one.take_events()]
        == [("stored", key) for key in KEYS[1:]]
    )
    into = poisoned(7)
    assert FileStore(FP, tmp_path / "two").get(KEYS[1:], into) == [True] * 7  # reopened: every page intact
    assert all(torch.equal(target, page.contiguous()) for target, page in zip(into, pages))
    assert not temporary_files(tmp_path / "two")


def test_a_put_of_many_pages_dedups_and_refuses_after_a_failed_page_as_one_thread_does(tmp_path, monkeypatch):
    store = FileStore(FP, tmp_path, io_threads=2)
    store.put(KEYS[2:3], [page(2)], prior_key=None)
    original = FileStore._commit

    def rename_fails_for_page_4(self, full_key, digest, prior, written, **kwargs):
        if full_key.endswith(KEYS[4]):  # its temporary file written, then the disk is full
            os.unlink(written[0])
            written = OSError(28, "No space left on device")
        return original(self, full_key, digest, prior, written, **kwargs)

    monkeypatch.setattr(FileStore, "_commit", rename_fails_for_page_4)
    statuses = store.put(KEYS[:7], [page(i) for i in range(7)])
    assert values(statuses) == ["stored", "stored", "deduplicated", "stored", "failed", "failed", "failed"]
    assert isinstance(statuses.error, OSError) and statuses.error.errno == 28
    assert store.exists(KEYS[:7]) == [True] * 4 + [False] * 3
    assert sorted(os.listdir(tmp_path)) == sorted(store.file_name(key) for key in KEYS[:4])  # no file of a refused page


def test_a_put_whose_prior_is_missing_writes_nothing(tmp_path, monkeypatch):
    from kvstage.storage import MissingPriorError

    store = FileStore(FP, tmp_path, io_threads=2)
    seen = threads_doing("_write_tmp", monkeypatch, meet=1)
    statuses = store.put(KEYS[1:5], [page(i) for i in range(4)], prior_key=KEYS[0])
    assert values(statuses) == ["failed"] * 4 and isinstance(statuses.error, MissingPriorError)
    assert seen == set() and os.listdir(tmp_path) == []
