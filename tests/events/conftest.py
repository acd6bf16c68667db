"""Helpers of the KV event tests: a manager rig whose store's pages are announced, and a
subscriber that collects what a publisher sent."""

from __future__ import annotations

import time

import pytest

from kvstage.events import BlockRemoved, KVEventPublisher, KVEventSubscriber

PROBE = BlockRemoved([])  # what _connected publishes


def _collect(subscriber: KVEventSubscriber, count: int, timeout_s: float = 10.0) -> list:
    """Poll ``subscriber`` until it returned ``count`` batches (or ``timeout_s`` passed)."""
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got += subscriber.poll(0.05)
    return got


def _connected(publisher: KVEventPublisher, subscriber: KVEventSubscriber, timeout_s: float = 10.0) -> list:
    """Publish probes (a ``BlockRemoved`` of no block) until ``subscriber`` receives one (ZMQ's
    slow joiner: a SUB socket gets nothing sent before it connected). Returns the batches it
    received."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        publisher.publish([PROBE])
        got = subscriber.poll(0.05)
        if got:
            return got
    raise AssertionError(f"no batch reached the subscriber of {publisher.endpoint} in {timeout_s} s")


@pytest.fixture
def publisher():
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", topic="engine-0")
    yield pub
    pub.close()


@pytest.fixture
def collect():
    """:func:`_collect`: poll a subscriber until it returned ``count`` batches."""
    return _collect


@pytest.fixture
def connected():
    """:func:`_connected`: publish probes until a subscriber receives one."""
    return _connected


@pytest.fixture
def stream(publisher, connected):
    """A subscriber connected to ``publisher``, and ``events()``: every event it sent since
    (probes left out), once it has been quiet for 0.3 s."""
    sub = KVEventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint, topic="engine-0")
    connected(publisher, sub)

    def events() -> list:
        got = []
        while True:
            batches = sub.poll(0.3)
            if not batches:
                return [event for batch in got for event in batch.events if event != PROBE]
            got += [batch for _, batch in batches]

    yield events
    assert sub.gaps == 0
    sub.close()
