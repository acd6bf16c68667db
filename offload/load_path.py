"""What the load path hands the engine: a prefix match, a prefetch handle, a load handle.

- :class:`PrefixMatch`: how many leading pages of a token sequence a store holds (lookup).
- :class:`PrefetchHandle`: a read of those pages from the store into host pages, running on a
  worker thread; it says how many leading pages are ready, and its policy says when the
  engine may load them (sglang's prefetch policies: ``best_effort``, ``wait_complete``,
  ``timeout``).
- :class:`LoadHandle`: the scatter of prefetched pages into a request's device slots, with one
  completion per layer that the forward pass waits on before it reads that layer.
"""

from __future__ import annotations

import time
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Any

import torch

from kvstage.errors import InvalidArgumentError
from kvstage.kernels.streams import CopyHandle

__all__ = ["PREFETCH_POLICIES", "LoadHandle", "PrefetchHandle", "PrefixMatch"]

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")

_NOTHING_TO_WAIT_FOR = CopyHandle()
_NOTHING_TO_WAIT_FOR.complete(seconds=0.0)


@dataclass(frozen=True)
class PrefixMatch:
    """The leading pages of a token sequence that a store holds.

    Attributes:
        num_pages: leading pages held (the lookup stopped at the first miss).
        page_keys: the keys of those pages, in order.
        num_tokens: ``num_pages * page_size``.
        pages_asked: whole pages looked up.
        lengths: a hybrid model's restorable lengths in tokens, ascending (``num_tokens`` the
            largest; :func:`~kvstage.offload.restorable.restorable_lengths`); ``()`` for a plain
            model, where every page boundary up to ``num_tokens`` is one.
    """

    num_pages: int
    page_keys: list[str]
    num_tokens: int
    pages_asked: int
    lengths: tuple[int, ...] = ()


class PrefetchHandle:
    """A prefetch of a request's stored prefix into host pages (see
    :meth:`kvstage.offload.OffloadManager.prefetch`).

    The read runs on a worker thread: first a lookup (``exists``) of every wanted page, then
    ``get`` of the leading hits that have host pages, in batches; :attr:`pages_ready` grows
    after each batch. A page that exists but fails to read ends the hit at the page before it.
    Once the read has ended, the next ``poll`` frees the host pages past the ready ones.

    Attributes:
        req: the request object.
        policy: ``"best_effort"`` (load whatever is ready when the engine schedules the
            request), ``"wait_complete"`` (only once the read has finished), or ``"timeout"``
            (once finished or ``timeout_s`` after the prefetch started).
        timeout_s: for ``"timeout"``, seconds.
        page_keys: the keys looked up, in chain order.
        pages_wanted: whole pages looked up (``len(page_keys)``).
        num_host_pages: host pages the read got (0 while it waits for them, see ``min_pages``);
            pages past it are not read even when the store holds them (counted in
            ``OffloadMetrics.pages_truncated``).
        min_pages: host pages the prefetch waits for before it starts (0: it does not wait).
        pages_hit: leading pages of ``page_keys`` the store holds, once the lookup ran (None before).
        pages_ready: leading pages read into host pages so far.
        host_page_ids: the host pages it holds now.
    """

    def __init__(self, req: Any, policy: str, timeout_s: float | None, page_keys: list[str], page_size: int) -> None:
        self.req = req
        self.policy = policy
        self.timeout_s = timeout_s
        self.page_keys = page_keys
        self.page_size = page_size
        self.pages_wanted = len(page_keys)
        self.host_page_ids: list[int] = []
        self.num_host_pages = 0
        self.min_pages = 0
        self.started = time.monotonic()
        # Written by the worker thread (single int stores), read by the engine's.
        self.pages_hit: int | None = None  # the lookup's leading hits, once known
        self.pages_ready = 0
        self.finished = False  # the worker is done with the host pages (or it never started)
        self.error: BaseException | None = None
        self.hole = False  # the read stopped at a page the lookup found but the store could not read
        self.cancelled = False
        self.loaded = False  # load() took it
        self.future: Any = None  # the read, once started
        self.accounted = False  # the manager counted its finished read
        self.lengths: tuple[int, ...] = ()  # a hybrid model's restorable lengths, once looked up
        self.entries: Any = None  # a hybrid model's component entries read, by component name

    @property
    def tokens_ready(self) -> int:
        """Tokens of the ready pages (``pages_ready * page_size``)."""
        return self.pages_ready * self.page_size

    def ready_to_load(self) -> bool:
        """Whether the policy lets the engine load now (a cancelled or used handle: False)."""
        if self.cancelled or self.loaded:
            return False
        if self.finished or self.policy == "best_effort":
            return True
        if self.policy == "timeout":
            return time.monotonic() - self.started >= self.timeout_s
        return False

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the read has finished (for tests and tools, never the engine's step);
        True when it has. A prefetch still waiting for host pages returns False at once (the
        manager's ``poll`` starts it)."""
        if self.future is None:
            return self.finished
        try:
            self.future.result(timeout=timeout_s)
        except FutureTimeoutError:
            return False
        return True

    def __repr__(self) -> str:
        return (
            f"PrefetchHandle(rid={getattr(self.req, 'rid', None)!r}, policy={self.policy}, wanted={self.pages_wanted}, "
            f"num_host_pages={self.num_host_pages}, hit={self.pages_hit}, ready={self.pages_ready}, finished={self.finished}, cancelled={self.cancelled})"
        )


class LoadHandle:
    """The scatter of prefetched pages into a request's device slots.

    Attributes:
        req: the request object.
        num_pages: pages loaded; num_tokens: ``num_pages * page_size`` (the prefix positions
            whose KV this load writes).
        layer_by_layer: one copy per layer (else one for every layer).
    """

    def __init__(
        self, req: Any, num_pages: int, page_size: int, handles: list[CopyHandle], num_layers: int, layer_by_layer: bool
    ) -> None:
        self.req = req
        self.num_pages = num_pages
        self.num_tokens = num_pages * page_size
        self.layer_by_layer = layer_by_layer
        self._handles = handles
        self._num_layers = num_layers

    def layer_handle(self, layer: int) -> CopyHandle:
        """The completion of ``layer``'s copy (the one copy of every layer unless layer by layer).

        Raises:
            InvalidArgumentError: ``layer`` is not in ``[0, num_layers)``.
        """
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self._num_layers:
            raise InvalidArgumentError(f"layer: must be an int in [0, {self._num_layers}), got {layer!r}")
        if not self._handles:  # a load of no pages (a lookup miss): nothing to wait for
            return _NOTHING_TO_WAIT_FOR
        return self._handles[layer] if self.layer_by_layer else self._handles[0]

    def wait_layer(self, layer: int, stream: "torch.cuda.Stream | None" = None) -> None:
        """Make the forward pass wait for ``layer``'s KV: on CUDA ``stream`` (default: current)
        waits on the layer's event without blocking the host; on CPU the caller blocks until
        the worker has copied the layer."""
        self.layer_handle(layer).wait(stream)

    def wait(self, stream: "torch.cuda.Stream | None" = None) -> None:
        """:meth:`wait_layer` for every layer."""
        for handle in self._handles:
            handle.wait(stream)

    def done(self) -> bool:
        """Whether every layer's copy has finished (never blocks); see :attr:`error`."""
        return all(handle.query() for handle in self._handles)

    @property
    def error(self) -> BaseException | None:
        """What a finished layer copy raised, or None. A failed load leaves its slots unwritten:
        the engine computes those tokens' KV itself (the pages stay in the store)."""
        return next((handle.error for handle in self._handles if handle.query() and handle.error is not None), None)

    def __repr__(self) -> str:
        return f"LoadHandle(rid={getattr(self.req, 'rid', None)!r}, pages={self.num_pages}, layer_by_layer={self.layer_by_layer}, done={self.done()})"
