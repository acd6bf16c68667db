"""K/V pages split into head groups, so servers of different TP sizes share them.

A TP rank holds ``num_heads / tp_size`` of a model's KV heads, so by default its pages are its
own key space (``tp{rank}of{size}``) and a server of another TP size finds none of them. With
``tp_lcm_size = G`` (a common multiple of every TP size that shares the store, sglang's name for
it), each page is stored as ``G`` entries, one per group of ``num_heads / G`` consecutive KV heads,
in one key space of every TP size (shard ``hg{G}``, :class:`LayoutFingerprint` ``head_groups``):

- group ``g`` holds the model's KV heads ``[g * num_heads / G, (g + 1) * num_heads / G)``, its
  entry is kvstage's page byte order ``[num_layers, 2, page_size, num_heads / G, head_dim]`` of
  those heads, under the key ``"{page key}.h{g}"`` (:func:`head_group_key`);
- TP rank ``r`` of ``tp_size`` holds groups ``[r * G / tp_size, (r + 1) * G / tp_size)``: it writes
  and reads those entries, and a page is a hit for it when all of them are stored.

sglang 0.5.23's Mooncake backend follows the same split (``tp_lcm_size / tp_size`` entries per
rank page, each named by its group's index; PR #11615), with its own key names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvstage.errors import InvalidArgumentError, is_int
from kvstage.kv_layout import KVLayout

__all__ = ["HeadGroups", "head_group_key"]


def head_group_key(key: str, group: int) -> str:
    """The store key of head group ``group`` of the page ``key``: ``"{key}.h{group}"``."""
    return f"{key}.h{group}"


@dataclass(frozen=True)
class HeadGroups:
    """One TP rank's head groups of a K/V page (see the module).

    Attributes:
        tp_lcm_size: ``G``, the groups a page is split into (a multiple of ``tp_size``).
        tp_rank, tp_size: this rank's place.
        rank_heads: KV heads this rank holds (its pool's ``num_heads``), a multiple of
            ``tp_lcm_size / tp_size``.
        argument: the name errors give ``tp_lcm_size`` (e.g. ``"storage_config.tp_lcm_size"``).

    Raises:
        InvalidArgumentError: ``tp_lcm_size`` is not a positive int multiple of ``tp_size``, or
            ``rank_heads`` is not a multiple of ``tp_lcm_size / tp_size`` (the model's KV heads
            are not divisible into ``tp_lcm_size`` groups); the message names ``argument``.
    """

    tp_lcm_size: int
    tp_rank: int
    tp_size: int
    rank_heads: int
    argument: str = "tp_lcm_size"

    def __post_init__(self) -> None:
        lcm = self.tp_lcm_size
        if not is_int(lcm) or lcm < 1 or lcm % self.tp_size != 0:
            raise InvalidArgumentError(
                f"{self.argument}: must be a positive multiple of tp_size {self.tp_size} "
                f"(a common multiple of every TP size sharing the store), got {lcm!r}"
            )
        if self.rank_heads % (lcm // self.tp_size) != 0:
            raise InvalidArgumentError(
                f"{self.argument}: {lcm} head groups need the model's KV heads "
                f"({self.rank_heads} per rank x tp_size {self.tp_size} = {self.rank_heads * self.tp_size}) "
                f"to be a multiple of {lcm}"
            )

    @classmethod
    def for_layout(
        cls, rank_layout: KVLayout, *, tp_lcm_size: int, tp_rank: int, tp_size: int, argument: str = "tp_lcm_size"
    ) -> "HeadGroups":
        """The head groups of a rank whose pool is of ``rank_layout``.

        Raises:
            InvalidArgumentError: ``rank_layout`` is MLA (one KV part: no heads to split, and its
                pages are the same on every rank and shared by every TP size already), or as the class.
        """
        if rank_layout.kv_parts != 2:
            raise InvalidArgumentError(
                f"{argument}: an MLA latent has no KV heads to split and is the same on every TP rank "
                "(its pages are shared by every TP size already); drop tp_lcm_size"
            )
        return cls(tp_lcm_size, tp_rank, tp_size, rank_layout.num_heads, argument)

    @property
    def per_rank(self) -> int:
        """Entries per page this rank writes and reads: ``tp_lcm_size / tp_size``."""
        return self.tp_lcm_size // self.tp_size

    @property
    def group_heads(self) -> int:
        """KV heads per group (per entry)."""
        return self.rank_heads // self.per_rank

    @property
    def groups(self) -> range:
        """The model-wide indices of this rank's groups."""
        return range(self.tp_rank * self.per_rank, (self.tp_rank + 1) * self.per_rank)

    def entry_layout(self, rank_layout: KVLayout) -> KVLayout:
        """The layout of one entry: ``rank_layout`` with ``group_heads`` heads.

        Raises:
            InvalidArgumentError: ``rank_layout`` is MLA or holds other than ``rank_heads`` heads.
        """
        if rank_layout.kv_parts != 2 or rank_layout.num_heads != self.rank_heads:
            raise InvalidArgumentError(
                f"{self.argument}: the pool's layout ({rank_layout.describe()}) is not one of "
                f"{self.rank_heads} K/V heads per rank"
            )
        return KVLayout(rank_layout.num_layers, 2, self.group_heads, rank_layout.head_dim, rank_layout.dtype)

    def entry_keys(self, keys: Sequence[str]) -> list[str]:
        """The store keys of ``keys``' pages: this rank's groups of each page, page by page."""
        return [head_group_key(key, group) for key in keys for group in self.groups]

    def entry_views(self, pages: Sequence[torch.Tensor], page_shape: Sequence[int]) -> list[torch.Tensor]:
        """Views of this rank's groups of each page, in :meth:`entry_keys`' order.

        Args:
            pages: views whose row-major elements are a page of ``page_shape``
                (``[num_layers, 2, page_size, rank_heads, head_dim]``) and which torch can view
                as that shape (e.g. :func:`kvstage.integrations.sglang.host_layouts.page_view`'s).
            page_shape: that shape.
        """
        entries = []
        for page in pages:
            if self.per_rank == 1:
                entries.append(page)
                continue
            five = page.view(*page_shape)
            for first in range(0, self.rank_heads, self.group_heads):
                entries.append(five[:, :, :, first : first + self.group_heads])
        return entries

    def page_hits(self, entry_hits: Sequence[bool]) -> list[bool]:
        """Per page: whether every one of its entries hit (``entry_hits`` in :meth:`entry_keys`' order)."""
        n = self.per_rank
        return [all(entry_hits[i : i + n]) for i in range(0, len(entry_hits), n)]
