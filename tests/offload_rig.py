"""The test suite's rig: a tiny engine around an :class:`OffloadManager` whose KV rows say
which token they hold, a store whose writes fail on demand, and inline store workers."""

from __future__ import annotations

import zlib
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import torch

from kvstage.errors import InvalidArgumentError, StorageError
from kvstage.kv_layout import KVLayout
from kvstage.offload.testing import SimpleRequest, SlotTable
from kvstage.storage import LayoutFingerprint, MemoryStore, PutStatus

from naive_keys import naive_prefill_keys

LAYOUT_FIELDS = ("num_layers", "kv_parts", "num_heads", "head_dim", "dtype")


def host_pool(**args: Any) -> Any:
    """A HostPool from flat arguments: the layout's fields and the pool's own."""
    from kvstage.offload import HostPool

    layout = KVLayout(*(args.pop(name) for name in LAYOUT_FIELDS))
    return HostPool(layout, **args)


class InlineStoreWorkers:
    """Store workers that run each call at once on the caller's thread and hand back a done
    future: deterministic store I/O for tests of the manager's accounting (the default
    workers run it on threads)."""

    def __init__(self) -> None:
        self.writes = 0
        self.reads = 0

    @staticmethod
    def _run(call: Callable[[], Any]) -> Future:
        future: Future = Future()
        try:
            future.set_result(call())
        except BaseException as error:
            future.set_exception(error)
        return future

    def write(self, call: Callable[[], Any]) -> Future:
        """Run a write now."""
        self.writes += 1
        return self._run(call)

    def read(self, call: Callable[[], Any]) -> Future:
        """Run a read now."""
        self.reads += 1
        return self._run(call)

    def close(self) -> None:
        """Nothing to stop."""


class FlakyStore(MemoryStore):
    """A :class:`MemoryStore` whose writes fail when ``fail(key)`` says so.

    Args:
        fingerprint: the KV layout.
        fail: ``fail(key) -> bool`` per page key (no prefix); True: that page's put is FAILED
            (and not visible). None: never.
        raise_on_put: ``raise_on_put() -> bool`` per put call; True: the call raises
            :class:`StorageError` and writes nothing (a backend that fails as a whole).
        fail_get: ``fail_get(key) -> bool`` per page key; True: ``get`` of it misses although
            ``exists`` finds it (a page that cannot be read).
        capacity_pages: as for :class:`MemoryStore` (default: unbounded for tests).
    """

    def __init__(
        self,
        fingerprint: LayoutFingerprint,
        *,
        fail: Callable[[str], bool] | None = None,
        raise_on_put: Callable[[], bool] | None = None,
        fail_get: Callable[[str], bool] | None = None,
        capacity_pages: int = 1 << 40,
    ) -> None:
        super().__init__(fingerprint, capacity_pages=capacity_pages)
        self.fail = fail
        self.raise_on_put = raise_on_put
        self.fail_get = fail_get

    # A memory store's hooks take page keys (no prefix: MemoryStore.prefixed_hook_keys).
    def _get(self, keys: list[str], into: list[torch.Tensor]) -> list[bool]:
        hits = super()._get(keys, into)
        if self.fail_get is None:
            return hits
        return [hit and not self.fail_get(key) for key, hit in zip(keys, hits)]

    def _put(self, keys: list[str], pages: list[torch.Tensor], prior_key: str | None = None) -> list[PutStatus]:
        if self.raise_on_put is not None and self.raise_on_put():
            raise StorageError("storage: injected failure of a whole put")
        statuses: list[PutStatus | None] = [None] * len(keys)
        keep_keys, keep_pages, keep_at = [], [], []
        for index, (key, page) in enumerate(zip(keys, pages)):
            if self.fail is not None and key not in self._pages and self.fail(key):
                statuses[index] = PutStatus.FAILED
            else:
                keep_keys.append(key)
                keep_pages.append(page)
                keep_at.append(index)
        # A failed page breaks the run: the pages after it are one chain that no lookup reaches.
        if len(keep_at) < len(keys):
            first_failed = next(i for i, status in enumerate(statuses) if status is PutStatus.FAILED)
            cut = sum(1 for index in keep_at if index < first_failed)
            for index in keep_at[cut:]:
                statuses[index] = PutStatus.FAILED
            keep_keys, keep_pages, keep_at = keep_keys[:cut], keep_pages[:cut], keep_at[:cut]
        for index, status in zip(keep_at, super()._put(keep_keys, keep_pages, prior_key)):
            statuses[index] = status
        return statuses  # type: ignore[return-value]


def namespace_code(extra_key: str | None, cache_salt: str | None) -> int:
    """A small int that differs between the namespaces a test uses (written into fake KV)."""
    return zlib.crc32(repr((extra_key, cache_salt)).encode()) & 0x7FFFFFFF


class Rig:
    """A tiny engine around an :class:`OffloadManager`: an int32 KV pool whose every row says
    which token it holds, a slot table, a host pool, a store, and the released requests.

    The KV row of (part, layer) for the token ``t`` at position ``p`` of a request in namespace
    ``ns`` is ``[t, p, namespace_code(ns), part * 16 + layer]`` repeated over heads, so a
    stored page can be checked against the tokens its key was computed from. Rows are
    written when their KV "exists": the prompt at :meth:`new_request` (prefill), a token's row
    when the next token is sampled (:meth:`decode`).

    Build one with :func:`make_rig`.
    """

    def __init__(self, kv_pool, stacked, host_pool, storage, hasher, slots, copy_stream, manager_kwargs) -> None:
        from kvstage.offload.manager import OffloadManager

        self.kv_pool = kv_pool
        self.stacked = stacked
        self.host_pool = host_pool
        self.storage = storage
        self.hasher = hasher
        self.slots = slots
        self.copy_stream = copy_stream
        self.released: list[Any] = []
        self.on_release: Callable[[Any], None] | None = None  # extra check a test may add
        self.manager = OffloadManager(
            kv_pool, host_pool, storage, hasher, slots, release=self._release, copy_stream=copy_stream, **manager_kwargs
        )

    @property
    def page_size(self) -> int:
        """Tokens per page (the host pool's)."""
        return self.host_pool.page_size

    def _release(self, req: Any) -> None:
        if self.on_release is not None:
            self.on_release(req)
        self.released.append(req)
        self.slots.release(req)

    def new_request(
        self, rid: Any, prompt: Sequence[int], max_new_tokens: int, *, cls: type = SimpleRequest, **namespace: Any
    ) -> Any:
        """A request whose prompt's KV is written (prefill done), with slots for its tokens."""
        req = cls(rid, prompt, **namespace)
        self.slots.assign(req, len(req.origin_input_ids) + max_new_tokens)
        self.write_kv(req, 0, len(req.origin_input_ids))
        if not self.manager.store_prompt:
            self.store_prompt_as_prefill(req)
        return req

    def store_prompt_as_prefill(self, req: Any) -> None:
        """What a disaggregated prefill side does (``store_prompt=False``): put the prompt's
        whole pages under their prefill keys, so the decode side's chain continues from them."""
        whole = len(req.origin_input_ids) // self.page_size
        if whole:
            keys = naive_prefill_keys(
                req.origin_input_ids[: whole * self.page_size], self.page_size, req.extra_key, req.cache_salt
            )
            self.storage.put(keys, [self.expected_page(req, index) for index in range(whole)])

    def decode(self, req: Any, token: int) -> None:
        """Sample ``token``: the previous last token's KV now exists."""
        req.output_ids.append(token)
        if len(req.output_ids) >= 2:
            position = req.kv_length - 1
            self.write_kv(req, position, position + 1)

    def _tokens(self, req: Any) -> list[int]:
        return (req.origin_input_ids + req.output_ids)[: req.kv_length]

    def expected_rows(self, req: Any, start: int, end: int) -> torch.Tensor:
        """``[end - start, kv_parts, num_layers, 4]`` int32: the rows of positions [start, end)."""
        tokens = (req.origin_input_ids + req.output_ids)[start:end]
        n = end - start
        pool = self.kv_pool
        rows = torch.empty((n, pool.kv_parts, pool.num_layers, 4), dtype=torch.int32)
        rows[..., 0] = torch.tensor([t % 2**31 for t in tokens], dtype=torch.int32).view(
            n, 1, 1
        )  # ids past int32 wrap in the rig's rows
        rows[..., 1] = torch.arange(start, end, dtype=torch.int32).view(n, 1, 1)
        rows[..., 2] = namespace_code(req.extra_key, req.cache_salt)
        marks = torch.arange(pool.kv_parts).view(-1, 1) * 16 + torch.arange(pool.num_layers).view(1, -1)
        rows[..., 3] = marks.to(torch.int32)
        return rows

    def write_kv(self, req: Any, start: int, end: int) -> None:
        """Write the KV rows of positions ``[start, end)`` of ``req`` into its slots (what a forward pass does)."""
        if end <= start:
            return
        rows = self.expected_rows(req, start, end).to(self.stacked.device)  # [n, parts, layers, 4]
        slots = self.slots(req)[start:end]
        num_heads, head_dim = self.kv_pool.num_heads, self.kv_pool.head_dim
        values = rows.permute(1, 2, 0, 3).unsqueeze(3)  # [parts, layers, n, 1, 4]
        values = values.expand(-1, -1, -1, num_heads, -1).repeat(1, 1, 1, 1, head_dim // 4)
        self.stacked[:, :, slots] = values

    def expected_page(self, req: Any, page_index: int) -> torch.Tensor:
        """The host page ``[num_layers, kv_parts, page_size, num_heads, head_dim]`` of page ``page_index``."""
        ps = self.page_size
        rows = self.expected_rows(req, page_index * ps, (page_index + 1) * ps)  # [ps, parts, layers, 4]
        page = rows.permute(2, 1, 0, 3).unsqueeze(3)  # [layers, parts, ps, 1, 4]
        return page.expand(-1, -1, -1, self.kv_pool.num_heads, -1).repeat(1, 1, 1, 1, self.kv_pool.head_dim // 4)

    def chain(self, req: Any) -> list[str]:
        """The prefill keys of every full page of the tokens with KV (what decode must match), from
        the naive reference (``tests/naive_keys.py``), not the manager's hasher."""
        return naive_prefill_keys(self._tokens(req), self.page_size, req.extra_key, req.cache_salt)

    def check_stored_pages(self, req: Any) -> tuple[int, int]:
        """Compare every stored page of ``req`` beyond the prompt's aligned prefix with its
        expected bytes. Returns (pages found, pages checked); raises AssertionError on a mismatch."""
        first = len(req.origin_input_ids) // self.page_size
        missing = self.missing_pages(req)
        checked = len(self.chain(req)) - first
        return checked - sum(1 for index in missing if index >= first), checked

    def missing_pages(self, req: Any) -> list[int]:
        """Compare every stored page of ``req``'s chain (:meth:`chain`: every whole page of its
        tokens with KV, the prompt's too) with its expected bytes.

        Returns:
            The indices of the chain's pages the store does not hold (``[]``: every page is
            stored).

        Raises:
            AssertionError: a stored page's bytes differ from its KV.
        """
        keys = self.chain(req)
        missing = []
        into = torch.empty(self.host_pool.page_shape, dtype=self.kv_pool.dtype)
        for index, key in enumerate(keys):
            if self.storage.get([key], [into]) != [True]:
                missing.append(index)
            elif not torch.equal(into, self.expected_page(req, index)):
                raise AssertionError(f"{req!r}: stored page {index} differs from its KV")
        return missing


def settle(rig: Rig, *, rounds: int = 100) -> None:
    """Run every copy of the rig's manual copy stream and poll, until no copy is pending, no
    request is live and no store write is pending.

    Raises:
        AssertionError: still not settled after ``rounds`` rounds.
    """
    for _ in range(rounds):
        rig.copy_stream.complete_all()
        rig.manager.poll()
        if not (rig.copy_stream.pending or rig.manager.requests_live or rig.manager.metrics.writes_pending):
            return
    raise AssertionError("the manager did not settle")


def make_rig(
    *,
    page_size: int = 4,
    num_layers: int = 2,
    num_heads: int = 1,
    head_dim: int = 4,
    num_slots: int = 256,
    num_host_pages: int = 16,
    buffer_pages: int | None = None,
    device: torch.device | str = "cpu",
    storage: Any = None,
    copy_stream: Any = None,
    slot_generator: torch.Generator | None = None,
    **manager_kwargs: Any,
) -> Rig:
    """A :class:`Rig` with an MHA int32 KV pool ``[2, num_layers, num_slots, num_heads, head_dim]``.

    Args:
        storage: default: an unbounded :class:`FlakyStore` that never fails.
        copy_stream: default: a :class:`ManualCopyStream`.
        manager_kwargs: passed to :class:`OffloadManager` (offload_stride, backend,
            on_storage_failure, ...); defaults: ``backend="torch"``, ``store_prompt=False``
            (a decode side whose prefill stored the prompt), :class:`InlineStoreWorkers`.
    """
    from kvstage.hashing import PageHasher
    from kvstage.kernels import KVPool
    from kvstage.offload.copy_stream import ManualCopyStream
    from kvstage.offload.host_pool import HostPool

    if head_dim % 4:
        raise InvalidArgumentError(f"head_dim: must be a multiple of 4 for the rig's rows, got {head_dim}")
    device = torch.device(device)
    stacked = torch.zeros((2, num_layers, num_slots, num_heads, head_dim), dtype=torch.int32, device=device)
    kv_pool = KVPool.from_stacked(stacked)
    host_pool = HostPool.like(kv_pool, num_pages=num_host_pages, page_size=page_size, buffer_pages=buffer_pages)
    fingerprint = LayoutFingerprint("rig", KVLayout(num_layers, 2, num_heads, head_dim, "int32"), page_size)
    storage = FlakyStore(fingerprint) if storage is None else storage
    copy_stream = ManualCopyStream() if copy_stream is None else copy_stream
    manager_kwargs.setdefault("backend", "torch")
    manager_kwargs.setdefault("store_prompt", False)  # most tests model a decode side whose prefill stored the prompt
    manager_kwargs.setdefault("store_workers", InlineStoreWorkers())
    return Rig(
        kv_pool,
        stacked,
        host_pool,
        storage,
        PageHasher(page_size=page_size),
        SlotTable(num_slots, device, slot_generator),
        copy_stream,
        manager_kwargs,
    )


STORED_PROMPT = list(range(1, 10))  # 9 tokens: 4 whole pages of 2 (a lookup asks all but the last token)


def make_stored_rig(**kwargs: Any) -> Rig:
    """A rig (page 2, the manager stores prompts) whose store holds request 'a''s 4 prompt pages
    (:data:`STORED_PROMPT`); the ``stored_rig`` fixture of tests/offload/conftest.py is one."""
    rig = make_rig(page_size=2, store_prompt=True, **kwargs)
    a = rig.new_request("a", STORED_PROMPT, 4)
    rig.manager.offload(a)
    rig.copy_stream.complete_all()
    rig.manager.poll()
    a.done = True
    rig.manager.finish(a)
    rig.copy_stream.complete_all()
    rig.manager.drain()
    assert rig.manager.metrics.pages_stored == 4 and rig.host_pool.used == 0
    return rig


def prefetched(rig: Rig, rid: str = "b") -> tuple[SimpleRequest, Any]:
    """A request with :data:`STORED_PROMPT` whose prefetch of the 4 stored pages (of
    :func:`make_stored_rig`) has finished, and 12 slots."""
    req = SimpleRequest(rid, STORED_PROMPT)
    handle = rig.manager.prefetch(req, policy="wait_complete")
    handle.wait()
    rig.manager.poll()
    assert handle.pages_ready == 4
    rig.slots.assign(req, 12)
    return req, handle
