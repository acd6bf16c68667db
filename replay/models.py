"""KV layouts to replay with: presets and explicit shapes.

Only the KV cache's shape matters to kvstage (no weights are run), so a "model" here is its
KV layout: layers, KV parts (2 for MHA/GQA: K and V; 1 for MLA: one latent), KV heads,
head_dim and dtype. Per-token KV bytes = layers x parts x heads x head_dim x itemsize.

Presets (shapes from the models' published configs):

    small        2 layers, MHA, 2 KV heads, head_dim 64, float16   (1 KiB a token; the CPU default)
    llama3-8b    32 layers, GQA, 8 KV heads, head_dim 128, bfloat16 (128 KiB a token)
    deepseek-v3  61 layers, MLA, kv_dim 576 (512 latent + 64 rope), bfloat16 (70272 B a token)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstage.errors import InvalidArgumentError, is_int

if TYPE_CHECKING:
    import torch

    from kvstage.kv_layout import KVLayout

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


PRESETS = {
    "small": ModelShape("small", 2, 2, 2, 64, "float16"),
    "llama3-8b": ModelShape("llama3-8b", 32, 2, 8, 128, "bfloat16"),
    "deepseek-v3": ModelShape("deepseek-v3", 61, 1, 1, 576, "bfloat16"),
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
