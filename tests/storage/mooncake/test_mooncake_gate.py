"""ClearGate and BufferPool (kvstage.storage.mooncake.gate) on their own, without Mooncake."""

from __future__ import annotations

import threading

import pytest

from kvstage.errors import InvalidArgumentError
from kvstage.storage.mooncake.gate import BufferPool, ClearGate


def started(function) -> threading.Thread:
    thread = threading.Thread(target=function, daemon=True)
    thread.start()
    return thread


def test_shared_holders_hold_the_gate_together():
    gate = ClearGate()
    both_inside = threading.Barrier(2, timeout=5)
    passed = []

    def holder() -> None:
        with gate.shared():
            both_inside.wait()  # breaks (raises) unless the other holder is inside too
            passed.append(True)

    threads = [started(holder), started(holder)]
    for thread in threads:
        thread.join(10)
    assert passed == [True, True]


def test_exclusive_waits_for_shared_holders_and_blocks_new_ones():
    gate = ClearGate()
    order: list[str] = []
    inside, leave = threading.Event(), threading.Event()

    def reader() -> None:
        with gate.shared():
            inside.set()
            leave.wait(10)
            order.append("first shared left")

    def clearer() -> None:
        with gate.exclusive():
            order.append("exclusive")

    def late_reader() -> None:
        with gate.shared():
            order.append("late shared")

    first = started(reader)
    assert inside.wait(5)
    clearing = started(clearer)
    clearing.join(0.3)
    assert clearing.is_alive() and order == []  # waits for the shared holder
    # A private count: nothing public says the clearer is queued, and the late reader must come after it.
    while not gate._exclusive_waiting:
        threading.Event().wait(0.01)
    late = started(late_reader)
    late.join(0.3)
    assert late.is_alive()  # a waiting exclusive holder goes first
    leave.set()
    for thread in (first, clearing, late):
        thread.join(10)
    assert order == ["first shared left", "exclusive", "late shared"]


def test_exclusive_holders_take_turns_and_the_gate_reopens_after_an_error():
    gate = ClearGate()
    with pytest.raises(RuntimeError):
        with gate.exclusive():
            raise RuntimeError("clear failed")
    with gate.exclusive():
        pass
    with gate.shared():
        pass


def test_buffer_pool_lends_distinct_buffers_up_to_its_limit_then_waits():
    made: list[bytearray] = []

    def make() -> bytearray:
        made.append(bytearray(8))
        return made[-1]

    pool = BufferPool(make, limit=2)
    with pool.lend() as first, pool.lend() as second:
        assert first is not second and len(made) == 2
        got: list = []

        def borrower() -> None:
            with pool.lend() as third:
                got.append(third)

        waiting = started(borrower)
        waiting.join(0.3)
        assert waiting.is_alive() and got == []  # the limit is reached: it waits
    waiting.join(5)
    assert len(got) == 1 and any(got[0] is buffer for buffer in (first, second))
    assert len(made) == 2  # a returned buffer is lent again, never a third made
    assert pool.drain() == made and pool.made == []


def test_buffer_pool_passes_none_on_when_it_cannot_make_one_and_tries_again_later():
    answers = [None, bytearray(4)]
    pool = BufferPool(lambda: answers.pop(0), limit=1)
    with pool.lend() as buffer:
        assert buffer is None
    with pool.lend() as buffer:
        assert buffer == bytearray(4)
    assert len(pool.made) == 1


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "2"])
def test_buffer_pool_refuses_a_limit_that_is_not_a_positive_int(limit):
    with pytest.raises(InvalidArgumentError, match=r"limit: must be an int >= 1"):
        BufferPool(lambda: None, limit)
