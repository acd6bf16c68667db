"""FileStore ``io_threads`` > 1 against what the file store promised with one thread: the disk
and capacity bound of a put, the error a refused put carries, a get that raises, ``close``
racing calls in flight. Each case runs with one thread too (the baseline it must equal)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from kvstage.kv_layout import KVLayout
from kvstage.storage import FileStore, LayoutFingerprint, MissingPriorError
from kvstage.storage.file_store import TMP_SUFFIX


FP = LayoutFingerprint("tiny/model", KVLayout(2, 2, 1, 4, "float32"), 2)
KEYS = [f"{i:064x}" for i in range(8)]
OTHER = [f"{i + 100:064x}" for i in range(8)]
POISON = -7.0
UNSHARE = ["unshare", "--mount", "--map-root-user"]  # as tests/storage/test_failure_causes.py


def namespaces_usable() -> str | None:
    """None when a mount namespace with tmpfs can be made here, else why not."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(UNSHARE + ["sh", "-c", "mount -t tmpfs tmpfs /mnt"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"no mount namespace here: {probe.stderr.strip()}"


def page(value: float) -> torch.Tensor:
    return torch.arange(32, dtype=torch.float32).add_(value).reshape(2, 2, 2, 1, 4)


def poisoned(count: int) -> list[torch.Tensor]:
    return [torch.full((2, 2, 2, 1, 4), POISON) for _ in range(count)]


def values(statuses) -> list[str]:
    return [status.value for status in statuses]


def directory_bytes(directory) -> int:
    """Bytes of every file in ``directory``: page files and temporary files (one renamed or
    removed while listed is skipped)."""
    total = 0
    for entry in os.scandir(directory):
        try:
            total += entry.stat().st_size
        except FileNotFoundError:
            pass
    return total


FULL_DISK = textwrap.dedent(
    """
    import json, os, subprocess, sys, torch
    from kvstage.kv_layout import KVLayout
    from kvstage.storage import FileStore, LayoutFingerprint

    fp = LayoutFingerprint("tiny", KVLayout(2, 2, 8, 64, "float32"), 4)  # 32 KiB pages
    old = [f"{i:064x}" for i in range(4)]
    new = [f"{i + 100:064x}" for i in range(4)]
    page = torch.ones(fp.page_bytes // 4)
    seen = {}
    for io_threads in (1, 2):
        directory = os.path.join(sys.argv[1], str(io_threads))
        os.mkdir(directory)
        # Room for 4 page files (36 KiB each in tmpfs pages), not 5; the store's capacity is 4 pages.
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", directory], check=True)
        probe = FileStore(fp, directory, io_threads=1)
        size = probe._file_size(probe.prefix + old[0])
        store = FileStore(fp, directory, capacity_bytes=4 * size, io_threads=io_threads)
        first = store.put(old, [page] * 4)
        answer = store.put(new, [page] * 4)  # a full store: each page evicts an old one first
        seen[io_threads] = dict(
            first=[s.value for s in first], statuses=[s.value for s in answer], errno=getattr(answer.error, "errno", None),
            leftovers=sorted(n for n in os.listdir(directory) if n.endswith(".tmp")), exists=store.exists(new),
        )
    print(json.dumps(seen))
    """
)


def test_a_put_into_a_full_store_on_a_disk_it_fills_stores_as_one_thread_does(tmp_path):
    """One thread makes room before it writes a page, so a store whose capacity is its disk
    never meets ENOSPC; io_threads must not write the pages before making room."""
    reason = namespaces_usable()
    if reason is not None:
        pytest.skip(reason)
    result = subprocess.run(UNSHARE + [sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    baseline = {"first": ["stored"] * 4, "statuses": ["stored"] * 4, "errno": None, "leftovers": [], "exists": [True] * 4}
    assert seen["1"] == baseline
    assert seen["2"] == baseline, f"io_threads=2 got {seen['2']} (errno {errno.ENOSPC} is ENOSPC)"


@pytest.mark.parametrize("io_threads", [1, 2, 3])
def test_a_put_never_holds_more_than_capacity_bytes_on_disk(tmp_path, monkeypatch, io_threads):
    """Page files and temporary files together stay within ``capacity_bytes`` at every write,
    as with one thread: a put of 8 pages into a store of 3 writes no more than 3 at once."""
    store = FileStore(FP, tmp_path, io_threads=io_threads)
    size = store._file_size(store.prefix + KEYS[0])
    store = FileStore(FP, tmp_path, capacity_bytes=3 * size, io_threads=io_threads)
    assert values(store.put(OTHER[:3], [page(-i) for i in range(3)])) == ["stored"] * 3  # the store is full
    peak = []
    original = FileStore._write_tmp

    def measured(self, *args, **kwargs):
        written = original(self, *args, **kwargs)
        peak.append(directory_bytes(tmp_path))
        return written

    monkeypatch.setattr(FileStore, "_write_tmp", measured)
    statuses = store.put(KEYS, [page(i) for i in range(8)])
    # The 8 pages' chain: pages 0-2 fit (the other chain evicted); page 3 would need room held
    # by this put's own pages, so it and the pages after it are refused, as with one thread.
    assert values(statuses) == ["stored"] * 3 + ["failed"] * 5
    assert peak and max(peak) <= 3 * size, (peak, 3 * size)
    assert not [name for name in os.listdir(tmp_path) if name.endswith(TMP_SUFFIX)]


@pytest.mark.parametrize("io_threads", [1, 2])
def test_a_prior_dropped_as_corrupt_during_a_put_fails_it_with_missing_prior_error(tmp_path, monkeypatch, io_threads):
    """A reader on another thread drops the put's prior (corrupt at its right size, so still
    indexed when the put starts) before the put's first page is decided: one thread refuses the
    pages with a MissingPriorError naming the prior; io_threads must say the same."""
    store = FileStore(FP, tmp_path, io_threads=io_threads)
    store.put(KEYS[:1], [page(0)])
    prior_file = store.path_of(KEYS[0])
    data = bytearray(prior_file.read_bytes())
    data[-1] ^= 0x01
    prior_file.write_bytes(bytes(data))
    original = FileStore._deduplicated
    readers = []

    def a_reader_first(self, full_key):
        if not readers:  # the first page's check: another thread's get finds the prior corrupt
            reader = threading.Thread(target=lambda: readers.append(store.get(KEYS[:1], poisoned(1))))
            readers.append(reader)
            reader.start()
            reader.join()
        return original(self, full_key)

    monkeypatch.setattr(FileStore, "_deduplicated", a_reader_first)
    statuses = store.put(KEYS[1:5], [page(i) for i in range(1, 5)], prior_key=KEYS[0])
    assert readers[1] == [False] and not prior_file.exists()  # the reader dropped the prior
    assert values(statuses) == ["failed"] * 4
    assert isinstance(statuses.error, MissingPriorError) and statuses.error.prior_key == KEYS[0], statuses.error
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("io_threads", [1, 2])
def test_a_get_that_raises_writes_no_target_after_it_returned(tmp_path, monkeypatch, io_threads):
    """A target the copy refuses (a leaf tensor that requires grad) makes ``get`` raise; once it
    has raised, no thread of the store may still write into the caller's other targets (the
    caller frees or reuses them). Reads after the first are slowed, as a slow disk would."""
    store = FileStore(FP, tmp_path, io_threads=io_threads)
    store.put(KEYS, [page(i) for i in range(8)])
    original = FileStore._read

    def slow(self, full_key, *args, **kwargs):
        if not full_key.endswith(KEYS[0]):
            time.sleep(0.05)
        return original(self, full_key, *args, **kwargs)

    monkeypatch.setattr(FileStore, "_read", slow)
    into = poisoned(8)
    into[0].requires_grad_(True)
    with pytest.raises(RuntimeError, match="requires grad"):
        store.get(KEYS, into)
    at_return = [target.detach().clone() for target in into]
    time.sleep(1.0)
    assert all(torch.equal(now.detach(), then) for now, then in zip(into, at_return))
    store.close()


@pytest.mark.parametrize("io_threads", [1, 2])
def test_a_put_that_raises_leaves_no_temporary_file_and_stores_what_one_thread_does(tmp_path, monkeypatch, io_threads):
    """A page whose bytes cannot be viewed (a conjugate view of a complex tensor: torch refuses
    ``view(uint8)``) makes ``put`` raise at that page: the pages before it are stored, as with
    one thread, and no temporary file of any page is left, then or later."""
    store = FileStore(FP, tmp_path, io_threads=io_threads)
    original = FileStore._write_tmp

    def slow(self, full_key, *args, **kwargs):
        if full_key.endswith(KEYS[7]):
            time.sleep(0.2)  # a slow write still in flight when the bad page raises
        return original(self, full_key, *args, **kwargs)

    monkeypatch.setattr(FileStore, "_write_tmp", slow)
    pages = [page(i) for i in range(8)]
    pages[3] = torch.zeros(16, dtype=torch.complex64).conj()  # 128 bytes, contiguous
    with pytest.raises(RuntimeError, match="conjugate"):
        store.put(KEYS, pages)
    left = lambda: sorted(name for name in os.listdir(tmp_path) if name.endswith(TMP_SUFFIX))  # noqa: E731
    assert left() == []
    time.sleep(0.5)
    assert left() == []
    assert store.exists(KEYS) == [True] * 3 + [False] * 5
    store.close()


def test_close_racing_calls_in_flight_never_fails_them(tmp_path):
    """``close()`` from one thread while another gets and puts many pages: every call answers
    (close waits for the I/O in flight; a call after it starts the threads again)."""
    store = FileStore(FP, tmp_path, io_threads=2)
    store.put(KEYS, [page(i) for i in range(8)])
    errors: list[BaseException] = []
    stop = threading.Event()

    def calls():
        try:
            for round_ in range(300):
                assert store.get(KEYS, poisoned(8)) == [True] * 8
                chain = [f"{round_ + 1:032x}{i:032x}" for i in range(4)]
                assert values(store.put(chain, [page(i) for i in range(4)])) == ["stored"] * 4
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)
        finally:
            stop.set()

    caller = threading.Thread(target=calls)
    caller.start()
    while not stop.is_set():
        store.close()
    caller.join()
    store.close()
    assert errors == []
