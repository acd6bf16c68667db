"""Which request objects the manager tracks, and what it remembers of released ones.

State is keyed by the request *object* (``id(req)``, the object held by its state so the id
cannot be reused while tracked), never by ``rid``. A released finished or aborted object is
remembered weakly (a late ``finish``/``abort`` of it is ignored, a late ``offload`` raises); an
object retracted with ``keep_offloaded`` keeps its offloaded length and chain until it runs
again, forgotten when the engine drops it.
"""

from __future__ import annotations

import weakref
from typing import Any

from kvstage.errors import InvalidArgumentError
from kvstage.offload.key_chain import RequestChain
from kvstage.offload.request_state import RequestState

__all__ = ["Lifecycles"]


class Lifecycles:
    """The tracked request states and the released request objects.

    Args:
        page_size: tokens per page.
        store_prompt: the manager's ``store_prompt``: False starts a new lifecycle after the
            prompt's whole pages (the prefill side stored them).

    Attributes:
        states: ``id(req)`` -> the tracked :class:`RequestState`.
        retracted: ``id(req)`` -> (the request held weakly, its offloaded length in tokens,
            its chain) for requests retracted with ``keep_offloaded=True``.
    """

    def __init__(self, page_size: int, store_prompt: bool) -> None:
        self.page_size = page_size
        self.store_prompt = store_prompt
        self.states: dict[int, RequestState] = {}
        self.retracted: dict[int, tuple[Any, int, RequestChain | None]] = {}
        self._ended: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()

    def state_of(self, req: Any, *, released_raises: bool) -> tuple[RequestState | None, bool]:
        """``req``'s state and whether it is new (built, not tracked yet: :meth:`commit`);
        None once it is ending, or released already (then ``released_raises`` raises).

        Raises:
            InvalidArgumentError: ``req`` was released already and ``released_raises``.
        """
        state = self.states.get(id(req))
        if state is not None:
            return (None if state.ending else state), False
        if self.has_ended(req):
            if released_raises:
                raise InvalidArgumentError(
                    f"req: rid={req.rid!r} was released already; a finished or aborted request object is not offloaded "
                    "again: give a new request a new object, and retract() a request that will run again"
                )
            return None, False
        return self.new_state(req), True

    def new_state(self, req: Any) -> RequestState:
        """A new lifecycle's state (not tracked yet): resumed after a retraction that kept the
        offload progress, else from the prompt's start (or, with ``store_prompt=False``, after
        the prompt pages the prefill side stored)."""
        resumed = self.resumed(req)
        if resumed is not None:
            state = RequestState(req, resumed[0])
            state.chain = resumed[1]  # every run of it was keyed before its release
        elif self.store_prompt:
            state = RequestState(req, 0)
        else:  # the prefill side stored the prompt's whole pages
            state = RequestState(req, len(req.origin_input_ids) // self.page_size * self.page_size)
        return state

    def commit(self, state: RequestState) -> None:
        """Track a new state (its call has passed every check); a kept retraction is taken."""
        self.retracted.pop(id(state.req), None)
        self.states[id(state.req)] = state

    def track(self, req: Any) -> RequestState:
        """A new state for ``req``, tracked."""
        state = self.new_state(req)
        self.commit(state)
        return state

    def release(self, state: RequestState) -> bool:
        """Stop tracking ``state`` and remember its object: ended (``retract_keep`` None),
        retracted keeping its progress (True) or starting over (False: nothing kept).
        False when it was released already."""
        req = state.req
        key = id(req)
        if self.states.get(key) is not state:
            return False
        del self.states[key]
        if state.retract_keep is True:
            try:
                held = weakref.ref(req, lambda _, key=key: self.retracted.pop(key, None))
            except TypeError:  # a class without weakref support: held until it runs again
                held = lambda req=req: req  # noqa: E731
            self.retracted[key] = (held, state.offloaded_length, state.chain)
        elif state.retract_keep is None:
            try:
                self._ended[key] = req
            except TypeError:  # a class without weakref support: not remembered
                pass
        return True

    def has_ended(self, req: Any) -> bool:
        """Whether ``req`` (this object) finished or was aborted and released."""
        return self._ended.get(id(req)) is req

    def resumed(self, req: Any) -> tuple[int, RequestChain | None] | None:
        """The offloaded length (tokens) and chain ``req`` kept at its retraction, or None."""
        kept = self.retracted.get(id(req))
        return None if kept is None or kept[0]() is not req else (kept[1], kept[2])
