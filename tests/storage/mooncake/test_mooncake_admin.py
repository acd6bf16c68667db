"""The master's admin server against a real mooncake_master: listing a key space, the periodic
thread, and a watcher announcing pages the master evicted, another client's included."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from kvstage.errors import InvalidArgumentError, StorageError
from kvstage.kv_layout import KVLayout
from kvstage.storage import LayoutFingerprint, PutStatus
from kvstage.storage.mooncake.admin import PeriodicThread, list_keys
from kvstage.storage.mooncake.store import MooncakeStore

from mooncake_master import free_port

BIG = KVLayout(2, 2, 16, 128, "bfloat16")  # 1 MiB pages of 64 tokens


def pages(n: int, fp: LayoutFingerprint, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return list(torch.randn(n, fp.page_bytes // 2, generator=generator).to(torch.bfloat16))


def new_keys(n: int) -> list[str]:
    return [uuid.uuid4().hex for _ in range(n)]


def test_list_keys_names_one_key_space(mooncake_master, fingerprint):
    other = LayoutFingerprint("listing-other", fingerprint.layout, fingerprint.page_size)
    fp = LayoutFingerprint(f"listing-{uuid.uuid4().hex[:8]}", fingerprint.layout, fingerprint.page_size)
    with MooncakeStore(fp, mooncake_master.url()) as store, MooncakeStore(other, mooncake_master.url()) as rest:
        keys = new_keys(3)
        store.put(keys, pages(3, fp, seed=1))
        rest.put(new_keys(2), pages(2, other, seed=2))
        listed = list_keys(mooncake_master.admin_address, fp.prefix())
        assert sorted(listed) == sorted(fp.prefix() + key for key in keys)
        assert len(list_keys(mooncake_master.admin_address, "")) >= 5
        store.clear()
        assert list_keys(mooncake_master.admin_address, fp.prefix()) == []
    with pytest.raises(StorageError, match="get_all_keys failed .*admin_address must be the master's admin server"):
        list_keys(f"127.0.0.1:{free_port()}", "", timeout_s=1.0)


def test_periodic_thread_runs_until_stopped_and_survives_a_failing_round():
    calls: list[int] = []
    done = threading.Event()

    def round_() -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("first round fails")
        if len(calls) == 3:
            done.set()

    thread = PeriodicThread(0.01, round_, "test-periodic").start()
    assert done.wait(5.0)
    thread.stop()
    count = len(calls)
    time.sleep(0.05)
    assert len(calls) == count >= 3  # stopped: no round after stop() returned
    thread.stop()  # idempotent
    with pytest.raises(InvalidArgumentError, match="interval_s: must be positive"):
        PeriodicThread(0, round_, "never")


def wait_rounds(store: MooncakeStore, rounds: int, timeout_s: float = 20.0) -> None:
    """Wait until the store's watcher compared ``rounds`` more listings."""
    target = store.watch_rounds + rounds
    deadline = time.monotonic() + timeout_s
    while store.watch_rounds < target:
        assert time.monotonic() < deadline, f"the watcher ran {store.watch_rounds} of {target} rounds"
        time.sleep(0.02)


def test_a_watcher_announces_evictions_of_pages_another_client_stored(mooncake_master):
    # Two engines: A watches, B writes 1 MiB pages until the master evicts (two 16 MiB
    # segments). A never asks for B's pages, yet announces the ones the master evicted.
    fp = LayoutFingerprint(f"watch-{uuid.uuid4().hex[:8]}", BIG, 64)
    small = mooncake_master.url(segment="16MiB", buffer="16MiB")
    with (
        MooncakeStore(fp, mooncake_master.url(segment="16MiB", buffer="16MiB", watch=0.1)) as a,
        MooncakeStore(fp, small) as b,
    ):
        first = new_keys(8)
        assert b.put(first, pages(8, fp, seed=3)) == [PutStatus.STORED] * 8
        wait_rounds(a, 2)  # a listing after the put: A knows the first batch
        stored = list(first)
        for i in range(40):
            keys = new_keys(8)
            answer = b.put(keys, pages(8, fp, seed=4 + i))
            stored += [k for k, status in zip(keys, answer) if status is PutStatus.STORED]
        wait_rounds(a, 2)
        events = a.take_events()
        evicted = [e.key for e in events]
        assert {e.kind for e in events} == {"evicted"} and len(evicted) == len(set(evicted))  # each once
        assert set(evicted) <= set(stored) and a.exists(evicted) == [False] * len(evicted)
        first_gone = {k for k, hit in zip(first, b.exists(first)) if not hit}
        assert first_gone and first_gone <= set(evicted)  # every page A saw listed and is gone
        assert a.exists(evicted) == [False] * len(evicted) and a.take_events() == []  # not again
    assert not [t for t in threading.enumerate() if t.name == "kvstage-mooncake-watch"]  # close stopped it


def test_a_watcher_does_not_announce_what_its_own_clear_removed(mooncake_master, fingerprint):
    fp = LayoutFingerprint(f"watchclear-{uuid.uuid4().hex[:8]}", fingerprint.layout, fingerprint.page_size)
    with MooncakeStore(fp, mooncake_master.url(watch=0.05)) as a, MooncakeStore(fp, mooncake_master.url()) as b:
        keys = new_keys(4)
        b.put(keys, pages(4, fp, seed=50))
        wait_rounds(a, 2)
        assert a.clear() == 4
        wait_rounds(a, 2)
        events = a.take_events()
        assert sorted(e.key for e in events) == sorted(keys) and {e.kind for e in events} == {"removed"}


def test_a_masters_three_ports_are_distinct():
    """Its metadata server and admin server once got the same port (picked one after another): the
    master exited with "Address already in use" and four sglang tests errored at setup."""
    from mooncake_master import free_ports

    for _ in range(50):
        ports = free_ports(3)
        assert len(set(ports)) == 3, ports
