"""Dynamo's standalone KV indexer (``ai-dynamo-runtime``) fed by a real :class:`OffloadManager`'s
KV events: its ``/query`` overlap at the disk tier is the stored prefix, and drops after an
eviction and after a flush (``clear``).

The indexer binds 0.0.0.0 (no host option): run inside the network namespace
(``bash tools/in-netns.sh``). It connects a SUB socket to the publisher, which binds 127.0.0.1.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from kvstage.events import BlockRemoved, BlockStored, KVEventPublisher
from kvstage.storage import MemoryStore

import dynamo_rig
from dynamo_rig import WORKER, Indexer, require_dynamo
from offload_rig import make_rig

PAGE = 4


@pytest.fixture
def indexer_and_publisher():
    require_dynamo()
    publisher = KVEventPublisher("tcp://127.0.0.1:0", topic="engine-1")
    indexer = Indexer(publisher.endpoint, PAGE)
    try:
        _until_connected(indexer, publisher)
        yield indexer, publisher
    finally:
        log = indexer.stop()
        publisher.close()
        print(log[-4000:])


def _until_connected(indexer: Indexer, publisher: KVEventPublisher) -> None:
    """Announce a probe page until the indexer sees it (its SUB socket gets nothing sent before
    it connected), then remove it."""
    probe = [900_001 + i for i in range(PAGE)]
    probe_hash = publisher.event_format.block_hash("ab" * 16)  # in the publisher's flavour's hash range
    deadline = time.monotonic() + 20
    while indexer.disk_overlap(probe) != PAGE:
        assert time.monotonic() < deadline, "dynamo.indexer never received the publisher's events"
        publisher.publish([BlockStored([probe_hash], None, probe, PAGE)])
        time.sleep(0.05)
    publisher.publish([BlockRemoved([probe_hash])])
    assert indexer.wait_for(probe, 0) == 0


def store_prefix(rig, rid: str, prompt: list[int]) -> object:
    """Store ``prompt``'s whole pages through the rig's manager (prefill then finish)."""
    req = rig.new_request(rid, prompt, 2)
    req.done = True
    rig.manager.finish(req)
    rig.copy_stream.complete_all()
    rig.manager.drain()
    return req


def test_dynamo_indexer_sees_the_managers_stored_prefix_and_its_eviction_and_clear(indexer_and_publisher):
    indexer, publisher = indexer_and_publisher
    # A store of 6 pages: a second prompt of 3 pages evicts from the first one's tail.
    fingerprint_rig = make_rig(page_size=PAGE)
    store = MemoryStore(fingerprint_rig.storage.fingerprint, capacity_pages=6)
    rig = make_rig(page_size=PAGE, store_prompt=True, storage=store, kv_events=publisher)
    first = list(range(100, 100 + 4 * PAGE + 1))  # 4 whole pages and one token
    store_prefix(rig, "a", first)
    assert rig.manager.metrics.pages_stored == 4
    assert indexer.wait_for(first, 4 * PAGE) == 4 * PAGE
    # A prefix of it, and a query that diverges after 2 pages, match as far as they agree.
    assert indexer.disk_overlap(first[: 2 * PAGE]) == 2 * PAGE
    assert indexer.disk_overlap(first[: 2 * PAGE] + [7] * PAGE) == 2 * PAGE

    second = list(range(500, 500 + 3 * PAGE + 1))
    store_prefix(rig, "b", second)
    assert rig.manager.metrics.pages_stored == 7 and store.stats.pages_evicted == 1
    rig.manager.poll()
    assert indexer.wait_for(second, 3 * PAGE) == 3 * PAGE
    # The evicted page is the first prompt's last (a chain's tail goes first).
    assert indexer.wait_for(first, 3 * PAGE) == 3 * PAGE

    assert rig.manager.flush() == 6
    rig.manager.poll()
    assert indexer.wait_for(first, 0) == 0
    assert indexer.wait_for(second, 0) == 0
    rig.manager.close()


def test_dynamo_replays_what_a_registered_worker_published_before_it_connected():
    require_dynamo()
    publisher = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", topic="engine-1")
    rig = make_rig(page_size=PAGE, store_prompt=True, kv_events=publisher)
    prompt = list(range(40, 40 + 3 * PAGE + 1))
    store_prefix(rig, "a", prompt)  # no subscriber yet: only the replay buffer holds it
    assert publisher.flush() and publisher.published >= 1
    indexer = Indexer(None, PAGE)
    try:
        registration = {
            "instance_id": int(WORKER), "endpoint": publisher.endpoint, "model_name": "default",
            "block_size": PAGE, "replay_endpoint": publisher.replay_endpoint,
        }  # fmt: skip
        assert indexer.post("/register", registration) == 201
        # Its first live batch (a probe) has a seq above 0: the indexer asks the replay socket for the rest.
        _until_connected(indexer, publisher)
        assert indexer.wait_for(prompt, 3 * PAGE) == 3 * PAGE
    finally:
        log = indexer.stop()
        rig.manager.close()
        publisher.close()
        print(log[-4000:])


def test_without_ai_dynamo_runtime_the_test_skips_naming_the_package(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name.startswith("dynamo") else real_find_spec(name, *args),
    )
    monkeypatch.setenv("KVSTAGE_DYNAMO_PYTHON", "/nonexistent/python")
    monkeypatch.setattr(dynamo_rig, "REPO_ROOT", Path("/nonexistent"))
    # A "missing: " skip, which tests/conftest.py turns into a failure under CI=true.
    with pytest.raises(
        pytest.skip.Exception, match=r"^missing: the ai-dynamo-runtime package \(bash tools/install-dynamo"
    ):
        require_dynamo()
