"""Helpers of the KV event tests: a manager rig whose store's pages are announced, and a
subscriber that collects what a publisher sent."""

from __future__ import annotations

import time

import pytest

from kvstage.events import KVEventPublisher, KVEventSubscriber


def collect(subscriber: KVEventSubscriber, count: int, timeout_s: float = 10.0) -> list:
    """Poll ``subscriber`` until it returned ``count`` batches (or ``timeout_s`` passed)."""
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got += subscriber.poll(0.05)
    return got


def connected(publisher: KVEventPublisher, subscriber: KVEventSubscriber, timeout_s: float = 10.0) -> list:
    """Publish empty-ish probes until ``subscriber`` receives one (ZMQ's slow joiner: a SUB
    socket gets nothing sent before it connected). Returns the batches it received."""
    from kvstage.events import AllBlocksCleared

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        publisher.publish([AllBlocksCleared()])
        got = subscriber.poll(0.05)
        if got:
            return got
    raise AssertionError(f"no batch reached the subscriber of {publisher.endpoint} in {timeout_s} s")


@pytest.fixture
def publisher():
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", topic="engine-0")
    yield pub
    pub.close()
