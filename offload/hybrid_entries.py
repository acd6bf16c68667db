"""A hybrid model's component entries in host memory (:class:`Entries`) and where their rows
live (:class:`EntryStaging`): a staging buffer of the :class:`StagingPool`, or, for one entry
read from a memory store that lends, the store's page itself (no copy: see
:meth:`MemoryStore.lend <kvstage.storage.memory_store.MemoryStore.lend>`); a staging buffer a
store adopted (:meth:`~kvstage.storage.memory_store.MemoryStore.put_adopting`) is replaced by
the buffers the store gave for it.
"""

from __future__ import annotations

from typing import Any

import torch

from kvstage.kernels.streams import CopyHandle
from kvstage.offload.staging_pool import StagingPool

__all__ = ["Entries", "EntryStaging"]


class Entries:
    """One component's entries in host memory: a gather's (store path) or a read's (load path)."""

    __slots__ = (
        "name",
        "state",
        "staging",
        "buffer",
        "keys",
        "indices",
        "handle",
        "req",
        "run",
        "first",
        "length",
        "counted",
        "loan",
        "buffers",
    )

    def __init__(self, name: str, state: Any, buffer: torch.Tensor, count: int) -> None:
        self.name, self.state, self.buffer, self.staging = name, state, buffer, buffer[:count]
        self.loan: Any = None  # a load's page lent by the store (staging is a view of it; buffer None)
        self.buffers: list[torch.Tensor] | None = None  # rows of their own (staging is their list; buffer None)
        self.indices: list[int] = []
        self.keys: list[str] | None = None  # known once the run is keyed (store) or read (load)
        self.handle: CopyHandle | None = None
        self.req: Any = None  # a snapshot's request and length
        self.run: Any = None  # a page gather's run and its first page
        self.first = 0
        self.length = 0
        self.counted = False  # its copy's end was counted off the request's copies in flight


class EntryStaging:
    """Rows for :class:`Entries` (module doc), on the manager's thread but for :meth:`borrow` and
    :meth:`take`, which a reader thread calls too (the staging pool and the stores are thread-safe).

    Args:
        staging: the staging pool buffers come from and go back to.
        page_size: tokens per page (a page entry's row shape).
    """

    def __init__(self, staging: StagingPool, page_size: int) -> None:
        self.staging, self.page_size = staging, page_size

    def take(self, name: str, state: Any, pool: Any, count: int, own_rows: bool = False) -> Entries:
        """Entries of ``count`` rows on a staging buffer of the pool (reused: :class:`StagingPool`);
        ``own_rows`` (for a copy by rows to a store that adopts): each row a buffer of its own,
        ``staging`` their list, so the store can keep every one."""
        row, dtype = self.row(pool)
        if not own_rows or count < 2:
            return Entries(name, state, self.staging.take(count, row, dtype), count)
        buffers = [self.staging.take(1, row, dtype) for _ in range(count)]
        entries = Entries(name, state, buffers[0], 1)
        entries.buffer, entries.buffers, entries.staging = None, buffers, [buffer[0] for buffer in buffers]
        return entries

    def borrow(self, name: str, store: Any, pool: Any, keys: list[str], by_rows: bool = False) -> Entries | None:
        """Entries lent by a store that lends (its pages are the staging, no copy): None when
        the store does not lend, there is not exactly one key (several: only ``by_rows``, the
        pool copied by rows, which reads a list of pages; then ``staging`` is that list), or a
        page is not the memory the staging pool would give (pinned or not); a miss (a key not
        stored): an entry whose ``staging`` is None.

        Raises:
            Whatever the store's ``lend`` raises.
        """
        if not keys or (len(keys) != 1 and not by_rows) or not getattr(store, "lends", False):
            return None
        loan = store.lend(keys)
        pages = list(loan.pages)
        if any(page is not None and page.is_pinned() != self.staging.pinned for page in pages):
            loan.end()
            return None
        row, dtype = self.row(pool)
        missed = any(page is None for page in pages)
        rows = [] if missed else [page.view(dtype).view(1, *row) for page in pages]
        entries = Entries(name, None, rows[0] if len(keys) == 1 and rows else torch.empty(0), len(keys))
        entries.buffer, entries.loan = None, loan
        if missed:  # evicted since the lookup: no rows
            entries.staging = None
        elif len(keys) > 1:
            entries.staging = [r[0] for r in rows]  # one page each: the rows' plan reads them in order
        return entries

    def row(self, pool: Any) -> tuple[tuple[int, ...], torch.dtype]:
        """An entry's row shape and dtype on ``pool`` (a state snapshot's bytes, or a page)."""
        if hasattr(pool, "snapshot_bytes"):
            return (pool.snapshot_bytes,), torch.uint8
        return tuple(pool.layout.page_shape(self.page_size)), pool.layout.dtype

    def give_back(self, entries: Entries) -> None:
        """``entries``' staging is free again (its write or load ended, or never ran); a loan ends."""
        if entries.loan is not None:
            entries.loan.end()
            entries.loan = entries.staging = None
        if entries.buffer is not None:
            self.staging.give(entries.buffer)
            entries.buffer = entries.staging = None
        if entries.buffers is not None:
            for buffer in entries.buffers:
                self.staging.give(buffer)
            entries.buffers = entries.staging = None

    def swap_in(self, entries: Entries, spares: list[torch.Tensor], adopted: list[bool]) -> None:
        """The store adopted ``entries``' staging buffers where ``adopted`` (one flag a row put):
        those are never given back; the buffers the store gave for them (no copy reads or writes
        them) join the staging pool in their place (on the manager's thread, as every give),
        when they are memory of the same kind, each the whole of its storage."""
        own = entries.buffers if entries.buffers is not None else [entries.buffer]
        shape, dtype = own[0].shape, own[0].dtype
        kept = [buffer for index, buffer in enumerate(own) if not (index < len(adopted) and adopted[index])]
        if entries.buffers is not None:
            entries.buffers = kept
        else:
            entries.buffer = entries.staging = None  # (one row, adopted)
        nbytes = shape.numel() * dtype.itemsize
        for spare in spares:
            if (
                spare.numel() * spare.element_size() == nbytes
                and spare.is_pinned() == self.staging.pinned
                and spare.storage_offset() == 0
                and spare.untyped_storage().nbytes() == nbytes
            ):
                self.staging.give(spare.view(torch.uint8).view(dtype).view(shape))
