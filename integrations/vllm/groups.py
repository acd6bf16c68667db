"""A hybrid model's KV cache groups as kvstage components, one key space each.

vLLM 0.33.0 offloads each KV cache group on its own (``offloading/config.py``
``build_offloading_config``: one ``OffloadingGroupConfig`` per group) and applies the hybrid rules
itself (``offloading/scheduler.py``: only chunks that can serve a hit at an alignment boundary are
stored, ``_reachable_store_block_mask``; sliding-window groups hit on the window's consecutive
chunks ending at the boundary, ``_sliding_window_lookup``; Mamba hits are rounded down to the
chunk, ``resolve_mamba_align_size``). kvstage's side: each group is a component of a
:class:`kvstage.model_layout.ModelLayout` (full attention, sliding window, request state), each
with its own key space, whose key for a chunk is the chunk's ``OffloadKey`` (block hash and group
index); the arithmetic those rules share with kvstage's own paths is
:mod:`kvstage.offload.restorable`'s.

vLLM's scheduler sees the groups' ``KVCacheGroupSpec``s; a spec sees only the offloading config,
so :class:`KVStageConnector` hands the spec the ``KVCacheConfig`` (:data:`KV_CACHE_CONFIG`) while
vLLM builds it.
"""

from __future__ import annotations

import contextvars
from typing import Any

from kvstage.errors import InvalidArgumentError, require
from kvstage.model_layout import FullAttention, ModelLayout, RequestState, SlidingWindow, TensorSpec

__all__ = ["KV_CACHE_CONFIG", "GroupStores", "group_fingerprints", "group_layout", "group_of_key"]

# vLLM's KVCacheConfig of the connector being built (set by KVStageConnector around vLLM's
# OffloadingConnector.__init__, which builds the spec and asks it for its manager or worker).
KV_CACHE_CONFIG: contextvars.ContextVar[Any] = contextvars.ContextVar("kvstage_vllm_kv_cache_config", default=None)


def group_of_key(page_key: str) -> int:
    """The KV cache group index of a page key (hex ``OffloadKey``: its last 4 bytes, big-endian,
    as vLLM's ``get_offload_group_idx``)."""
    return int(page_key[-8:], 16)


def _kind(spec: Any) -> str | None:
    """kvstage's component kind for one layer's vLLM spec, or None (a kind kvstage does not store)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    kind = type(spec)  # exact types: a subclass (sinks, ring windows) has hit rules of its own
    if kind in (FullAttentionSpec, MLAAttentionSpec):
        return "full"
    if kind in (SlidingWindowSpec, SlidingWindowMLASpec):
        return "swa"
    if kind is MambaSpec and spec.mamba_cache_mode == "align":
        return "state"
    return None


def _layer_order(names: list[str]) -> dict[str, int]:
    """Each layer name's index among ``names`` (ordered by the number in the name, as vLLM's
    ``extract_layer_index``, then by name)."""

    def number(name: str) -> int:
        digits = [int(part) for part in name.split(".") if part.isdigit()]
        return digits[0] if digits else -1

    return {name: index for index, name in enumerate(sorted(set(names), key=lambda n: (number(n), n)))}


def group_layout(kv_cache_config: Any, group_ids: tuple[int, ...]) -> tuple[ModelLayout, dict[int, str]]:
    """The offloaded groups ``group_ids`` of vLLM's ``KVCacheConfig`` as a
    :class:`~kvstage.model_layout.ModelLayout`: a group of ``FullAttentionSpec`` /
    ``MLAAttentionSpec`` layers is a :class:`FullAttention`, of ``SlidingWindowSpec`` layers a
    :class:`SlidingWindow` (vLLM's ``sliding_window``), of ``MambaSpec`` layers in align mode a
    :class:`RequestState` (the state tensors of one layer); component ``g<group id>``.
    Layers are numbered by the number in their name.

    Returns:
        The layout, and each group id's component name.

    Raises:
        InvalidArgumentError: a group of another kind (naming ``kv_cache_groups[i]``, its kind
            and its layers), e.g. Mamba outside align mode, chunked local attention, sinks.
    """
    groups = [(group_id, kv_cache_config.kv_cache_groups[group_id]) for group_id in group_ids]
    order = _layer_order([name for _, group in groups for name in group.layer_names])
    components, names = [], {}
    for group_id, group in groups:
        from vllm.v1.kv_cache_interface import iter_layer_specs

        specs = list(iter_layer_specs(group.kv_cache_spec))
        kinds = {_kind(spec) for spec in specs}
        if None in kinds or len(kinds) != 1:
            spec = next((s for s in specs if _kind(s) is None), specs[0])
            mode = f" (mamba_cache_mode {spec.mamba_cache_mode!r})" if hasattr(spec, "mamba_cache_mode") else ""
            raise InvalidArgumentError(
                f"kv_cache_groups[{group_id}]: KVStageOffloadingSpec stores full-attention, sliding-window and Mamba "
                f"(align mode: --enable-prefix-caching) groups; group {group_id} (layers {list(group.layer_names)}) is "
                f"{type(spec).__name__}{mode}"
            )
        (kind,) = kinds
        spec, name = specs[0], f"g{group_id}"
        layers = tuple(sorted(order[layer] for layer in group.layer_names))
        if kind == "state":
            tensors = tuple(
                TensorSpec(f"t{i}", shape, dtype) for i, (shape, dtype) in enumerate(zip(spec.shapes, spec.dtypes))
            )
            component = RequestState(layers, tensors, name=name, replicated=bool(spec.tp_replicated))
        else:
            from kvstage.kv_layout import KVLayout

            mla = spec.num_kv_heads == 1 and "MLA" in type(spec).__name__
            layout = KVLayout(len(layers), 1 if mla else 2, spec.num_kv_heads, spec.head_size, spec.dtype)
            if kind == "full":
                component = FullAttention(layers, layout, name=name)
            else:
                component = SlidingWindow(layers, layout, spec.sliding_window, name=name)
        components.append(component)
        names[group_id] = name
    return ModelLayout(len(order), tuple(components)), names


def group_fingerprints(config: Any, kv_cache_config: Any, *, model_id: str | None = None) -> dict[int, Any]:
    """One key space per offloaded group (:func:`group_layout`'s components), by group id.

    A page is one block of the group on this worker: each of its layers' rows as vLLM's worker
    lays them out (``page_size_bytes``, padding included), in the group's layer order. The page
    format names the group (its component, block size and layers), the whole model's layout
    (every group: processes of another hybrid layout share no key space), the hash block, the
    KV cache layout and the parallel layout.

    Raises:
        InvalidArgumentError: as :func:`group_layout`; chunks of more than one block.
    """
    from kvstage.integrations.vllm.keys import _world, require_one_block_chunks
    from kvstage.storage import LayoutFingerprint

    require_one_block_chunks(config)
    group_ids = tuple(group.group_id for group in config.groups)
    layout, names = group_layout(kv_cache_config, group_ids)
    parallel = config.parallel
    model = "|".join(f"{c.name}={c.describe()}" for c in layout.components)
    fingerprints = {}
    for group in config.groups:
        spec = kv_cache_config.kv_cache_groups[group.group_id].kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", {})
        page_bytes = sum(per_layer.get(layer, spec).page_size_bytes for layer in group.layer_names)
        component = layout.component(names[group.group_id])
        page_format = "|".join(
            [
                "vllm-group-v1",
                f"component={component.name}",
                f"g{group.group_id}:{group.tokens_per_block}tok:{','.join(group.layer_names)}",
                f"model={model}",
                f"tph={config.cache.tokens_per_hash}",
                f"layout={config.kv_cache_layout}",
                _world(parallel),
            ]
        )
        fingerprints[group.group_id] = LayoutFingerprint.opaque(
            model_id or config.model.name,
            page_bytes=page_bytes,
            page_format=page_format,
            tp_rank=parallel.rank,
            tp_size=parallel.world_size,
            rank_neutral=bool(config.replicated_layout),
        )
    return fingerprints


class GroupStores:
    """The stores of a hybrid model's groups (one key space each) as one store for the
    scheduler's manager: ``exists`` asks each key's group's store, ``take_events`` gives every
    group store's events of its own key space (relabelled :attr:`prefix`), ``clear`` clears each.

    Args:
        stores: per group id, its store (kept: ``close`` lets go of each through
            :func:`kvstage.storage.shared.release_shared_storage`).
    """

    def __init__(self, stores: dict[int, Any]) -> None:
        self.stores = dict(stores)
        self.prefix = "kvstage-vllm-groups:" + ",".join(store.prefix for store in self.stores.values())

    def _store(self, key: str) -> Any:
        group = group_of_key(key)
        require(group in self.stores, "keys", lambda: f"key {key!r} is of KV cache group {group}, not offloaded here")
        return self.stores[group]

    def exists(self, keys: list[str]) -> list[bool]:
        """Whether each key's group store holds it (one ``exists`` per group)."""
        by_store: dict[int, list[int]] = {}
        keys = list(keys)
        for index, key in enumerate(keys):
            by_store.setdefault(group_of_key(key), []).append(index)
        answers = [False] * len(keys)
        for indices in by_store.values():
            store = self._store(keys[indices[0]])
            for index, held in zip(indices, store.exists([keys[i] for i in indices])):
                answers[index] = bool(held)
        return answers

    def take_events(self) -> list:
        """Each group store's events of its own key space, relabelled :attr:`prefix` (a key's
        group names its store)."""
        from dataclasses import replace

        events = []
        for store in self.stores.values():
            events.extend(
                replace(event, key_space=self.prefix)
                for event in store.take_events()
                if event.key_space == store.prefix
            )
        return events

    def clear(self) -> None:
        """Clear every group's key space."""
        for store in self.stores.values():
            store.clear()

    def close(self) -> None:
        """Let go of every group store."""
        from kvstage.storage.shared import release_shared_storage

        for store in self.stores.values():
            release_shared_storage(store)
