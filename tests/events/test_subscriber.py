"""KVEventSubscriber, the reference consumer: seq order, holes filled by replay (from kvstage's
publisher and from a hand-driven PUB/ROUTER pair speaking the protocol), what cannot be
replayed counted as gaps, a restarted publisher counted as a reset."""

from __future__ import annotations

import time

import pytest
import zmq

from kvstage.errors import InvalidArgumentError
from kvstage.events import BlockRemoved, KVEventPublisher, KVEventSubscriber
from kvstage.events.wire import KVEventBatch, encode_batch

END = (-1).to_bytes(8, "big", signed=True)


def payload(i: int) -> bytes:
    return encode_batch(KVEventBatch(float(i), [BlockRemoved([i])], 0))


class HandPublisher:
    """A PUB and a ROUTER socket driven by the test: it decides what goes live and what replays."""

    def __init__(self, answer_replay: bool = True) -> None:
        context = zmq.Context.instance()
        self.pub = context.socket(zmq.PUB)
        self.router = context.socket(zmq.ROUTER)
        for sock in (self.pub, self.router):
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: dict[int, bytes] = {}
        self.answer_replay = answer_replay
        self.refusal: bytes | None = None  # set: replay answers the end marker alone, saying this
        self.requests: list[int] = []

    def send(self, seq: int, live: bool = True) -> None:
        self.buffer[seq] = payload(seq)
        if live:
            self.pub.send_multipart([b"t", seq.to_bytes(8, "big"), self.buffer[seq]])

    def serve(self) -> None:
        """Answer the replay requests waiting (from a thread: the subscriber blocks on them)."""
        while self.router.poll(0):
            client, _, start = self.router.recv_multipart()
            self.requests.append(int.from_bytes(start, "big"))
            if not self.answer_replay:
                continue
            if self.refusal is not None:
                self.router.send_multipart([client, b"", b"", END, self.refusal])
                continue
            for seq in sorted(self.buffer):
                if seq >= self.requests[-1]:
                    self.router.send_multipart([client, b"", b"t", seq.to_bytes(8, "big"), self.buffer[seq]])
            self.router.send_multipart([client, b"", b"", END, b""])

    def close(self) -> None:
        self.pub.close()
        self.router.close()


def poll_serving(hand: HandPublisher, sub: KVEventSubscriber, count: int, timeout_s: float = 10.0) -> list:
    """Poll ``sub`` while ``hand`` answers replays on a thread, until ``count`` batches came."""
    import threading

    stop = threading.Event()

    def serve():
        while not stop.is_set():
            hand.serve()
            time.sleep(0.005)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    got: list = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < count and time.monotonic() < deadline:
            got += sub.poll(0.05)
    finally:
        stop.set()
        thread.join()
    return got


def connect_hand(hand: HandPublisher, sub: KVEventSubscriber) -> None:
    """Wait until the SUB socket is connected (a message sent before is lost): probe with a raw
    subscriber's view is impossible, so send seq 0 until the subscriber sees it."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        hand.send(0)
        got = sub.poll(0.05)
        if got:
            assert [seq for seq, _ in got] == [0]
            return
    raise AssertionError("the subscriber never connected")


def test_a_hole_in_the_live_stream_is_filled_by_replay_in_seq_order():
    hand = HandPublisher()
    with KVEventSubscriber(hand.endpoint, replay_endpoint=hand.replay_endpoint, topic="t") as sub:
        connect_hand(hand, sub)
        hand.send(1)
        hand.send(2, live=False)  # lost on the way: only replay has it
        hand.send(3, live=False)
        hand.send(4)
        got = poll_serving(hand, sub, 4)
        assert [seq for seq, _ in got] == [1, 2, 3, 4]
        assert [batch.events for _, batch in got] == [[BlockRemoved([i])] for i in (1, 2, 3, 4)]
        assert hand.requests == [2] and sub.replayed == 2 and sub.gaps == 0 and sub.last_seq == 4
    hand.close()


def test_what_replay_does_not_return_is_counted_as_gaps():
    hand = HandPublisher()
    with KVEventSubscriber(hand.endpoint, replay_endpoint=hand.replay_endpoint) as sub:
        connect_hand(hand, sub)
        hand.send(1, live=False)
        del hand.buffer[1]  # older than the publisher's buffer
        hand.send(2, live=False)
        hand.send(3)
        got = poll_serving(hand, sub, 2)
        assert [seq for seq, _ in got] == [2, 3] and sub.gaps == 1 and sub.replayed == 1
    hand.close()


def test_without_a_replay_endpoint_a_hole_is_only_counted():
    hand = HandPublisher()
    with KVEventSubscriber(hand.endpoint) as sub:
        connect_hand(hand, sub)
        hand.send(5)
        got = poll_serving(hand, sub, 1)
        assert [seq for seq, _ in got] == [5] and sub.gaps == 4 and sub.replayed == 0
    hand.close()


def test_a_replay_that_never_answers_ends_after_its_timeout_as_gaps():
    hand = HandPublisher(answer_replay=False)
    with KVEventSubscriber(hand.endpoint, replay_endpoint=hand.replay_endpoint, replay_timeout_s=0.3) as sub:
        connect_hand(hand, sub)
        hand.send(3)
        started = time.monotonic()
        got = poll_serving(hand, sub, 1)
        assert 0.25 < time.monotonic() - started < 5
        assert [seq for seq, _ in got] == [3] and sub.gaps == 2 and hand.requests == [1]
    hand.close()


def test_a_replay_the_publisher_refuses_ends_at_once_as_gaps_and_logs_why(caplog):
    hand = HandPublisher()
    hand.refusal = b"bad replay request: start_seq is 4 bytes, want 8 (big-endian)"
    with KVEventSubscriber(hand.endpoint, replay_endpoint=hand.replay_endpoint, replay_timeout_s=5) as sub:
        connect_hand(hand, sub)
        hand.send(3)
        started = time.monotonic()
        got = poll_serving(hand, sub, 1)
        assert time.monotonic() - started < 2  # not the replay's timeout
        assert [seq for seq, _ in got] == [3] and sub.gaps == 2 and sub.replayed == 0 and hand.requests == [1]
    assert f"refused: {hand.refusal.decode()}" in caplog.text
    hand.close()


def test_a_late_subscriber_replays_the_publishers_buffer_from_seq_zero(connected):
    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        for i in range(50):
            pub.publish([BlockRemoved([i])])
        time.sleep(0.1)
        with KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint) as sub:
            got = connected(pub, sub)  # a probe's first arrival replays everything before it
            seqs = [seq for seq, _ in got]
            assert seqs == list(range(len(seqs))) and len(seqs) >= 2
            events = [event for _, batch in got for event in batch.events]
            assert events[:50] == [BlockRemoved([i]) for i in range(50)]
            assert sub.gaps == 0 and sub.replayed == seqs[-1]


def test_a_late_subscriber_counts_what_fell_out_of_the_buffer(connected):
    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=10) as pub:
        for i in range(50):  # one batch each: the sender keeps up when nothing else runs
            pub.publish([BlockRemoved([i])])
            time.sleep(0.002)
        time.sleep(0.1)
        sent = pub.published
        with KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint) as sub:
            got = connected(pub, sub)
            last = got[-1][0]
            assert last >= sent > 10
            # The buffer holds the last 10 batches, the probe that arrived among them: the rest are gaps.
            assert [seq for seq, _ in got] == list(range(last - 9, last + 1))
            assert sub.gaps == last - 9 and sub.replayed == 9


def rebind(endpoint: str, replay_endpoint: str) -> KVEventPublisher:
    """A publisher on the ports a closed one held (ZMQ releases them shortly after close)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return KVEventPublisher(endpoint, replay_endpoint=replay_endpoint)
        except InvalidArgumentError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_restarted_publisher_is_counted_as_a_reset_and_followed(connected, collect):
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    endpoint, replay_endpoint = pub.endpoint, pub.replay_endpoint
    with KVEventSubscriber(endpoint, replay_endpoint=replay_endpoint) as sub:
        connected(pub, sub)
        for i in range(20):  # one batch each, so the old seq ends well above where the new one starts
            sent = pub.published
            pub.publish([BlockRemoved([i])])
            while pub.published == sent:
                time.sleep(0.001)
        got = collect(sub, 1)
        while sub.last_seq < pub.published - 1:
            got += sub.poll(0.05)
        before = sub.last_seq
        assert before >= 20 and sub.resets == 0
        assert [event for _, batch in got for event in batch.events][-20:] == [BlockRemoved([i]) for i in range(20)]
        pub.close()
        pub = rebind(endpoint, replay_endpoint)  # same ports, seq from 0
        got = connected(pub, sub)
        assert sub.resets == 1 and got[-1][0] < before
        assert [seq for seq, _ in got] == list(range(got[-1][0] + 1))  # replayed from 0 like a first contact
    pub.close()


def test_bad_arguments_and_poll_after_close_raise():
    with pytest.raises(InvalidArgumentError, match=r"^endpoint: must be a str"):
        KVEventSubscriber(None)
    with pytest.raises(InvalidArgumentError, match=r"^replay_timeout_s: must be a number of seconds"):
        KVEventSubscriber("tcp://127.0.0.1:1", replay_timeout_s=-1)
    sub = KVEventSubscriber("tcp://127.0.0.1:1")
    with pytest.raises(InvalidArgumentError, match=r"^timeout_s: must be a number of seconds"):
        sub.poll("1")
    sub.close()
    sub.close()
    with pytest.raises(InvalidArgumentError, match=r"^subscriber: poll\(\) after close\(\)"):
        sub.poll(0)


@pytest.mark.parametrize("argument", ["endpoint", "replay_endpoint"])
def test_an_endpoint_zmq_cannot_connect_to_is_refused_naming_the_argument_and_the_rule(argument):
    endpoints = {"endpoint": "tcp://127.0.0.1:1", argument: "nonsense"}
    with pytest.raises(InvalidArgumentError, match=rf"^{argument}: cannot connect to 'nonsense' \(a ZMQ endpoint"):
        KVEventSubscriber(endpoints["endpoint"], replay_endpoint=endpoints.get("replay_endpoint"))
