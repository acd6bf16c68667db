"""A view of an inference engine's device KV pool: per-(part, layer) buffers of token rows.

The pool is what sglang keeps per layer: MHA has a K buffer and a V buffer of shape
``[num_slots, num_heads, head_dim]`` per layer (``kv_parts = 2``); MLA has one latent buffer
``[num_slots, 1, kv_dim]`` per layer (``kv_parts = 1``). A *slot* is one token's row in every
buffer; the engine's ``req_to_token`` table maps a request's token positions to slots.

The per-layer buffers need not be adjacent in memory: the kernels reach each one through a
table of per-(part, layer) byte offsets (see :mod:`kvstage.kernels.transfer`).
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from kvstage.errors import ArgumentTypeError, DeviceMismatchError, require
from kvstage.kernels.words import widest_word
from kvstage.kv_layout import KVLayout

__all__ = ["KVPool"]


class KVPool:
    """The device KV pool: ``kv_parts x num_layers`` buffers ``[num_slots, num_heads, head_dim]``.

    Build one with :meth:`mha`, :meth:`mla` or :meth:`from_stacked`; the pool keeps
    references to (never copies of) the engine's tensors. Build a new pool if the engine
    reallocates its buffers: the Triton launcher caches their addresses per pool.

    Every buffer must have the same shape, dtype and device, and be contiguous (a slot's
    row of ``num_heads * head_dim`` elements is one run of bytes, and slot ``s`` starts
    ``s * row_bytes`` after the buffer's start).

    Attributes:
        kv_parts: 2 for MHA (K, V), 1 for MLA (the latent).
        num_layers: number of layers.
        num_slots: token slots per buffer.
        num_heads: KV heads per slot (1 for MLA).
        head_dim: elements per head (``kv_dim`` for MLA, e.g. 576).
        dtype: the element dtype (any: fp16, bf16, fp32, fp8, int8, ...; the copies move bytes).
        device: where the buffers live.
        buffers: ``buffers[part][layer]`` is the tensor of that part and layer.
    """

    def __init__(
        self,
        buffers: Sequence[Sequence[torch.Tensor]],
        *,
        argument: str = "buffers",
        part_names: Sequence[str] | None = None,
    ) -> None:
        """Wrap ``buffers[part][layer]`` tensors; prefer :meth:`mha`, :meth:`mla`, :meth:`from_stacked`.

        ``part_names`` (one per part) names a buffer in errors as the caller passed it, e.g.
        ``v_buffers[3]``; without it, ``{argument}[part][layer]``.

        Raises:
            ArgumentTypeError: an entry is not a tensor, or dtypes differ.
            InvalidArgumentError: no parts or layers, a buffer is not 3-D, shapes differ, a
                part has a different layer count, or a buffer is not contiguous.
            DeviceMismatchError: buffers on different devices.
        """
        parts = [list(part) for part in buffers]
        require(len(parts) in (1, 2), argument, f"must hold 1 (MLA) or 2 (MHA) parts, got {len(parts)}")
        num_layers = len(parts[0])
        require(num_layers >= 1, argument, "must hold at least one layer")

        def buffer_name(p: int, layer: int) -> str:
            return f"{argument}[{p}][{layer}]" if part_names is None else f"{part_names[p]}[{layer}]"

        first = parts[0][0]
        require(
            isinstance(first, torch.Tensor),
            buffer_name(0, 0),
            f"must be a torch.Tensor, got {type(first).__name__}",
            ArgumentTypeError,
        )
        require(
            first.dim() == 3,
            buffer_name(0, 0),
            f"must be [num_slots, num_heads, head_dim], got shape {tuple(first.shape)}",
        )
        for p, part in enumerate(parts):
            require(
                len(part) == num_layers,
                f"{argument}[{p}]",
                f"must hold {num_layers} layers like part 0, got {len(part)}",
            )
            for layer, t in enumerate(part):
                name = buffer_name(p, layer)
                require(
                    isinstance(t, torch.Tensor),
                    name,
                    f"must be a torch.Tensor, got {type(t).__name__}",
                    ArgumentTypeError,
                )
                require(
                    t.dtype == first.dtype,
                    name,
                    f"dtype must be {first.dtype} like the others, got {t.dtype}",
                    ArgumentTypeError,
                )
                require(
                    t.device == first.device,
                    name,
                    f"device must be {first.device} like the others, got {t.device}",
                    DeviceMismatchError,
                )
                require(
                    tuple(t.shape) == tuple(first.shape),
                    name,
                    f"shape must be {tuple(first.shape)} like the others, got {tuple(t.shape)}",
                )
                require(t.is_contiguous(), name, "must be contiguous (each slot one run of bytes)")
        self.buffers: list[list[torch.Tensor]] = parts
        self.kv_parts = len(parts)
        self.num_layers = num_layers
        self.num_slots, self.num_heads, self.head_dim = (int(d) for d in first.shape)
        require(
            self.num_slots >= 1 and self.num_heads >= 1 and self.head_dim >= 1,
            argument,
            f"every dimension must be >= 1, got shape {tuple(first.shape)}",
        )
        self.dtype: torch.dtype = first.dtype
        self.device: torch.device = first.device
        self._layout = KVLayout(self.num_layers, self.kv_parts, self.num_heads, self.head_dim, self.dtype)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def mha(cls, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor]) -> "KVPool":
        """An MHA pool from per-layer K and V buffers, each ``[num_slots, num_heads, head_dim]``.

        Raises:
            InvalidArgumentError: the lists differ in length or are empty; shapes differ;
                a buffer is not contiguous.
            ArgumentTypeError / DeviceMismatchError: as :class:`KVPool`.
        """
        k_list, v_list = list(k_buffers), list(v_buffers)
        require(len(k_list) >= 1, "k_buffers", "must hold at least one layer")
        require(
            len(v_list) == len(k_list), "v_buffers", f"must hold {len(k_list)} layers like k_buffers, got {len(v_list)}"
        )
        return cls([k_list, v_list], argument="k_buffers/v_buffers", part_names=("k_buffers", "v_buffers"))

    @classmethod
    def mla(cls, latent_buffers: Sequence[torch.Tensor]) -> "KVPool":
        """An MLA pool from per-layer latent buffers, each ``[num_slots, 1, kv_dim]``.

        Raises:
            InvalidArgumentError: empty list, or a buffer's head dimension is not 1.
            ArgumentTypeError / DeviceMismatchError: as :class:`KVPool`.
        """
        latent = list(latent_buffers)
        require(len(latent) >= 1, "latent_buffers", "must hold at least one layer")
        for layer, t in enumerate(latent):
            if isinstance(t, torch.Tensor):
                require(
                    t.dim() == 3 and t.shape[1] == 1,
                    f"latent_buffers[{layer}]",
                    f"must be [num_slots, 1, kv_dim], got shape {tuple(t.shape)}",
                )
        return cls([latent], argument="latent_buffers", part_names=("latent_buffers",))

    @classmethod
    def from_rows(cls, row_buffers: Sequence[torch.Tensor]) -> "KVPool":
        """A one-part pool from per-layer 2-D buffers ``[num_slots, row_elems]``, e.g. a DSA indexer
        sidecar: per-token rows (fp8 index K plus its fp32 scale as uint8, 132 bytes), or sglang's
        ``index_k_with_scale_buffer`` pages (``[num_pages, page_size * (index_head_dim + 4)]`` uint8:
        move them at ``page_size=1`` with device page ids as slots). Buffers are viewed as
        ``[num_slots, 1, row_elems]`` (no copy).

        Raises:
            InvalidArgumentError: empty list; a buffer that is not 2-D; shapes differ; not contiguous.
            ArgumentTypeError / DeviceMismatchError: as :class:`KVPool`.
        """
        rows = list(row_buffers)
        require(len(rows) >= 1, "row_buffers", "must hold at least one layer")
        for layer, t in enumerate(rows):
            require(
                isinstance(t, torch.Tensor),
                f"row_buffers[{layer}]",
                lambda: f"must be a torch.Tensor, got {type(t).__name__}",
                ArgumentTypeError,
            )
            require(
                t.dim() == 2,
                f"row_buffers[{layer}]",
                lambda: f"must be [num_slots, row_elems], got shape {tuple(t.shape)}",
            )
            require(t.is_contiguous(), f"row_buffers[{layer}]", "must be contiguous (each slot one run of bytes)")
        return cls([[t.unsqueeze(1) for t in rows]], argument="row_buffers", part_names=("row_buffers",))

    @classmethod
    def allocate(
        cls, layout: KVLayout, num_slots: int, *, device: torch.device | str = "cpu", fill: float | None = None
    ) -> "KVPool":
        """A new pool of ``layout`` with ``num_slots`` slots: one ``[num_slots, num_heads,
        head_dim]`` buffer per part and layer, uninitialized or filled with ``fill`` (e.g. NaN,
        so that a read of a slot nothing wrote shows).

        Raises:
            ArgumentTypeError: ``layout`` is not a :class:`KVLayout`.
            InvalidArgumentError: ``num_slots`` is not a positive int.
        """
        require(
            isinstance(layout, KVLayout),
            "layout",
            lambda: f"must be a KVLayout, got {type(layout).__name__}",
            ArgumentTypeError,
        )
        require(
            isinstance(num_slots, int) and not isinstance(num_slots, bool) and num_slots >= 1,
            "num_slots",
            lambda: f"must be a positive int, got {num_slots!r}",
        )
        shape = (layout.kv_parts, layout.num_layers, num_slots, layout.num_heads, layout.head_dim)
        if fill is None:
            stacked = torch.empty(shape, dtype=layout.dtype, device=device)
        else:
            stacked = torch.full(shape, fill, dtype=layout.dtype, device=device)
        return cls.from_stacked(stacked)

    @classmethod
    def from_stacked(cls, t: torch.Tensor) -> "KVPool":
        """A pool from one tensor ``[kv_parts, num_layers, num_slots, num_heads, head_dim]``.

        ``kv_parts`` is 2 (MHA) or 1 (MLA). The pool's buffers are views of ``t``.

        Raises:
            ArgumentTypeError: ``t`` is not a tensor.
            InvalidArgumentError: ``t`` is not 5-D, ``kv_parts`` is not 1 or 2, or ``t`` is
                not contiguous.
        """
        require(isinstance(t, torch.Tensor), "t", f"must be a torch.Tensor, got {type(t).__name__}", ArgumentTypeError)
        require(
            t.dim() == 5,
            "t",
            f"must be [kv_parts, num_layers, num_slots, num_heads, head_dim], got shape {tuple(t.shape)}",
        )
        require(t.shape[0] in (1, 2), "t", f"dim 0 (kv_parts) must be 1 or 2, got {t.shape[0]}")
        require(t.is_contiguous(), "t", "must be contiguous")
        return cls([list(t[p].unbind(0)) for p in range(t.shape[0])], argument="t")

    # ------------------------------------------------------------------ queries
    @property
    def is_mla(self) -> bool:
        """True for a one-part (latent) pool."""
        return self.kv_parts == 1

    @property
    def layout(self) -> KVLayout:
        """One token's layout: ``KVLayout(num_layers, kv_parts, num_heads, head_dim, dtype)``."""
        return self._layout

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self._layout.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one slot in one buffer: ``num_heads * head_dim * itemsize`` (:attr:`KVLayout.row_bytes`)."""
        return self._layout.row_bytes

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page of every layer and part: ``kv_parts * num_layers * page_size * row_bytes``.

        Raises:
            InvalidArgumentError: ``page_size`` is not a positive int.
        """
        return self._layout.page_bytes(page_size)

    def layer(self, part: int, layer: int) -> torch.Tensor:
        """The buffer ``[num_slots, num_heads, head_dim]`` of ``part`` (0 = K or latent, 1 = V) and ``layer``.

        Raises:
            InvalidArgumentError: ``part`` or ``layer`` out of range.
        """
        require(0 <= part < self.kv_parts, "part", f"must be in [0, {self.kv_parts}), got {part}")
        require(0 <= layer < self.num_layers, "layer", f"must be in [0, {self.num_layers}), got {layer}")
        return self.buffers[part][layer]

    @functools.cached_property
    def word_alignment(self) -> int:
        """The widest word, in bytes (16, 8, 4, 2 or 1), dividing ``row_bytes`` and every buffer's
        start address: the widest access a copy may use on the pool's side (the rule is
        :func:`kvstage.kernels.words.widest_word`). Computed once (the buffers of a pool never change)."""
        return widest_word(self.row_bytes, (t.data_ptr() for t in self.tensors()))

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer, part-major: ``[part 0 layer 0, part 0 layer 1, ..., part 1 layer 0, ...]``."""
        return [t for part in self.buffers for t in part]

    def __repr__(self) -> str:
        kind = "MLA" if self.is_mla else "MHA"
        return (
            f"KVPool({kind}, num_layers={self.num_layers}, num_slots={self.num_slots}, num_heads={self.num_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device})"
        )
