"""Router-facing KV events: kvstage's stored, evicted and removed pages in vLLM's KV event
format (ZMQ PUB ``[topic, seq, payload]``, msgpack batches, a replay socket), which Dynamo's
indexer, llm-d and sglang's consumers read.

- :mod:`~kvstage.events.wire`: the records and their encoding; :func:`block_hash`.
- :mod:`~kvstage.events.publisher`: :class:`KVEventPublisher` (PUB + replay ROUTER).
- :mod:`~kvstage.events.subscriber`: :class:`KVEventSubscriber`, a reference consumer that
  checks seq gaps and replays them.
- :mod:`~kvstage.events.announcer`: :class:`KVEventAnnouncer`, a manager's writes (with their
  token ids) and its store's events joined into one stream
  (``OffloadManager(..., kv_events=...)``).
"""

from kvstage.events.announcer import KVEventAnnouncer, announcer_for
from kvstage.events.publisher import KVEventPublisher
from kvstage.events.subscriber import KVEventSubscriber
from kvstage.events.wire import (
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    block_hash,
    decode_batch,
    encode_batch,
)

__all__ = [
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventAnnouncer",
    "KVEventBatch",
    "KVEventPublisher",
    "KVEventSubscriber",
    "announcer_for",
    "block_hash",
    "decode_batch",
    "encode_batch",
]
