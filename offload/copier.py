"""The copier: moves KV pages between the device KV pool and host pages, and reports results.

The manager decides what moves; the copier moves it. It is the one place that allocates host
pages for a copy, checks the engine's slot indices, groups host pages by host buffer, submits
the gathers (D2H) and scatters (H2D) to the copy stream and hands back plain
:class:`CopyResult` records that the manager polls. It never looks at requests, keys or stores.

Host pages of one copy are allocated in ascending order, so the pages that fall in one host
buffer are one run of positions: each buffer's slot indices are a slice of the caller's
tensor (no index tensor is built on the device, so nothing syncs with it).

A KV pool in host memory with a host pool of one page a buffer (:attr:`HostPool.own_pages`,
the pages a memory store adopts and lends) moves by rows instead of the kernels: each page's
rows of each layer straight into or out of its page (:mod:`~kvstage.offload.host_rows`), copied
by :class:`~kvstage.offload.row_copies.RowCopies` (:attr:`Copier.row_copies`, which the hybrid
model's component copies share; one copy at a time on the copy stream's thread).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from kvstage.errors import InvalidArgumentError, require
from kvstage.kernels import gather, resolve_backend, scatter
from kvstage.kernels.streams import CopyHandle
from kvstage.offload.collaborators import CopyStreamLike, KVPoolLike
from kvstage.offload.copy_stream import CopyStream
from kvstage.offload.host_pool import HostPool
from kvstage.offload.host_rows import kv_rows
from kvstage.offload.row_copies import RowCopies
from kvstage.offload.slot_indices import check_slots

__all__ = ["CopyResult", "Copier", "GATHER", "SCATTER"]

GATHER, SCATTER = "gather", "scatter"


@dataclass(frozen=True)
class CopyResult:
    """The outcome of one finished copy.

    Attributes:
        job: the caller's token for the copy (what it passed to :meth:`Copier.gather` or
            :meth:`Copier.scatter`).
        direction: :data:`GATHER` (device to host) or :data:`SCATTER` (host to device).
        host_page_ids: the host pages the copy wrote (gather) or read (scatter), in page order;
            still allocated: the caller frees them (:meth:`Copier.free`) when done with them.
        ok: the copy completed without error.
        error: what the copy raised, or None.
        bytes: bytes moved (pages x page bytes; 0 when it failed).
        seconds: the copy's duration (GPU time on CUDA; wall time of the worker on CPU).
    """

    job: Any
    direction: str
    host_page_ids: list[int]
    ok: bool
    error: BaseException | None
    bytes: int
    seconds: float


class _Copy:
    __slots__ = ("job", "direction", "host_page_ids", "handles")

    def __init__(self, job: Any, direction: str, host_page_ids: list[int], handles: list[CopyHandle]) -> None:
        self.job = job
        self.direction = direction
        self.host_page_ids = host_page_ids
        self.handles = handles

    def done(self) -> bool:
        return all(handle.query() for handle in self.handles)


class Copier:
    """Gathers and scatters of whole pages between a KV pool and a host pool, on a copy stream.

    Args:
        kv_pool: the device KV pool (:class:`kvstage.kernels.KVPool`).
        host_pool: host pages of the same layout.
        copy_stream: where copies run: anything with ``submit(copy, keep=..., after=...) ->
            CopyHandle`` and ``in_order`` (default: a :class:`CopyStream` on the pool's device).
        backend: the kernels' backend (``"auto"``, ``"triton"``, ``"torch"``).

    Raises:
        InvalidArgumentError: the host pool's layout differs from the KV pool's, or ``backend``
            is unknown.
        BackendUnavailableError: ``backend="triton"`` where Triton cannot run.

    Not thread-safe: one thread (the engine's scheduler) calls it.
    """

    # Called with each CopyResult as poll() returns it (see add_result_listener); a tuple,
    # replaced whole, so the common case (none) costs one truth test a poll.
    _result_listeners: tuple = ()

    def __init__(
        self,
        kv_pool: KVPoolLike,
        host_pool: HostPool,
        *,
        copy_stream: CopyStreamLike | None = None,
        backend: str = "auto",
    ) -> None:
        for name in ("num_layers", "kv_parts", "num_heads", "head_dim", "dtype"):
            mine, theirs = getattr(host_pool.layout, name), getattr(kv_pool.layout, name)
            require(mine == theirs, "host_pool", lambda: f"layout's {name} {mine} must equal the KV pool's {theirs}")
        self.device = torch.device(kv_pool.device)
        resolve_backend(backend, self.device.type == "cuda")  # validates now, not mid-step
        self.kv_pool = kv_pool
        self.host_pool = host_pool
        self.page_size = host_pool.page_size
        self.backend = backend
        self.owns_copy_stream = copy_stream is None
        self.copy_stream = copy_stream if copy_stream is not None else CopyStream(self.device)
        self._in_order = bool(getattr(self.copy_stream, "in_order", False))
        self._copies: deque[_Copy] = deque()
        self._page_runs = torch.arange(host_pool.buffer_pages, dtype=torch.int64)  # runs of local ids are views
        # Host memory: row copies (for the host pool's own pages, and the hybrid model's components).
        self.row_copies = RowCopies() if self.device.type == "cpu" else None
        self._rows = kv_rows(kv_pool, self.page_size) if self.row_copies is not None and host_pool.own_pages else None

    # -- host pages -----------------------------------------------------------------------

    def alloc(self, num_pages: int) -> list[int] | None:
        """``num_pages`` host pages in ascending order (pages of one host buffer adjacent), or
        None when fewer are free (nothing changed)."""
        host_page_ids = self.host_pool.alloc(num_pages)
        if host_page_ids is not None:
            host_page_ids.sort()
        return host_page_ids

    def free(self, host_page_ids: Sequence[int]) -> None:
        """Return host pages to the pool (see :meth:`HostPool.free`)."""
        self.host_pool.free(host_page_ids)

    @property
    def free_pages(self) -> int:
        """Host pages free now."""
        return self.host_pool.free_pages

    # -- copies ---------------------------------------------------------------------------

    def gather(
        self,
        job: Any,
        slot_indices: torch.Tensor,
        *,
        after: Any = None,
        argument: str = "slot_indices",
        checked: bool = False,
    ) -> list[int] | None:
        """Allocate host pages and launch the D2H copy of ``slot_indices``' pages into them.

        Args:
            job: the caller's token, handed back in the :class:`CopyResult`.
            slot_indices: int32/int64 ``[num_pages * page_size]`` device slots, page by page.
            after: the producer event or stream the copy waits for (see :meth:`CopyStream.submit`).
            argument: how error messages name ``slot_indices``.
            checked: the caller ran :meth:`check_slot_indices` on ``slot_indices`` (or on a
                tensor they are a whole-page slice of) already; not checked again.

        Returns:
            The host page ids (page ``i`` goes to ``host_page_ids[i]``), or None when the host
            pool has fewer free pages (nothing changed).

        Raises:
            ArgumentTypeError, DeviceMismatchError, InvalidArgumentError: ``slot_indices`` is not
                a 1-D int32/int64 tensor of whole pages on the KV pool's device; nothing changed.
            Whatever the launch raises on CUDA; the host pages are freed then.
        """
        num_pages = (
            slot_indices.shape[0] // self.page_size if checked else self.check_slot_indices(slot_indices, argument)
        )
        host_page_ids = self.alloc(num_pages)
        if host_page_ids is None:
            return None
        try:
            self._submit(job, GATHER, slot_indices, host_page_ids, layers=[None], after=after)
        except BaseException:
            self.host_pool.free(host_page_ids)
            raise
        return host_page_ids

    def scatter(
        self,
        job: Any,
        host_page_ids: Sequence[int],
        slot_indices: torch.Tensor,
        *,
        layer_by_layer: bool = False,
        after: Any = None,
    ) -> list[CopyHandle]:
        """Launch the H2D copy of host pages into device slots.

        Args:
            job: the caller's token, handed back in the :class:`CopyResult`.
            host_page_ids: allocated host pages (from :meth:`alloc`), page ``i`` going to
                ``slot_indices[i * page_size : (i + 1) * page_size]``.
            slot_indices: int32/int64 ``[len(host_page_ids) * page_size]`` device slots.
            layer_by_layer: one copy per layer (in layer order), so the forward pass can wait
                for each layer alone; else one copy of every layer.
            after: the producer event or stream the copy waits for.

        Returns:
            One :class:`CopyHandle` per layer (``layer_by_layer``) or one for every layer.
            The host pages stay allocated until the caller frees them after the result.

        Raises:
            ArgumentTypeError, DeviceMismatchError, InvalidArgumentError: bad ``slot_indices``,
                or its length is not ``len(host_page_ids) * page_size``, or a host page is not
                allocated; nothing was launched.
        """
        num_pages = self.check_slot_indices(slot_indices, "slot_indices", distinct=True)
        host_page_ids = list(host_page_ids)
        require(
            num_pages == len(host_page_ids),
            "slot_indices",
            lambda: (
                f"must hold {len(host_page_ids)} pages of {self.page_size} slots for the host pages, got {num_pages} pages"
            ),
        )
        for index, host_page_id in enumerate(host_page_ids):
            if not self.host_pool.is_allocated(host_page_id):
                raise InvalidArgumentError(f"host_page_ids[{index}]: {host_page_id!r} is not an allocated host page")
        layers = list(range(self.kv_pool.num_layers)) if layer_by_layer else [None]
        return self._submit(job, SCATTER, slot_indices, host_page_ids, layers=layers, after=after)

    def poll(self) -> list[CopyResult]:
        """The copies finished since the last poll (never blocks); their host pages are still
        allocated."""
        if not self._copies:
            return []
        finished: list[_Copy] = []
        copies = self._copies
        if self._in_order:
            while copies and copies[0].handles[-1].query():
                finished.append(copies.popleft())
        else:
            waiting: deque[_Copy] = deque()
            for copy in copies:
                (finished if copy.done() else waiting).append(copy)
            self._copies = waiting
        results = [self._result(copy) for copy in finished]
        for listener in self._result_listeners:
            for result in results:
                listener(result)
        return results

    def add_result_listener(self, listener: Callable[[CopyResult], None]) -> None:
        """Call ``listener(result)`` with each :class:`CopyResult` that :meth:`poll` returns,
        on the polling thread, before the caller handles it (e.g. a latency histogram). It must
        not raise: an exception propagates out of :meth:`poll`.

        Raises:
            InvalidArgumentError: ``listener`` is not callable.
        """
        require(callable(listener), "listener", "must be callable")
        self._result_listeners = (*self._result_listeners, listener)

    def remove_result_listener(self, listener: Callable[[CopyResult], None]) -> None:
        """Stop calling ``listener`` (added by :meth:`add_result_listener`); absent: nothing (a bound method matches an equal one)."""
        self._result_listeners = tuple(added for added in self._result_listeners if added != listener)

    def synchronize(self, job: Any | None = None) -> None:
        """Block until every copy (or every copy of ``job``) in flight has completed."""
        for copy in list(self._copies):
            if job is None or copy.job is job:
                for handle in copy.handles:
                    handle.synchronize()

    @property
    def copies_in_flight(self) -> int:
        """Copies launched and not yet returned by :meth:`poll`."""
        return len(self._copies)

    def close(self) -> None:
        """Wait for every copy, then stop the copy stream if the copier made it."""
        self.synchronize()
        if self.owns_copy_stream:
            self.copy_stream.close()
        if self.row_copies is not None:
            self.row_copies.close()

    # -- internals ------------------------------------------------------------------------

    def check_slot_indices(self, slot_indices: Any, argument: str, *, distinct: bool = False) -> int:
        """Check slot indices for a copy of the KV pool's pages; returns their number of pages
        (the rule: :func:`kvstage.offload.slot_indices.check_slots`).

        Raises:
            ArgumentTypeError, DeviceMismatchError, InvalidArgumentError: naming ``argument``.
        """
        return check_slots(
            slot_indices,
            argument,
            device=self.device,
            num_slots=self.kv_pool.num_slots,
            page_size=self.page_size,
            distinct=distinct,
        )

    def _groups(
        self, slot_indices: torch.Tensor, host_page_ids: list[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(host buffer, its slot indices, its local host page ids) per host buffer touched."""
        page_size = self.page_size
        groups = []
        for buffer_index, positions, local_ids in self.host_pool.locate(host_page_ids):
            first, last = positions[0], positions[-1]
            if last - first + 1 != len(positions):  # not one run: host pages not in ascending order
                raise InvalidArgumentError(
                    "host_page_ids: pages of one host buffer must be adjacent (allocate with Copier.alloc)"
                )
            slots = slot_indices[first * page_size : (last + 1) * page_size]
            start, count = local_ids[0], len(local_ids)
            if local_ids == list(range(start, start + count)):
                local = self._page_runs[start : start + count]
            else:
                local = torch.tensor(local_ids, dtype=torch.int64)
            groups.append((self.host_pool.buffers[buffer_index], slots, local))
        return groups

    def _submit(
        self,
        job: Any,
        direction: str,
        slot_indices: torch.Tensor,
        host_page_ids: list[int],
        *,
        layers: list,
        after: Any,
    ) -> list[CopyHandle]:
        if self._rows is not None:
            return self._submit_rows(job, direction, slot_indices, host_page_ids, layers, after)
        groups = self._groups(slot_indices, host_page_ids)
        kv_pool, page_size, backend = self.kv_pool, self.page_size, self.backend
        keep = [tensor for group in groups for tensor in group]
        handles: list[CopyHandle] = []
        for layer in layers:
            if direction == GATHER:

                def copy(groups=groups) -> None:  # slots checked on the engine's thread (check_slot_indices)
                    for staging, slots, local in groups:
                        gather(
                            kv_pool,
                            staging,
                            slots,
                            local,
                            page_size=page_size,
                            layout="page_first",
                            backend=backend,
                            check_bounds=False,
                        )
            else:

                def copy(groups=groups, layer=layer) -> None:
                    for staging, slots, local in groups:
                        scatter(
                            staging,
                            kv_pool,
                            slots,
                            local,
                            page_size=page_size,
                            layout="page_first",
                            layer=layer,
                            backend=backend,
                            check_bounds=False,
                        )

            handles.append(self.copy_stream.submit(copy, keep=keep, after=after))
        self._copies.append(_Copy(job, direction, host_page_ids, handles))
        return handles

    def _submit_rows(
        self, job: Any, direction: str, slot_indices: torch.Tensor, host_page_ids: list[int], layers: list, after: Any
    ) -> list[CopyHandle]:
        """:meth:`_submit` by rows (module doc): the plan is built on the copy stream's thread,
        from the pages the host pool holds then (a page lent in by a prefetch, for a scatter)."""
        rows, row_copies, host_pool, to_host = self._rows, self.row_copies, self.host_pool, direction == GATHER
        handles = []
        for layer in layers:

            def copy(layer=layer) -> None:
                pages = [host_pool.page(host_page_id) for host_page_id in host_page_ids]
                row_copies.copy_plan(rows.plan(pages, slot_indices, to_host=to_host, layer=layer))

            handles.append(self.copy_stream.submit(copy, keep=[slot_indices], after=after))
        self._copies.append(_Copy(job, direction, host_page_ids, handles))
        return handles

    def _result(self, copy: _Copy) -> CopyResult:
        error = next((handle.error for handle in copy.handles if handle.error is not None), None)
        seconds = sum(handle.seconds or 0.0 for handle in copy.handles)
        nbytes = 0 if error is not None else len(copy.host_page_ids) * self.host_pool.page_bytes
        return CopyResult(copy.job, copy.direction, copy.host_page_ids, error is None, error, nbytes, seconds)
