"""A store's I/O threads (kvstage.storage.io_threads.IoThreads): named threads started on first
use, results and errors through futures, map returning only once every call ended, a close
that a later call undoes, and work run on the caller when the pool refuses it."""

from __future__ import annotations

import threading
import time

import pytest

from kvstage.storage.io_threads import IoThreads


def test_work_runs_on_the_named_threads_and_its_result_or_error_comes_back():
    io = IoThreads(2, "test-io")
    try:
        assert io.submit(lambda a, b: (a + b, threading.current_thread().name), 2, 3).result(timeout=10)[0] == 5
        name = io.submit(lambda: threading.current_thread().name).result(timeout=10)
        assert name.startswith("test-io") and name != threading.current_thread().name
        with pytest.raises(ZeroDivisionError):
            io.submit(lambda: 1 / 0).result(timeout=10)
    finally:
        io.close()


def test_map_returns_once_every_call_ended_in_order_on_at_most_its_threads():
    io = IoThreads(2, "test-io")
    running, peak, lock = [0], [0], threading.Lock()

    def slow(value: int) -> int:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        return value * 10

    try:
        futures = io.map(slow, range(6))
        assert all(future.done() for future in futures)
        assert [future.result() for future in futures] == [0, 10, 20, 30, 40, 50]
        assert peak[0] == 2
    finally:
        io.close()


def test_a_closed_pool_starts_again_at_the_next_call_and_close_is_idempotent():
    io = IoThreads(1, "test-io")
    first = io.submit(threading.current_thread).result(timeout=10)
    io.close()
    assert not first.is_alive()  # stopped, after its work
    io.close()
    second = io.submit(threading.current_thread).result(timeout=10)
    assert second is not first and second.is_alive() and second is not threading.current_thread()
    io.close()
    assert not second.is_alive()


def test_work_the_pool_refuses_runs_on_the_calling_thread(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    def refuse(self, *args, **kwargs):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(ThreadPoolExecutor, "submit", refuse)
    io = IoThreads(2, "test-io")
    future = io.submit(threading.get_ident)
    assert future.done() and future.result() == threading.get_ident()
    io.close()
