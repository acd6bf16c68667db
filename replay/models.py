"""KV layouts to replay with: presets and explicit shapes.

Only the KV cache's shape matters to kvstage (no weights are run), so a "model" here is its
KV layout: layers, KV parts (2 for MHA/GQA: K and V; 1 for MLA: one latent), KV heads,
head_dim and dtype. Per-token KV bytes = layers x parts x heads x head_dim x itemsize.

Presets (shapes from the models' published configs):

    small        2 layers, MHA, 2 KV heads, head_dim 64, float16   (1 KiB a token; the CPU default)
    llama3-8b    32 layers, GQA, 8 KV heads, head_dim 128, bfloat16 (128 KiB a token)
    deepseek-v3  61 layers, MLA, kv_dim 576 (512 latent + 64 rope), bfloat16 (70272 B a token)

Hybrid presets (:class:`HybridShape`: the KV fields are the full-attention layers'; the other
layers are sliding-window KV of the same head shape, or linear-attention state):

    small-swa        4 layers: sliding window (W 128) and full alternating, MHA 2x64, float16
    small-linear     4 layers: 3 linear attention (conv 64x4 float16, recurrent 2x16x16 float32)
                     then 1 full, MHA 2x64, float16
    gpt-oss-like     24 layers alternating sliding (W 128) and full, GQA 8x64, bfloat16 (gpt-oss-20b)
    qwen3-next-like  48 layers, 3 linear attention then 1 full, full GQA 2x256 bfloat16; linear:
                     conv 8192x4 bfloat16, recurrent 32x128x128 float32 (Qwen3-Next-80B-A3B)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstage.errors import InvalidArgumentError, is_int

if TYPE_CHECKING:
    import torch

    from kvstage.kv_layout import KVLayout
    from kvstage.model_layout import ModelLayout

# By name, so that `kvstage --help` builds its parser without importing torch (~2 s).
DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class ModelShape:
    """The KV layout of a model.

    Attributes:
        name: preset name or ``"custom"``.
        num_layers: transformer layers.
        kv_parts: 2 (MHA: K and V) or 1 (MLA: one latent).
        num_heads: KV heads per part (1 for MLA).
        head_dim: elements per head (kv_dim for MLA).
        dtype_name: KV dtype as torch spells it, one of :data:`DTYPES` (e.g. ``"bfloat16"``).
    """

    name: str
    num_layers: int
    kv_parts: int
    num_heads: int
    head_dim: int
    dtype_name: str

    @property
    def layout(self) -> KVLayout:
        """The per-token KV layout (imports torch, which building the CLI parser avoids)."""
        from kvstage.kv_layout import KVLayout

        return KVLayout(self.num_layers, self.kv_parts, self.num_heads, self.head_dim, self.dtype_name)

    @property
    def dtype(self) -> torch.dtype:
        """The KV dtype (``layout.dtype``)."""
        return self.layout.dtype

    @property
    def token_bytes(self) -> int:
        """KV bytes of one token over every layer and part (``layout.token_bytes``)."""
        return self.layout.token_bytes

    def page_bytes(self, page_size: int) -> int:
        """KV bytes of one page of ``page_size`` tokens (``layout.page_bytes``)."""
        return self.layout.page_bytes(page_size)

    def describe(self) -> str:
        """One line, e.g. ``llama3-8b (32 layers, MHA 8x128, bfloat16, 128.0 KiB/token)``."""
        kind = f"MLA kv_dim {self.head_dim}" if self.kv_parts == 1 else f"MHA {self.num_heads}x{self.head_dim}"
        return f"{self.name} ({self.num_layers} layers, {kind}, {self.dtype_name}, {self.token_bytes / 1024:.1f} KiB/token)"


@dataclass(frozen=True)
class HybridShape(ModelShape):
    """A hybrid model: the :class:`ModelShape` fields are its full-attention layers' KV (the
    manager's own pool); ``layer_types`` says what each layer caches.

    Attributes:
        layer_types: per layer, ``"full"``, ``"swa"`` (sliding-window KV of the full layers'
            head shape and dtype) or ``"linear"`` (per-request state, no KV).
        window: the sliding window in tokens (``SlidingWindow.window``), for ``"swa"`` layers.
        state: one linear layer's state tensors, ``(name, shape, dtype name)`` each.
    """

    layer_types: tuple[str, ...] = ()
    window: int = 0
    state: tuple[tuple[str, tuple[int, ...], str], ...] = ()

    @property
    def token_bytes(self) -> int:
        """Device KV bytes of one token over the full and the sliding-window layers (both pools)."""
        return self.layout.token_bytes * len(self.layers_of("swa") + self.layers_of("full")) // self.num_layers

    def page_bytes(self, page_size: int) -> int:
        """Device KV bytes of one page over the full and the sliding-window layers (sizes the pools)."""
        return self.token_bytes * page_size

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """The layers of one type, ascending."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)

    @property
    def model_layout(self) -> ModelLayout:
        """The :class:`~kvstage.model_layout.ModelLayout`: components ``full``, and ``swa`` or ``state``."""
        from kvstage.kv_layout import KVLayout
        from kvstage.model_layout import FullAttention, ModelLayout, RequestState, SlidingWindow, TensorSpec

        components = [FullAttention(self.layers_of("full"), self.layout)]
        if self.layers_of("swa"):
            kv = KVLayout(len(self.layers_of("swa")), self.kv_parts, self.num_heads, self.head_dim, self.dtype_name)
            components.append(SlidingWindow(self.layers_of("swa"), kv, window=self.window))
        if self.layers_of("linear"):
            specs = tuple(TensorSpec(name, shape, dtype) for name, shape, dtype in self.state)
            components.append(RequestState(self.layers_of("linear"), specs))
        return ModelLayout(len(self.layer_types), tuple(components))

    def describe(self) -> str:
        """One line, e.g. ``gpt-oss-like (24 layers: 12 full + 12 sliding W128, MHA 8x64, bfloat16)``."""
        swa, linear = len(self.layers_of("swa")), len(self.layers_of("linear"))
        other = f"{swa} sliding W{self.window}" if swa else f"{linear} linear attention"
        state = " (state " + ", ".join(f"{n} {'x'.join(map(str, s))} {d}" for n, s, d in self.state) + ")"
        return (
            f"{self.name} ({len(self.layer_types)} layers: {self.num_layers} full + {other}, "
            f"MHA {self.num_heads}x{self.head_dim}, {self.dtype_name}{state if linear else ''})"
        )


def _hybrid(name, types, heads, head_dim, dtype, window=0, state=()) -> HybridShape:
    full = sum(t == "full" for t in types)
    return HybridShape(name, full, 2, heads, head_dim, dtype, tuple(types), window, tuple(state))


HYBRID_PRESETS = {
    "small-swa": _hybrid("small-swa", ["swa", "full"] * 2, 2, 64, "float16", window=128),
    "small-linear": _hybrid(
        "small-linear",
        ["linear"] * 3 + ["full"],
        2,
        64,
        "float16",
        state=(("conv", (64, 4), "float16"), ("recurrent", (2, 16, 16), "float32")),
    ),
    "gpt-oss-like": _hybrid("gpt-oss-like", ["swa", "full"] * 12, 8, 64, "bfloat16", window=128),
    "qwen3-next-like": _hybrid(
        "qwen3-next-like",
        (["linear"] * 3 + ["full"]) * 12,
        2,
        256,
        "bfloat16",
        state=(("conv", (8192, 4), "bfloat16"), ("recurrent", (32, 128, 128), "float32")),
    ),
}

PRESETS = {
    "small": ModelShape("small", 2, 2, 2, 64, "float16"),
    "llama3-8b": ModelShape("llama3-8b", 32, 2, 8, 128, "bfloat16"),
    "deepseek-v3": ModelShape("deepseek-v3", 61, 1, 1, 576, "bfloat16"),
    **HYBRID_PRESETS,
}
DEFAULT_MODEL = "small"


def resolve_model(
    preset: str | None = None,
    *,
    layers: int | None = None,
    heads: int | None = None,
    head_dim: int | None = None,
    dtype: str | None = None,
    mla: bool = False,
) -> ModelShape:
    """A :class:`ModelShape` from a preset, with any explicit field overriding it.

    Without a preset, the explicit fields override the ``small`` preset and the name is
    ``"custom"``. ``mla=True`` makes one KV part and one head (``head_dim`` is kv_dim).

    Raises:
        InvalidArgumentError: unknown preset or dtype (the message names ``--model`` or
            ``--dtype``), or a size that is not a positive int (names ``--layers`` etc.).
    """
    if preset is not None and preset not in PRESETS:
        raise InvalidArgumentError(f"--model: unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    base = PRESETS[preset or DEFAULT_MODEL]
    if isinstance(base, HybridShape):
        given = [
            o
            for o, v in (("--layers", layers), ("--heads", heads), ("--head-dim", head_dim), ("--dtype", dtype))
            if v is not None
        ]
        if given or mla:
            raise InvalidArgumentError(
                f"{given[0] if given else '--mla'}: a hybrid preset ({preset}) takes no shape overrides"
            )
        return base
    for option, value in (("--layers", layers), ("--heads", heads), ("--head-dim", head_dim)):
        if value is not None and (not is_int(value) or value < 1):
            raise InvalidArgumentError(f"{option}: must be a positive int, got {value!r}")
    if dtype is not None and dtype not in DTYPES:
        raise InvalidArgumentError(f"--dtype: unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    overridden = any(v is not None for v in (layers, heads, head_dim, dtype)) or mla
    kv_parts = 1 if mla else base.kv_parts
    if mla and heads not in (None, 1):
        raise InvalidArgumentError(f"--heads: MLA has one latent head, got {heads}")
    return ModelShape(
        name=base.name if not overridden else (f"{preset}+custom" if preset else "custom"),
        num_layers=layers or base.num_layers,
        kv_parts=kv_parts,
        num_heads=1 if kv_parts == 1 else (heads or base.num_heads),
        head_dim=head_dim or base.head_dim,
        dtype_name=dtype or base.dtype_name,
    )
