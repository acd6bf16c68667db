"""Router-facing KV events: kvstage's stored, evicted and removed pages in vLLM's KV event
format (ZMQ PUB ``[topic, seq, payload]``, msgpack batches, a replay socket), which Dynamo's
indexer, llm-d and sglang's consumers read.

- :mod:`~kvstage.events.wire`: the records and their encoding; :func:`block_hash`;
  :class:`EventBatcher` (a batch's events, a chain's runs joined as they come).
- :mod:`~kvstage.events.sglang_format`: sglang's flavour (:data:`SGLANG_FORMAT`: its fields,
  block hashes and L3 tier), for ``KVEventPublisher(..., event_format=SGLANG_FORMAT)``.
- :mod:`~kvstage.events.publisher`: :class:`KVEventPublisher` (PUB + replay ROUTER).
- :mod:`~kvstage.events.subscriber`: :class:`KVEventSubscriber`, a reference consumer that
  checks seq gaps and replays them.
- :mod:`~kvstage.events.announcer`: :class:`KVEventAnnouncer`, a manager's writes (with their
  token ids) and its store's events joined into one stream
  (``OffloadManager(..., kv_events=...)``).
"""

from kvstage.events.announcer import KVEventAnnouncer, announcer_for
from kvstage.events.publisher import KVEventPublisher
from kvstage.events.sglang_format import SGLANG_FORMAT, sglang_block_hash
from kvstage.events.subscriber import KVEventSubscriber
from kvstage.events.wire import (
    MEDIUM_STORAGE,
    VLLM_FORMAT,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatcher,
    EventFormat,
    KVEventBatch,
    block_hash,
    decode_batch,
    encode_batch,
)

__all__ = [
    "MEDIUM_STORAGE",
    "SGLANG_FORMAT",
    "VLLM_FORMAT",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatcher",
    "EventFormat",
    "KVEventAnnouncer",
    "KVEventBatch",
    "KVEventPublisher",
    "KVEventSubscriber",
    "announcer_for",
    "block_hash",
    "decode_batch",
    "encode_batch",
    "sglang_block_hash",
]
