"""The layout fingerprint: what must match for two processes to share stored pages.

Every key a store holds starts with its fingerprint's :meth:`LayoutFingerprint.prefix`, so a
page is only ever read back as KV of the same model, dtype, layout, page size and shard:

- tensor parallel (K/V): each rank holds its own heads, so the rank and TP size are part of the
  key space;
- MLA: the latent is replicated on every TP rank, so the fingerprint is rank-neutral (TP 4 and
  TP 8 share pages) and only rank 0 writes (:attr:`LayoutFingerprint.writes_pages`);
- pipeline parallel: stages hold different layers, so the layer range is part of the key space
  (stage 1 never deduplicates against, or reads, stage 0's pages);
- head groups (``head_groups = G``, :mod:`kvstage.storage.head_groups`): K/V pages split into
  ``G`` entries of ``num_heads / G`` KV heads each, one key space (shard ``hg{G}``) that every
  TP size dividing ``G`` reads and writes, each rank its own groups;
- opaque pages (:meth:`LayoutFingerprint.opaque`): an engine that lays its pages out itself
  (vLLM's offload blocks) names the format with a string; the key space is the model, that
  format, the page's bytes and the shard, and the engine says whether ranks share pages;
- a hybrid model's components (:meth:`LayoutFingerprint.of_component`, built by
  :meth:`kvstage.model_layout.ModelLayout.fingerprints`): one key space per component, named
  by it and covering the whole model layout, e.g. ``"m@swa-0123456789abcdef@B4096@tp0of1@"``.
"""

from __future__ import annotations

import hashlib
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstage.errors import ArgumentTypeError, InvalidArgumentError, is_int, require
from kvstage.kv_layout import KVLayout

__all__ = ["LayoutFingerprint", "prefix_differences", "prefix_fields", "prefix_of"]

_MODEL_ID_RULE = (
    "the model's name or path (e.g. 'meta-llama/Llama-3.1-8B'); it is part of every page key's prefix, "
    "so that pages of different models are never shared"
)
_NO_MODEL_ID: Any = object()  # ``model_id`` not given: a clear error instead of Python's bare TypeError


def _require_model_id(model_id: Any) -> None:
    """Raises ArgumentTypeError naming ``model_id`` and what it is for when it was not given."""
    if model_id is _NO_MODEL_ID:
        raise ArgumentTypeError(f"model_id: required: {_MODEL_ID_RULE}")


@dataclass(frozen=True)
class LayoutFingerprint:
    """The key space of stored pages.

    Attributes:
        model_id: the model's name or path, e.g. ``"meta-llama/Llama-3.1-8B"`` (non-empty; required:
            it is part of every page key's prefix, so different models never share pages).
        layout: this process's KV layout (:class:`kvstage.kv_layout.KVLayout`); for a pipeline
            stage, ``layout.num_layers`` is the stage's layer count.
        page_size: tokens per page.
        tp_rank: this worker's tensor-parallel rank, in ``[0, tp_size)``.
        tp_size: the tensor-parallel world size.
        first_layer: the model layer this process's layer 0 is (pipeline stage > 0: > 0).
        page_format: ``""`` for pages of ``layout``; else the description of an engine's own page
            format (built by :meth:`opaque`, whose ``layout`` is then ``page_bytes`` uint8).
        rank_neutral_pages: opaque formats only: every rank holds the same page bytes.
        component: ``""``, or a hybrid model's component name (:meth:`of_component`): the
            marker of its prefix in place of ``opaque``; ``page_format`` then describes the
            component and the whole model layout.
        head_groups: 0 (pages per TP rank), or ``G``: the key space of head groups of ``G``
            (:mod:`kvstage.storage.head_groups`), ``layout`` being one group's (``num_heads``
            the heads of one group); a multiple of ``tp_size``, K/V layouts only.

    Raises:
        InvalidArgumentError: an empty model id, a size or rank out of range (bools are not ints).
        ArgumentTypeError: ``layout`` is not a :class:`KVLayout`.
    """

    model_id: str
    layout: KVLayout
    page_size: int
    tp_rank: int = 0
    tp_size: int = 1
    first_layer: int = 0
    page_format: str = ""
    rank_neutral_pages: bool = False
    component: str = ""
    head_groups: int = 0

    def __post_init__(self) -> None:
        require(
            isinstance(self.model_id, str) and self.model_id != "",
            "model_id",
            lambda: f"must be a non-empty str, {_MODEL_ID_RULE}, got {self.model_id!r}",
        )
        require(
            isinstance(self.layout, KVLayout),
            "layout",
            lambda: f"must be a kvstage.kv_layout.KVLayout, got {type(self.layout).__name__}",
            ArgumentTypeError,
        )
        for name in ("page_size", "tp_size"):
            value = getattr(self, name)
            require(is_int(value) and value >= 1, name, lambda: f"must be a positive int, got {value!r}")
        require(
            is_int(self.tp_rank) and 0 <= self.tp_rank < self.tp_size,
            "tp_rank",
            lambda: f"must be an int in [0, tp_size={self.tp_size}), got {self.tp_rank!r}",
        )
        require(
            is_int(self.first_layer) and self.first_layer >= 0,
            "first_layer",
            lambda: f"must be an int >= 0, got {self.first_layer!r}",
        )
        require(
            isinstance(self.page_format, str),
            "page_format",
            lambda: f"must be a str, got {type(self.page_format).__name__}",
        )
        require(
            not self.rank_neutral_pages or self.page_format != "",
            "rank_neutral_pages",
            "is for opaque page formats only (a KV layout is rank-neutral when it is MLA)",
        )
        require(
            self.component == "" or (isinstance(self.component, str) and _MARKER.fullmatch(self.component) is not None),
            "component",
            lambda: f"must be '' or a component name matching [a-z][a-z0-9_]* (not 'opaque'), got {self.component!r}",
        )
        require(
            self.component == "" or self.page_format != "",
            "component",
            "needs page_format, the component's and model layout's description (use LayoutFingerprint.of_component)",
        )
        require(
            is_int(self.head_groups) and self.head_groups >= 0 and self.head_groups % self.tp_size == 0,
            "head_groups",
            lambda: f"must be 0 or a positive multiple of tp_size {self.tp_size}, got {self.head_groups!r}",
        )
        require(
            self.head_groups == 0 or (self.page_format == "" and self.layout.kv_parts == 2),
            "head_groups",
            "splits K/V heads: not for MLA (one KV part, the same on every rank) or opaque page formats",
        )

    @classmethod
    def opaque(
        cls,
        model_id: str = _NO_MODEL_ID,
        *,
        page_bytes: int,
        page_format: str,
        tp_rank: int = 0,
        tp_size: int = 1,
        rank_neutral: bool = False,
    ) -> "LayoutFingerprint":
        """The key space of pages an engine lays out itself: ``page_bytes`` bytes each.

        Args:
            model_id: as the attribute.
            page_bytes: bytes of one page (>= 1).
            page_format: a non-empty description of everything that decides the page's bytes
                besides the model (e.g. vLLM's block size, KV groups, dtype, parallel layout);
                two formats never share pages.
            tp_rank, tp_size: this process's shard, when its pages hold only its own share.
            rank_neutral: every rank holds the same bytes (e.g. an MLA model's replicated
                latent, or pages that already hold every rank's share): one key space for all
                ranks, written by rank 0 only.

        Raises:
            ArgumentTypeError: ``model_id`` not given.
            InvalidArgumentError: an empty or non-str ``page_format``, ``page_bytes`` not a
                positive int, or as the class.
        """
        _require_model_id(model_id)
        require(
            isinstance(page_format, str) and page_format != "",
            "page_format",
            lambda: f"must be a non-empty str describing the page format, got {page_format!r}",
        )
        require(
            is_int(page_bytes) and page_bytes >= 1, "page_bytes", lambda: f"must be a positive int, got {page_bytes!r}"
        )
        layout = KVLayout(num_layers=1, kv_parts=1, num_heads=1, head_dim=page_bytes, dtype="uint8")
        return cls(
            model_id,
            layout,
            1,
            tp_rank=tp_rank,
            tp_size=tp_size,
            page_format=page_format,
            rank_neutral_pages=bool(rank_neutral),
        )

    @classmethod
    def of_component(
        cls,
        model_id: str = _NO_MODEL_ID,
        *,
        component: str,
        layout_description: str,
        entry_bytes: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        rank_neutral: bool = False,
    ) -> "LayoutFingerprint":
        """The key space of one component of a hybrid model (see
        :meth:`kvstage.model_layout.ModelLayout.fingerprints`, which passes these).

        The prefix is ``"{model}@{component}-{16 hex digits}@B{entry_bytes}@{shard}@"``: the
        digest is the SHA-256 of ``component={component}|{layout_description}``, so two processes
        whose layouts differ in any component (layer kinds, window, shapes, dtypes, page size,
        first layer) never share a key space of any component, and one model's components never
        share one with each other. Entries are ``entry_bytes`` bytes (a page, or a state snapshot);
        as for an opaque format, ``layout`` is then ``entry_bytes`` uint8 and ``page_size`` 1, so
        a pool is checked against it with :meth:`ModelLayout.require_matches`, not
        :meth:`require_matches`.

        Args:
            model_id, tp_rank, tp_size: as the attributes.
            component: the component's name (``[a-z][a-z0-9_]*``, not ``opaque``).
            layout_description: :meth:`ModelLayout.description` (``|``-separated ``name=value``
                parts; the file store leaves it beside the pages, so differences can be named).
            entry_bytes: bytes stored under one key (>= 1).
            rank_neutral: every rank holds the same bytes (MLA, a replicated sidecar).

        Raises:
            ArgumentTypeError: ``model_id`` not given.
            InvalidArgumentError: a bad ``component``, an empty ``layout_description``,
                ``entry_bytes`` not a positive int, or as the class.
        """
        _require_model_id(model_id)
        require(
            isinstance(component, str) and _MARKER.fullmatch(component) is not None,
            "component",
            lambda: f"must be a component name matching [a-z][a-z0-9_]* (not 'opaque'), got {component!r}",
        )
        require(
            isinstance(layout_description, str) and layout_description != "",
            "layout_description",
            lambda: f"must be a non-empty str (ModelLayout.description), got {layout_description!r}",
        )
        require(
            is_int(entry_bytes) and entry_bytes >= 1,
            "entry_bytes",
            lambda: f"must be a positive int, got {entry_bytes!r}",
        )
        layout = KVLayout(num_layers=1, kv_parts=1, num_heads=1, head_dim=entry_bytes, dtype="uint8")
        return cls(
            model_id,
            layout,
            1,
            tp_rank=tp_rank,
            tp_size=tp_size,
            page_format=f"component={component}|{layout_description}",
            rank_neutral_pages=bool(rank_neutral),
            component=component,
        )

    @classmethod
    def of(
        cls,
        kv_pool: Any,
        *,
        page_size: int,
        model_id: str = _NO_MODEL_ID,
        tp_rank: int = 0,
        tp_size: int = 1,
        first_layer: int = 0,
    ) -> "LayoutFingerprint":
        """The fingerprint of a KV pool's (or host pool's, or a :class:`KVLayout`'s) layout.

        Args:
            kv_pool: anything with a ``layout`` attribute holding a :class:`KVLayout`, or a
                :class:`KVLayout` itself.
            page_size, model_id, tp_rank, tp_size, first_layer: as the attributes.

        Raises:
            ArgumentTypeError: ``kv_pool`` has no layout, or ``model_id`` was not given.
            InvalidArgumentError: as the class.
        """
        _require_model_id(model_id)
        layout = kv_pool if isinstance(kv_pool, KVLayout) else getattr(kv_pool, "layout", None)
        require(
            isinstance(layout, KVLayout),
            "kv_pool",
            lambda: f"must be a KVPool, HostPool or KVLayout (something with a .layout), got {type(kv_pool).__name__}",
            ArgumentTypeError,
        )
        return cls(model_id, layout, page_size, tp_rank=tp_rank, tp_size=tp_size, first_layer=first_layer)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (``layout.page_bytes(page_size)``)."""
        return self.layout.page_bytes(self.page_size)

    @property
    def layers(self) -> range:
        """The model layers this key space holds, ``range(first_layer, first_layer + num_layers)``."""
        return range(self.first_layer, self.first_layer + self.layout.num_layers)

    @property
    def rank_neutral(self) -> bool:
        """True for MLA (one KV part): every TP rank holds the same latent, so ranks share pages;
        for an opaque format, as :meth:`opaque` was told."""
        if self.page_format:
            return self.rank_neutral_pages
        return self.layout.kv_parts == 1

    @property
    def writes_pages(self) -> bool:
        """Whether this process writes pages: every rank for K/V; only TP rank 0 for MLA, whose
        other ranks hold the same bytes and would only write them again."""
        return not self.rank_neutral or self.tp_rank == 0

    def prefix(self) -> str:
        """The key prefix, e.g. ``"llama3-8b@bfloat16@L0-31xKV2xH8xD128@P64@tp0of1@"``
        (MLA: ``...@tp-any@``; head groups of 4: ``...xH2xD128@P64@hg4@``, whatever the rank); an opaque format: ``"{model}@opaque-{16 hex digits of the
        format's SHA-256}@B{page_bytes}@{shard}@"``; a hybrid model's component: the same with
        the component's name for ``opaque`` (:meth:`of_component`).

        A model id made only of ``[A-Za-z0-9._-]`` is used as it is. Any other character
        becomes ``_`` (so the prefix is safe as a file name and as a Mooncake key) and the id
        then ends in ``-`` and the first 8 hex digits of the SHA-256 of the id as given (UTF-8),
        so ids that sanitize alike (``org/model``, ``org_model``, ``org/mödel``) keep distinct
        key spaces: ``"org/model"`` -> ``"org_model-c87c0c64"``.
        """
        model = _safe_model_name(self.model_id)
        layout = self.layout
        layers = self.layers
        shard = "tp-any" if self.rank_neutral else f"tp{self.tp_rank}of{self.tp_size}"
        if self.head_groups:
            shard = f"hg{self.head_groups}"
        if self.page_format:
            digest = hashlib.sha256(self.page_format.encode()).hexdigest()[:16]
            return f"{model}@{self.component or _OPAQUE_NAME}-{digest}@B{self.page_bytes}@{shard}@"
        return (
            f"{model}@{layout.dtype_name}@L{layers.start}-{layers.stop - 1}xKV{layout.kv_parts}"
            f"xH{layout.num_heads}xD{layout.head_dim}@P{self.page_size}@{shard}@"
        )

    def require_matches(self, layout: KVLayout, page_size: int, argument: str = "storage") -> None:
        """Raise unless pages of ``layout`` and ``page_size`` belong to this key space.

        Equal page bytes are not enough: a page of another dtype or shape would later be read
        back as this layout.

        Raises:
            InvalidArgumentError: the layouts or page sizes differ (the message names the field).
        """
        for name in ("dtype", "num_layers", "kv_parts", "num_heads", "head_dim"):
            mine, theirs = getattr(self.layout, name), getattr(layout, name)
            if mine != theirs:
                raise InvalidArgumentError(f"{argument}: its layout's {name} {mine} must equal the pool's {theirs}")
        if self.page_size != page_size:
            raise InvalidArgumentError(
                f"{argument}: its layout's page_size {self.page_size} must equal the pool's {page_size}"
            )


_SAFE = frozenset(string.ascii_letters + string.digits + "._-")
_OPAQUE_NAME = "opaque"
_OPAQUE = _OPAQUE_NAME + "-"  # the second field of an opaque format's prefix
# A component's name: the marker of a described key space's second field, ``NAME-DIGEST``
# (no dtype name holds ``-``); "opaque" is an engine's page format.
_MARKER = re.compile(r"(?!opaque$)[a-z][a-z0-9_]{0,31}")
_DESCRIBED = re.compile(r"([a-z][a-z0-9_]{0,31})-([0-9a-f]{16})")


def prefix_of(full_key: str) -> str | None:
    """The fingerprint prefix (:meth:`LayoutFingerprint.prefix`) a full key starts with, or None
    when it starts with none.

    A prefix is ``@``-ended fields, and no field holds ``@`` (model ids are sanitized): five for
    pages of a KV layout (model, dtype, layers and layout, page size, shard), four for an opaque
    format or a hybrid model's component (model, ``opaque-DIGEST`` or ``COMPONENT-DIGEST``, page
    bytes, shard), told apart by the second field.
    """
    fields = full_key.split("@", 5)
    count = 4 if len(fields) > 1 and _is_described(fields[1]) else 5
    if len(fields) <= count or any(field == "" for field in fields[:count]):
        return None
    return "@".join(fields[:count]) + "@"


def _is_described(field: str) -> bool:
    """Whether a prefix's second field names a described key space (opaque or a component)."""
    return field.startswith(_OPAQUE) or _DESCRIBED.fullmatch(field) is not None


_LAYERS_AND_LAYOUT = re.compile(r"L(\d+)-(\d+)xKV(\d+)xH(\d+)xD(\d+)")


def prefix_fields(prefix: str) -> dict[str, str] | None:
    """A fingerprint prefix's fields, named by the settings they come from, or None when
    ``prefix`` is no prefix (:meth:`LayoutFingerprint.prefix`).

    Pages of a KV layout: ``model_id`` (as sanitized in the prefix), ``dtype``, ``layers``
    (``"0-31"``), ``kv_parts``, ``num_heads``, ``head_dim``, ``page_size``, ``shard``
    (``"tp0of2"``, or ``"tp-any"`` for rank-neutral pages). An opaque format: ``model_id``,
    ``page_format`` (the format's digest: the prefix holds no more of it), ``page_bytes``,
    ``shard``. A hybrid model's component: ``model_id``, ``component``, ``page_format`` (the
    digest of the component and model layout), ``page_bytes`` (its entry bytes), ``shard``.
    Values are strings, in that order.
    """
    if not isinstance(prefix, str) or prefix_of(prefix) != prefix:
        return None
    fields = prefix.split("@")[:-1]
    if _is_described(fields[1]):
        model, marker, page_bytes, shard = fields
        if not page_bytes.startswith("B"):
            return None
        if marker.startswith(_OPAQUE):
            return {
                "model_id": model,
                "page_format": marker[len(_OPAQUE) :],
                "page_bytes": page_bytes[1:],
                "shard": shard,
            }
        component, _, digest = marker.rpartition("-")
        return {
            "model_id": model,
            "component": component,
            "page_format": digest,
            "page_bytes": page_bytes[1:],
            "shard": shard,
        }
    model, dtype, layout, page_size, shard = fields
    match = _LAYERS_AND_LAYOUT.fullmatch(layout)
    if match is None or not page_size.startswith("P"):
        return None
    first, last, kv_parts, heads, head_dim = match.groups()
    return {
        "model_id": model,
        "dtype": dtype,
        "layers": f"{first}-{last}",
        "kv_parts": kv_parts,
        "num_heads": heads,
        "head_dim": head_dim,
        "page_size": page_size[1:],
        "shard": shard,
    }


def prefix_differences(theirs: str, mine: str, formats: Mapping[str, str] | None = None) -> list[str]:
    """What makes the key space ``theirs`` another than ``mine``: one line per setting that
    differs, e.g. ``"page_size 64 (this store: 16)"``; ``[]`` for equal prefixes.

    Args:
        theirs: another key space's prefix (e.g. from :func:`kvstage.storage.key_spaces.key_spaces`).
        mine: this store's prefix.
        formats: opaque formats' descriptions by prefix (their ``page_format``), where known:
            the prefix holds only a digest, so two formats are compared part by part (their
            ``|``-separated parts; ``name=value`` parts by name) only when both are described.

    Returns:
        Lines in the order of :func:`prefix_fields`; one line ``"page kind: ..."`` first when
        they are of two kinds (a KV layout, an engine's own page format, a hybrid model's
        component; then only ``model_id`` is compared besides); ``["not a fingerprint prefix:
        ..."]`` when ``theirs`` is none.
    """
    a, b = prefix_fields(theirs), prefix_fields(mine)
    if a is None or b is None:
        return [f"not a fingerprint prefix: {theirs if a is None else mine!r}"]
    formats = formats or {}
    lines = []
    if _kind(a) != _kind(b):
        lines.append(f"page kind: {_kind(a)} (this store: {_kind(b)})")
        names = ["model_id"]
    else:
        names = list(a)
    for name in names:
        if a[name] == b[name]:
            continue
        if name == "page_format":
            lines.extend(_format_differences(a[name], formats.get(theirs), formats.get(mine)))
        else:
            lines.append(f"{name} {a[name]} (this store: {b[name]})")
    return lines


def _kind(fields: dict[str, str]) -> str:
    if "component" in fields:
        return "a hybrid model's component"
    return "an engine's own page format" if "page_format" in fields else "a KV layout"


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _format_differences(digest: str, theirs: str | None, mine: str | None) -> list[str]:
    """Two opaque formats' differing parts (see :func:`prefix_differences`)."""
    if theirs is None or mine is None:
        return [f"page_format with digest {digest}, not described (this store: {_short(mine or 'not described')})"]
    a, b = theirs.split("|"), mine.split("|")
    named_a = {part.partition("=")[0]: part for part in a if "=" in part}
    named_b = {part.partition("=")[0]: part for part in b if "=" in part}
    lines = []
    for name in dict.fromkeys([*named_a, *named_b]):  # name=value parts, by name, in order
        if named_a.get(name) != named_b.get(name):
            lines.append(
                f"page_format {_short(named_a.get(name, 'no ' + name))} (this store: {_short(named_b.get(name, 'no ' + name))})"
            )
    only_a = [part for part in a if "=" not in part and part not in b]  # the other parts, by presence
    only_b = [part for part in b if "=" not in part and part not in a]
    if only_a or only_b:
        lines.append(
            f"page_format {_short('|'.join(only_a) or 'none')} (this store: {_short('|'.join(only_b) or 'none')})"
        )
    return lines or [f"page_format with digest {digest} (this store: {_short(mine)})"]


def _safe_model_name(model_id: str) -> str:
    """``model_id`` when every character is in ``[A-Za-z0-9._-]``; otherwise each other
    character as ``_`` plus ``-`` and 8 hex digits of the id's SHA-256 (see ``prefix``)."""
    if all(c in _SAFE for c in model_id):
        return model_id
    sanitized = "".join(c if c in _SAFE else "_" for c in model_id)
    return f"{sanitized}-{hashlib.sha256(model_id.encode()).hexdigest()[:8]}"
