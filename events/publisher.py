"""``KVEventPublisher``: KV event batches on a ZMQ PUB socket, vLLM's framing, with replay.

Frames (vLLM's ``ZmqEventPublisher``, sglang's alike): ``[topic, seq, payload]``, ``seq`` an
8-byte big-endian counter from 0, ``payload`` a batch in the publisher's ``event_format``
(vLLM's :func:`~kvstage.events.wire.encode_batch` by default). The replay socket
(ZMQ ROUTER) answers a request ``[b"", start_seq]`` with ``[b"", topic, seq, payload]`` for each
buffered batch from ``start_seq`` on, then the end marker ``[b"", b"", seq=-1, b""]``. A
malformed request (not those two frames, or ``start_seq`` not 8 bytes) gets the end marker
alone, its last frame saying why (``b"bad replay request: ..."``), and is logged.

Batches: :meth:`KVEventPublisher.publish` only appends to a queue (no lock); the sending thread
takes what is queued (up to ``max_batch`` publish calls' worth) as one batch, a chain's
consecutive ``BlockStored`` joined as they come (:class:`~kvstage.events.wire.EventBatcher`), at
most one batch a ``linger_s`` while calls keep coming, so a burst or a stream of writes costs one
encoding and one message a ``linger_s``, and the caller never waits for the network.

Checks: a list of events is checked on the caller's thread (one the format cannot carry is
refused, nothing queued), so one bad call cannot make the batch it would join unencodable.

Bounds: the last ``buffer_steps`` batches are kept for replay (older ones are gone: a subscriber
that fell further behind counts them as gaps); publish calls waiting for the sending thread are
at most ``max_pending`` (checked without a lock: threads publishing at once may pass it by one
each), beyond which a call's events are dropped, counted in ``dropped``, and a
seq is skipped so that subscribers see the gap. The PUB socket's own high-water mark (``hwm``)
drops messages to a slow subscriber, which replay refills.

Gaps: a skipped seq (dropped calls, or a deferred call's events that cannot be encoded) goes
out with the next batch; where the calls taken next add no event (or none come), that batch
is an empty one (``[ts, [], data_parallel_rank]``), sent at once, so a subscriber sees the hole
without waiting for later events, and :meth:`KVEventPublisher.flush` returns only after it.
A router asking replay for the skipped seq gets the end marker only: the dropped events are
gone (its cue to resynchronize, as for any replay gap).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

import zmq

from kvstage.errors import InvalidArgumentError, ThreadingError, is_int, require, require_seconds
from kvstage.events.wire import VLLM_FORMAT, EventBatcher, EventFormat, KVEventBatch, check_events, encode_batch

__all__ = ["END_SEQ", "KVEventPublisher"]

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker
# A frame sent by the backend socket's send (copied, int flags): ~0.4 us, where
# send_multipart's Python layer (flag enums, checks a frame) costs ~3 us a frame.
_SEND_FRAME = zmq.backend.Socket.send
_MORE = int(zmq.SNDMORE)
_IDLE_S = 0.01  # the sender checks replay requests at least this often


class KVEventPublisher:
    """Publishes KV event batches (vLLM's format) from a background thread.

    Args:
        endpoint: where the PUB socket binds, e.g. ``"tcp://127.0.0.1:5557"`` or
            ``"tcp://127.0.0.1:0"`` (a free port: read :attr:`endpoint`); subscribers connect.
        replay_endpoint: where the replay ROUTER socket binds (None: no replay).
        topic: the first frame of every message (routers key a stream by it: one per engine).
        buffer_steps: batches kept for replay (>= 1).
        data_parallel_rank: the third field of every batch (an int >= 0).
        hwm: the PUB socket's send high-water mark, messages (>= 1).
        max_pending: publish calls waiting for the sending thread at most (>= 1).
        max_batch: publish calls the sending thread joins into one batch at most (>= 1).
        linger_s: seconds the sending thread waits after a publish call woke it, gathering more
            calls into the batch, and at least between two batches while calls keep coming
            (>= 0; 0: send at once). One message a ``linger_s`` for a stream of writes (unless
            ``max_batch`` calls wait), at up to twice that much added latency.
        event_format: the engine flavour batches are encoded in and announcers name pages by:
            :data:`~kvstage.events.wire.VLLM_FORMAT` (default) or
            :data:`~kvstage.events.sglang_format.SGLANG_FORMAT`.

    Attributes:
        endpoint / replay_endpoint: the bound addresses (the port chosen for ``:0``).
        published: batches sent (empty ones showing a gap included). events_published: events in them.
        dropped: publish calls whose events were dropped (a full pending queue).

    Raises:
        InvalidArgumentError: a bound is not a positive int, an endpoint or the topic is not a
            str, or an endpoint cannot be bound (zmq's error as the cause).

    :meth:`publish` may be called from any thread and never blocks on the network.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10000,
        data_parallel_rank: int = 0,
        hwm: int = 100000,
        max_pending: int = 100000,
        max_batch: int = 1024,
        linger_s: float = 0.001,
        event_format: EventFormat = VLLM_FORMAT,
    ) -> None:
        bounds = (("buffer_steps", buffer_steps), ("hwm", hwm), ("max_pending", max_pending), ("max_batch", max_batch))
        for name, value in bounds:
            require(is_int(value) and value >= 1, name, lambda: f"must be an int >= 1, got {value!r}")
        require(isinstance(endpoint, str), "endpoint", lambda: f"must be a str, got {endpoint!r}")
        require(
            replay_endpoint is None or isinstance(replay_endpoint, str),
            "replay_endpoint",
            lambda: f"must be None or a str, got {replay_endpoint!r}",
        )
        require(isinstance(topic, str), "topic", lambda: f"must be a str, got {topic!r}")
        require(
            isinstance(event_format, EventFormat),
            "event_format",
            lambda: f"must be an EventFormat (VLLM_FORMAT, SGLANG_FORMAT), got {event_format!r}",
        )
        self.event_format = event_format
        require(
            is_int(data_parallel_rank) and data_parallel_rank >= 0,
            "data_parallel_rank",
            lambda: f"must be an int >= 0, got {data_parallel_rank!r}",
        )
        self.topic = topic
        self.buffer_steps = buffer_steps
        self.data_parallel_rank = data_parallel_rank
        self.max_pending = max_pending
        self.max_batch = max_batch
        require_seconds(linger_s, "linger_s")
        self.linger_s = float(linger_s)
        self.published = self.events_published = self.dropped = 0
        self._topic = topic.encode()
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            self.endpoint = _bind(self._pub, endpoint, "endpoint")
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))  # a whole replay and its marker
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _bind(self._replay, replay_endpoint, "replay_endpoint")
        except BaseException:
            self._close_sockets()
            raise
        self._seq = 0  # the next batch's (the sending thread's alone)
        # publish calls' events (lists, callables) and flush markers (Events), oldest first
        self._pending: collections.deque = collections.deque()
        self._gap = False  # events were dropped since the last batch: skip a seq
        self._full = threading.Lock()  # the gap flag: set on a drop, taken with a batch
        self._wake = threading.Event()  # set: the sending thread has something to do
        self._buffer: list[tuple[int, bytes]] = []  # the last buffer_steps (seq, payload), oldest first
        self._closed = False
        self._thread = threading.Thread(target=self._send_loop, name="kvstage-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list | Callable[[EventBatcher], Any]) -> bool:
        """Queue ``events`` (:class:`~kvstage.events.BlockStored`,
        :class:`~kvstage.events.BlockRemoved`, :class:`~kvstage.events.AllBlocksCleared`) for
        the next batch, in call order; the sending thread encodes and sends it. Never blocks on
        the network (nor on a lock); an empty list sends nothing. Returns False when the call
        was dropped (``max_pending`` calls waiting: counted in ``dropped``, a seq gap), else True.

        ``events`` may instead be a callable: the sending thread calls it, in call order, with
        the batch's :class:`~kvstage.events.wire.EventBatcher`, and it adds its events there
        (``batcher.add(events)``, ``batcher.stored(...)``): work moved off the caller's thread.
        It must not call :meth:`flush` (that raises: the sending thread cannot wait for itself).

        A list is checked here, on the caller's thread (:func:`~kvstage.events.wire.check_events`:
        one the format cannot carry would make the whole batch it joins unencodable); a
        callable's events are checked when the batch is encoded, where one that cannot be is
        dropped alone (logged, a seq skipped).

        Raises:
            InvalidArgumentError: the publisher is closed, ``events`` is neither a list nor a
                callable, or the list holds an item that is no KV event or whose block hashes,
                token ids or block size the format cannot carry (nothing is queued).
        """
        if type(events) is not list:
            if isinstance(events, list):
                events = list(events)  # a subclass: the sender tells calls apart by type
            elif not callable(events):
                raise InvalidArgumentError(
                    f"events: must be a list of KV events or a callable taking an EventBatcher, "
                    f"got {type(events).__name__}"
                )
        if type(events) is list:
            if not events:
                return True
            check_events(events, self.event_format.hash_range)
        if self._closed:
            raise InvalidArgumentError("publisher: publish() after close()")
        pending = self._pending
        queued = len(pending) < self.max_pending
        if queued:  # a deque's append is atomic: no lock on this path
            pending.append(events)
        else:
            with self._full:
                self.dropped += 1
                self._gap = True
        if not self._wake.is_set():
            self._wake.set()
        return queued

    def dropped_elsewhere(self) -> None:
        """Count one publish call's events as dropped by a caller that bounds its own queue (an
        announcer's): the next batch skips a seq (an empty one where none follows), so
        subscribers see the gap."""
        with self._full:
            self.dropped += 1
            self._gap = True
        if not self._wake.is_set():
            self._wake.set()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until the events of every publish call made before this one are sent (or
        dropped, the skipped seq sent: see the module); True when they are, False after
        ``timeout_s`` seconds (or when the sending thread has ended).

        Raises:
            InvalidArgumentError: ``timeout_s`` is not a number of seconds >= 0.
            ThreadingError: called on the sending thread (from a deferred publish call): it
                would wait for itself, so it fails at once rather than after ``timeout_s``.
        """
        require_seconds(timeout_s, "timeout_s")
        if threading.get_ident() == self._thread.ident:
            raise ThreadingError(
                "flush: called on the publisher's sending thread (a deferred publish call), which would "
                "wait for itself; call it from another thread"
            )
        if not self._thread.is_alive():  # closed: it sent everything queued, unless it timed out
            return not self._pending
        done = threading.Event()
        self._pending.append(done)  # a marker past the bound: the sender sets it once it got there
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        while not done.wait(0.01):
            if time.monotonic() > deadline or not self._thread.is_alive():
                return done.is_set()
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (up to ``timeout_s`` seconds), stop the thread, close the
        sockets. Idempotent. From a deferred publish call (the sending thread): returns at
        once, the thread sending what is queued and stopping after that call.

        Raises:
            InvalidArgumentError: ``timeout_s`` is not a number of seconds >= 0.
        """
        require_seconds(timeout_s, "timeout_s")
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if threading.get_ident() == self._thread.ident:
            return  # it cannot wait for itself
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # it closes the sockets itself when it ends
            logger.warning("kv events: the sending thread did not stop within %.1f s", timeout_s)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                sock.close(linger=0)

    def _send_loop(self) -> None:
        """The sockets' only thread once started: sends queued events, answers replay."""
        pending = self._pending
        taken = 0.0  # when the last round took its batch (monotonic seconds)
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._answer_replay()
            linger = self.linger_s
            if not pending and not self._gap:  # (a gap alone is sent too: an empty batch)
                if self._closed:
                    break
                if not self._wake.wait(_IDLE_S):
                    continue
            elif linger:  # busy: one batch a linger_s at most, so a stream of calls shares them
                linger = taken + linger - time.monotonic()
            if linger > 0 and not self._closed and len(pending) < self.max_batch:
                time.sleep(linger)  # let a burst of calls join this batch
            self._wake.clear()  # before taking: a publish from now on wakes the next round
            taken = time.monotonic()
            while True:
                with self._full:
                    gap, self._gap = self._gap, False
                if not pending and not gap:
                    break
                markers = self._send_batch(pending, gap)
                for marker in markers:
                    marker.set()
                if len(pending) < self.max_batch:
                    break  # the rest waits for the next round's linger
        self._close_sockets()

    def _send_batch(self, pending: collections.deque, gap: bool) -> list:
        """Take up to ``max_batch`` publish calls from ``pending`` and send their events as one
        batch (a seq skipped first after a drop); returns the flush markers met."""
        batcher = EventBatcher()
        markers = []
        popleft = pending.popleft
        for _ in range(min(len(pending), self.max_batch)):
            call = popleft()
            kind = type(call)
            if kind is list:
                batcher.add(call)
            elif kind is threading.Event:
                markers.append(call)
            else:
                try:
                    call(batcher)
                except Exception:
                    logger.exception("kv events: a deferred publish call raised; its events may be incomplete")
        if gap:
            self._seq += 1  # dropped events: subscribers see the hole
        if batcher.events or gap:  # a gap with no events goes out as an empty batch after it
            self._send(KVEventBatch(time.time(), batcher.events, self.data_parallel_rank))
        return markers

    def _send(self, batch: KVEventBatch) -> None:
        seq = self._seq
        self._seq += 1
        try:
            payload = self._encode(batch)
        except Exception:
            # An event a deferred call added that the format cannot carry: it alone is dropped,
            # under a skipped seq (subscribers see the gap), the rest go out.
            logger.exception("kv events: batch %d cannot be encoded; its unencodable events are dropped", seq)
            kept = [event for event in batch.events if self._encodes(event)]  # none: an empty batch
            batch = KVEventBatch(batch.ts, kept, batch.data_parallel_rank)
            payload = self._encode(batch)
            seq = self._seq
            self._seq += 1
        pub = self._pub
        _SEND_FRAME(pub, self._topic, _MORE)
        _SEND_FRAME(pub, seq.to_bytes(8, "big"), _MORE)
        _SEND_FRAME(pub, payload, 0)
        self.published += 1
        self.events_published += len(batch.events)
        self._buffer.append((seq, payload))
        if len(self._buffer) > 2 * self.buffer_steps:  # trimmed in steps: amortized O(1)
            del self._buffer[: -self.buffer_steps]

    def _encode(self, batch: KVEventBatch) -> bytes:
        # vLLM's through this module's name (looked up per call), another flavour's its own
        return encode_batch(batch) if self.event_format is VLLM_FORMAT else self.event_format.encode(batch)

    def _encodes(self, event) -> bool:
        """Whether one event encodes alone in this publisher's format (and fits its hash range)."""
        try:
            check_events([event], self.event_format.hash_range)
            self._encode(KVEventBatch(0.0, [event], self.data_parallel_rank))
        except Exception:
            return False
        return True

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()  # [identity, ...]: ROUTER puts the sender's first
        why = None
        if len(frames) != 3:
            why = f"{len(frames)} frames, want 3 ([identity, b'', start_seq])"
        elif len(frames[2]) != 8:
            why = f"start_seq is {len(frames[2])} bytes, want 8 (big-endian)"
        if why is not None:  # the end marker at once, saying why: the requester need not time out
            logger.warning("kv events: a replay request refused: %s", why)
            self._replay.send_multipart((frames[0], b"", b"", END_SEQ, f"bad replay request: {why}".encode()))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer[-self.buffer_steps :]:
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _bind(sock: zmq.Socket, endpoint: str, name: str) -> str:
    """Bind ``sock`` to ``endpoint``; returns the bound address (the OS's port for ``:0``)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as error:
        raise InvalidArgumentError(f"{name}: cannot bind {endpoint!r}: {error}") from error
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
