"""kvstage's stores on vLLM 0.33.0's own KV-event path: vLLM's real ``Scheduler`` publishes them
through its ``ZmqEventPublisher`` on 127.0.0.1, and a subscriber decodes them with vLLM's own
msgspec types (``KVEventBatch``).

What must hold, with the workers in the scheduler's process (``ConnectorRig``) and with
``KVStageConnector``'s workers as tensor-parallel ranks in processes of their own (TP=2,
``TPRig``, driven as vLLM's multiprocess executor drives them: metadata pickled to each rank,
their ``KVConnectorOutput`` aggregated by vLLM's ``KVOutputAggregator``): every block stored is
announced ``BlockStored`` medium ``STORAGE`` exactly once, with its token ids, parent and block
size when ``self_describing_kv_events`` is set; a block a rank's store evicts is announced
``BlockRemoved`` once (not once per rank), and every stored block after a connector cache
reset; a page a worker could not write, or a store lost while its job ran, is not announced. The
manager's own rules (the order, once, left out) are also checked on the manager alone.
"""

from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM 0.33.0 is not installed (make .venv-vllm/.installed, then run with .venv-vllm/bin/python)",
)
zmq = pytest.importorskip("zmq")

import msgspec  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from vllm_rig import ConnectorRig, TPRig  # noqa: E402

BLOCK = ConnectorRig.BLOCK_SIZE
PROMPT = list(range(1, 4 * BLOCK + 6))  # 4 full blocks and 5 tokens
SELF_DESCRIBING = {"self_describing_kv_events": True}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Subscriber:
    """A ZMQ SUB on vLLM's publisher at 127.0.0.1:``port``, decoding ``[topic, seq, payload]``
    with vLLM's types."""

    def __init__(self, port: int) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)  # ZMQ: the subscription reaches the publisher before its first batch
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list = []
        self.seqs: list[int] = []

    def drain(self, quiet_s: float = 0.5) -> list:
        """Every batch received until none came for ``quiet_s``; the events so far."""
        while self.socket.poll(int(quiet_s * 1000)):
            _topic, seq, payload = self.socket.recv_multipart()
            self.seqs.append(int.from_bytes(seq, "big"))
            self.events.extend(self.decoder.decode(payload).events)
        return self.events

    def storage(self, kind: type) -> list:
        return [event for event in self.events if isinstance(event, kind) and event.medium == "STORAGE"]

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def zmq_events_config(port: int):
    """vLLM's ZMQ publisher on ``port``. It binds only a wildcard endpoint (it connects to
    ``tcp://127.0.0.1:PORT``, and in the tests' network namespace a PUB connecting to a bound
    SUB never delivers), so ``tcp://*:PORT``: the namespace has loopback only
    (``tools/in-netns.sh``)."""
    from vllm.config import KVEventsConfig

    return KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}", topic="kvstage-test"
    )


class EventsTPRig(TPRig):
    """:class:`vllm_rig.TPRig` whose scheduler publishes its KV events on a ZMQ PUB socket at
    127.0.0.1, read by :attr:`subscriber`."""

    def __init__(self, model_dir, storage: str, **kwargs) -> None:
        port = free_port()
        super().__init__(model_dir, storage, kv_events_config=zmq_events_config(port), **kwargs)
        self.subscriber = Subscriber(port)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.subscriber.close()


def gpu_hashes(events) -> list:
    return [
        h for event in events if isinstance(event, BlockStored) and event.medium == "GPU" for h in event.block_hashes
    ]


def assert_self_describing(stored: list, prompt: list[int], hashes: list) -> None:
    """``stored`` are one BlockStored a block of ``prompt``, in order, each with its tokens,
    block size and parent (the block before it; None for the first)."""
    assert [event.block_hashes for event in stored] == [[h] for h in hashes]
    for index, event in enumerate(stored):
        assert event.token_ids == prompt[index * BLOCK : (index + 1) * BLOCK]
        assert event.block_size == BLOCK
        assert event.parent_block_hash == (hashes[index - 1] if index else None)


@pytest.fixture
def tp_rig(tmp_path):
    rig = EventsTPRig(tmp_path / "model", f"file:{tmp_path / 'kv'}", extra_config=SELF_DESCRIBING)
    yield rig
    rig.close()


def test_tp2_every_stored_block_is_announced_once_with_its_tokens(tp_rig):
    tp_rig.add_request("a", PROMPT)
    tp_rig.run_until_idle()
    assert tp_rig.ask("stored_pages") == [4, 4]  # each rank wrote its share of the 4 full blocks
    events = tp_rig.subscriber.drain()
    stored = tp_rig.subscriber.storage(BlockStored)
    assert len(stored) == 4  # not 0 (workers in other processes), not 8 (one per rank)
    assert_self_describing(stored, PROMPT, gpu_hashes(events)[:4])
    assert tp_rig.subscriber.seqs == sorted(set(tp_rig.subscriber.seqs))  # vLLM's stream: no gap, no repeat

    tp_rig.add_request("b", PROMPT)  # the same prefix again: loaded, not stored, not announced again
    tp_rig.run_until_idle()
    tp_rig.subscriber.drain()
    assert len(tp_rig.subscriber.storage(BlockStored)) == 4
    assert tp_rig.subscriber.storage(BlockRemoved) == []

    assert tp_rig.scheduler.reset_prefix_cache(reset_connector=True)  # e.g. after a weight update: the store cleared
    tp_rig.step()  # vLLM publishes the connector's events of a step
    tp_rig.subscriber.drain()
    removed = [h for event in tp_rig.subscriber.storage(BlockRemoved) for h in event.block_hashes]
    assert sorted(removed) == sorted(h for event in stored for h in event.block_hashes)


def test_tp2_a_block_a_ranks_store_evicts_is_announced_removed_once(tmp_path):
    # Each rank's file store holds 3 of its pages: a second prompt's 2 blocks evict from the first's.
    page_bytes = 2 * BLOCK * (TPRig.NUM_KV_HEADS // 2) * TPRig.HEAD_SIZE * 2 * len(TPRig.LAYERS)
    capacity = int(3.5 * page_bytes)  # 3 page files with their headers, not 4
    rig = EventsTPRig(
        tmp_path / "model", f"file:{tmp_path / 'kv'}?capacity_bytes={capacity}", extra_config=SELF_DESCRIBING
    )
    try:
        first, second = list(range(1, 2 * BLOCK + 3)), list(range(100, 100 + 2 * BLOCK + 3))
        rig.add_request("a", first)
        rig.run_until_idle()
        rig.add_request("c", second)
        rig.run_until_idle()
        rig.subscriber.drain()
        stored = rig.subscriber.storage(BlockStored)
        removed = [h for event in rig.subscriber.storage(BlockRemoved) for h in event.block_hashes]
        assert len(stored) == 4
        announced = [event.block_hashes[0] for event in stored]
        keys = {maybe_convert_block_hash(key[:-4]): key.hex() for key in _stored_offload_keys(rig)}
        assert set(keys) == set(announced)
        held = rig.ask("holds", [keys[h] for h in announced])  # each rank: which pages its store still holds
        lost = [h for i, h in enumerate(announced) if not all(rank_held[i] for rank_held in held)]
        assert lost and sorted(removed) == sorted(lost)  # each lost block once, though both ranks evicted it
    finally:
        rig.close()


def _stored_offload_keys(rig: EventsTPRig) -> list[bytes]:
    """The OffloadKeys vLLM's connector stored (its event tracker's metadata names them)."""
    return list(rig.scheduler.connector.connector_scheduler._events_tracker._pending_event_metadata)


def test_in_process_every_stored_block_is_announced_once_with_its_tokens(tmp_path):
    port, subscriber = free_port(), None
    rig = ConnectorRig(tmp_path / "model", f"file:{tmp_path / 'kv'}", extra_config=SELF_DESCRIBING)
    try:  # vLLM's publisher on 127.0.0.1 instead of the rig's null one
        from vllm.distributed.kv_events import EventPublisherFactory

        rig.scheduler.kv_event_publisher.shutdown()
        rig.scheduler.kv_event_publisher = EventPublisherFactory.create(zmq_events_config(port), 0)
        subscriber = Subscriber(port)
        rig.add_request("a", PROMPT)
        rig.run_until_idle()
        events = subscriber.drain()
        stored = subscriber.storage(BlockStored)
        assert_self_describing(stored, PROMPT, gpu_hashes(events)[:4])  # once: the manager and worker share the store
    finally:
        rig.close()
        rig.scheduler.kv_event_publisher.shutdown()
        if subscriber is not None:
            subscriber.close()


def test_a_page_the_store_could_not_write_is_not_announced(tmp_path):
    # memory:4096 holds one page: of a's 4-block chain the store keeps the first and fails the rest.
    rig = ConnectorRig(tmp_path / "model", "memory:4096")
    try:
        rig.add_request("a", PROMPT, max_tokens=1)
        rig.run_until_idle()
        assert rig.worker.connector_worker.worker.pages_failed == 3
        stored = [event for event in rig.kv_events if isinstance(event, BlockStored) and event.medium == "STORAGE"]
        assert [h for event in stored for h in event.block_hashes] == gpu_hashes(rig.kv_events)[:1]
    finally:
        rig.close()


def _manager(reports: bool):
    from kvstage.integrations.vllm import KVStageOffloadingManager
    from kvstage.storage import LayoutFingerprint, MemoryStore

    store = MemoryStore(LayoutFingerprint.opaque("m", page_bytes=16, page_format="test"))
    manager = KVStageOffloadingManager(store, events=True)
    manager.workers_report_stores = reports
    return manager, store


def _announced(manager) -> list[tuple[bool, list[bytes]]]:
    return [(event.removed, list(event.keys)) for event in manager.take_events()]


def test_the_manager_announces_what_the_workers_report_once_in_the_order_prepared():
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    manager, _store = _manager(reports=True)
    try:
        a, b, c = (bytes([i]) * 32 + bytes(4) for i in (1, 2, 3))
        context = ReqContext("r")
        assert manager.prepare_store([a, b, c], context).keys_to_store == [a, b, c]
        manager.stores_reported(unwritten=[b.hex()], removed=[])  # one rank could not write b
        manager.complete_store({c, b, a}, context)  # vLLM passes a set
        assert _announced(manager) == [(False, [a, c])]  # prepared order, b left out
        assert manager.lookup(a, context) is LookupResult.HIT  # held at once: no store round trip
        assert manager.lookup(b, context) is LookupResult.RETRY  # asked of the store
        manager.stores_reported(unwritten=[], removed=[a.hex(), a.hex(), b.hex()])  # two ranks evicted a
        assert _announced(manager) == [(True, [a])]  # once; b was never announced
        assert manager.lookup(a, context) is LookupResult.MISS
    finally:
        manager.shutdown()


def test_a_page_lost_while_its_store_job_runs_is_not_announced():
    from vllm.v1.kv_offload.base import ReqContext

    manager, _store = _manager(reports=True)
    try:
        a, b = (bytes([i]) * 32 + bytes(4) for i in (1, 2))
        context = ReqContext("r")
        manager.prepare_store([a, b], context)
        manager.stores_reported(unwritten=[], removed=[a.hex()])  # rank 0 wrote a, then evicted it; rank 1 not done
        manager.complete_store({a, b}, context)
        assert _announced(manager) == [(False, [b])]
    finally:
        manager.shutdown()


def test_without_worker_reports_a_block_is_announced_once_the_stores_own_event_said_stored():
    import torch
    from vllm.v1.kv_offload.base import ReqContext

    manager, store = _manager(reports=False)  # vLLM's plain OffloadingConnector, the store in this process
    try:
        a, b = (bytes([i]) * 32 + bytes(4) for i in (1, 2))
        context = ReqContext("r")
        manager.prepare_store([a, b], context)
        store.put([a.hex()], [torch.zeros(16, dtype=torch.uint8)])  # b's page never reached the store
        manager.complete_store({a, b}, context)
        assert _announced(manager) == [(False, [a])]
        store.clear()
        assert _announced(manager) == [(True, [a])]  # the store's removal, from its own events
    finally:
        manager.shutdown()
