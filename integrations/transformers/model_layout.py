"""A transformers model's :class:`~kvstage.model_layout.ModelLayout`, read from the cache a short
prefill fills (hybrid models included).

The layer kinds are those ``DynamicCache(config=...)`` builds (transformers'
``DYNAMIC_LAYER_TYPE_MAPPING``); shapes and dtypes are those a prefill of a few tokens leaves in
each cache layer, so the layout is what the model caches, whatever its config calls it:

=====================================================  ==========================================
cache layer                                            components
=====================================================  ==========================================
``DynamicLayer``                                       full attention (K/V; MLA: one latent row of
                                                       ``kv_lora_rank + qk_rope_head_dim``)
``DynamicSlidingWindowLayer`` (``sliding_attention``)  sliding window ``W = sliding_window``
``DynamicIndexedLayer`` (DeepSeek V3.2)                full attention (MLA) + sidecar ``indexer``
                                                       (tensor ``indexer_keys``, per token)
``LinearAttentionLayer`` (Qwen3-Next, Jamba)           state (tensors ``conv``, ``recurrent``; a
                                                       layer's state ``i > 0``: ``conv_i``, ...)
``LinearAttentionAndFullAttentionLayer`` (Falcon-H1)   full attention + state
``LinearAttentionAndSlidingWindowAttentionLayer``      sliding window + state
=====================================================  ==========================================

Refused, naming the layer: chunked attention (the same cache class as a sliding window, another
mask), shared-KV ("dummy") layers, any other cache layer class.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.kv_layout import KVLayout
from kvstage.model_layout import (
    FullAttention,
    LayoutComponent,
    ModelLayout,
    PageSidecar,
    RequestState,
    SlidingWindow,
    TensorSpec,
)

__all__ = ["model_layout", "model_layout_of_config"]


def model_layout_of_config(config: Any, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> ModelLayout:
    """Build the model of ``config`` with random weights on CPU (no download) and read its layout
    (:func:`model_layout`). For small configs: the whole model is built.

    Raises:
        ArgumentTypeError: ``config`` is no transformers config.
        InvalidArgumentError: as :func:`model_layout`.
    """
    from transformers import AutoModelForCausalLM, PretrainedConfig

    if not isinstance(config, PretrainedConfig):
        raise ArgumentTypeError(f"config: must be a transformers PretrainedConfig, got {type(config).__name__}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model_layout(model.to(dtype).eval())


def model_layout(model: Any, *, probe_tokens: int | None = None) -> ModelLayout:
    """The :class:`ModelLayout` of ``model``'s ``DynamicCache`` (module doc).

    Args:
        model: a transformers decoder-only model (``config``, ``forward(input_ids, cache=...)``).
        probe_tokens: tokens of the probe prefill (default: the largest window + 1, at least 4),
            run on the model's device under ``no_grad`` with the random state restored.

    Returns:
        The layout; its sliding-window layers are checked to keep ``min(n, W - 1)`` of ``n``
        tokens, full layers ``n``, state layers one row per request.

    Raises:
        ArgumentTypeError: ``model`` has no transformers config.
        InvalidArgumentError: a refused layer kind (named with its layer and config field), a
            probe that fails, cache layers of one kind whose shapes or dtypes differ, a cache
            that does not hold what its class says after the prefill.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import get_layer_types_and_kwargs

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise ArgumentTypeError(
            f"model: must be a transformers model (with a PretrainedConfig .config), got {type(model).__name__}"
        )
    text = config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(text)
    for layer, kind in enumerate(layer_types):
        if kind in ("chunked_attention", "dummy"):
            why = (
                "chunked attention (a window reset at chunk boundaries)" if kind == "chunked_attention" else "shared KV"
            )
            raise InvalidArgumentError(
                f"model.config.layer_types: layer {layer} is a {kind!r} layer ({why}); kvstage stores full attention, "
                "sliding windows, DSA indexer keys and linear-attention / Mamba state"
            )
    windows = [getattr(text, "sliding_window", None) or 0]
    count = probe_tokens if probe_tokens is not None else max(4, max(windows) + 1)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise InvalidArgumentError(f"probe_tokens: must be a positive int, got {probe_tokens!r}")
    cache = DynamicCache(config=config)
    forward = inspect.signature(type(model).forward).parameters
    argument = "cache" if "cache" in forward else "past_key_values"
    device = getattr(model, "device", torch.device("cpu"))
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    ids = torch.arange(count, device=device)[None] % max(int(getattr(text, "vocab_size", count) or count), 1)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            model(input_ids=ids, use_cache=True, **{argument: cache})
    except Exception as error:
        raise InvalidArgumentError(
            f"model: a {count}-token prefill with a DynamicCache (to read its cache layers) failed: {error!r}"
        ) from error
    return _layout_of_cache(cache.layers, count, text)


def _kv(layer: Any, index: int, text: Any) -> tuple[tuple[int, int, int], torch.dtype, tuple[int, ...]]:
    """``(kv_parts, heads, head_dim)``, dtype and keys' shape of a cache layer's per-token KV."""
    keys, values = layer.keys, layer.values
    if keys.dim() != 4 or values.dim() != 4 or keys.shape[0] != 1 or keys.dtype != values.dtype:
        raise InvalidArgumentError(
            f"model: cache layer {index} holds keys {tuple(keys.shape)} {keys.dtype} and values "
            f"{tuple(values.shape)} {values.dtype}; kvstage stores [1, heads, tokens, dim] keys and values of one dtype"
        )
    kv_lora_rank, rope = getattr(text, "kv_lora_rank", None), getattr(text, "qk_rope_head_dim", None)
    if (
        kv_lora_rank
        and rope
        and (keys.shape[1], keys.shape[3], values.shape[1], values.shape[3])
        == (
            1,
            kv_lora_rank,
            1,
            rope,
        )
    ):
        return (1, 1, kv_lora_rank + rope), keys.dtype, tuple(keys.shape)  # MLA: latent and rope part, one row
    if (keys.shape[1], keys.shape[3]) != (values.shape[1], values.shape[3]):
        raise InvalidArgumentError(
            f"model: cache layer {index} holds keys {tuple(keys.shape)} and values {tuple(values.shape)}; kvstage "
            "stores keys and values of the same heads and head size (or an MLA latent)"
        )
    return (2, int(keys.shape[1]), int(keys.shape[3])), keys.dtype, tuple(keys.shape)


def _state(layer: Any, index: int) -> tuple[TensorSpec, ...]:
    specs = []
    for state in range(layer.number_of_states):
        for name, tensors in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
            tensor = tensors.get(state)
            if tensor is None:
                continue
            if tensor.dim() < 2 or tensor.shape[0] != 1:
                raise InvalidArgumentError(
                    f"model: cache layer {index}'s {name} state is {tuple(tensor.shape)}; kvstage stores [1, ...] "
                    "state of one request"
                )
            specs.append(TensorSpec(name if state == 0 else f"{name}_{state}", tuple(tensor.shape[1:]), tensor.dtype))
    if not specs:
        raise InvalidArgumentError(
            f"model: cache layer {index} ({type(layer).__name__}) holds no state after a prefill"
        )
    return tuple(specs)


def _layout_of_cache(layers: list, count: int, text: Any) -> ModelLayout:
    from transformers.cache_utils import (
        DynamicIndexedLayer,
        DynamicLayer,
        DynamicSlidingWindowLayer,
        LinearAttentionCacheLayerMixin,
    )

    groups: dict[tuple, list[int]] = {}  # (kind, what makes one component) -> layers

    def add(key: tuple, index: int) -> None:
        groups.setdefault(key, []).append(index)

    for index, layer in enumerate(layers):
        is_state = isinstance(layer, LinearAttentionCacheLayerMixin)
        has_kv = isinstance(layer, DynamicLayer)
        if not (is_state or has_kv) or type(layer).__name__ == "DummyLayer":
            raise InvalidArgumentError(
                f"model: cache layer {index} is a {type(layer).__name__}; kvstage reads DynamicLayer, "
                "DynamicSlidingWindowLayer, DynamicIndexedLayer and linear-attention layers"
            )
        if has_kv:
            (parts, heads, dim), dtype, shape = _kv(layer, index, text)
            if isinstance(layer, DynamicSlidingWindowLayer):
                window = int(layer.sliding_window)
                kept = min(count, window - 1)
                if shape[2] != kept:
                    raise InvalidArgumentError(
                        f"model: sliding-window cache layer {index} (window {window}) kept {shape[2]} of {count} "
                        f"tokens; kvstage expects transformers' W - 1 = {kept}"
                    )
                add(("swa", parts, heads, dim, dtype, window), index)
            else:
                if shape[2] != count:
                    raise InvalidArgumentError(
                        f"model: cache layer {index} ({type(layer).__name__}) kept {shape[2]} of {count} tokens; "
                        "a full-attention layer keeps every token"
                    )
                add(("full", parts, heads, dim, dtype), index)
            if isinstance(layer, DynamicIndexedLayer):
                indexer = layer.indexer_keys
                if indexer is None or indexer.dim() != 3 or tuple(indexer.shape[:2]) != (1, count):
                    raise InvalidArgumentError(
                        f"model: cache layer {index}'s indexer_keys is "
                        f"{None if indexer is None else tuple(indexer.shape)}, expected [1, {count}, index_head_dim]"
                    )
                add(("sidecar", int(indexer.shape[2]), indexer.dtype), index)
        if is_state:
            add(("state", _state(layer, index)), index)
    components: list[LayoutComponent] = []
    for kind in ("full", "swa", "sidecar", "state"):
        keys = [key for key in groups if key[0] == kind]
        if len(keys) > 1:
            described = "; ".join(f"layers {groups[key]}: {key[1:]}" for key in keys)
            raise InvalidArgumentError(
                f"model: its {kind} cache layers differ in shape, dtype or window ({described}); kvstage stores one "
                f"layout per component"
            )
        if not keys:
            continue
        (key,) = keys
        layer_ids = tuple(groups[key])
        if kind in ("full", "swa"):
            _, parts, heads, dim, dtype, *window = key
            layout = KVLayout(len(layer_ids), parts, heads, dim, dtype)
            component = (
                FullAttention(layer_ids, layout) if kind == "full" else SlidingWindow(layer_ids, layout, window[0])
            )
        elif kind == "sidecar":
            _, dim, dtype = key
            component = PageSidecar(layer_ids, (TensorSpec("indexer_keys", (dim,), dtype),), name="indexer")
        else:
            component = RequestState(layer_ids, key[1])
        components.append(component)
    return ModelLayout(len(layers), tuple(components))
