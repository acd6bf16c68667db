"""KVEventPublisher: vLLM's frames on PUB, a monotonic seq, replay over ROUTER with its end
marker, the bounded replay buffer and pending queue, and bad arguments."""

from __future__ import annotations

import time

import pytest
import zmq

from kvstage.errors import InvalidArgumentError
from kvstage.events import BlockRemoved, BlockStored, KVEventPublisher
from kvstage.events.wire import decode_batch


def publish_each(pub: KVEventPublisher, calls: list[list]) -> None:
    """Publish each call's events as a batch of its own: wait for it to be sent before the next."""
    for events in calls:
        sent = pub.published
        pub.publish(events)
        deadline = time.monotonic() + 10
        while pub.published == sent:
            assert time.monotonic() < deadline, "the sending thread sent nothing"
            time.sleep(0.001)


def raw_subscriber(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def replay(endpoint: str, start_seq: int, timeout_ms: int = 5000) -> list[list[bytes]]:
    """The replies to one replay request, the end marker included."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        replies = []
        while sock.poll(timeout_ms):
            replies.append(sock.recv_multipart())
            if replies[-1][2] == (-1).to_bytes(8, "big", signed=True):
                return replies
        raise AssertionError(f"no end marker after {replies!r}")
    finally:
        sock.close()


def test_binding_port_zero_exposes_the_bound_ports():
    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":0")
        assert pub.replay_endpoint.startswith("tcp://127.0.0.1:") and pub.replay_endpoint != pub.endpoint


def test_frames_are_topic_seq_payload_with_seq_counting_up_by_one():
    with KVEventPublisher("tcp://127.0.0.1:0", topic="engine-7", data_parallel_rank=2) as pub:
        sub = raw_subscriber(pub.endpoint)
        try:
            deadline = time.monotonic() + 10
            while not sub.poll(20):  # slow joiner: publish until the SUB socket is connected
                assert time.monotonic() < deadline
                pub.publish([BlockRemoved([0])])
            while sub.poll(100):
                first = sub.recv_multipart()
            sent = [BlockStored([10 + i], None, [i] * 4, 4) for i in range(5)]
            publish_each(pub, [[event] for event in sent])
            frames = []
            while len(frames) < 5 and sub.poll(5000):
                frames.append(sub.recv_multipart())
        finally:
            sub.close()
    assert [len(f) for f in frames] == [3] * 5 and {f[0] for f in frames} == {b"engine-7"}
    assert all(len(f[1]) == 8 for f in frames)
    start = int.from_bytes(first[1], "big") + 1
    assert [int.from_bytes(f[1], "big") for f in frames] == list(range(start, start + 5))
    batches = [decode_batch(f[2]) for f in frames]
    assert [batch.events for batch in batches] == [[event] for event in sent]
    assert {batch.data_parallel_rank for batch in batches} == {2}


def test_calls_queued_while_the_sender_is_busy_go_out_as_one_batch_in_call_order(monkeypatch):
    release, encoding = stall_encoding(monkeypatch)
    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        pub.publish([BlockRemoved([0])])
        assert encoding.wait(10)  # the sender holds batch 0
        for i in range(1, 4):
            pub.publish([BlockRemoved([i]), BlockRemoved([10 + i])])
        release.set()
        time.sleep(0.2)
        replies = replay(pub.replay_endpoint, 0)
        assert pub.published == 2 and pub.events_published == 7
    assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [0, 1]
    assert decode_batch(replies[1][3]).events == [BlockRemoved([n]) for i in range(1, 4) for n in (i, 10 + i)]


def stall_encoding(monkeypatch):
    """Make the sending thread wait in its first encoding until ``release`` is set; ``encoding``
    is set once it waits."""
    import threading

    import kvstage.events.publisher as publisher_module

    release, encoding = threading.Event(), threading.Event()
    real_encode = publisher_module.encode_batch

    def stalled_encode(batch):
        encoding.set()
        release.wait(10)
        return real_encode(batch)

    monkeypatch.setattr(publisher_module, "encode_batch", stalled_encode)
    return release, encoding


def test_replay_sends_buffered_batches_from_start_seq_then_the_end_marker():
    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", topic="t") as pub:
        publish_each(pub, [[BlockRemoved([i])] for i in range(6)])
        replies = replay(pub.replay_endpoint, 2)
    assert [r[0] for r in replies] == [b""] * 5
    assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [2, 3, 4, 5]
    assert [decode_batch(r[3]).events for r in replies[:-1]] == [[BlockRemoved([i])] for i in range(2, 6)]
    assert {r[1] for r in replies[:-1]} == {b"t"}
    assert replies[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]


def test_the_replay_buffer_keeps_the_last_buffer_steps_batches():
    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=3) as pub:
        publish_each(pub, [[BlockRemoved([i])] for i in range(20)])
        replies = replay(pub.replay_endpoint, 0)
    assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [17, 18, 19]
    assert [decode_batch(r[3]).events for r in replies[:-1]] == [[BlockRemoved([i])] for i in (17, 18, 19)]


def test_a_full_pending_queue_drops_the_events_and_skips_a_seq(monkeypatch):
    release, encoding = stall_encoding(monkeypatch)
    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", max_pending=1) as pub:
        pub.publish([BlockRemoved([0])])
        assert encoding.wait(10)  # the sender holds batch 0
        started = time.perf_counter()
        for i in range(1, 4):  # 1 waits; 2 and 3 find the queue full
            pub.publish([BlockRemoved([i])])
        assert time.perf_counter() - started < 0.5  # publish did not wait for the stalled sender
        release.set()
        time.sleep(0.2)
        replies = replay(pub.replay_endpoint, 0)
        assert pub.dropped == 2 and pub.published == 2
    assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [0, 2]  # seq 1 stands for the dropped
    assert [decode_batch(r[3]).events for r in replies[:-1]] == [[BlockRemoved([0])], [BlockRemoved([1])]]


def test_an_empty_list_is_not_sent():
    with KVEventPublisher("tcp://127.0.0.1:0") as pub:
        pub.publish([])
        publish_each(pub, [[BlockRemoved([1])]])
        assert pub.published == 1 and pub.events_published == 1


def test_a_subscriber_gets_what_was_published_before_close(publisher, connected):
    from kvstage.events import KVEventSubscriber

    with KVEventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint) as sub:
        connected(publisher, sub)
        publisher.publish([BlockRemoved([42])])
        publisher.close()
        got = sub.poll(2.0)
    assert got and got[-1][1].events == [BlockRemoved([42])]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"buffer_steps": 0}, r"^buffer_steps: must be an int >= 1"),
        ({"hwm": 1.5}, r"^hwm: must be an int >= 1"),
        ({"max_pending": True}, r"^max_pending: must be an int >= 1"),
        ({"max_batch": 0}, r"^max_batch: must be an int >= 1"),
        ({"topic": b"x"}, r"^topic: must be a str"),
        ({"replay_endpoint": 5}, r"^replay_endpoint: must be None or a str"),
        ({"data_parallel_rank": "0"}, r"^data_parallel_rank: must be an int"),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        KVEventPublisher("tcp://127.0.0.1:0", **kwargs)


def test_an_endpoint_that_cannot_be_bound_is_named():
    with KVEventPublisher("tcp://127.0.0.1:0") as pub:
        with pytest.raises(InvalidArgumentError, match=r"^endpoint: cannot bind 'tcp://127.0.0.1:\d+'"):
            KVEventPublisher(pub.endpoint)
    with pytest.raises(InvalidArgumentError, match=r"^replay_endpoint: cannot bind 'nope'"):
        KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="nope")


def test_publish_after_close_raises_and_close_is_idempotent():
    pub = KVEventPublisher("tcp://127.0.0.1:0")
    pub.close()
    pub.close()
    with pytest.raises(InvalidArgumentError, match=r"^publisher: publish\(\) after close\(\)"):
        pub.publish([BlockRemoved([1])])
    with pytest.raises(InvalidArgumentError, match=r"^events: must be a list"):
        KVEventPublisher("tcp://127.0.0.1:0").publish(BlockRemoved([1]))


def test_deferred_calls_run_on_the_sender_in_call_order_and_one_without_events_takes_no_seq(monkeypatch):
    import threading

    release, encoding = stall_encoding(monkeypatch)
    ran_on: list = []

    def deferred(events):
        def make(batcher):
            ran_on.append(threading.current_thread().name)
            batcher.add(events)

        return make

    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        pub.publish([BlockRemoved([0])])
        assert encoding.wait(10)  # the sender holds batch 0: the next calls join one batch
        pub.publish(deferred([BlockStored([1], None, [1, 1], 2)]))
        pub.publish([BlockRemoved([7])])
        pub.publish(deferred([]))
        pub.publish(deferred([BlockStored([2], None, [2, 2], 2), BlockStored([3], 2, [3, 3], 2)]))
        release.set()
        assert pub.flush(10)
        pub.publish(deferred([]))  # nothing to send: no batch, no seq
        publish_each(pub, [[BlockRemoved([9])]])
        replies = replay(pub.replay_endpoint, 0)
        assert pub.published == 3 and pub.dropped == 0
    assert ran_on == ["kvstage-kv-events"] * 4
    assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [0, 1, 2]  # no seq gap
    assert decode_batch(replies[1][3]).events == [
        BlockStored([1], None, [1, 1], 2),
        BlockRemoved([7]),
        BlockStored([2, 3], None, [2, 2, 3, 3], 2),  # a chain's consecutive runs joined
    ]
    assert decode_batch(replies[2][3]).events == [BlockRemoved([9])]


def test_a_deferred_call_that_raises_loses_only_its_events():
    def broken(batcher):
        raise RuntimeError("boom")

    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        pub.publish(broken)
        publish_each(pub, [[BlockRemoved([4])]])
        replies = replay(pub.replay_endpoint, 0)
    assert [decode_batch(r[3]).events for r in replies[:-1]] == [[BlockRemoved([4])]]


def test_publishing_neither_a_list_nor_a_callable_is_refused_naming_the_argument():
    with KVEventPublisher("tcp://127.0.0.1:0") as pub:
        with pytest.raises(InvalidArgumentError, match=r"^events: must be a list of KV events or a callable"):
            pub.publish((BlockRemoved([1]),))


def test_flush_waits_for_what_was_published_before_it_and_is_true_after_close():
    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", linger_s=0.05) as pub:
        for i in range(50):
            pub.publish([BlockRemoved([i])])
        assert pub.flush(10)
        assert pub.events_published == 50  # every one sent when flush returned, lingering or not
    assert pub.flush(1)  # closed: everything queued was sent


def test_a_stream_of_calls_goes_out_in_at_most_one_batch_a_linger():
    # Before: calls that came while a batch was sent went out at once after it, so with a
    # slow send the sender sent back to back (one message a send's time, not a linger's).
    linger_s, calls = 0.02, 200
    with KVEventPublisher("tcp://127.0.0.1:0", linger_s=linger_s) as pub:
        send = pub._send

        def slow_send(batch):
            time.sleep(0.005)
            send(batch)

        pub._send = slow_send
        started = time.monotonic()
        for i in range(calls):
            pub.publish([BlockRemoved([i])])
            time.sleep(0.001)
        assert pub.flush(10)
        elapsed = time.monotonic() - started
        assert pub.events_published == calls
        assert pub.published <= elapsed / linger_s + 2


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("BlockRemoved", r"^events: each must be a BlockStored, BlockRemoved or AllBlocksCleared, got str"),
        (BlockRemoved([1 << 64]), r"^events: block_hashes must be ints in \[0, 2\*\*64\), got 18446744073709551616"),
        (BlockRemoved([-1]), r"^events: block_hashes must be ints in \[0, 2\*\*64\), got -1"),
        (BlockStored([1], 1 << 64, [0, 0], 2), r"^events: parent_block_hash must be None or an int in \[0, 2\*\*64\)"),
        (BlockStored([1], None, [0, 1.5], 2), r"^events: token_ids must be ints in \[0, 2\*\*64\), got 1.5"),
        (BlockStored([1], None, [0, 0], 0), r"^events: block_size must be an int >= 1, got 0"),
    ],
)
def test_a_list_with_an_event_the_format_cannot_carry_is_refused_on_the_callers_thread_and_the_others_go_out(
    monkeypatch, bad, message
):
    release, encoding = stall_encoding(monkeypatch)
    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        pub.publish([BlockRemoved([0])])
        assert encoding.wait(10)  # the sender holds batch 0: the next calls would join one batch
        pub.publish([BlockRemoved([1])])
        with pytest.raises(InvalidArgumentError, match=message):
            pub.publish([BlockRemoved([5]), bad])
        pub.publish([BlockStored([2], None, [2, 2], 2)])
        release.set()
        assert pub.flush(10)
        replies = replay(pub.replay_endpoint, 0)
        assert pub.dropped == 0
    assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [0, 1]
    assert decode_batch(replies[1][3]).events == [BlockRemoved([1]), BlockStored([2], None, [2, 2], 2)]


def test_an_event_a_deferred_call_added_that_cannot_be_encoded_loses_only_itself_and_skips_a_seq(monkeypatch):
    release, encoding = stall_encoding(monkeypatch)
    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        pub.publish([BlockRemoved([0])])
        assert encoding.wait(10)
        pub.publish([BlockRemoved([1])])
        pub.publish(lambda batcher: batcher.add([BlockRemoved([1 << 64])]))  # past the caller's check
        pub.publish([BlockStored([2], None, [2, 2], 2)])
        release.set()
        assert pub.flush(10)
        replies = replay(pub.replay_endpoint, 0)
    assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [0, 2]  # seq 1: the lost event's gap
    assert decode_batch(replies[1][3]).events == [BlockRemoved([1]), BlockStored([2], None, [2, 2], 2)]


@pytest.mark.parametrize(
    ("timeout_s", "message"), [("x", r"^timeout_s: must be a number of seconds"), (-1, r"^timeout_s: must be")]
)
def test_flush_with_a_timeout_that_is_no_duration_is_refused_naming_it(timeout_s, message):
    with KVEventPublisher("tcp://127.0.0.1:0") as pub:
        with pytest.raises(InvalidArgumentError, match=message):
            pub.flush(timeout_s)


def test_a_negative_data_parallel_rank_is_refused_naming_the_rule():
    with pytest.raises(InvalidArgumentError, match=r"^data_parallel_rank: must be an int >= 0, got -3"):
        KVEventPublisher("tcp://127.0.0.1:0", data_parallel_rank=-3)


def test_a_drop_that_no_later_batch_follows_is_shown_by_an_empty_batch_under_the_next_seq(monkeypatch):
    # Before: the skipped seq waited for a later batch with events; with none, no subscriber
    # ever saw the hole and flush() returned True.
    from kvstage.events import KVEventSubscriber

    release, encoding = stall_encoding(monkeypatch)
    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", max_pending=1) as pub:
        with KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, replay_timeout_s=5) as sub:
            pub.publish([BlockRemoved([0])])
            assert encoding.wait(10)  # the sender holds batch 0
            assert pub.publish(lambda batcher: None)  # waits; it adds no events
            assert pub.publish([BlockRemoved([1])]) is False  # the queue is full: dropped
            release.set()
            assert pub.flush(10)
            replies = replay(pub.replay_endpoint, 0)
            assert pub.dropped == 1 and pub.published == 2 and pub.events_published == 1
            got: list = []
            deadline = time.monotonic() + 10
            while not got or got[-1][0] < 3:  # (slow joiner: publish until one arrives)
                assert time.monotonic() < deadline, f"the subscriber got {got!r}"
                publish_each(pub, [[BlockRemoved([2])]])  # sent before the next: max_pending drops none
                got += sub.poll(0.05)
            assert pub.dropped == 1 and sub.gaps == 1  # the dropped call's seq, whatever it got live and what by replay
    assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [0, 2]  # seq 1 stands for the dropped call
    assert [decode_batch(r[3]).events for r in replies[:-1]] == [[BlockRemoved([0])], []]
    assert [(seq, batch.events) for seq, batch in got[:3]] == [
        (0, [BlockRemoved([0])]),
        (2, []),
        (3, [BlockRemoved([2])]),
    ]


def test_a_call_dropped_elsewhere_with_nothing_queued_is_shown_by_an_empty_batch_before_flush_returns():
    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        publish_each(pub, [[BlockRemoved([0])]])
        pub.dropped_elsewhere()  # an announcer's own queue was full
        assert pub.flush(10)
        replies = replay(pub.replay_endpoint, 0)
        assert pub.dropped == 1 and pub.published == 2
    assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [0, 2]
    assert [decode_batch(r[3]).events for r in replies[:-1]] == [[BlockRemoved([0])], []]


def test_a_deferred_call_whose_only_events_cannot_be_encoded_shows_its_skipped_seq_by_an_empty_batch():
    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        publish_each(pub, [[BlockRemoved([0])]])
        pub.publish(lambda batcher: batcher.add([BlockRemoved([1 << 64])]))  # past the caller's check
        assert pub.flush(10)
        replies = replay(pub.replay_endpoint, 0)
    assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [0, 2]  # seq 1: the lost event's
    assert [decode_batch(r[3]).events for r in replies[:-1]] == [[BlockRemoved([0])], []]


@pytest.mark.parametrize(
    ("request_frames", "why"),
    [
        ([(2).to_bytes(8, "big")], "2 frames, want 3 ([identity, b'', start_seq])"),  # no empty delimiter
        ([b"", b"", (2).to_bytes(8, "big")], "4 frames, want 3 ([identity, b'', start_seq])"),
        ([b"", (2).to_bytes(4, "big")], "start_seq is 4 bytes, want 8 (big-endian)"),
    ],
)
def test_a_malformed_replay_request_gets_the_end_marker_at_once_with_why_and_a_log_line_saying_it(
    caplog, request_frames, why
):
    # Before: no reply at all (the requester waited its whole timeout) and a log line naming
    # the frame count only, also where the count was right and start_seq was not 8 bytes.
    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        publish_each(pub, [[BlockRemoved([i])] for i in range(4)])
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(pub.replay_endpoint)
        try:
            sock.send_multipart(request_frames)
            started = time.monotonic()
            assert sock.poll(2000), "no answer to a malformed replay request"
            answer = sock.recv_multipart()
            assert time.monotonic() - started < 1.0
            assert not sock.poll(100)  # the end marker alone: no batch replayed
        finally:
            sock.close()
        good = replay(pub.replay_endpoint, 2)  # the socket still serves well-formed requests
    assert answer == [b"", b"", (-1).to_bytes(8, "big", signed=True), f"bad replay request: {why}".encode()]
    assert f"kv events: a replay request refused: {why}" in caplog.text
    assert [int.from_bytes(r[2], "big") for r in good[:-1]] == [2, 3] and good[-1][3] == b""


def test_flush_from_a_deferred_call_raises_at_once_and_the_events_it_added_before_go_out():
    # Before: it waited its whole timeout (the sending thread, which sets flush's marker, was
    # the one waiting) and then returned False.
    from kvstage.errors import ThreadingError

    outcome: list = []

    def deferred(batcher):
        batcher.add([BlockRemoved([1])])
        started = time.monotonic()
        try:
            outcome.append(pub.flush(2))
        except ThreadingError as error:
            outcome.append(error)
        outcome.append(time.monotonic() - started)

    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        pub.publish(deferred)
        assert pub.flush(10)
        replies = replay(pub.replay_endpoint, 0)
    error, waited = outcome
    assert isinstance(error, ThreadingError) and waited < 0.5
    assert str(error).startswith("flush: called on the publisher's sending thread (a deferred publish call)")
    assert [decode_batch(r[3]).events for r in replies[:-1]] == [[BlockRemoved([1])]]


def test_close_from_a_deferred_call_stops_the_publisher_after_sending_what_is_queued():
    # Before: close() tried to join the sending thread from itself (RuntimeError, logged as
    # the deferred call raising).
    outcome: list = []

    def closing(batcher):
        batcher.add([BlockRemoved([1])])
        try:
            pub.close()
            outcome.append("closed")
        except RuntimeError as error:
            outcome.append(error)

    pub = KVEventPublisher("tcp://127.0.0.1:0")
    pub.publish(closing)
    pub._thread.join(10)
    assert outcome == ["closed"] and not pub._thread.is_alive()
    assert pub.published == 1 and pub.events_published == 1  # the closing call's batch went out
    with pytest.raises(InvalidArgumentError, match=r"^publisher: publish\(\) after close\(\)"):
        pub.publish([BlockRemoved([2])])
