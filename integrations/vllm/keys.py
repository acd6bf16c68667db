"""vLLM's names for kvstage's: offload keys as page keys, a store index's answer as vLLM's
``LookupResult``, its offload config as a layout fingerprint, kvstage's store events as vLLM's
``OffloadingEvent``s.

vLLM 0.33.0 (``vllm/v1/kv_offload/base.py``) keys an offloaded chunk by ``OffloadKey``: the
block hash bytes followed by the KV cache group index as 4 big-endian bytes. kvstage's stores take
hex string keys, so a page key is ``key.hex()`` and ``bytes.fromhex`` gives the key back: one
chunk of one group is one page, and groups never share a page key.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping, Sequence

from vllm.v1.kv_offload.base import LookupResult, OffloadingEvent, get_offload_group_idx

from kvstage.errors import require
from kvstage.offload import StoreIndex
from kvstage.storage import LayoutFingerprint
from kvstage.storage.events import StoreEvent

__all__ = [
    "block_fingerprint",
    "chunk_page_format",
    "lookup_result",
    "offloading_events",
    "page_keys",
    "prior_page_keys",
    "require_one_block_chunks",
    "tier_fingerprint",
]

_LOOKUP = {True: LookupResult.HIT, False: LookupResult.MISS, None: LookupResult.RETRY}


def page_keys(keys: Iterable[bytes]) -> list[str]:
    """vLLM ``OffloadKey``s (bytes) as kvstage page keys (lowercase hex), in order."""
    return [key.hex() for key in keys]


class _KeyOrder:
    """A request's chunk keys of each KV group in token order (a ``ReqContext`` state)."""

    def __init__(self, chunk_tokens: dict[int, int]) -> None:
        self.chunk_tokens = chunk_tokens  # what made a key a chunk here
        self.seen = 0  # entries of the request's positions taken in
        self.by_group: dict[int, list[tuple[int, bytes]]] = {}  # group -> sorted (end token, key)


def prior_page_keys(
    req_context, keys: Sequence[bytes], *, chunk_tokens: Mapping[int, int] | None = None
) -> list[str | None]:
    """For each ``OffloadKey`` of a request, the page key of the request's chunk right before it
    (same KV group), or None where vLLM recorded no position for it or it is the request's first
    chunk.

    vLLM 0.33.0's connector scheduler records each key's end token in the request's
    ``ReqContext`` (``set_offload_key_position``) for every chunk of the request, stored or not,
    and for each partial-tail key it looks up or stores (a hash boundary inside a chunk,
    ``_make_boundary_key``); a chunk ends at a multiple of its group's chunk tokens. The chunk
    before a key is the chunk with the nearest earlier end token: a partial tail links to the
    last whole chunk before it and is no chunk's predecessor. The reverse index is kept in the
    context (``set_state``) and extended as the request grows.

    Args:
        req_context: vLLM's ``ReqContext`` of the request storing ``keys``.
        keys: ``OffloadKey`` s of that request.
        chunk_tokens: tokens of one chunk per KV group id; a group not named (or None): every
            key with a position is a chunk.
    """
    positions = getattr(req_context, "_offload_key_positions", None)  # vLLM offers no reverse lookup
    if not positions:
        return [None] * len(keys)
    chunk_tokens = dict(chunk_tokens or {})
    order = req_context.get_state(_KeyOrder)
    if order is None or order.chunk_tokens != chunk_tokens:  # another caller's chunks: built again
        order = _KeyOrder(chunk_tokens)
        req_context.set_state(order)
    if order.seen < len(positions):  # the dict only grows, in insertion order
        for key, end in itertools.islice(positions.items(), order.seen, None):
            group = get_offload_group_idx(key)
            if end % chunk_tokens.get(group, 1) == 0:  # a partial tail is no chunk
                bisect.insort(order.by_group.setdefault(group, []), (end, key))
        order.seen = len(positions)
    priors: list[str | None] = []
    for key in keys:
        end = positions.get(key)
        ends = order.by_group.get(get_offload_group_idx(key), [])
        index = bisect.bisect_left(ends, (end, b"")) if end is not None else 0
        priors.append(ends[index - 1][1].hex() if index > 0 else None)
    return priors


def lookup_result(index: StoreIndex, key: bytes) -> LookupResult:
    """``index``'s answer for the ``OffloadKey`` ``key`` as vLLM's: HIT when the store is known
    to hold it, MISS when known not to, RETRY while the store is being asked (never a store
    round trip on the caller's thread: see :meth:`kvstage.offload.StoreIndex.lookup`)."""
    return _LOOKUP[index.lookup(key.hex())]


def _world(parallel) -> str:
    """The parallel layout of vLLM's ``OffloadingConfig.parallel`` as a page format part."""
    return f"world=tp{parallel.tp_size}pp{parallel.pp_size}pcp{parallel.pcp_size}dcp{parallel.dcp_size}x{parallel.world_size}"


def chunk_page_format(config) -> str:
    """The page format of one primary-tier chunk of vLLM's ``TieringOffloadingSpec``.

    A chunk holds ``blocks_per_chunk`` blocks of every worker (or one copy, for a replicated
    layout) of one KV group, laid out by vLLM; its bytes depend on the KV dtype, the groups'
    block sizes and layers, the hash granularity, the host layout (canonical or not) and, unless
    vLLM says the bytes are parallelism-agnostic, the parallel layout. The model is the
    fingerprint's model id.

    Args:
        config: vLLM's ``OffloadingConfig`` (``vllm/v1/kv_offload/config.py``).
    """
    groups = ";".join(
        f"g{group.group_id}:{group.tokens_per_block}tok:{','.join(group.layer_names)}" for group in config.groups
    )
    parts = [
        "vllm-chunk-v1",
        f"dtype={config.model.dtype}",
        f"groups={groups}",
        f"bpc={config.cache.blocks_per_chunk}",
        f"tph={config.cache.tokens_per_hash}",
        f"canonical={int(bool(config.canonical_layout))}",
        f"layout={config.kv_cache_layout}",
        f"replicated={int(bool(config.replicated_layout))}",
    ]
    parallel = config.parallel
    if not parallel.is_parallelism_agnostic:
        parts.append(_world(parallel))
    return "|".join(parts)


def tier_fingerprint(config, *, page_bytes: int, model_id: str | None = None) -> LayoutFingerprint:
    """The key space of a :class:`KVStageTier`: whole primary-tier chunks of ``page_bytes``.

    A chunk holds every worker's share, so one scheduler writes it and the shard is the whole
    world, named in the format (:func:`chunk_page_format`).

    Args:
        config: vLLM's ``OffloadingConfig``.
        page_bytes: bytes of one chunk (the primary tier's row stride, padding included).
        model_id: the model's name; None: ``config.model.name``.

    Raises:
        InvalidArgumentError: as :meth:`LayoutFingerprint.opaque`.
    """
    return LayoutFingerprint.opaque(
        model_id or config.model.name,
        page_bytes=page_bytes,
        page_format=chunk_page_format(config),
    )


def require_one_block_chunks(config) -> None:
    """Raise unless vLLM's chunk is one GPU block (kvstage's page is a block of one group).

    Raises:
        InvalidArgumentError: naming ``blocks_per_chunk`` or ``block_size``, whichever the extra
            config gave.
    """
    written = "blocks_per_chunk" if "blocks_per_chunk" in config.extra_config else "block_size"
    require(
        config.cache.blocks_per_chunk == 1,
        written,
        lambda: (
            f"KVStageOffloadingSpec stores GPU blocks as they are: leave it out or give vLLM's block of "
            f"{config.groups[0].tokens_per_block} tokens (blocks_per_chunk 1), got {config.extra_config.get(written)!r} "
            f"({config.cache.blocks_per_chunk} blocks a chunk)"
        ),
    )


def block_fingerprint(config, *, model_id: str | None = None) -> LayoutFingerprint:
    """The key space of one worker's blocks: ``config.worker_kv_bytes_per_block`` bytes a page.

    The format names the KV dtype, the group's block size and layers, and the parallel layout;
    pages are this rank's share (``tp_rank`` of ``world_size``), or rank-neutral where vLLM
    says every rank holds the same bytes (``replicated_layout``, MLA).

    Args:
        config: vLLM's ``OffloadingConfig``.
        model_id: the model's name; None: ``config.model.name``.

    Raises:
        InvalidArgumentError: more than one KV group (a hybrid model's key spaces are
            :func:`kvstage.integrations.vllm.groups.group_fingerprints`), or as
            :func:`require_one_block_chunks`.
    """
    require(
        len(config.groups) == 1,
        "kv_cache_groups",
        lambda: f"block_fingerprint keys one KV cache group, got {len(config.groups)}: use groups.group_fingerprints",
    )
    require_one_block_chunks(config)
    group, parallel = config.groups[0], config.parallel
    page_format = "|".join(
        [
            "vllm-block-v1",
            f"dtype={config.model.dtype}",
            f"g{group.group_id}:{group.tokens_per_block}tok:{','.join(group.layer_names)}",
            f"tph={config.cache.tokens_per_hash}",
            f"layout={config.kv_cache_layout}",
            _world(parallel),
        ]
    )
    return LayoutFingerprint.opaque(
        model_id or config.model.name,
        page_bytes=config.worker_kv_bytes_per_block,
        page_format=page_format,
        tp_rank=parallel.rank,
        tp_size=parallel.world_size,
        rank_neutral=bool(config.replicated_layout),
    )


def offloading_events(events: Sequence[StoreEvent], *, key_space: str, medium, locality, ownership: str) -> list:
    """kvstage store events of ``key_space`` as vLLM ``OffloadingEvent``s, one per run of
    events of one kind, in order: ``stored`` is a store (``removed=False``), ``evicted`` and
    ``removed`` are removals (``removed=True``). Events of other key spaces are left out
    (another fingerprint's pages).

    Args:
        events: what ``store.take_events()`` returned.
        key_space: the store's fingerprint prefix.
        medium, locality, ownership: the ``OffloadingEvent`` fields for this tier.
    """
    translated: list = []
    kind, keys = None, []
    for event in events:
        if event.key_space != key_space:
            continue
        if event.kind != kind and keys:
            translated.append(OffloadingEvent(keys, medium, kind != "stored", locality=locality, ownership=ownership))
            keys = []
        kind = event.kind
        keys.append(bytes.fromhex(event.key))
    if keys:
        translated.append(OffloadingEvent(keys, medium, kind != "stored", locality=locality, ownership=ownership))
    return translated
