"""The host page pool: pinned page-first memory that offloaded KV pages are copied into.

Memory is allocated in several host buffers rather than one tensor, because a single pinned
allocation of several GB fails on some systems (the CUDA driver pins through one
``cudaHostAlloc`` call, and large ones hit the locked-memory limit or fragment). Each host
buffer is one staging tensor of the kernels' ``page_first`` layout::

    host buffer b: [buffer_pages, num_layers, kv_parts, page_size, num_heads, head_dim]

so a gather writes a buffer directly with local page ids. A host page id is global:
``id = b * buffer_pages + local``; :meth:`HostPool.locate` groups ids by host buffer.

The pool only hands out and takes back host page ids; it never looks at the bytes.

One page a buffer (``buffer_pages=1``, :attr:`HostPool.own_pages`): each page is the whole of
its own storage, what a store that adopts pages keeps (``put_adopting``) and what it lends
(``lend``). Then a page's memory can change hands: :meth:`HostPool.replace` puts the buffer a
store gave back in place of one it kept, and :meth:`HostPool.lend_in` makes allocated pages
read a store's lent pages until they are freed (the loan ends with the last of them).
"""

from __future__ import annotations

import numbers
import threading
from typing import Any, Iterable, Sequence

import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError, is_int, require
from kvstage.kv_layout import KVLayout

DEFAULT_BUFFER_BYTES = 1 << 30  # 1 GiB: pins reliably, and few enough buffers for a big pool


class HostPool:
    """Host memory for ``num_pages`` KV pages of one layout, page-first, in host buffers.

    Args:
        layout: the KV layout of a page (:class:`kvstage.kv_layout.KVLayout`).
        num_pages: pages the pool holds (its capacity), >= 1.
        page_size: tokens per page, >= 1.
        pin: pin the memory (page-locked, for async D2H). None: pin when CUDA is available.
        buffer_pages: pages per host buffer (the last may be smaller). None: as many as fit in
            :data:`DEFAULT_BUFFER_BYTES` (at least 1, at most ``num_pages``).

    Attributes:
        layout, page_size, pinned, buffer_pages: as given (resolved).
        page_bytes: bytes of one page.
        buffers: the host buffer tensors ``[buffer_pages, *layout.page_shape(page_size)]``.

    Raises:
        InvalidArgumentError: a size is not a positive int (bools are not sizes), or ``pin`` is
            true and the memory cannot be pinned (no accelerator).
        ArgumentTypeError: ``layout`` is not a :class:`KVLayout`.

    Not thread-safe: one thread (the engine's scheduler) allocates and frees.
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        num_pages: int,
        page_size: int,
        pin: bool | None = None,
        buffer_pages: int | None = None,
    ) -> None:
        require(
            isinstance(layout, KVLayout),
            "layout",
            lambda: f"must be a KVLayout, got {type(layout).__name__}",
            ArgumentTypeError,
        )
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            require(is_int(value) and value >= 1, name, lambda: f"must be a positive int, got {value!r}")
        self.layout = layout
        self.page_size = page_size
        self.page_shape = layout.page_shape(page_size)
        self.page_bytes = layout.page_bytes(page_size)
        if buffer_pages is None:
            buffer_pages = max(1, min(num_pages, DEFAULT_BUFFER_BYTES // self.page_bytes))
        require(
            is_int(buffer_pages) and buffer_pages >= 1,
            "buffer_pages",
            lambda: f"must be a positive int, got {buffer_pages!r}",
        )
        buffer_pages = min(buffer_pages, num_pages)
        self.pinned = torch.cuda.is_available() if pin is None else bool(pin)
        self.buffer_pages = buffer_pages
        self.buffers: list[torch.Tensor] = []
        for start in range(0, num_pages, buffer_pages):
            pages = min(buffer_pages, num_pages - start)
            try:
                self.buffers.append(torch.empty((pages, *self.page_shape), dtype=layout.dtype, pin_memory=self.pinned))
            except RuntimeError as error:
                if not self.pinned:
                    raise
                raise InvalidArgumentError(
                    f"pin: could not pin {pages * self.page_bytes} bytes of host memory ({error}); "
                    "pass pin=False where there is no accelerator, or a smaller buffer_pages"
                ) from error
        self._capacity = num_pages
        # Free ids as a stack whose top is the lowest id, so fresh allocations are ascending and
        # usually fall in one host buffer (one gather launch per segment).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._in_use = bytearray(num_pages)  # 1 where allocated: catches double and foreign frees
        self._high_water = 0
        self.buffers_allocated = 0  # page buffers replace() allocated (a store at capacity gives its spares)
        self._loans: dict[int, tuple[torch.Tensor, list]] = {}  # page id -> (own buffer, [loan, pages left])
        self._loans_lock = threading.Lock()  # lend_in runs on a reader thread, free on the owner's

    @classmethod
    def like(
        cls, kv_pool: Any, *, num_pages: int, page_size: int, pin: bool | None = None, buffer_pages: int | None = None
    ) -> "HostPool":
        """A host pool whose pages match a :class:`kvstage.kernels.KVPool`'s ``layout``.

        Args:
            kv_pool: anything with a ``layout`` (:class:`KVLayout`).
            num_pages, page_size, pin, buffer_pages: as for :class:`HostPool`.
        """
        return cls(kv_pool.layout, num_pages=num_pages, page_size=page_size, pin=pin, buffer_pages=buffer_pages)

    # -- counters -------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Pages the pool holds."""
        return self._capacity

    @property
    def used(self) -> int:
        """Pages allocated now."""
        return self._capacity - len(self._free)

    @property
    def free_pages(self) -> int:
        """Pages free now (``capacity - used``)."""
        return len(self._free)

    @property
    def high_water(self) -> int:
        """The most pages ever allocated at once."""
        return self._high_water

    # -- alloc / free ---------------------------------------------------------------------

    def alloc(self, num_pages: int) -> list[int] | None:
        """Allocate ``num_pages`` pages.

        Returns:
            A new list of ``num_pages`` distinct host page ids (never a view of the free list), or
            None when fewer than ``num_pages`` pages are free; then nothing changed.

        Raises:
            InvalidArgumentError: ``num_pages`` is not a non-negative int.
        """
        if not is_int(num_pages) or num_pages < 0:  # not require(): its message would be built every call
            raise InvalidArgumentError(f"num_pages: must be a non-negative int, got {num_pages!r}")
        free = self._free
        if num_pages > len(free):
            return None
        if num_pages == 0:
            return []
        host_page_ids = free[-num_pages:]
        del free[-num_pages:]
        host_page_ids.reverse()  # ascending: the top of the stack is the lowest id
        in_use = self._in_use
        for page in host_page_ids:
            in_use[page] = 1
        used = self._capacity - len(free)
        if used > self._high_water:
            self._high_water = used
        return host_page_ids

    def free(self, host_page_ids: Iterable[int]) -> None:
        """Return pages to the pool; all or nothing.

        Raises:
            InvalidArgumentError: an id is not an int in ``[0, capacity)``, is not allocated
                (a double free or an id this pool never handed out), or repeats in ``host_page_ids``.
                Nothing is freed then.
        """
        # numpy integers are ids too (what an engine gets from an array); bools are not.
        host_page_ids = [
            int(page) if isinstance(page, numbers.Integral) and not isinstance(page, bool) else page
            for page in host_page_ids
        ]
        in_use = self._in_use
        capacity = self._capacity
        for index, page in enumerate(host_page_ids):
            if not is_int(page) or not 0 <= page < capacity:
                raise InvalidArgumentError(
                    f"host_page_ids[{index}]: must be a page id in [0, {capacity}), got {page!r}"
                )
            if not in_use[page]:
                raise InvalidArgumentError(
                    f"host_page_ids[{index}]: page {page} is not allocated (double free or foreign id)"
                )
        if len(set(host_page_ids)) != len(host_page_ids):
            raise InvalidArgumentError("host_page_ids: a page id repeats")
        if self._loans:
            self._end_loans(host_page_ids)
        for page in host_page_ids:
            in_use[page] = 0
        # Pushed so that the lowest ids come out first again.
        self._free.extend(sorted(host_page_ids, reverse=True))

    def is_allocated(self, host_page_id: int) -> bool:
        """Whether ``host_page_id`` is allocated now."""
        return is_int(host_page_id) and 0 <= host_page_id < self._capacity and bool(self._in_use[host_page_id])

    # -- addressing -----------------------------------------------------------------------

    def page(self, host_page_id: int) -> torch.Tensor:
        """A contiguous view of one page: ``[num_layers, kv_parts, page_size, num_heads, head_dim]``.

        Raises:
            InvalidArgumentError: ``host_page_id`` is not an id in ``[0, capacity)``.
        """
        if not is_int(host_page_id) or not 0 <= host_page_id < self._capacity:
            raise InvalidArgumentError(f"host_page_id: must be in [0, {self._capacity}), got {host_page_id!r}")
        return self.buffers[host_page_id // self.buffer_pages][host_page_id % self.buffer_pages]

    def locate(self, host_page_ids: Sequence[int]) -> list[tuple[int, list[int], list[int]]]:
        """Group host page ids by host buffer.

        Returns:
            ``(buffer_index, positions, local_ids)`` per host buffer touched, in order of first
            appearance: ``positions`` are indices into ``host_page_ids``, ``local_ids`` the ids
            within that host buffer.
        """
        if not host_page_ids:
            return []
        buffer_pages = self.buffer_pages
        first = host_page_ids[0] // buffer_pages
        if len(self.buffers) == 1 or all(page // buffer_pages == first for page in host_page_ids):
            base = first * buffer_pages
            return [(first, list(range(len(host_page_ids))), [page - base for page in host_page_ids])]
        groups: dict[int, tuple[int, list[int], list[int]]] = {}
        for position, page in enumerate(host_page_ids):
            buffer_index = page // buffer_pages
            group = groups.get(buffer_index)
            if group is None:
                group = groups[buffer_index] = (buffer_index, [], [])
            group[1].append(position)
            group[2].append(page - buffer_index * buffer_pages)
        return list(groups.values())

    # -- pages of their own (one page a buffer) ------------------------------------------

    @property
    def own_pages(self) -> bool:
        """Every page is the whole of its own buffer (``buffer_pages == 1``): a store may keep it."""
        return self.buffer_pages == 1

    def replace(self, host_page_id: int, buffer: torch.Tensor | None) -> None:
        """A store kept page ``host_page_id``'s buffer: ``buffer`` (a store's spare, flat
        ``uint8 [page_bytes]`` or the page's shape, no copy reads or writes it any more) is
        the page's memory from now on; None, or a buffer of another size or pinning, or one that
        is not the whole of its storage (what a store adopts): a new one.

        Raises:
            InvalidArgumentError: the pool is not one page a buffer, or the id is not allocated.
        """
        require(self.own_pages, "host_pool", "replace() needs one page a buffer (buffer_pages=1)")
        require(
            self.is_allocated(host_page_id),
            "host_page_id",
            lambda: f"{host_page_id!r} is not an allocated host page",
        )
        if (
            buffer is None
            or buffer.numel() * buffer.element_size() != self.page_bytes
            or buffer.is_pinned() != self.pinned
            or not buffer.is_contiguous()
            or buffer.storage_offset() != 0
            or buffer.untyped_storage().nbytes() != self.page_bytes  # part of a larger buffer: no store keeps it
        ):
            buffer = torch.empty(self.page_bytes, dtype=torch.uint8, pin_memory=self.pinned)
            self.buffers_allocated += 1
        self.buffers[host_page_id] = buffer.view(torch.uint8).view(self.layout.dtype).view(1, *self.page_shape)

    def lend_in(self, host_page_ids: Sequence[int], pages: Sequence[torch.Tensor], loan: Any) -> None:
        """Allocated pages ``host_page_ids`` read ``pages`` (a store's lent pages, flat ``uint8
        [page_bytes]``; never written) until freed: then each gets its own buffer back, and
        ``loan.end()`` runs when the last of them is freed. Any thread (a prefetch's reader).

        Raises:
            InvalidArgumentError: not one page a buffer, lengths differ, a page that is not a
                contiguous CPU tensor of the page's bytes, or an id not allocated, lent in already
                or given twice; nothing changed then.
        """
        require(self.own_pages, "host_pool", "lend_in() needs one page a buffer (buffer_pages=1)")
        ids = list(host_page_ids)
        require(len(ids) == len(pages), "pages", lambda: f"must be one per host page id, {len(ids)}, got {len(pages)}")
        with self._loans_lock:
            seen: set = set()
            views = []  # every view made before any page changes (a page that cannot be viewed changes none)
            for index, (page_id, page) in enumerate(zip(ids, pages)):
                require(
                    self.is_allocated(page_id) and page_id not in self._loans and page_id not in seen,
                    f"host_page_ids[{index}]",
                    lambda page_id=page_id: (
                        f"{page_id!r} is not an allocated host page of its own (or it repeats in this call)"
                    ),
                )
                seen.add(page_id)
                require(
                    isinstance(page, torch.Tensor)
                    and page.is_cpu
                    and page.is_contiguous()
                    and page.numel() * page.element_size() == self.page_bytes,
                    f"pages[{index}]",
                    lambda page=page: (
                        f"must be a contiguous CPU tensor of {self.page_bytes} bytes, got "
                        + (
                            f"{page.numel() * page.element_size()} bytes"
                            if isinstance(page, torch.Tensor)
                            else type(page).__name__
                        )
                    ),
                )
                views.append(page.view(torch.uint8).view(-1).view(self.layout.dtype).view(1, *self.page_shape))
            record = [loan, len(ids)]
            for page_id, view in zip(ids, views):
                self._loans[page_id] = (self.buffers[page_id], record)
                self.buffers[page_id] = view
        if not ids:
            loan.end()

    @property
    def pages_lent_in(self) -> int:
        """Allocated pages that read a store's lent page now (:meth:`lend_in`)."""
        return len(self._loans)

    def _end_loans(self, host_page_ids: list[int]) -> None:
        ended = []
        with self._loans_lock:
            for page_id in host_page_ids:
                lent = self._loans.pop(page_id, None)
                if lent is None:
                    continue
                own, record = lent
                self.buffers[page_id] = own
                record[1] -= 1
                if record[1] == 0:
                    ended.append(record[0])
        for loan in ended:  # outside the lock: a store's lock is taken
            loan.end()

    def __repr__(self) -> str:
        return (
            f"HostPool(pages={self._capacity}, used={self.used}, page_shape={self.page_shape}, dtype={self.layout.dtype}, "
            f"buffers={len(self.buffers)}x{self.buffer_pages}, pinned={self.pinned})"
        )
