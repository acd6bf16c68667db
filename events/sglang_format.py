"""KV events as sglang 0.5.23 writes them (``sglang/srt/disaggregation/kv_events.py``,
``mem_cache/events.py``): the same framing, replay and batch array as vLLM's
(:mod:`kvstage.events.wire`), with sglang's fields, block hashes and tier name.

- A batch: msgpack array ``[ts, events, attn_dp_rank]``.
- ``BlockStored``: a tagged map that always carries ``block_hashes, parent_block_hash,
  token_ids, block_size, lora_id`` and then ``medium, cache_salt, session_id, lora_name``
  only when set (sglang's msgspec structs omit defaults); kvstage writes ``medium`` and
  ``cache_salt``, not ``extra_keys`` (vLLM's), ``session_id`` or ``lora_name`` (sglang's is an
  adapter's public name, which kvstage does not know: a namespace is in the page hashes).
- ``BlockRemoved``: ``block_hashes`` and ``medium``; ``AllBlocksCleared``: nothing.
- Block hashes: sglang's ``hash_str_to_int64``, the first 16 hex digits of the page hash as a
  signed int64, so a page kvstage announces has the hash sglang's own GPU / host events give the
  same page (keys of the ``sglang-v1`` scheme, no namespace).
- Tier: ``"DISK"``, sglang's ``StorageMedium.DISK`` (its L3), which sglang itself never emits.
"""

from __future__ import annotations

from typing import Any

import msgpack

from kvstage.errors import InvalidArgumentError
from kvstage.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventFormat, KVEvent, KVEventBatch

__all__ = ["SGLANG_FORMAT", "SGLANG_MEDIUM_L3", "encode_sglang_batch", "sglang_block_hash"]

SGLANG_MEDIUM_L3 = "DISK"  # sglang's StorageMedium.DISK, "L3: SSD / NVMe"; Dynamo counts it at disk
_SIGN = 1 << 63


def sglang_block_hash(page_key: str) -> int:
    """sglang's event hash of a page key: its first 16 hex digits as a signed int64 (sglang's
    ``hash_str_to_int64``).

    Raises:
        InvalidArgumentError: ``page_key`` is not a hex string of 16 digits or more.
    """
    if not isinstance(page_key, str) or len(page_key) < 16:
        raise InvalidArgumentError(f"page_key: must be a hex key of >= 16 digits, got {page_key!r}")
    try:
        value = int(page_key[:16], 16)
    except ValueError:
        raise InvalidArgumentError(f"page_key: must be hexadecimal, got {page_key!r}") from None
    return value - (1 << 64) if value >= _SIGN else value


def _event_map(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": None,
        }
        # sglang's order; session_id and lora_name (an adapter's public name) are not known here
        if event.medium is not None:
            out["medium"] = event.medium
        if event.cache_salt is not None:
            out["cache_salt"] = event.cache_salt
        return out
    if isinstance(event, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": event.block_hashes}
        if event.medium is not None:
            out["medium"] = event.medium
        return out
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise InvalidArgumentError(
        f"events: each must be a BlockStored, BlockRemoved or AllBlocksCleared, got {type(event).__name__}"
    )


def encode_sglang_batch(batch: KVEventBatch) -> bytes:
    """``batch`` as sglang's msgpack payload (``[ts, events, attn_dp_rank]``, events as tagged
    maps with sglang's fields; ``extra_keys`` is not written).

    Raises:
        InvalidArgumentError: an event is none of the three kinds.
    """
    return msgpack.packb([batch.ts, [_event_map(event) for event in batch.events], batch.data_parallel_rank])


SGLANG_FORMAT = EventFormat(
    "sglang", SGLANG_MEDIUM_L3, sglang_block_hash, encode_sglang_batch, hash_range=range(-_SIGN, _SIGN)
)
