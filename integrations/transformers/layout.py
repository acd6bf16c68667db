"""A transformers model's KV layout, read from its config, and the refusal of models kvstage cannot store.

kvstage stores KV that a ``DynamicCache`` holds in plain ``DynamicLayer`` layers (full
attention, every token's KV kept), one layout for every layer:

- MHA / GQA (Llama, Qwen, Mistral without a window, ...): each layer's ``keys`` and ``values``
  are ``[batch, num_key_value_heads, seq, head_dim]``; the KV pool holds a K and a V buffer
  per layer (``kv_parts = 2``).
- MLA (DeepseekV2/V3 and the models built like them): transformers 5 caches the compressed
  latent, ``keys`` the ``kv_a_layernorm``'d ``[batch, 1, seq, kv_lora_rank]`` part and
  ``values`` the rotated ``[batch, 1, seq, qk_rope_head_dim]`` part; the pool holds them as one
  latent row per token (``kv_parts = 1``, ``head_dim = kv_lora_rank + qk_rope_head_dim``), as
  sglang does.

The layer kinds come from transformers' own ``get_layer_types_and_kwargs`` (what
``DynamicCache(config=...)`` builds), so a sliding-window, chunked, indexed (DeepSeek V3.2),
linear-attention / Mamba, hybrid or KV-sharing layer is refused by the same rule transformers
uses to give it another cache layer. The heads and head size are read from the cache a
one-token forward fills (the config may not state them plainly: Falcon's ``multi_query``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.kv_layout import KVLayout

__all__ = ["CacheLayout", "cache_layout"]

# The config fields that make transformers pick another layer kind than "full_attention"
# (get_layer_types_and_kwargs): named in the refusal so the user sees which setting it is.
_LAYER_KIND_FIELDS = {
    "sliding_attention": "sliding_window",
    "chunked_attention": "attention_chunk_size",
    "dummy": "kv_sharing_modes",
}


@dataclass(frozen=True)
class CacheLayout:
    """How a model's ``DynamicCache`` layers map to kvstage's KV pool rows.

    Attributes:
        layout: one token's layout (:class:`~kvstage.kv_layout.KVLayout`): layers, parts,
            heads, head_dim, dtype (the cache's: the model's dtype, as a rule).
        key_dim: elements of a layer's ``keys`` per head (MHA: ``head_dim``; MLA:
            ``kv_lora_rank``).
        value_dim: elements of a layer's ``values`` per head (MHA: ``head_dim``; MLA:
            ``qk_rope_head_dim``).
    """

    layout: KVLayout
    key_dim: int
    value_dim: int

    @property
    def is_mla(self) -> bool:
        """True when the pool holds one latent row per token (keys and values side by side)."""
        return self.layout.kv_parts == 1

    @property
    def cache_heads(self) -> int:
        """Heads of a cache layer's ``keys`` / ``values`` (1 for MLA)."""
        return self.layout.num_heads


def _positive_int(config: Any, name: str) -> int | None:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _refuse_layer_kinds(config: Any) -> None:
    from transformers.cache_utils import get_layer_types_and_kwargs

    layer_types, _ = get_layer_types_and_kwargs(config)
    for layer, kind in enumerate(layer_types):
        if kind == "full_attention":
            continue
        field = (
            "layer_types"
            if getattr(config, "layer_types", None) is not None
            else _LAYER_KIND_FIELDS.get(kind, "layer_types")
        )
        raise InvalidArgumentError(
            f"model.config.{field}: layer {layer} is a {kind!r} layer ({type(config).__name__}); kvstage stores only "
            "full-attention layers that keep every token's KV (transformers' 'full_attention': no sliding window, "
            "chunked or indexed attention, Mamba / linear attention, hybrid or shared-KV layers)"
        )


def cache_layout(model: Any) -> CacheLayout:
    """The KV layout of ``model``'s ``DynamicCache``, from its config and the cache a one-token forward fills.

    Args:
        model: a transformers decoder-only model (``PreTrainedModel`` with ``config``,
            ``dtype``); for a multimodal model its text decoder's config is read.

    Returns:
        :class:`CacheLayout`.

    Raises:
        ArgumentTypeError: ``model`` has no transformers ``config``.
        InvalidArgumentError: the model is not one kvstage can store, naming the config field:
            an encoder-decoder (``is_encoder_decoder``); a layer that is not full attention
            (``sliding_window``, ``attention_chunk_size``, ``layer_types``, ``kv_sharing_modes``;
            Mamba / linear-attention / hybrid / DeepSeek V3.2's indexed layers); a model whose
            generate() cannot use a ``DynamicCache``; cache layers that differ in heads or head
            size, or whose keys and values differ (other than MLA's latent and rope part); a
            model whose one-token forward (the probe below) fails or fills no ``DynamicLayer``.

    The KV heads and head size are those of the cache a one-token forward fills (on the
    model's device, under ``no_grad``, the random state restored): what the model caches,
    whatever its config calls them (Falcon's ``multi_query``, ``num_kv_heads``). Forward
    hooks on the model see that call.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise ArgumentTypeError(
            f"model: must be a transformers model (with a PretrainedConfig .config), got {type(model).__name__}"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise InvalidArgumentError(
            f"model.config.is_encoder_decoder: is True ({type(config).__name__}); kvstage stores a decoder-only model's KV"
        )
    supports = getattr(type(model), "_supports_default_dynamic_cache", None)
    if supports is not None and not supports():
        raise InvalidArgumentError(
            f"model: {type(model).__name__} keeps a cache of its own, not a DynamicCache; kvstage stores DynamicCache KV only"
        )
    text = config.get_text_config(decoder=True)
    _refuse_layer_kinds(text)
    num_layers = _positive_int(text, "num_hidden_layers")
    if num_layers is None:
        raise InvalidArgumentError(
            f"model.config.num_hidden_layers: must be a positive int, got {getattr(text, 'num_hidden_layers', None)!r}"
        )
    dtype = getattr(model, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise ArgumentTypeError(f"model.dtype: must be a torch.dtype, got {type(dtype).__name__}")

    keys, values, dtype = _probe_shapes(model, num_layers)
    kv_lora_rank, rope_dim = _positive_int(text, "kv_lora_rank"), _positive_int(text, "qk_rope_head_dim")
    if kv_lora_rank is not None and rope_dim is not None:
        # MLA: the cache holds the latent [1, 1, n, kv_lora_rank] and the rope part [1, 1, n, rope_dim]
        if (keys, values) != ((1, kv_lora_rank), (1, rope_dim)):
            raise InvalidArgumentError(
                f"model.config.kv_lora_rank: an MLA model's cache layers must hold [1, 1, n, {kv_lora_rank}] keys and "
                f"[1, 1, n, {rope_dim}] values (kv_lora_rank, qk_rope_head_dim), a forward filled {_shape(keys)} and {_shape(values)}"
            )
        return CacheLayout(KVLayout(num_layers, 1, 1, kv_lora_rank + rope_dim, dtype), kv_lora_rank, rope_dim)
    if keys != values:
        raise InvalidArgumentError(
            f"model: its cache layers hold {_shape(keys)} keys and {_shape(values)} values; kvstage stores keys and "
            "values of the same heads and head size (or an MLA latent)"
        )
    heads, head_dim = keys
    return CacheLayout(KVLayout(num_layers, 2, heads, head_dim, dtype), head_dim, head_dim)


def _shape(heads_dim: tuple[int, int]) -> str:
    return f"[1, {heads_dim[0]}, n, {heads_dim[1]}]"


def _probe_shapes(model: Any, num_layers: int) -> tuple[tuple[int, int], tuple[int, int], torch.dtype]:
    """``(heads, dim)`` of the keys and of the values a one-token forward puts in every cache layer, and their dtype.

    The cache the model fills is the truth a config may not state plainly (Falcon's
    ``multi_query`` keeps one KV head while ``num_attention_heads`` says more; models set
    ``head_dim`` in many ways). One token on the model's device under ``no_grad``, the random
    state restored (a model in train mode draws dropout masks); a forward hook sees the call.
    """
    import inspect

    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    forward = inspect.signature(type(model).forward).parameters
    argument = "cache" if "cache" in forward else "past_key_values"
    cache = DynamicCache(config=model.config)
    device = getattr(model, "device", torch.device("cpu"))
    # fork_rng saves and restores the CPU state and these CUDA devices' (by index)
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True, **{argument: cache})
    except Exception as error:
        raise InvalidArgumentError(
            f"model: a one-token forward with a DynamicCache (to read its KV heads and head size) failed: {error!r}; "
            "kvstage needs a model whose forward(input_ids, cache=DynamicCache) fills the cache"
        ) from error
    layers = getattr(cache, "layers", [])
    if len(layers) != num_layers:
        raise InvalidArgumentError(
            f"model.config.num_hidden_layers: is {num_layers}, the model's DynamicCache has {len(layers)} layers"
        )
    shapes = set()
    for index, layer in enumerate(layers):
        if type(layer) is not DynamicLayer or not getattr(layer, "is_initialized", False) or layer.keys.shape[2] != 1:
            raise InvalidArgumentError(
                f"model: a one-token forward left cache layer {index} ({type(layer).__name__}) without that token's KV; "
                "kvstage stores full-attention layers that keep every token's KV"
            )
        if layer.keys.shape[0] != 1 or layer.values.shape[0] != 1 or layer.keys.dim() != 4 or layer.values.dim() != 4:
            raise InvalidArgumentError(
                f"model: cache layer {index} holds keys {tuple(layer.keys.shape)} and values {tuple(layer.values.shape)} "
                "for one token of one sequence; kvstage stores [batch, heads, tokens, dim] layers"
            )
        shapes.add(
            (
                (int(layer.keys.shape[1]), int(layer.keys.shape[3])),
                (int(layer.values.shape[1]), int(layer.values.shape[3])),
                layer.keys.dtype,
                layer.values.dtype,
            )
        )
    if len(shapes) != 1:
        raise InvalidArgumentError(
            f"model: its cache layers differ in (heads, head size) or dtype of keys and values: {sorted(shapes, key=str)}; "
            "kvstage stores one layout for every layer"
        )
    ((keys, values, key_dtype, value_dtype),) = shapes
    if key_dtype != value_dtype:
        raise InvalidArgumentError(
            f"model: its cache holds {key_dtype} keys and {value_dtype} values; kvstage stores one dtype"
        )
    return keys, values, key_dtype
