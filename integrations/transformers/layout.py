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
uses to give it another cache layer.
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
            heads, head_dim, dtype (the model's dtype).
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
        field = "layer_types" if getattr(config, "layer_types", None) is not None else _LAYER_KIND_FIELDS.get(kind, "layer_types")
        raise InvalidArgumentError(
            f"model.config.{field}: layer {layer} is a {kind!r} layer ({type(config).__name__}); kvstage stores only "
            "full-attention layers that keep every token's KV (transformers' 'full_attention': no sliding window, "
            "chunked or indexed attention, Mamba / linear attention, hybrid or shared-KV layers)"
        )


def cache_layout(model: Any) -> CacheLayout:
    """The KV layout of ``model``'s ``DynamicCache``, from its config and dtype.

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
            generate() cannot use a ``DynamicCache``; layers that differ in
            ``num_key_value_heads`` or ``head_dim``; a missing head count or size.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise ArgumentTypeError(f"model: must be a transformers model (with a PretrainedConfig .config), got {type(model).__name__}")
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
        raise InvalidArgumentError(f"model.config.num_hidden_layers: must be a positive int, got {getattr(text, 'num_hidden_layers', None)!r}")
    dtype = getattr(model, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise ArgumentTypeError(f"model.dtype: must be a torch.dtype, got {type(dtype).__name__}")

    kv_lora_rank, rope_dim = _positive_int(text, "kv_lora_rank"), _positive_int(text, "qk_rope_head_dim")
    if kv_lora_rank is not None and rope_dim is not None:
        layout = KVLayout(num_layers, 1, 1, kv_lora_rank + rope_dim, dtype)
        return CacheLayout(layout, kv_lora_rank, rope_dim)

    shapes = set()
    for layer, layer_config in enumerate(getattr(text, "per_layer_config", None) or [text] * num_layers):
        heads = _positive_int(layer_config, "num_attention_heads")
        kv_heads = _positive_int(layer_config, "num_key_value_heads") or heads
        head_dim = _positive_int(layer_config, "head_dim")
        hidden = _positive_int(layer_config, "hidden_size")
        if head_dim is None and heads is not None and hidden is not None and hidden % heads == 0:
            head_dim = hidden // heads
        if kv_heads is None or head_dim is None:
            raise InvalidArgumentError(
                f"model.config: layer {layer} names no KV head count or head size "
                "(num_key_value_heads / num_attention_heads, head_dim / hidden_size)"
            )
        shapes.add((kv_heads, head_dim))
    if len(shapes) != 1:
        raise InvalidArgumentError(
            f"model.config.per_layer_config: layers differ in (num_key_value_heads, head_dim): {sorted(shapes)}; "
            "kvstage stores one layout for every layer"
        )
    ((kv_heads, head_dim),) = shapes
    return CacheLayout(KVLayout(num_layers, 2, kv_heads, head_dim, dtype), head_dim, head_dim)
