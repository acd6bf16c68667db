"""The host page pool: page-first staging memory that offloaded KV pages are copied into.

Memory is allocated in chunks rather than in one tensor, because a single pinned allocation of
several GB fails on some systems (the CUDA driver pins through one ``cudaHostAlloc`` call, and
large ones hit the locked-memory limit or fragment). Each chunk is one staging tensor of the
kernels' ``page_first`` layout::

    chunk c: [chunk_pages, num_layers, kv_parts, page_size, head_num, head_dim]

so a gather writes a chunk directly with local page ids. A page id is global:
``id = c * chunk_pages + local``; :meth:`HostPool.locate` splits ids into chunks.

The pool only hands out and takes back page ids; it never looks at the bytes.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError, is_int, require

DEFAULT_CHUNK_BYTES = 1 << 30  # 1 GiB: pins reliably, and few enough chunks for a big pool


class HostPool:
    """Host memory for ``num_pages`` KV pages, page-first, in chunks.

    Args:
        num_layers: layers in one page.
        kv_parts: 2 for MHA (K and V), 1 for MLA.
        head_num: KV heads per part (1 for MLA).
        head_dim: elements per head (kv_dim for MLA).
        dtype: the KV dtype (e.g. ``torch.bfloat16``).
        num_pages: pages the pool holds (its capacity), >= 1.
        page_size: tokens per page, >= 1.
        pin: pin the memory (page-locked, for async D2H). None: pin when CUDA is available.
        chunk_pages: pages per chunk (the last chunk may be smaller). None: as many as fit in
            :data:`DEFAULT_CHUNK_BYTES` (at least 1, at most ``num_pages``).

    Raises:
        InvalidArgumentError: a size is not a positive int (bools are not sizes), kv_parts is
            not 1 or 2, or ``pin`` is true and the memory cannot be pinned (no accelerator).
        ArgumentTypeError: dtype is not a torch.dtype.

    Not thread-safe: one thread (the engine's scheduler) allocates and frees.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        kv_parts: int,
        head_num: int,
        head_dim: int,
        dtype: torch.dtype,
        num_pages: int,
        page_size: int,
        pin: bool | None = None,
        chunk_pages: int | None = None,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("head_num", head_num),
            ("head_dim", head_dim),
            ("num_pages", num_pages),
            ("page_size", page_size),
        ):
            require(is_int(value) and value >= 1, name, f"must be a positive int, got {value!r}")
        require(is_int(kv_parts) and kv_parts in (1, 2), "kv_parts", f"must be 1 (MLA) or 2 (MHA), got {kv_parts!r}")
        require(isinstance(dtype, torch.dtype), "dtype", f"must be a torch.dtype, got {dtype!r}", ArgumentTypeError)
        self.num_layers = num_layers
        self.kv_parts = kv_parts
        self.head_num = head_num
        self.head_dim = head_dim
        self.dtype = dtype
        self.page_size = page_size
        self.page_shape = (num_layers, kv_parts, page_size, head_num, head_dim)
        self.page_bytes = num_layers * kv_parts * page_size * head_num * head_dim * dtype.itemsize
        if chunk_pages is None:
            chunk_pages = max(1, min(num_pages, DEFAULT_CHUNK_BYTES // self.page_bytes))
        require(
            is_int(chunk_pages) and chunk_pages >= 1, "chunk_pages", f"must be a positive int, got {chunk_pages!r}"
        )
        chunk_pages = min(chunk_pages, num_pages)
        self.pinned = torch.cuda.is_available() if pin is None else bool(pin)
        self.chunk_pages = chunk_pages
        self._page_range = torch.arange(chunk_pages, dtype=torch.int64)  # runs of host page ids are views of it
        self.chunks: list[torch.Tensor] = []
        for start in range(0, num_pages, chunk_pages):
            pages = min(chunk_pages, num_pages - start)
            try:
                self.chunks.append(torch.empty((pages, *self.page_shape), dtype=dtype, pin_memory=self.pinned))
            except RuntimeError as error:
                if not self.pinned:
                    raise
                raise InvalidArgumentError(
                    f"pin: could not pin {pages * self.page_bytes} bytes of host memory ({error}); "
                    "pass pin=False where there is no accelerator, or a smaller chunk_pages"
                ) from error
        self._capacity = num_pages
        # Free ids as a stack whose top is the lowest id, so fresh allocations are ascending and
        # usually fall in one chunk (one gather launch per segment).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._in_use = bytearray(num_pages)  # 1 where allocated: catches double and foreign frees
        self._high_water = 0

    @classmethod
    def like(cls, kv_pool, *, num_pages: int, page_size: int, pin: bool | None = None, chunk_pages: int | None = None) -> "HostPool":
        """A host pool whose pages match a :class:`kvstage.kernels.KVPool`'s layout and dtype.

        Args:
            kv_pool: anything with ``num_layers``, ``kv_parts``, ``head_num``, ``head_dim``, ``dtype``.
            num_pages, page_size, pin, chunk_pages: as for :class:`HostPool`.
        """
        return cls(
            num_layers=kv_pool.num_layers,
            kv_parts=kv_pool.kv_parts,
            head_num=kv_pool.head_num,
            head_dim=kv_pool.head_dim,
            dtype=kv_pool.dtype,
            num_pages=num_pages,
            page_size=page_size,
            pin=pin,
            chunk_pages=chunk_pages,
        )

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

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The chunk tensors, for :meth:`StorageBackend.register_host_buffers`."""
        return list(self.chunks)

    # -- alloc / free ---------------------------------------------------------------------

    def alloc(self, n: int) -> list[int] | None:
        """Allocate ``n`` pages.

        Returns:
            A new list of ``n`` distinct page ids (never a view of the free list), or None when
            fewer than ``n`` pages are free; then nothing changed.

        Raises:
            InvalidArgumentError: ``n`` is not a non-negative int.
        """
        if not is_int(n) or n < 0:  # not require(): its message would be built every call
            raise InvalidArgumentError(f"n: must be a non-negative int, got {n!r}")
        free = self._free
        if n > len(free):
            return None
        if n == 0:
            return []
        ids = free[-n:]
        del free[-n:]
        ids.reverse()  # ascending: the top of the stack is the lowest id
        in_use = self._in_use
        for page in ids:
            in_use[page] = 1
        used = self._capacity - len(free)
        if used > self._high_water:
            self._high_water = used
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return pages to the pool; all or nothing.

        Raises:
            InvalidArgumentError: an id is not an int in ``[0, capacity)``, is not allocated
                (a double free or an id this pool never handed out), or repeats in ``ids``.
                Nothing is freed then.
        """
        ids = list(ids)
        in_use = self._in_use
        capacity = self._capacity
        for index, page in enumerate(ids):
            if not is_int(page) or not 0 <= page < capacity:
                raise InvalidArgumentError(f"ids[{index}]: must be a page id in [0, {capacity}), got {page!r}")
            if not in_use[page]:
                raise InvalidArgumentError(f"ids[{index}]: page {page} is not allocated (double free or foreign id)")
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError("ids: a page id repeats")
        for page in ids:
            in_use[page] = 0
        # Pushed so that the lowest ids come out first again.
        self._free.extend(sorted(ids, reverse=True))

    def is_allocated(self, page: int) -> bool:
        """Whether ``page`` is allocated now."""
        return 0 <= page < self._capacity and bool(self._in_use[page])

    # -- addressing -----------------------------------------------------------------------

    def page(self, page: int) -> torch.Tensor:
        """A contiguous view of one page: ``[num_layers, kv_parts, page_size, head_num, head_dim]``.

        Raises:
            InvalidArgumentError: ``page`` is not an id in ``[0, capacity)``.
        """
        if not is_int(page) or not 0 <= page < self._capacity:
            raise InvalidArgumentError(f"page: must be in [0, {self._capacity}), got {page!r}")
        return self.chunks[page // self.chunk_pages][page % self.chunk_pages]

    def locate(self, ids: Sequence[int]) -> list[tuple[int, list[int], list[int]]]:
        """Group page ids by chunk.

        Returns:
            ``(chunk_index, positions, local_ids)`` per chunk touched, in order of first
            appearance: ``positions`` are indices into ``ids``, ``local_ids`` the ids within
            the chunk's staging tensor.
        """
        if not ids:
            return []
        chunk_pages = self.chunk_pages
        first = ids[0] // chunk_pages
        if len(self.chunks) == 1 or all(page // chunk_pages == first for page in ids):
            base = first * chunk_pages
            return [(first, list(range(len(ids))), [page - base for page in ids])]
        groups: dict[int, tuple[int, list[int], list[int]]] = {}
        for position, page in enumerate(ids):
            chunk = page // chunk_pages
            group = groups.get(chunk)
            if group is None:
                group = groups[chunk] = (chunk, [], [])
            group[1].append(position)
            group[2].append(page - chunk * chunk_pages)
        return list(groups.values())

    def gather_copy(
        self, kv_pool: Any, slots: torch.Tensor, host_ids: Sequence[int], *, backend: str = "auto"
    ) -> tuple[Callable[[], None], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        """The D2H copy of pages from a device KV pool into host pages of this pool, to run later.

        Args:
            kv_pool: the :class:`kvstage.kernels.KVPool` the pages come from (same layout).
            slots: int32/int64 ``[len(host_ids) * page_size]`` device slots, page by page.
            host_ids: the host page (allocated from this pool) each page goes to, in order.
            backend: the gather's backend (``"auto"``, ``"triton"``, ``"torch"``).

        Returns:
            ``(copy, keep)``: ``copy()`` runs one :func:`kvstage.kernels.gather` per chunk
            touched (on the caller's stream or thread); ``keep`` holds the ``(staging, slots,
            host page ids)`` tensors it reads, to keep alive until it has run. Host page ids
            stay on CPU (the kernels read them there without a device sync); a run of
            consecutive ids, the usual case, is a view of one ``arange``.

        Raises:
            InvalidArgumentError: a host id that is not an allocated page of this pool, or
                ``slots`` not a 1-D tensor of ``len(host_ids) * page_size`` slots. ``copy()``
                raises what the gather raises (its validation runs before anything is written).
        """
        from kvstage.kernels import gather

        host_ids = list(host_ids)
        for index, page in enumerate(host_ids):
            if not is_int(page) or not 0 <= page < self._capacity or not self._in_use[page]:
                raise InvalidArgumentError(f"host_ids[{index}]: must be an allocated page of this pool, got {page!r}")
        require(
            isinstance(slots, torch.Tensor) and slots.dim() == 1 and slots.numel() == len(host_ids) * self.page_size,
            "slots",
            lambda: f"must be a 1-D tensor of len(host_ids) * page_size = {len(host_ids) * self.page_size} slots, got {slots!r:.80}",
        )
        groups = self.locate(host_ids)
        page_size = self.page_size
        keep = []
        for chunk, positions, local_ids in groups:
            if len(groups) == 1:
                chunk_slots = slots
            else:
                pages = torch.tensor(positions, dtype=torch.int64, device=slots.device)
                chunk_slots = slots.view(-1, page_size).index_select(0, pages).reshape(-1)
            first, n = local_ids[0], len(local_ids)
            if n == 1 or local_ids == list(range(first, first + n)):
                page_ids = self._page_range[first : first + n]
            else:
                page_ids = torch.tensor(local_ids, dtype=torch.int64)
            keep.append((self.chunks[chunk], chunk_slots, page_ids))

        def copy() -> None:
            for staging, chunk_slots, page_ids in keep:
                gather(kv_pool, staging, chunk_slots, page_ids, page_size=page_size, layout="page_first", backend=backend)

        return copy, keep

    def __repr__(self) -> str:
        return (
            f"HostPool(pages={self._capacity}, used={self.used}, page_shape={self.page_shape}, dtype={self.dtype}, "
            f"chunks={len(self.chunks)}x{self.chunk_pages}, pinned={self.pinned})"
        )
