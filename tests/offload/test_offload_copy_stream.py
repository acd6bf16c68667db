"""Copy streams: CPU worker runs copies in order and completes events asynchronously; the
manual stream completes them in any order; on CUDA copies wait for the producer stream."""

from __future__ import annotations

import threading

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.offload import CopyStream, ManualCopyStream


def test_cpu_events_complete_asynchronously_and_in_order():
    stream = CopyStream("cpu")
    gate = threading.Event()
    ran: list[int] = []

    def first() -> None:
        assert gate.wait(10)
        ran.append(1)

    events = [stream.submit(first), stream.submit(lambda: ran.append(2), keep=[torch.zeros(1)])]
    assert [e.query() for e in events] == [False, False]  # held by the worker
    assert events[0].seconds is None
    gate.set()
    events[1].synchronize()
    assert ran == [1, 2] and all(e.query() for e in events)
    assert events[0].seconds > 0 and events[0].error is None
    stream.close()
    stream.close()


def test_cpu_copy_error_is_kept_on_its_event_and_the_worker_goes_on():
    stream = CopyStream("cpu")
    bad = stream.submit(lambda: 1 / 0)
    good = stream.submit(lambda: None)
    stream.synchronize()
    assert isinstance(bad.error, ZeroDivisionError) and good.error is None
    assert bad.query() and good.query()
    stream.close()


def test_cpu_copy_moves_bytes():
    stream = CopyStream("cpu")
    source, target = torch.arange(10.0), torch.zeros(10)
    stream.submit(lambda: target.copy_(source)).synchronize()
    assert torch.equal(target, source)
    stream.close()


def test_manual_stream_completes_in_the_order_the_test_chooses():
    stream = ManualCopyStream()
    ran: list[str] = []
    a, b, c = (stream.submit(lambda name=name: ran.append(name)) for name in "abc")
    assert not stream.in_order and stream.pending == [a, b, c]
    stream.complete(2)
    stream.complete(a)
    assert ran == ["c", "a"] and a.query() and not b.query() and c.query()
    stream.complete(b, error=RuntimeError("injected"))
    assert ran == ["c", "a"] and isinstance(b.error, RuntimeError) and b.query()
    with pytest.raises(InvalidArgumentError, match="^which: no pending copy 0"):
        stream.complete(0)
    with pytest.raises(InvalidArgumentError, match="^which: not a pending handle"):
        stream.complete(a)


def test_manual_stream_can_skip_running_copies():
    stream = ManualCopyStream(run_copies=False)
    ran: list[int] = []
    event = stream.submit(lambda: ran.append(1))
    event.synchronize()
    assert event.query() and ran == [] and stream.submitted == 1


@pytest.mark.gpu
def test_cuda_copy_waits_for_the_producer_stream():
    stream = CopyStream("cuda")
    a = torch.randn(2048, 2048, device="cuda")
    product = a @ a  # queued on the current stream
    target = torch.empty(product.shape, pin_memory=True)
    event = stream.submit(lambda: target.copy_(product, non_blocking=True), keep=[product])
    event.synchronize()
    assert event.query() and event.seconds > 0
    torch.testing.assert_close(target, (a @ a).cpu())
