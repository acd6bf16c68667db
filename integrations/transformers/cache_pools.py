"""A hybrid transformers model's ``DynamicCache`` as kvstage pools, and back.

:class:`CachePools` holds one pool per component of a :class:`~kvstage.model_layout.ModelLayout`
(:func:`~kvstage.integrations.transformers.model_layout`), the engine side that kvstage's
gather/scatter and the offload manager read and write:

=====================================================  ==========================================
cache layer part                                       pool (slot = token position / state slot)
=====================================================  ==========================================
``DynamicLayer`` keys / values                         full-attention :class:`KVPool` (K, V; MLA:
                                                       one row ``keys ++ values``, as sglang)
``DynamicSlidingWindowLayer`` keys / values            sliding-window :class:`KVPool` (K, V)
``DynamicIndexedLayer.indexer_keys``                   sidecar :class:`KVPool` of rows
                                                       (:meth:`KVPool.from_rows`)
linear-attention ``conv_states`` / ``recurrent_states``  :class:`StatePool` slot (every state layer's
                                                       tensors, snapshot order of the layout)
=====================================================  ==========================================

Token pools are indexed by position (slot ``t`` holds token ``t``), so a page of tokens
``[i * P, (i + 1) * P)`` is slots ``[i * P, (i + 1) * P)``. :meth:`CachePools.copy_in` copies a
cache's tokens ``[start, end)`` in after a forward, :meth:`CachePools.save_state` its state into a
state slot (the state after exactly ``cache.get_seq_length()`` tokens), and
:meth:`CachePools.to_cache` builds a fresh ``DynamicCache`` positioned at ``L`` from the pools:
what transformers itself holds after ``L`` tokens (a sliding-window layer its last ``W - 1``
tokens and ``L`` as its length, a state layer the snapshot). Moving pool bytes to a store and
back is kvstage's (kernels, offload manager); this module only translates cache layers.

A sliding-window layer keeps ``W - 1`` tokens, so ``copy_in`` of tokens it no longer holds is
refused: copy after every forward (or call :func:`record_window` on the cache before a forward
that computes more than ``W - 1`` tokens, which keeps them until :meth:`CachePools.copy_in` has
copied them and trims the layer back).
"""

from __future__ import annotations

from typing import Any

import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError, is_int, require
from kvstage.kernels import KVPool, StatePool
from kvstage.model_layout import LayoutComponent, ModelLayout

__all__ = ["CachePools", "record_window"]


def record_window(cache: Any) -> None:
    """Make ``cache``'s sliding-window layers keep every token of the next forwards (transformers'
    ``activate_past_recording`` on those layers only) until :meth:`CachePools.copy_in` trims
    them back to ``W - 1``; the forward's attention is unchanged (the same keys are visible)."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.activate_past_recording()


class CachePools:
    """One sequence's pools for ``layout``: ``max_tokens`` token slots per token component and
    ``state_slots`` state slots.

    Attributes:
        layout: the model's :class:`ModelLayout`.
        max_tokens: token slots (positions ``[0, max_tokens)``).
        pools: per component name, its :class:`KVPool` (full, sliding window, sidecar: slot =
            position) or :class:`StatePool` (state: slot = a snapshot's slot).
        state_buffers: per state component, ``{tensor name: [per layer [state_slots, *shape]]}``
            (what :meth:`RequestState.require_buffers` checks).

    Args:
        layout: from :func:`~kvstage.integrations.transformers.model_layout`.
        max_tokens: the longest sequence (>= 1).
        state_slots: state slots per state component (>= 1).
        device: where the pools live (the model's device).
        fill: value the pools start with (NaN by default: a read of a slot nothing wrote shows).

    Raises:
        ArgumentTypeError: ``layout`` is not a ModelLayout.
        InvalidArgumentError: ``max_tokens`` or ``state_slots`` not a positive int.
    """

    def __init__(
        self,
        layout: ModelLayout,
        *,
        max_tokens: int,
        state_slots: int = 1,
        device: torch.device | str = "cpu",
        fill: float = float("nan"),
    ) -> None:
        require(
            isinstance(layout, ModelLayout),
            "layout",
            lambda: f"must be a kvstage.model_layout.ModelLayout, got {type(layout).__name__}",
            ArgumentTypeError,
        )
        require(
            is_int(max_tokens) and max_tokens >= 1, "max_tokens", lambda: f"must be a positive int, got {max_tokens!r}"
        )
        require(
            is_int(state_slots) and state_slots >= 1,
            "state_slots",
            lambda: f"must be a positive int, got {state_slots!r}",
        )
        self.layout = layout
        self.max_tokens = max_tokens
        self.device = torch.device(device)
        self.pools: dict[str, KVPool | StatePool] = {}
        self.state_buffers: dict[str, dict[str, list[torch.Tensor]]] = {}
        for component in layout.components:
            if component.kind in ("full", "swa"):
                self.pools[component.name] = KVPool.allocate(component.layout, max_tokens, device=device, fill=fill)
            elif component.kind == "sidecar":
                require(
                    len(component.tensors) == 1,
                    "layout",
                    lambda component=component: (
                        f"sidecar {component.name!r} has {len(component.tensors)} tensors; a transformers cache "
                        "holds one (indexer_keys)"
                    ),
                )
                (tensor,) = component.tensors
                rows = [
                    torch.full((max_tokens, *tensor.shape), fill, dtype=tensor.dtype, device=device)
                    for _ in component.layers
                ]
                self.pools[component.name] = KVPool.from_rows([row.reshape(max_tokens, -1) for row in rows])
            else:
                buffers = {
                    tensor.name: [
                        torch.full((state_slots, *tensor.shape), fill, dtype=tensor.dtype, device=device)
                        for _ in component.layers
                    ]
                    for tensor in component.tensors
                }
                component.require_buffers(buffers)
                self.state_buffers[component.name] = buffers
                self.pools[component.name] = StatePool.from_layers(
                    [[buffers[tensor.name][j] for tensor in component.tensors] for j in range(component.num_layers)]
                )

    @property
    def kv_pool(self) -> KVPool:
        """The full-attention component's pool: the ``OffloadManager``'s ``kv_pool``.

        Raises:
            InvalidArgumentError: the layout has no (or more than one) full-attention component.
        """
        fulls = self._of_kind("full")
        require(len(fulls) == 1, "layout", lambda: f"has {len(fulls)} full-attention components; the manager needs one")
        return self.pools[fulls[0].name]

    def components(self, slots_of: Any = None, window_kept: Any = None) -> Any:
        """The manager's :class:`~kvstage.offload.components.ComponentPools`: every pool but
        :attr:`kv_pool`'s, a sliding window's slots of a request being ``slots_of(req)`` (default:
        positions ``[0, max_tokens)``, one sequence per pools).

        Args:
            window_kept: ``{window component name: R}`` for an engine that frees a window's
                slots behind a request (``ComponentPools``' rule: ``R >= W - 1``); None: it
                keeps them until the release.

        Raises:
            InvalidArgumentError: as :attr:`kv_pool` (a ``window_kept`` that breaks
                ``ComponentPools``' rules is refused by the manager that takes it).
        """
        from kvstage.offload.components import ComponentPools

        full = self.kv_pool
        positions = torch.arange(self.max_tokens, device=self.device)
        slots_of = slots_of if slots_of is not None else (lambda req: positions)
        others = {name: pool for name, pool in self.pools.items() if pool is not full}
        return ComponentPools(
            self.layout,
            others,
            slots_of={c.name: slots_of for c in self._of_kind("swa")},
            window_kept={} if window_kept is None else window_kept,
        )

    def _of_kind(self, kind: str) -> tuple[LayoutComponent, ...]:
        return self.layout.of_kind(kind)

    def _check_cache(self, cache: Any) -> None:
        layers = getattr(cache, "layers", None)
        require(
            isinstance(layers, list),
            "cache",
            lambda: f"must be a transformers DynamicCache, got {type(cache).__name__}",
            ArgumentTypeError,
        )
        require(
            len(layers) == self.layout.num_layers,
            "cache",
            lambda: f"holds {len(layers)} layers, the layout {self.layout.num_layers}",
        )

    # -- cache -> pools ----------------------------------------------------------------------

    @torch.no_grad()
    def copy_in(self, cache: Any, start: int, end: int) -> None:
        """Copy ``cache``'s per-token KV and sidecar rows of positions ``[start, end)`` into the
        pools' slots ``[start, end)``; sliding-window layers that recorded more than ``W - 1``
        tokens (:func:`record_window`) are trimmed back afterwards.

        Raises:
            InvalidArgumentError: ``0 <= start <= end <= min(max_tokens, cache length)`` does not
                hold; a sliding-window layer no longer holds position ``start`` (it keeps ``W - 1``
                tokens); a cache of another layer count. Raised before anything is copied.
        """
        self._check_cache(cache)
        length = cache.get_seq_length()
        require(
            is_int(start) and is_int(end) and 0 <= start <= end <= min(length, self.max_tokens),
            "start/end",
            lambda: (
                f"must satisfy 0 <= start <= end <= min(cache length {length}, max_tokens {self.max_tokens}), "
                f"got {start!r}, {end!r}"
            ),
        )
        for component in self._of_kind("swa") if end > start else ():
            for layer in component.layers:
                kept = cache.layers[layer].keys.shape[-2]
                first = cache.layers[layer].cumulative_length - kept
                require(
                    start >= first,
                    "start",
                    lambda first=first, layer=layer: (
                        f"sliding-window layer {layer} holds positions from {first} on (W - 1 tokens), not {start}: "
                        "copy after each forward, or record_window(cache) before it"
                    ),
                )
        if end == start:
            return
        for component in (*self._of_kind("full"), *self._of_kind("swa")):
            pool = self.pools[component.name]
            for j, layer in enumerate(component.layers):
                cache_layer = cache.layers[layer]
                offset = cache_layer.get_seq_length() - cache_layer.keys.shape[-2]  # a window's first position
                keys = cache_layer.keys[0, :, start - offset : end - offset]  # [heads, n, dim]
                values = cache_layer.values[0, :, start - offset : end - offset]
                if pool.kv_parts == 1:  # MLA: latent ++ rope part, one row
                    pool.layer(0, j)[start:end] = torch.cat([keys, values], dim=-1).transpose(0, 1)
                else:
                    pool.layer(0, j)[start:end] = keys.transpose(0, 1)
                    pool.layer(1, j)[start:end] = values.transpose(0, 1)
        for component in self._of_kind("sidecar"):
            pool = self.pools[component.name]
            for j, layer in enumerate(component.layers):
                rows = cache.layers[layer].indexer_keys[0, start:end]  # [n, index_head_dim]
                pool.layer(0, j)[start:end] = rows.reshape(end - start, 1, -1)
        for component in self._of_kind("swa"):
            for layer in component.layers:
                cache_layer = cache.layers[layer]
                if cache_layer.record_past and cache_layer.keys.shape[-2] > component.window - 1:
                    cache_layer.crop(0)  # back to the W - 1 tokens the next forward needs

    @torch.no_grad()
    def save_state(self, cache: Any, slot: int) -> None:
        """Copy ``cache``'s state (every state layer's conv and recurrent tensors: the state after
        ``cache.get_seq_length()`` tokens) into state slot ``slot`` of every state component.

        Raises:
            InvalidArgumentError: the layout has no state; ``slot`` out of range; a state layer
                that holds no state or a state of another shape or dtype than the layout's.
        """
        self._check_cache(cache)
        states = self._of_kind("state")
        require(bool(states), "cache", "the layout has no state component")
        for component in states:
            buffers = self.state_buffers[component.name]
            slots = next(iter(buffers.values()))[0].shape[0]
            require(is_int(slot) and 0 <= slot < slots, "slot", lambda: f"must be in [0, {slots}), got {slot!r}")
            for layer in component.layers:
                for tensor in component.tensors:
                    value = _state_tensor(cache.layers[layer], tensor.name)
                    require(
                        value is not None and tuple(value.shape) == (1, *tensor.shape) and value.dtype == tensor.dtype,
                        f"cache.layers[{layer}]",
                        lambda value=value, tensor=tensor: (
                            f"{tensor.name} state is "
                            f"{'missing' if value is None else (tuple(value.shape), value.dtype)}, the layout's "
                            f"{(1, *tensor.shape)} {tensor.dtype}"
                        ),
                    )
            for j, layer in enumerate(component.layers):
                for tensor in component.tensors:
                    buffers[tensor.name][j][slot] = _state_tensor(cache.layers[layer], tensor.name)[0]

    # -- pools -> cache ----------------------------------------------------------------------

    def to_cache(self, config: Any, num_tokens: int, *, state_slot: int | None = None) -> Any:
        """A fresh ``DynamicCache(config=config)`` positioned at ``num_tokens``: full layers hold
        slots ``[0, num_tokens)``, sliding-window layers the last ``min(num_tokens, W - 1)`` of
        them (and ``num_tokens`` as their length), indexed layers their ``indexer_keys``, state
        layers the snapshot in ``state_slot``. Tensors are copies (the pools may be reused).

        Raises:
            InvalidArgumentError: ``num_tokens`` outside ``[1, max_tokens]``; a layout with state
                and no ``state_slot`` (or one out of range); a config whose cache layers are not
                the layout's.
        """
        from transformers import DynamicCache

        require(
            is_int(num_tokens) and 1 <= num_tokens <= self.max_tokens,
            "num_tokens",
            lambda: f"must be in [1, max_tokens={self.max_tokens}], got {num_tokens!r}",
        )
        states = self._of_kind("state")
        if states:
            slots = next(iter(self.state_buffers[states[0].name].values()))[0].shape[0]
            require(
                is_int(state_slot) and 0 <= state_slot < slots,
                "state_slot",
                lambda: f"must be a state slot in [0, {slots}) (the layout has state), got {state_slot!r}",
            )
        cache = DynamicCache(config=config)
        self._check_cache(cache)
        for component in (*self._of_kind("full"), *self._of_kind("swa")):
            pool = self.pools[component.name]
            first = 0 if component.kind == "full" else max(num_tokens - (component.window - 1), 0)
            for j, layer in enumerate(component.layers):
                if pool.kv_parts == 1:
                    rows = pool.layer(0, j)[first:num_tokens].transpose(0, 1)[None]  # [1, 1, n, latent + rope]
                    split = _latent_dim(config)
                    keys, values = rows[..., :split], rows[..., split:]
                else:
                    keys = pool.layer(0, j)[first:num_tokens].transpose(0, 1)[None]
                    values = pool.layer(1, j)[first:num_tokens].transpose(0, 1)[None]
                cache_layer = cache.layers[layer]
                _require_kind(cache_layer, component, layer)
                cache_layer.update(keys.contiguous(), values.contiguous())
                if component.kind == "swa":
                    cache_layer.cumulative_length = num_tokens
        for component in self._of_kind("sidecar"):
            pool = self.pools[component.name]
            for j, layer in enumerate(component.layers):
                cache_layer = cache.layers[layer]
                _require_kind(cache_layer, component, layer)
                rows = pool.layer(0, j)[:num_tokens].reshape(1, num_tokens, -1)
                cache_layer.update_indexer(rows.clone())
        for component in states:
            buffers = self.state_buffers[component.name]
            for j, layer in enumerate(component.layers):
                cache_layer = cache.layers[layer]
                _require_kind(cache_layer, component, layer)
                for tensor in component.tensors:
                    kind, index = _state_name(tensor.name)
                    value = buffers[tensor.name][j][state_slot : state_slot + 1]
                    if kind == "conv":
                        cache_layer.lazy_initialization(conv_states=value, state_idx=index)
                        cache_layer.conv_states[index].copy_(value)
                    else:
                        cache_layer.lazy_initialization(recurrent_states=value, state_idx=index)
                        cache_layer.recurrent_states[index].copy_(value)
                    cache_layer.has_previous_state[index] = True
                if hasattr(cache_layer, "cumulative_length_linear"):  # transformers >= 5.25: a state layer's length
                    cache_layer.cumulative_length_linear.fill_(num_tokens)
        return cache


def _state_name(name: str) -> tuple[str, int]:
    """``conv`` -> (conv, 0), ``recurrent_2`` -> (recurrent, 2) (model_layout's names)."""
    kind, _, index = name.partition("_")
    return kind, int(index) if index else 0


def _state_tensor(layer: Any, name: str) -> torch.Tensor | None:
    kind, index = _state_name(name)
    states = getattr(layer, "conv_states" if kind == "conv" else "recurrent_states", None)
    if not isinstance(states, dict) or not layer.has_previous_state.get(index, False):
        return None
    return states.get(index)


def _latent_dim(config: Any) -> int:
    """Elements of an MLA cache layer's ``keys`` (the latent; ``values`` are the rope part)."""
    return int(config.get_text_config(decoder=True).kv_lora_rank)


def _require_kind(layer: Any, component: LayoutComponent, index: int) -> None:
    """Refuse a fresh cache layer that is not of the kind ``component`` caches (another config)."""
    from transformers.cache_utils import (
        DynamicIndexedLayer,
        DynamicLayer,
        DynamicSlidingWindowLayer,
        LinearAttentionCacheLayerMixin,
    )

    wanted = {
        "full": DynamicLayer,
        "swa": DynamicSlidingWindowLayer,
        "sidecar": DynamicIndexedLayer,
        "state": LinearAttentionCacheLayerMixin,
    }[component.kind]
    if not isinstance(layer, wanted) or (component.kind == "full" and isinstance(layer, DynamicSlidingWindowLayer)):
        raise InvalidArgumentError(
            f"config: cache layer {index} is a {type(layer).__name__}; the layout's {component.name!r} component "
            f"caches it as {component.kind}"
        )
