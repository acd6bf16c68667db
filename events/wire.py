"""KV events as vLLM 0.33 writes them: the records, their msgpack encoding, and page keys as
block hashes.

The format (``vllm/distributed/kv_events.py``), which Dynamo's indexer, llm-d and sglang's
consumers read: a batch is a msgpack **array** ``[ts, events, data_parallel_rank]``; each event
a tagged **map** ``{"type": "BlockStored", ...}`` with vLLM's field names and order.
``BlockStored`` always carries ``block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name`` and ``extra_keys`` only when set (vLLM omits defaults);
``BlockRemoved`` carries ``block_hashes, medium``; ``AllBlocksCleared`` nothing.

Block hashes are ints: vLLM's default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) sends the
low 64 bits of its block hash, unsigned, and Dynamo cannot read byte-string hashes.
:func:`block_hash` is the one place a kvstage page key (hex) becomes one.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from itertools import repeat
from operator import itemgetter
from typing import Any, Callable, Sequence

import msgpack

from kvstage.errors import InvalidArgumentError

__all__ = [
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatcher",
    "EventFormat",
    "KVEvent",
    "KVEventBatch",
    "block_hash",
    "block_hashes",
    "check_events",
    "decode_batch",
    "encode_batch",
    "merge_stored",
    "VLLM_FORMAT",
]

MEDIUM_STORAGE = "STORAGE"  # vLLM's MEDIUM_STORAGE; Dynamo counts it at its disk tier
_LOW_64 = (1 << 64) - 1
_LOW_16_DIGITS = itemgetter(slice(-16, None))  # a key's last 16 hex digits: its low 64 bits


def block_hash(page_key: str) -> int:
    """The int block hash of a kvstage page key: its low 64 bits, unsigned (as vLLM's
    ``maybe_convert_block_hash`` takes the low 64 bits of its own hash).

    Args:
        page_key: a hex page key (no fingerprint prefix), at least 16 hex digits.

    Raises:
        InvalidArgumentError: ``page_key`` is not a hex string of 16 digits or more.
    """
    if not isinstance(page_key, str) or len(page_key) < 16:
        raise InvalidArgumentError(f"page_key: must be a hex key of >= 16 digits, got {page_key!r}")
    try:
        return int(page_key[-16:], 16)
    except ValueError:
        raise InvalidArgumentError(f"page_key: must be hexadecimal, got {page_key!r}") from None


def block_hashes(page_keys: Sequence[str]) -> list[int]:
    """:func:`block_hash` of each of ``page_keys``, in order (one pass: what an announcer runs
    per write).

    Raises:
        InvalidArgumentError: a key is not a hex string of 16 digits or more.
    """
    try:
        hashes = list(map(int, map(_LOW_16_DIGITS, page_keys), repeat(16)))  # C loops: no frame per key
        if min(map(len, page_keys), default=16) >= 16:
            return hashes
    except (TypeError, ValueError):
        pass
    return [block_hash(key) for key in page_keys]  # raises naming the bad key


@dataclass(slots=True)
class BlockStored:
    """Pages stored: one chain run, self-describing.

    Attributes:
        block_hashes: one int per page (:func:`block_hash`), in chain order.
        parent_block_hash: the hash of the page before the first one (already announced on this
            stream), or None: the run starts at the root.
        token_ids: every page's token ids, concatenated (``len == block_size * len(block_hashes)``).
        block_size: tokens per page.
        lora_name: the namespace's ``extra_key`` (vLLM's LoRA name slot), or None.
        medium: the tier: ``"STORAGE"`` for a store (vLLM's name; ``"GPU"``, ``"CPU"`` its others).
        extra_keys: None, or one tuple per page of what else seeds its hash (vLLM: the LoRA
            name, then multimodal pairs, then ``cache_salt``).
        cache_salt: the tenant's salt, or None (sglang's field; vLLM's format carries it in
            ``extra_keys`` and does not write this one).
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    medium: str = MEDIUM_STORAGE
    extra_keys: list[tuple[Any, ...] | None] | None = None
    cache_salt: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Pages gone from ``medium`` (evicted, removed, corrupt). ``block_hashes``: ints."""

    block_hashes: list[int]
    medium: str = MEDIUM_STORAGE


@dataclass(slots=True)
class AllBlocksCleared:
    """Every page of this stream (this batch's data-parallel rank) is gone."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    """One published message: ``ts`` (``time.time()`` seconds), ``events`` in order, and the
    publisher's ``data_parallel_rank``."""

    ts: float
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = 0


class EventBatcher:
    """The events of one batch as they are gathered, a chain's consecutive ``BlockStored``
    joined on arrival: one that continues the event just before it (its parent is that one's
    last hash; same block size, medium, LoRA name, salt and kind of ``extra_keys``) extends it.

    Attributes:
        events: the batch's events so far, in arrival order.

    A joined event's lists are copied once, on its first join, then extended in place, so the
    lists of an event or call given to it are never changed (the cost stays linear in the pages).
    """

    __slots__ = ("events", "_last", "_owned", "_removal")

    def __init__(self) -> None:
        self.events: list[KVEvent] = []
        self._last: BlockStored | None = None  # events[-1] when it is a BlockStored, else None
        self._owned = False  # _last's lists are this batcher's (copied): it may extend them
        self._removal: BlockRemoved | None = None  # events[-1] when it is a BlockRemoved built here

    def add(self, events: list[KVEvent]) -> None:
        """Append ``events`` (any kinds), joining each ``BlockStored`` that continues the event before."""
        for event in events:
            if type(event) is BlockStored:
                self.stored(
                    event.block_hashes,
                    event.parent_block_hash,
                    event.token_ids,
                    event.block_size,
                    event.lora_name,
                    event.medium,
                    event.extra_keys,
                    event.cache_salt,
                )
            else:
                self.events.append(event)
                self._last = self._removal = None

    def stored(
        self,
        block_hashes: list[int],
        parent_block_hash: int | None,
        token_ids: list[int],
        block_size: int,
        lora_name: str | None = None,
        medium: str = MEDIUM_STORAGE,
        extra_keys: list | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Append one ``BlockStored`` (its fields as :class:`BlockStored`'s; the lists are read,
        never changed), joined into the event before when it continues it."""
        last = self._last
        if (
            last is not None
            and parent_block_hash is not None
            and parent_block_hash == last.block_hashes[-1]
            and block_size == last.block_size
            and medium == last.medium
            and lora_name == last.lora_name
            and cache_salt == last.cache_salt
            and (extra_keys is None) == (last.extra_keys is None)
        ):
            if not self._owned:
                last.block_hashes = list(last.block_hashes)
                last.token_ids = list(last.token_ids)
                if last.extra_keys is not None:
                    last.extra_keys = list(last.extra_keys)
                self._owned = True
            last.block_hashes += block_hashes
            last.token_ids += token_ids
            if extra_keys is not None:
                last.extra_keys += extra_keys
            return
        last = BlockStored(
            block_hashes, parent_block_hash, token_ids, block_size, lora_name, medium, extra_keys, cache_salt
        )
        self.events.append(last)
        self._last, self._owned, self._removal = last, False, None

    def removed(self, block_hash: int, medium: str = MEDIUM_STORAGE) -> None:
        """Append a removal of one page, joined into the ``BlockRemoved`` of the same medium this
        batcher built just before."""
        removal = self._removal
        if removal is not None and removal.medium == medium:
            removal.block_hashes.append(block_hash)
            return
        self._removal = BlockRemoved([block_hash], medium)
        self.events.append(self._removal)
        self._last = None


def merge_stored(events: list[KVEvent]) -> list[KVEvent]:
    """``events`` with each ``BlockStored`` that continues the one just before it joined into
    it (:class:`EventBatcher`): the same pages in fewer, longer events (a consumer indexes them
    alike). The input events are not changed."""
    batcher = EventBatcher()
    batcher.add(events)
    return batcher.events


_UINT64 = range(1 << 64)  # vLLM's block hashes (the low 64 bits, unsigned) and any token id
_ARRAY_CODES = {(0, 1 << 64): "Q", (-(1 << 63), 1 << 63): "q"}  # array typecodes of those ranges


def check_events(events: list, hash_range: range = _UINT64) -> None:
    """Raise unless every item of ``events`` is a KV event the format can carry: its block
    hashes (and a stored run's parent) ints in ``hash_range``, its token ids ints in
    ``[0, 2**64)``, its block size an int >= 1. O(pages + tokens), in C for the int64 and
    uint64 ranges (where integer scalars such as numpy's pass: one the encoder cannot take is
    dropped alone at the send, under a skipped seq).

    Raises:
        InvalidArgumentError: naming ``events``, the field and the rule.
    """
    for event in events:
        kind = type(event)
        if kind is BlockRemoved:
            _require_ints(event.block_hashes, hash_range, "block_hashes")
        elif kind is BlockStored:
            _require_ints(event.block_hashes, hash_range, "block_hashes")
            parent = event.parent_block_hash
            if parent is not None and not (type(parent) is int and parent in hash_range):
                raise InvalidArgumentError(
                    f"events: parent_block_hash must be None or an int in {_range_text(hash_range)}, got {parent!r}"
                )
            _require_ints(event.token_ids, _UINT64, "token_ids")
            size = event.block_size
            if type(size) is not int or size < 1:
                raise InvalidArgumentError(f"events: block_size must be an int >= 1, got {size!r}")
        elif kind is not AllBlocksCleared:
            raise InvalidArgumentError(
                f"events: each must be a BlockStored, BlockRemoved or AllBlocksCleared, got {kind.__name__}"
            )


def _require_ints(values: Any, allowed: range, field_name: str) -> None:
    if not isinstance(values, list):
        raise InvalidArgumentError(f"events: {field_name} must be a list of ints, got {type(values).__name__}")
    code = _ARRAY_CODES.get((allowed.start, allowed.stop))
    if code is not None:
        try:  # one pass in C: an int (or __index__: numpy's) in the range, else TypeError/OverflowError
            array.array(code, values)
        except (TypeError, OverflowError):
            pass
        else:
            return
    for value in values:  # name the first one breaking the rule
        if type(value) is not int or value not in allowed:
            raise InvalidArgumentError(f"events: {field_name} must be ints in {_range_text(allowed)}, got {value!r}")


def _range_text(allowed: range) -> str:
    """``[lo, hi)`` with powers of two written as ``2**n``."""

    def text(value: int) -> str:
        size = abs(value)
        if size > 1 and size & (size - 1) == 0:
            return f"{'-' if value < 0 else ''}2**{size.bit_length() - 1}"
        return str(value)

    return f"[{text(allowed.start)}, {text(allowed.stop)})"


def _event_map(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        out = {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": None,  # deprecated in vLLM, still always written
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            out["extra_keys"] = event.extra_keys
        return out
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise InvalidArgumentError(
        f"events: each must be a BlockStored, BlockRemoved or AllBlocksCleared, got {type(event).__name__}"
    )


def encode_batch(batch: KVEventBatch) -> bytes:
    """``batch`` as vLLM's msgpack payload (array of 3, events as tagged maps).

    Raises:
        InvalidArgumentError: an event is none of the three kinds.
    """
    return msgpack.packb([batch.ts, [_event_map(event) for event in batch.events], batch.data_parallel_rank])


def _event(item: Any) -> KVEvent:
    if not isinstance(item, dict):
        raise InvalidArgumentError(f"payload: an event must be a tagged map, got {type(item).__name__}")
    kind = item.get("type")
    if kind == "BlockStored":
        extra = item.get("extra_keys")
        return BlockStored(
            list(item["block_hashes"]),
            item["parent_block_hash"],
            list(item["token_ids"]),
            item["block_size"],
            item.get("lora_name"),
            item.get("medium"),
            None if extra is None else [None if keys is None else tuple(keys) for keys in extra],
            item.get("cache_salt"),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(list(item["block_hashes"]), item.get("medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise InvalidArgumentError(f"payload: unknown event type {kind!r} (BlockStored, BlockRemoved, AllBlocksCleared)")


def decode_batch(payload: bytes) -> KVEventBatch:
    """The :class:`KVEventBatch` of a vLLM-format or sglang-format payload (map events; unknown
    fields are ignored; sglang's ``cache_salt`` is read).

    Raises:
        InvalidArgumentError: not msgpack, not an array of 2 or 3, or an event of an unknown type
            or missing a field.
    """
    try:
        items = msgpack.unpackb(payload, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as error:
        raise InvalidArgumentError(f"payload: not a msgpack KV event batch: {error!r}") from error
    if not isinstance(items, list) or len(items) not in (2, 3):
        raise InvalidArgumentError(f"payload: a batch is an array [ts, events, data_parallel_rank], got {items!r:.80}")
    rank = items[2] if len(items) == 3 else None
    try:
        return KVEventBatch(items[0], [_event(item) for item in items[1]], rank)
    except KeyError as error:
        raise InvalidArgumentError(f"payload: an event lacks the field {error.args[0]!r}") from None


@dataclass(frozen=True)
class EventFormat:
    """An engine's flavour of the KV event format: what a publisher encodes with and what an
    announcer names pages and their tier by.

    Attributes:
        name: ``"vllm"`` or ``"sglang"``.
        medium: the tier a store's pages are announced at.
        block_hash: a page key (hex) to its int block hash.
        encode: a :class:`KVEventBatch` to its payload bytes.
        many_block_hashes: page keys to their block hashes in one pass (None: ``block_hash`` each).
        hash_range: the block hashes the format carries (vLLM's: ``[0, 2**64)``).
    """

    name: str
    medium: str
    block_hash: Callable[[str], int]
    encode: Callable[[KVEventBatch], bytes]
    many_block_hashes: Callable[[Sequence[str]], list[int]] | None = None  # block_hash of each, in one pass
    hash_range: range = _UINT64

    def hashes(self, page_keys: Sequence[str]) -> list[int]:
        """:attr:`block_hash` of each page key, in order."""
        if self.many_block_hashes is not None:
            return self.many_block_hashes(page_keys)
        return [self.block_hash(key) for key in page_keys]


VLLM_FORMAT = EventFormat("vllm", MEDIUM_STORAGE, block_hash, encode_batch, block_hashes)
