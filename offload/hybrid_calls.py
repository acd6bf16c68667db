"""The calls a hybrid model adds to :class:`~kvstage.offload.OffloadManager` (its state
snapshots), kept apart so the manager's module stays the plain model's lifecycle; the work is
:class:`~kvstage.offload.hybrid.Hybrid`'s."""

from __future__ import annotations

from typing import Any

from kvstage.kernels.streams import CopyHandle
from kvstage.offload.manager_arguments import check_after, checked_kv_length
from kvstage.offload.one_thread import owner_thread_only
from kvstage.offload.request import as_int

__all__ = ["HybridCalls"]


class HybridCalls:
    """A mixin of :class:`~kvstage.offload.OffloadManager`: :meth:`snapshot`."""

    _hybrid: Any
    _states: dict
    _lifecycles: Any

    @owner_thread_only
    def snapshot(
        self, req: Any, length: int, state_slot: int, *, kv_length: int | None = None, after: Any = None
    ) -> CopyHandle:
        """A hybrid model's state snapshot: ``state_slot`` holds ``req``'s state after exactly
        ``length`` tokens (page-aligned). Its every state layer is gathered in one launch on the
        copy stream after ``after`` (default ``producer``) into host memory, and stored under
        ``h_{length/page_size - 1}`` once the pages before it are (:mod:`~kvstage.offload.hybrid`).
        A request not tracked yet (no :meth:`offload` so far) is tracked from this call, as
        :meth:`offload` would: end it with :meth:`finish` or :meth:`abort`.

        Args:
            length, state_slot: integer scalars (an int, a numpy integer, a 0-d integer tensor).
            kv_length: the request's tokens with KV (as :meth:`offload`; default: all but the last).

        Returns:
            The copy's handle: keep the slot's state unchanged until it completes.

        Raises:
            InvalidArgumentError: no state component; ``length`` not a positive multiple of the
                page size or past ``kv_length``; ``state_slot`` outside the state pool; ``req``
                was released already; the manager is closed. Nothing is copied then.
            ThreadingError: called from another thread than the manager's.
        """
        self._require_open("snapshot")
        check_after(after, "after")
        tokens = checked_kv_length(req, kv_length, 0)
        length, state_slot = as_int(length), as_int(state_slot)
        state, new = self._states.get(id(req)), False
        if state is None:  # tracked from here: the put waits for the pages before ``length``
            state, new = self._lifecycles.state_of(req, released_raises=True)
        handle = self._hybrid.snapshot(req, state, length, state_slot, tokens, self._after(after))
        if new:
            self._lifecycles.commit(state)
        return handle
