"""``KVEventSubscriber``: a small reference consumer of vLLM-format KV events.

It connects a SUB socket to a publisher (kvstage's :class:`~kvstage.events.KVEventPublisher`,
vLLM's or sglang's: the framing is theirs) and, when given the replay endpoint, a DEALER socket
to its replay ROUTER. Sequence numbers are checked: a batch arriving after a hole makes it ask
the replay socket for the missing ones first, so batches come out in seq order; what replay
cannot return (no replay endpoint, older than the publisher's buffer, no answer in time, a
request refused: the end marker saying why, logged) is counted in
:attr:`KVEventSubscriber.gaps`. A seq at or below the last one means the publisher restarted
(its seq starts at 0 again): counted in :attr:`KVEventSubscriber.resets`, and the stream is
followed from there as from a first contact.
"""

from __future__ import annotations

import logging
import time

import zmq

from kvstage.errors import InvalidArgumentError, require, require_seconds
from kvstage.events.publisher import END_SEQ
from kvstage.events.wire import KVEventBatch, decode_batch

__all__ = ["KVEventSubscriber"]

logger = logging.getLogger(__name__)


class KVEventSubscriber:
    """Subscribes to one KV event stream and yields its batches in seq order.

    Args:
        endpoint: the publisher's PUB address, e.g. ``"tcp://127.0.0.1:5557"``.
        replay_endpoint: its replay ROUTER address (None: holes are only counted).
        topic: the topic (prefix) subscribed to; ``""``: every message.
        replay_timeout_s: seconds one replay may take before what has not come is a gap.

    Attributes:
        last_seq: the seq of the last batch returned (None: none yet).
        gaps: batches never received (neither live nor by replay).
        replayed: batches received by replay.
        resets: times the publisher's seq went back (a restarted publisher).
        undecodable: payloads that were no KV event batch (logged, skipped).

    Raises:
        InvalidArgumentError: an endpoint or topic is not a str, an endpoint zmq cannot connect
            to (zmq's error as the cause), or a bad timeout.
    """

    def __init__(
        self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "", replay_timeout_s: float = 1.0
    ) -> None:
        require(isinstance(endpoint, str), "endpoint", lambda: f"must be a str, got {endpoint!r}")
        require(
            replay_endpoint is None or isinstance(replay_endpoint, str),
            "replay_endpoint",
            lambda: f"must be None or a str, got {replay_endpoint!r}",
        )
        require(isinstance(topic, str), "topic", lambda: f"must be a str, got {topic!r}")
        require_seconds(replay_timeout_s, "replay_timeout_s")
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.replay_timeout_s = float(replay_timeout_s)
        self.last_seq: int | None = None
        self.gaps = self.replayed = self.resets = self.undecodable = 0
        context = zmq.Context.instance()
        self._sub = context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._replay = None
        try:
            _connect(self._sub, endpoint, "endpoint")
            if replay_endpoint is not None:
                self._replay = context.socket(zmq.DEALER)
                self._replay.setsockopt(zmq.LINGER, 0)
                _connect(self._replay, replay_endpoint, "replay_endpoint")
        except BaseException:
            self.close()
            raise

    def poll(self, timeout_s: float) -> list[tuple[int, KVEventBatch]]:
        """Wait up to ``timeout_s`` seconds for a message, then take every one waiting.

        Returns:
            ``[(seq, batch), ...]`` in seq order, holes filled by replay where it could.

        Raises:
            InvalidArgumentError: a bad timeout, or the subscriber is closed.
        """
        require_seconds(timeout_s, "timeout_s")
        if self._sub.closed:
            raise InvalidArgumentError("subscriber: poll() after close()")
        out: list[tuple[int, KVEventBatch]] = []
        wait_ms = int(timeout_s * 1000)
        while self._sub.poll(wait_ms):
            wait_ms = 0
            frames = self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                logger.warning("kv events: a message must be [topic, seq 8 bytes, payload], got %d frames", len(frames))
                continue
            self._take(int.from_bytes(frames[1], "big"), frames[2], out)
        return out

    def close(self) -> None:
        """Close the sockets. Idempotent."""
        for sock in (self._sub, self._replay):
            if sock is not None and not sock.closed:
                sock.close(linger=0)

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take(self, seq: int, payload: bytes, out: list) -> None:
        last = self.last_seq
        if last is not None and seq <= last:  # the publisher started over
            self.resets += 1
            last = None
        start = 0 if last is None else last + 1
        if seq > start:
            missed = self._fetch(start, seq)
            self.gaps += seq - start - len(missed)
            for missed_seq in sorted(missed):
                self._emit(missed_seq, missed[missed_seq], out)
        self._emit(seq, payload, out)

    def _emit(self, seq: int, payload: bytes, out: list) -> None:
        self.last_seq = seq
        try:
            out.append((seq, decode_batch(payload)))
        except InvalidArgumentError as error:
            self.undecodable += 1
            logger.warning("kv events: batch %d from %s skipped: %s", seq, self.endpoint, error)

    def _fetch(self, start: int, end: int) -> dict[int, bytes]:
        """The batches ``start <= seq < end`` the replay socket returns (empty without one)."""
        if self._replay is None:
            return {}
        while self._replay.poll(0):  # the rest of an earlier replay that timed out
            self._replay.recv_multipart()
        self._replay.send_multipart((b"", start.to_bytes(8, "big")))
        got: dict[int, bytes] = {}
        deadline = time.monotonic() + self.replay_timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._replay.poll(left_ms):
                logger.warning(
                    "kv events: replay from %s gave no end marker in %.1f s",
                    self.replay_endpoint,
                    self.replay_timeout_s,
                )
                break
            frames = self._replay.recv_multipart()
            if len(frames) != 4:
                logger.warning(
                    "kv events: replay from %s ended: a reply of %d frames, want 4", self.replay_endpoint, len(frames)
                )
                break
            if frames[2] == END_SEQ:
                if frames[3]:  # the publisher refused the request, saying why
                    logger.warning(
                        "kv events: replay from %s refused: %s",
                        self.replay_endpoint,
                        frames[3].decode(errors="replace"),
                    )
                break
            seq = int.from_bytes(frames[2], "big")
            if start <= seq < end:
                got[seq] = frames[3]
        self.replayed += len(got)
        return got


def _connect(sock: zmq.Socket, endpoint: str, name: str) -> None:
    """Connect ``sock`` to ``endpoint``, a zmq error raised as one naming the argument."""
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as error:
        raise InvalidArgumentError(
            f"{name}: cannot connect to {endpoint!r} (a ZMQ endpoint such as 'tcp://HOST:PORT'): {error}"
        ) from error
