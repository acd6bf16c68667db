"""A model's KV as components: the value the layout fingerprint, lookup and (next) the store and load
paths of a hybrid model share.

A :class:`ModelLayout` is this process's layers (``num_layers``, numbered from 0 as the engine's
pool numbers them; a pipeline stage's own layers) and the components that cache them:

- :class:`FullAttention`: per-token KV of layers that keep every token (K/V or an MLA latent,
  a :class:`~kvstage.kv_layout.KVLayout`); stored for every page.
- :class:`SlidingWindow`: per-token KV of layers that attend to the last ``window`` tokens (the
  token itself included, so ``window - 1`` earlier tokens are kept); stored only where it can
  serve a hit (:mod:`kvstage.offload.restorable`).
- :class:`PageSidecar`: per-token tensors stored beside every page (DeepSeek V3.2's indexer K
  and its scale), one row per token and layer.
- :class:`RequestState`: per-request tensors of linear-attention / Mamba layers (conv and
  recurrent / SSM state), a fixed size whatever the length; stored as a state snapshot at
  page-aligned lengths.

Every component has its own key space (:meth:`ModelLayout.fingerprints`), and every key space
covers the whole layout: its entries have their own byte size (:meth:`LayoutComponent.entry_bytes`)
and a store checks one size per key space; ``clear``, eviction and the file store's key-space
listing already work per key space. sglang instead suffixes the key in one namespace
(``{hash}.swa``, ``.mamba``, ``.indexer``). The key within a component's space is the page's key
``h_i`` for every component; a state snapshot after ``k`` pages takes ``h_{k-1}``
(:mod:`kvstage.offload.restorable`).
A model whose only component is one :class:`FullAttention` over every layer is a plain model:
its key space is exactly the :class:`~kvstage.storage.LayoutFingerprint` of its ``KVLayout``
(pages stored before hybrid models existed stay readable).

An entry's bytes, in order: full / sliding-window pages as :meth:`KVLayout.page_shape`
(``[num_layers, kv_parts, page_size, num_heads, head_dim]``); a sidecar page per layer
(ascending), per tensor (in order), ``[page_size, *shape]``; a state snapshot per layer, per
tensor, ``shape``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError, is_int, require
from kvstage.kv_layout import KVLayout, canonical_dtype, canonical_dtype_name

__all__ = [
    "COMPONENT_KINDS",
    "FullAttention",
    "LayoutComponent",
    "ModelLayout",
    "PageSidecar",
    "RequestState",
    "SlidingWindow",
    "TensorSpec",
]

COMPONENT_KINDS = ("full", "swa", "sidecar", "state")
# A component's name is the marker of its key space's prefix (``model@NAME-DIGEST@...``):
# file-name and Mooncake safe, no ``@`` or ``-``; "opaque" marks engine page formats.
_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
_RESERVED = frozenset({"opaque"})
LAYOUT_VERSION = 1  # part of every hybrid key space's description: a new byte order gets a new one


def _layers(value: object, argument: str = "layers") -> tuple[int, ...]:
    require(
        isinstance(value, (tuple, list, range)),
        argument,
        lambda: f"must be a tuple of layer indices, got {type(value).__name__}",
        ArgumentTypeError,
    )
    layers = tuple(value)
    require(len(layers) >= 1, argument, "must name at least one layer")
    require(
        all(is_int(layer) and layer >= 0 for layer in layers),
        argument,
        lambda: f"must hold ints >= 0, got {layers!r}",
    )
    require(
        all(a < b for a, b in zip(layers, layers[1:])),
        argument,
        lambda: f"must be strictly increasing (one layer once, in order), got {layers!r}",
    )
    return layers


def _shape(value: object, argument: str) -> tuple[int, ...]:
    require(
        isinstance(value, (tuple, list, torch.Size)),
        argument,
        lambda: f"must be a tuple of sizes, got {type(value).__name__}",
        ArgumentTypeError,
    )
    shape = tuple(value)
    require(
        all(is_int(size) and size >= 1 for size in shape),
        argument,
        lambda: f"must hold positive ints, got {shape!r}",
    )
    return shape


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a sidecar row or a state snapshot, for one layer.

    Attributes:
        name: e.g. ``"index_k"``, ``"conv"``, ``"recurrent"`` (``[a-z][a-z0-9_]*``).
        shape: per token (a sidecar) or per request (a state); ``()`` is one element.
        dtype: element dtype (a name is normalized to the ``torch.dtype``).

    Raises:
        InvalidArgumentError: a bad name or a size that is not a positive int.
        ArgumentTypeError: ``shape`` is not a tuple, ``dtype`` no dtype.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        require(
            isinstance(self.name, str) and _NAME.fullmatch(self.name) is not None,
            "name",
            lambda: f"must match [a-z][a-z0-9_]* (at most 32 characters), got {self.name!r}",
        )
        object.__setattr__(self, "shape", _shape(self.shape, f"{self.name}.shape"))
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, f"{self.name}.dtype"))

    @property
    def nbytes(self) -> int:
        """Bytes of one (token's or request's) tensor: ``prod(shape) * itemsize``."""
        return math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> str:
        """E.g. ``conv 128x4 float32``."""
        return f"{self.name} {'x'.join(map(str, self.shape)) or 'scalar'} {canonical_dtype_name(self.dtype)}"


def _tensors(value: object, owner: str) -> tuple[TensorSpec, ...]:
    require(
        isinstance(value, (tuple, list)) and len(value) >= 1,
        "tensors",
        lambda: f"{owner}: must be a non-empty tuple of TensorSpec, got {value!r}",
        ArgumentTypeError,
    )
    tensors = tuple(value)
    require(
        all(isinstance(tensor, TensorSpec) for tensor in tensors),
        "tensors",
        lambda: f"{owner}: must hold kvstage.model_layout.TensorSpec values",
        ArgumentTypeError,
    )
    names = [tensor.name for tensor in tensors]
    require(len(set(names)) == len(names), "tensors", lambda: f"{owner}: a tensor name repeats in {names}")
    return tensors


def _entry_views(
    entry: torch.Tensor, tensors: tuple[TensorSpec, ...], num_layers: int, rows: tuple[int, ...], expected: int
) -> dict[str, list[torch.Tensor]]:
    """Views of ``entry`` (contiguous bytes, layer by layer, tensor by tensor, each ``rows + shape``)."""
    require(
        isinstance(entry, torch.Tensor) and entry.is_contiguous() and entry.dtype == torch.uint8,
        "entry",
        "must be a contiguous uint8 tensor",
        ArgumentTypeError,
    )
    require(entry.numel() == expected, "entry", lambda: f"{entry.numel()} bytes, an entry has {expected}")
    flat = entry.reshape(-1)
    views: dict[str, list[torch.Tensor]] = {tensor.name: [] for tensor in tensors}
    offset = 0
    for _ in range(num_layers):
        for tensor in tensors:
            size = math.prod(rows) * tensor.nbytes
            views[tensor.name].append(flat[offset : offset + size].view(tensor.dtype).view(*rows, *tensor.shape))
            offset += size
    return views


class LayoutComponent:
    """What every component has: a ``name`` (its key space's marker, unique in a model), the
    ``layers`` it caches (strictly increasing indices) and a ``kind`` (one of
    :data:`COMPONENT_KINDS`). The subclasses (frozen dataclasses) say how many bytes one key
    holds."""

    kind: ClassVar[str] = ""
    layers: tuple[int, ...]
    name: str

    def __post_init__(self) -> None:
        require(
            isinstance(self.name, str) and _NAME.fullmatch(self.name) is not None and self.name not in _RESERVED,
            "name",
            lambda: f"must match [a-z][a-z0-9_]* (at most 32 characters) and not be 'opaque', got {self.name!r}",
        )
        object.__setattr__(self, "layers", _layers(self.layers, f"{self.name}.layers"))

    @property
    def num_layers(self) -> int:
        """Layers of this component."""
        return len(self.layers)

    @property
    def per_page(self) -> bool:
        """True for components stored page by page (full, sliding window, sidecar); False for a
        state snapshot (one entry per length, a fixed size)."""
        return self.kind != "state"

    def entry_bytes(self, page_size: int) -> int:
        """Bytes stored under one key: a page of ``page_size`` tokens, or one state snapshot.

        Raises:
            InvalidArgumentError: ``page_size`` is not a positive int.
        """
        require(is_int(page_size) and page_size >= 1, "page_size", lambda: f"must be a positive int, got {page_size!r}")
        return self._entry_bytes(page_size)

    def _entry_bytes(self, page_size: int) -> int:
        raise NotImplementedError

    @property
    def rank_neutral(self) -> bool:
        """Every tensor-parallel rank holds the same bytes (one key space, rank 0 writes)."""
        raise NotImplementedError

    def describe(self) -> str:
        """The component in one line, also its part of the model's digest, e.g.
        ``swa L0,2 K/V 2x16 float32 W8``."""
        return f"{self.kind} L{','.join(map(str, self.layers))} {self._describe()}"

    def _describe(self) -> str:
        raise NotImplementedError


def _require_kv_layout(component: LayoutComponent, layout: object) -> None:
    require(
        isinstance(layout, KVLayout),
        f"{component.name}.layout",
        lambda: f"must be a kvstage.kv_layout.KVLayout, got {type(layout).__name__}",
        ArgumentTypeError,
    )
    require(
        layout.num_layers == len(component.layers),
        f"{component.name}.layout",
        lambda: f"num_layers {layout.num_layers} must equal the {len(component.layers)} layers it caches",
    )


def _kv_describe(layout: KVLayout) -> str:
    kind = f"MLA {layout.head_dim}" if layout.kv_parts == 1 else f"K/V {layout.num_heads}x{layout.head_dim}"
    return f"{kind} {layout.dtype_name}"


@dataclass(frozen=True)
class FullAttention(LayoutComponent):
    """Per-token KV of layers that keep every token (MHA/GQA K and V, or an MLA latent).

    Attributes:
        layers: the layers, strictly increasing.
        layout: their KV layout (``layout.num_layers == len(layers)``).
        name: default ``"full"``.

    Raises:
        InvalidArgumentError / ArgumentTypeError: bad layers, a layout of another layer count.
    """

    kind: ClassVar[str] = "full"
    layers: tuple[int, ...]
    layout: KVLayout
    name: str = "full"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_kv_layout(self, self.layout)

    def _entry_bytes(self, page_size: int) -> int:
        return self.layout.page_bytes(page_size)

    @property
    def rank_neutral(self) -> bool:
        return self.layout.kv_parts == 1  # an MLA latent is replicated on every rank

    def _describe(self) -> str:
        return _kv_describe(self.layout)


@dataclass(frozen=True)
class SlidingWindow(LayoutComponent):
    """Per-token KV of sliding-window layers: token ``t`` attends to ``[t - window + 1, t]``
    (transformers' ``sliding_window``; its cache keeps ``window - 1`` tokens).

    Attributes:
        layers, layout: as :class:`FullAttention`.
        window: ``W`` tokens (>= 1).
        name: default ``"swa"``.

    Raises:
        InvalidArgumentError: ``window`` not a positive int, or as :class:`FullAttention`.
    """

    kind: ClassVar[str] = "swa"
    layers: tuple[int, ...]
    layout: KVLayout
    window: int
    name: str = "swa"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_kv_layout(self, self.layout)
        require(
            is_int(self.window) and self.window >= 1,
            f"{self.name}.window",
            lambda: f"must be a positive int (tokens a query attends to, itself included), got {self.window!r}",
        )

    def window_pages(self, page_size: int) -> int:
        """Pages before a page-aligned length that hold the window's ``window - 1`` kept tokens:
        ``ceil((window - 1) / page_size)`` (0 for a window of 1)."""
        self.entry_bytes(page_size)  # validates page_size
        return -(-(self.window - 1) // page_size)

    def _entry_bytes(self, page_size: int) -> int:
        return self.layout.page_bytes(page_size)

    @property
    def rank_neutral(self) -> bool:
        return self.layout.kv_parts == 1

    def _describe(self) -> str:
        return f"{_kv_describe(self.layout)} W{self.window}"


@dataclass(frozen=True)
class PageSidecar(LayoutComponent):
    """Per-token tensors stored with every page, one row per token and layer (DeepSeek V3.2's
    indexer K and scale: sglang's ``indexer`` pool, hit policy ``ALL_PAGES``).

    Attributes:
        layers: the layers that have the sidecar.
        tensors: each token's tensors in one layer, in byte order.
        name: default ``"sidecar"`` (e.g. ``"indexer"``; a model may have several).
        replicated: every TP rank holds the same rows (default True, as sglang's indexer
            pool, keyed without a rank).

    Raises:
        InvalidArgumentError / ArgumentTypeError: no tensors, a repeated tensor name, bad layers.
    """

    kind: ClassVar[str] = "sidecar"
    layers: tuple[int, ...]
    tensors: tuple[TensorSpec, ...]
    name: str = "sidecar"
    replicated: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "tensors", _tensors(self.tensors, self.name))

    @property
    def row_bytes(self) -> int:
        """Bytes of one token in one layer (its tensors together)."""
        return sum(tensor.nbytes for tensor in self.tensors)

    def _entry_bytes(self, page_size: int) -> int:
        return self.num_layers * page_size * self.row_bytes

    def entry_views(self, entry: torch.Tensor, page_size: int) -> dict[str, list[torch.Tensor]]:
        """A page's tensors as views of ``entry`` (``entry_bytes(page_size)`` uint8): per tensor
        name, one ``[page_size, *shape]`` view per layer (the byte order of the module doc).

        Raises:
            ArgumentTypeError / InvalidArgumentError: ``entry`` is not contiguous uint8 of that size.
        """
        return _entry_views(entry, self.tensors, self.num_layers, (page_size,), self.entry_bytes(page_size))

    @property
    def rank_neutral(self) -> bool:
        return bool(self.replicated)

    def _describe(self) -> str:
        return " + ".join(tensor.describe() for tensor in self.tensors) + ("" if self.replicated else " sharded")


@dataclass(frozen=True)
class RequestState(LayoutComponent):
    """Per-request state of linear-attention / Mamba layers, a fixed size whatever the length:
    each layer's tensors (conv state, recurrent / SSM state). Stored as a state snapshot: the
    state after exactly ``L`` tokens, ``L`` page-aligned (sglang's ``mamba`` pool, vLLM's Mamba
    group in align mode).

    Attributes:
        layers: the state layers.
        tensors: one layer's tensors, in byte order (the same for every layer of the component).
        name: default ``"state"``.
        replicated: every TP rank holds the same state (default False: sglang shards Mamba
            state by rank).

    Raises:
        InvalidArgumentError / ArgumentTypeError: no tensors, a repeated tensor name, bad layers.
    """

    kind: ClassVar[str] = "state"
    layers: tuple[int, ...]
    tensors: tuple[TensorSpec, ...]
    name: str = "state"
    replicated: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "tensors", _tensors(self.tensors, self.name))

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's state."""
        return sum(tensor.nbytes for tensor in self.tensors)

    def _entry_bytes(self, page_size: int) -> int:
        return self.num_layers * self.layer_bytes

    def entry_views(self, entry: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """A snapshot's tensors as views of ``entry`` (``entry_bytes`` uint8): per tensor name,
        one ``shape`` view per layer (the byte order of the module doc).

        Raises:
            ArgumentTypeError / InvalidArgumentError: ``entry`` is not contiguous uint8 of that size.
        """
        return _entry_views(entry, self.tensors, self.num_layers, (), self.entry_bytes(1))

    def require_buffers(self, buffers: object, argument: str = "state_buffers") -> int:
        """Check an engine's state pool against this component before anything is copied:
        ``buffers[name][j]`` is layer ``layers[j]``'s ``[num_slots, *shape]`` tensor of the
        tensor ``name``'s dtype, on one device.

        Returns:
            ``num_slots`` (equal for every buffer).

        Raises:
            ArgumentTypeError: not a mapping, a buffer that is no tensor, a wrong dtype.
            InvalidArgumentError: a missing or unknown tensor name, a wrong layer count or shape,
                slot counts or devices that differ (each naming ``argument[name][j]``).
        """
        require(
            isinstance(buffers, Mapping),
            argument,
            lambda: f"must map tensor names to per-layer buffers, got {type(buffers).__name__}",
            ArgumentTypeError,
        )
        names = [tensor.name for tensor in self.tensors]
        for name in buffers:
            require(name in names, argument, lambda name=name: f"names tensor {name!r}; {self.name} has {names}")
        slots, devices = set(), set()
        for tensor in self.tensors:
            require(tensor.name in buffers, argument, lambda tensor=tensor: f"has no {tensor.name!r} buffers")
            layers = buffers[tensor.name]
            require(
                isinstance(layers, (list, tuple)) and len(layers) == self.num_layers,
                f"{argument}[{tensor.name!r}]",
                lambda layers=layers: (
                    f"must be one buffer per state layer ({self.num_layers}), got "
                    f"{len(layers) if isinstance(layers, (list, tuple)) else type(layers).__name__}"
                ),
            )
            for j, buffer in enumerate(layers):
                where = f"{argument}[{tensor.name!r}][{j}]"
                require(
                    isinstance(buffer, torch.Tensor),
                    where,
                    lambda buffer=buffer: f"must be a tensor, got {type(buffer).__name__}",
                    ArgumentTypeError,
                )
                require(
                    buffer.dim() == 1 + len(tensor.shape) and tuple(buffer.shape[1:]) == tensor.shape,
                    where,
                    lambda buffer=buffer, tensor=tensor: (
                        f"shape {tuple(buffer.shape)} must be "
                        f"[num_slots, {', '.join(map(str, tensor.shape))}] (layer {self.layers[j]})"
                    ),
                )
                require(
                    buffer.dtype == tensor.dtype,
                    where,
                    lambda buffer=buffer, tensor=tensor: f"dtype {buffer.dtype} must be {tensor.dtype}",
                    ArgumentTypeError,
                )
                slots.add(buffer.shape[0])
                devices.add(buffer.device)
        require(len(slots) == 1, argument, lambda: f"buffers hold different slot counts {sorted(slots)}")
        require(len(devices) == 1, argument, lambda: f"buffers are on different devices {sorted(map(str, devices))}")
        return slots.pop()

    @property
    def rank_neutral(self) -> bool:
        return bool(self.replicated)

    def _describe(self) -> str:
        return " + ".join(tensor.describe() for tensor in self.tensors) + (" replicated" if self.replicated else "")


@dataclass(frozen=True)
class ModelLayout:
    """Which layers cache what: ``num_layers`` layers and the components that cache them.

    Rules (checked here, each error names the argument and the rule):

    - components are :class:`LayoutComponent` values with distinct names;
    - their layers are in ``[0, num_layers)``;
    - components of one kind cache disjoint layers (a layer has at most one KV, one sidecar and
      one state component; a layer may have KV and state, as Falcon-H1's, or KV and a sidecar,
      as DeepSeek V3.2's);
    - every layer has per-token KV (full or sliding window) or state; a sidecar alone is no cache.

    Attributes:
        num_layers: layers of this process (a pipeline stage's count).
        components: given in any order, kept in one order (by kind as in
            :data:`COMPONENT_KINDS`, then name); :meth:`component` finds one by name.

    Raises:
        InvalidArgumentError / ArgumentTypeError: a broken rule.
    """

    num_layers: int
    components: tuple[LayoutComponent, ...]

    def __post_init__(self) -> None:
        require(
            is_int(self.num_layers) and self.num_layers >= 1,
            "num_layers",
            lambda: f"must be a positive int, got {self.num_layers!r}",
        )
        require(
            isinstance(self.components, (tuple, list)) and len(self.components) >= 1,
            "components",
            lambda: f"must be a non-empty tuple of components, got {self.components!r}",
            ArgumentTypeError,
        )
        components = tuple(self.components)
        for index, component in enumerate(components):
            require(
                isinstance(component, LayoutComponent) and component.kind in COMPONENT_KINDS,
                f"components[{index}]",
                lambda component=component: (
                    "must be a FullAttention, SlidingWindow, PageSidecar or RequestState, "
                    f"got {type(component).__name__}"
                ),
                ArgumentTypeError,
            )
        names = [component.name for component in components]
        require(len(set(names)) == len(names), "components", lambda: f"names must be distinct, got {names}")
        # one order (kind, then name): equal layouts compare equal and describe alike
        components = tuple(sorted(components, key=lambda c: (COMPONENT_KINDS.index(c.kind), c.name)))
        object.__setattr__(self, "components", components)
        owner: dict[tuple[str, int], str] = {}  # (KV / sidecar / state, layer) -> component
        for component in components:
            group = "kv" if component.kind in ("full", "swa") else component.kind
            for layer in component.layers:
                require(
                    layer < self.num_layers,
                    f"{component.name}.layers",
                    lambda layer=layer: f"layer {layer} is outside [0, num_layers={self.num_layers})",
                )
                other = owner.setdefault((group, layer), component.name)
                require(
                    other == component.name,
                    f"{component.name}.layers",
                    lambda layer=layer, other=other: (
                        f"layer {layer} is already cached by {other!r} "
                        f"(a layer has at most one {'KV' if group == 'kv' else group} component)"
                    ),
                )
        cached = {layer for (group, layer) in owner if group != "sidecar"}
        missing = [layer for layer in range(self.num_layers) if layer not in cached]
        require(
            not missing,
            "components",
            lambda: f"layers {missing} have neither per-token KV (full, sliding window) nor state",
        )

    @classmethod
    def full_attention(cls, layout: KVLayout) -> "ModelLayout":
        """A plain model: every layer full attention, ``layout`` (the model kvstage served before
        hybrid models; its key space is :class:`~kvstage.storage.LayoutFingerprint`'s).

        Raises:
            ArgumentTypeError: ``layout`` is not a :class:`KVLayout`.
        """
        require(
            isinstance(layout, KVLayout),
            "layout",
            lambda: f"must be a kvstage.kv_layout.KVLayout, got {type(layout).__name__}",
            ArgumentTypeError,
        )
        return cls(layout.num_layers, (FullAttention(tuple(range(layout.num_layers)), layout),))

    @property
    def is_plain(self) -> bool:
        """One full-attention component over every layer: today's key space, unchanged."""
        return len(self.components) == 1 and self.components[0].kind == "full"

    @property
    def has_state(self) -> bool:
        """Whether a restorable length needs a state snapshot."""
        return any(component.kind == "state" for component in self.components)

    def of_kind(self, kind: str) -> tuple[LayoutComponent, ...]:
        """The components of ``kind`` (one of :data:`COMPONENT_KINDS`), in order.

        Raises:
            InvalidArgumentError: an unknown kind.
        """
        require(kind in COMPONENT_KINDS, "kind", lambda: f"must be one of {COMPONENT_KINDS}, got {kind!r}")
        return tuple(component for component in self.components if component.kind == kind)

    def component(self, name: str) -> LayoutComponent:
        """The component called ``name``.

        Raises:
            InvalidArgumentError: the layout has no such component (the message lists its names).
        """
        for component in self.components:
            if component.name == name:
                return component
        raise InvalidArgumentError(
            f"component: the layout has no component {name!r}; it has {[c.name for c in self.components]}"
        )

    def description(self, page_size: int, first_layer: int = 0) -> str:
        """What every hybrid key space's digest covers, as ``|``-separated ``name=value`` parts:
        the layout version, ``page_size``, ``first_layer``, ``num_layers`` and each component's
        :meth:`LayoutComponent.describe`, e.g. ``"layout=kvstage-v1|page_size=8|first_layer=0|
        num_layers=4|full=full L1,3 K/V 2x16 float32|swa=swa L0,2 K/V 2x16 float32 W8"``.

        Raises:
            InvalidArgumentError: ``page_size`` not a positive int, ``first_layer`` not an int >= 0.
        """
        require(is_int(page_size) and page_size >= 1, "page_size", lambda: f"must be a positive int, got {page_size!r}")
        require(
            is_int(first_layer) and first_layer >= 0, "first_layer", lambda: f"must be an int >= 0, got {first_layer!r}"
        )
        parts = [
            f"layout=kvstage-v{LAYOUT_VERSION}",
            f"page_size={page_size}",
            f"first_layer={first_layer}",
            f"num_layers={self.num_layers}",
        ]
        parts += [f"{component.name}={component.describe()}" for component in self.components]
        return "|".join(parts)

    def fingerprints(
        self,
        model_id: str,
        *,
        page_size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        first_layer: int = 0,
    ):
        """One key space per component, by name (:class:`~kvstage.storage.LayoutFingerprint`).

        A plain model (:attr:`is_plain`): its one component's key space is
        ``LayoutFingerprint(model_id, layout, page_size, ...)``, the prefix kvstage has always
        used. Otherwise each component's key space is named by the component and covers the whole
        layout (:meth:`description`), so processes whose layer kinds, window, shapes or dtypes
        differ in any component share no key space; see
        :meth:`~kvstage.storage.LayoutFingerprint.of_component`.

        Raises:
            ArgumentTypeError / InvalidArgumentError: as :class:`~kvstage.storage.LayoutFingerprint`.
        """
        from kvstage.storage.fingerprint import LayoutFingerprint  # storage sits above this value

        if self.is_plain:
            (component,) = self.components
            plain = LayoutFingerprint(
                model_id, component.layout, page_size, tp_rank=tp_rank, tp_size=tp_size, first_layer=first_layer
            )
            return {component.name: plain}
        description = self.description(page_size, first_layer)
        return {
            component.name: LayoutFingerprint.of_component(
                model_id,
                component=component.name,
                layout_description=description,
                entry_bytes=component.entry_bytes(page_size),
                tp_rank=tp_rank,
                tp_size=tp_size,
                rank_neutral=component.rank_neutral,
            )
            for component in self.components
        }

    def require_matches(
        self, fingerprints: Mapping[str, object], page_size: int, first_layer: int = 0, argument: str = "storage"
    ) -> None:
        """Raise unless ``fingerprints`` (per component name, e.g. each component's store's
        ``fingerprint``) are this layout's key spaces at ``page_size``: one per component, each
        of this layout (model id, shard aside: those only choose among key spaces).

        Raises:
            InvalidArgumentError: a component without a key space, a key space of a component the
                layout does not have, or one of another layout, naming ``argument[name]`` and
                what differs (e.g. the window: ``swa=swa L0,2 K/V 2x16 float32 W16 (the pool's:
                ... W8)``; a plain model: the field, as :meth:`LayoutFingerprint.require_matches`).
        """
        require(
            isinstance(fingerprints, Mapping),
            argument,
            lambda: f"must map component names to key spaces, got {type(fingerprints).__name__}",
            ArgumentTypeError,
        )
        names = [component.name for component in self.components]
        for name in fingerprints:
            require(name in names, argument, lambda name=name: f"names component {name!r}; the layout has only {names}")
        description = None if self.is_plain else self.description(page_size, first_layer)
        for component in self.components:
            require(
                component.name in fingerprints,
                argument,
                lambda component=component: f"has no key space for the layout's component {component.name!r}",
            )
            fingerprint = fingerprints[component.name]
            where = f"{argument}[{component.name!r}]"
            if description is None:
                fingerprint.require_matches(component.layout, page_size, argument=where)
                continue
            theirs = getattr(fingerprint, "page_format", "")
            mine = f"component={component.name}|{description}"
            if theirs != mine:
                raise InvalidArgumentError(f"{where}: its layout differs from the pool's: {_differences(theirs, mine)}")

    def describe(self) -> str:
        """One line per component, e.g. ``4 layers: full L1,3 K/V 2x16 float32; swa L0,2 ...``."""
        return f"{self.num_layers} layers: " + "; ".join(
            f"{c.name}={c.describe()}" if c.name != c.kind else c.describe() for c in self.components
        )


def _differences(theirs: str, mine: str) -> str:
    """The ``name=value`` parts of two descriptions that differ, as ``theirs (the pool's: mine)``."""
    a = dict(part.partition("=")[::2] for part in theirs.split("|")) if theirs else {}
    b = dict(part.partition("=")[::2] for part in mine.split("|"))
    parts = [
        f"{name}={a.get(name, 'none')} (the pool's: {b.get(name, 'none')})"
        for name in dict.fromkeys([*b, *a])
        if a.get(name) != b.get(name)
    ]
    return "; ".join(parts) or "another description"
