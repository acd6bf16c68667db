"""One token's KV layout: the value the KV pool, host pool, layout fingerprint and replay share.

A layout is ``kv_parts x num_layers`` rows of ``num_heads x head_dim`` elements of ``dtype``
per token (``kv_parts``: 2 for K and V, 1 for an MLA latent with ``num_heads = 1`` and
``head_dim = kv_dim``). Every part of kvstage that needs page sizes in bytes asks this value,
so the rule is written once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError, is_int, require

__all__ = ["KVLayout", "canonical_dtype", "canonical_dtype_name"]


def canonical_dtype(value: object, argument: str = "dtype") -> torch.dtype:
    """``value`` as a ``torch.dtype``: a ``torch.dtype``, or its name with or without ``torch.``
    (aliases such as ``"float"``, ``"half"`` resolve to ``float32``, ``float16``).

    Raises:
        ArgumentTypeError: ``value`` is neither a ``torch.dtype`` nor a string, or the string
            names no torch dtype (e.g. ``"Tensor"``); the message names ``argument``.
    """
    if isinstance(value, torch.dtype):
        return value
    require(
        isinstance(value, str),
        argument,
        lambda: f"must be a torch.dtype or its name, got {type(value).__name__}",
        ArgumentTypeError,
    )
    name = value.removeprefix("torch.")
    resolved = getattr(torch, name, None) if name.isidentifier() else None
    require(
        isinstance(resolved, torch.dtype),
        argument,
        lambda: f"{value!r} names no torch dtype (e.g. 'bfloat16', torch.float16)",
        ArgumentTypeError,
    )
    return resolved


def canonical_dtype_name(dtype: torch.dtype) -> str:
    """The canonical name torch prints for ``dtype``, without ``torch.`` (``torch.float`` -> ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVLayout:
    """The KV layout of one token across every layer and part.

    Attributes:
        num_layers: layers (>= 1).
        kv_parts: 2 (K and V) or 1 (MLA latent).
        num_heads: KV heads per part (1 for MLA).
        head_dim: elements per head (``kv_dim`` for MLA, e.g. 576).
        dtype: the element dtype; a name given here is normalized to the ``torch.dtype``.

    Raises:
        InvalidArgumentError: a size is not a positive int (bools are not sizes), ``kv_parts``
            is not 1 or 2.
        ArgumentTypeError: ``dtype`` is not a dtype (see :func:`canonical_dtype`).
    """

    num_layers: int
    kv_parts: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim"):
            value = getattr(self, name)
            require(is_int(value) and value >= 1, name, lambda: f"must be a positive int, got {value!r}")
        require(
            is_int(self.kv_parts) and self.kv_parts in (1, 2),
            "kv_parts",
            lambda: f"must be 1 (MLA) or 2 (K and V), got {self.kv_parts!r}",
        )
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    @property
    def dtype_name(self) -> str:
        """The dtype's canonical name, e.g. ``"bfloat16"`` (never an alias such as ``"half"``)."""
        return canonical_dtype_name(self.dtype)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one token in one (part, layer) buffer: ``num_heads * head_dim * itemsize``."""
        return self.num_heads * self.head_dim * self.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes of one token over every part and layer."""
        return self.kv_parts * self.num_layers * self.row_bytes

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page of ``page_size`` tokens over every part and layer.

        Raises:
            InvalidArgumentError: ``page_size`` is not a positive int.
        """
        if not is_int(page_size) or page_size < 1:
            raise InvalidArgumentError(f"page_size: must be a positive int, got {page_size!r}")
        return self.token_bytes * page_size

    def page_shape(self, page_size: int) -> tuple[int, int, int, int, int]:
        """The page-first shape of one page: ``(num_layers, kv_parts, page_size, num_heads, head_dim)``."""
        self.page_bytes(page_size)  # validates page_size
        return (self.num_layers, self.kv_parts, page_size, self.num_heads, self.head_dim)

    def describe(self) -> str:
        """One line, e.g. ``32 layers, K/V 8x128, bfloat16, 128.0 KiB/token``."""
        kind = f"MLA kv_dim {self.head_dim}" if self.kv_parts == 1 else f"K/V {self.num_heads}x{self.head_dim}"
        return f"{self.num_layers} layers, {kind}, {self.dtype_name}, {self.token_bytes / 1024:.1f} KiB/token"
