"""A view of an engine's per-request state: every state layer's tensors, indexed by state slot.

Linear-attention and Mamba layers keep a fixed-size state per request, not KV per token: per
layer a conv state (e.g. ``[num_slots, 128, 4]``) and a recurrent / SSM state (e.g.
``[num_slots, 4, 16, 16]``), each of its own dtype (shapes as transformers' Qwen3Next, Jamba
and FalconH1 caches; sglang's ``MambaPool`` keeps per-layer conv and temporal buffers indexed
by slot, vLLM carves them out of per-block buffers). A *state slot* is one request's row in
every tensor: ``t[slot]``.

A request's *state snapshot* (the bytes a state copy moves for one slot) is every tensor's
slot row, in :attr:`StatePool.tensors` order, packed with no padding: tensor ``k``'s row is
bytes ``offsets[k] : offsets[k] + row_bytes[k]`` of the snapshot, ``snapshot_bytes`` in all.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from kvstage.errors import ArgumentTypeError, DeviceMismatchError, require
from kvstage.kernels.words import widest_word

__all__ = ["StatePool"]


class StatePool:
    """The engine's state tensors: ``tensors[k]`` is ``[num_slots, ...]`` of any shape and dtype.

    The pool keeps references to (never copies of) the engine's tensors; build a new one if the
    engine reallocates them (the Triton launcher caches their addresses per pool).

    Every tensor's slot row (``t[s]``, dims 1 on) must be one run of bytes (C-contiguous); the
    slots may be any distance apart (``t.stride(0)``: a view carved out of larger per-slot
    blocks, as vLLM's are, is fine) but must not overlap.

    Attributes:
        tensors: the state tensors, in snapshot order.
        names: each tensor's name in errors (``tensors[k]`` unless given).
        num_slots: state slots (dim 0 of every tensor).
        row_bytes: bytes of one slot row of each tensor (``prod(shape[1:]) * itemsize``).
        slot_stride_bytes: bytes between consecutive slots of each tensor (``stride(0) * itemsize``).
        offsets: where each tensor's row starts within a snapshot, in bytes.
        snapshot_bytes: bytes of one slot's snapshot (``sum(row_bytes)``).
        device: where the tensors live.
        layers: each layer's tensors as a ``range`` of indices (built by :meth:`from_layers` or
            :meth:`from_stacked`; otherwise every tensor is one layer's), for ``tensors=`` of the copies.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        names: Sequence[str] | None = None,
        layers: Sequence[range] | None = None,
    ) -> None:
        """Wrap ``tensors`` (snapshot order); ``names`` (one per tensor) names them in errors;
        ``layers`` (ranges of indices covering the tensors in order) groups them by layer.

        Raises:
            ArgumentTypeError: ``tensors`` is not a sequence of tensors.
            InvalidArgumentError: no tensors; ``names`` of another length; a tensor with no dims or a
                zero-size dim; slot counts differ; a slot row that is not one run of bytes; slots
                that overlap (``stride(0)`` too small, e.g. an expanded view); two tensors at one address.
            DeviceMismatchError: tensors on different devices.
        """
        require(
            isinstance(tensors, Sequence) and not isinstance(tensors, (str, torch.Tensor)),
            "tensors",
            lambda: f"must be a sequence of torch.Tensor (one per state tensor), got {type(tensors).__name__}",
            ArgumentTypeError,
        )
        tensors = list(tensors)
        require(len(tensors) >= 1, "tensors", "must hold at least one state tensor")
        if names is None:
            names = [f"tensors[{k}]" for k in range(len(tensors))]
        names = list(names)
        require(len(names) == len(tensors), "names", f"must name each of the {len(tensors)} tensors, got {len(names)}")
        for name, t in zip(names, tensors):
            require(
                isinstance(t, torch.Tensor),
                name,
                lambda: f"must be a torch.Tensor, got {type(t).__name__}",
                ArgumentTypeError,
            )
        first = tensors[0]
        seen: dict[int, str] = {}
        for name, t in zip(names, tensors):
            require(t.dim() >= 1, name, "must have dim 0 = state slot, got a 0-d tensor")
            require(
                all(d >= 1 for d in t.shape), name, lambda: f"every dimension must be >= 1, got shape {tuple(t.shape)}"
            )
            require(
                t.device == first.device,
                name,
                lambda: f"device must be {first.device} like {names[0]}, got {t.device}",
                DeviceMismatchError,
            )
            require(
                t.shape[0] == first.shape[0],
                name,
                lambda: f"must have {first.shape[0]} slots (dim 0) like {names[0]}, got {t.shape[0]}",
            )
            require(
                t[0].is_contiguous(),
                name,
                lambda: f"each slot row must be one run of bytes (dims 1.. C-contiguous), got strides {t.stride()}",
            )
            row = math.prod(t.shape[1:]) * t.element_size()
            require(
                t.shape[0] == 1 or t.stride(0) * t.element_size() >= row,
                name,
                lambda: (
                    f"slots must not overlap: stride(0) * itemsize = {t.stride(0) * t.element_size()} bytes "
                    f"< the {row}-byte slot row"
                ),
            )
            other = seen.setdefault(t.data_ptr(), name)
            require(other == name, name, lambda: f"starts at the same address as {other}: their slots would overlap")
        self.tensors: list[torch.Tensor] = tensors
        self.names: list[str] = names
        self.num_slots = int(first.shape[0])
        self.device: torch.device = first.device
        self.row_bytes: list[int] = [math.prod(t.shape[1:]) * t.element_size() for t in tensors]
        self.slot_stride_bytes: list[int] = [t.stride(0) * t.element_size() for t in tensors]
        self.offsets: list[int] = [sum(self.row_bytes[:k]) for k in range(len(tensors))]
        self.snapshot_bytes = sum(self.row_bytes)
        self.layers: list[range] = [range(k, k + 1) for k in range(len(tensors))] if layers is None else list(layers)
        covered = [k for group in self.layers for k in group]
        require(
            covered == list(range(len(tensors))) and all(len(g) >= 1 and g.step == 1 for g in self.layers),
            "layers",
            lambda: f"must be non-empty ranges covering the {len(tensors)} tensors in order, got {self.layers}",
        )

    @classmethod
    def from_layers(cls, layers: Sequence[Sequence[torch.Tensor]]) -> "StatePool":
        """A pool from per-layer tensor lists, e.g. ``[[conv_0, ssm_0], [conv_1, ssm_1], ...]``:
        snapshot order layer by layer, and names ``layers[l][i]`` in errors.

        Raises:
            ArgumentTypeError / InvalidArgumentError / DeviceMismatchError: as :class:`StatePool`;
                InvalidArgumentError also for no layers or a layer with no tensors.
        """
        require(
            isinstance(layers, Sequence) and not isinstance(layers, (str, torch.Tensor)) and len(layers) >= 1,
            "layers",
            "must be a non-empty sequence of per-layer tensor lists",
        )
        tensors, names, ranges = [], [], []
        for layer, group in enumerate(layers):
            require(
                isinstance(group, Sequence) and not isinstance(group, (str, torch.Tensor)) and len(group) >= 1,
                f"layers[{layer}]",
                "must be a non-empty sequence of the layer's state tensors",
            )
            ranges.append(range(len(tensors), len(tensors) + len(group)))
            for i, t in enumerate(group):
                tensors.append(t)
                names.append(f"layers[{layer}][{i}]")
        return cls(tensors, names=names, layers=ranges)

    @classmethod
    def from_stacked(cls, stacked: Sequence[torch.Tensor]) -> "StatePool":
        """A pool from tensors ``[num_layers, num_slots, ...]`` holding one kind of state for every
        layer, as sglang's ``MambaPool`` keeps its conv and temporal states: snapshot order layer by
        layer (``stacked[0][0], stacked[1][0], ..., stacked[0][1], ...``), names ``stacked[i][layer]``.

        Raises:
            ArgumentTypeError: ``stacked`` is not a sequence of tensors.
            InvalidArgumentError: none given; a tensor with fewer than 2 dims; layer counts differ;
                and as :class:`StatePool` for the per-layer views.
        """
        require(
            isinstance(stacked, Sequence) and not isinstance(stacked, (str, torch.Tensor)),
            "stacked",
            lambda: f"must be a sequence of [num_layers, num_slots, ...] tensors, got {type(stacked).__name__}",
            ArgumentTypeError,
        )
        require(len(stacked) >= 1, "stacked", "must hold at least one tensor")
        for i, t in enumerate(stacked):
            require(
                isinstance(t, torch.Tensor),
                f"stacked[{i}]",
                lambda: f"must be a torch.Tensor, got {type(t).__name__}",
                ArgumentTypeError,
            )
            require(
                t.dim() >= 2,
                f"stacked[{i}]",
                lambda: f"must be [num_layers, num_slots, ...], got shape {tuple(t.shape)}",
            )
            require(
                t.shape[0] == stacked[0].shape[0],
                f"stacked[{i}]",
                lambda: f"must hold {stacked[0].shape[0]} layers (dim 0) like stacked[0], got {t.shape[0]}",
            )
        layers = range(stacked[0].shape[0])
        tensors = [t[layer] for layer in layers for t in stacked]
        names = [f"stacked[{i}][{layer}]" for layer in layers for i in range(len(stacked))]
        ranges = [range(layer * len(stacked), (layer + 1) * len(stacked)) for layer in layers]
        return cls(tensors, names=names, layers=ranges)

    @property
    def num_tensors(self) -> int:
        """State tensors in the pool."""
        return len(self.tensors)

    def staging_shape(self, num_ids: int) -> tuple[int, int]:
        """The shape of a uint8 staging buffer for ``num_ids`` slots' snapshots: ``(num_ids, snapshot_bytes)``."""
        return (num_ids, self.snapshot_bytes)

    @functools.cached_property
    def word_alignment(self) -> list[int]:
        """Per tensor, the widest word (16, 8, 4, 2 or 1 bytes) dividing its row, its slot stride
        (when it has more than one slot), its start address and its offset within a snapshot:
        the widest access a copy may use on it before the staging buffer's address (and, for
        more than one snapshot, ``snapshot_bytes``) is counted (:func:`widest_word`)."""
        return [
            widest_word(rb, [t.data_ptr(), off] + ([stride] if self.num_slots > 1 else []))
            for t, rb, stride, off in zip(self.tensors, self.row_bytes, self.slot_stride_bytes, self.offsets)
        ]

    def __repr__(self) -> str:
        shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in self.tensors[:4])
        more = f", ... ({self.num_tensors} tensors)" if self.num_tensors > 4 else ""
        return (
            f"StatePool(num_slots={self.num_slots}, snapshot_bytes={self.snapshot_bytes}, "
            f"device={self.device}, [{shapes}{more}])"
        )
