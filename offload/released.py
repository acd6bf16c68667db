"""Request objects the manager released: which ended, and what retracted ones had offloaded.

A finished or aborted object is remembered weakly (a late ``finish``/``abort`` of it is
ignored, a late ``offload`` raises); an object retracted with ``keep_offloaded`` keeps its
offloaded length and chain until it runs again, forgotten when the engine drops it.
"""

from __future__ import annotations

import weakref
from typing import Any

from kvstage.offload.key_chain import RequestChain

__all__ = ["ReleasedRequests"]


class ReleasedRequests:
    """Released request objects, keyed by ``id(req)`` and checked to be the same object.

    Attributes:
        retracted: ``id(req)`` -> (the request held weakly, its offloaded length in tokens,
            its chain) for requests retracted with ``keep_offloaded=True``.
    """

    def __init__(self) -> None:
        self._ended: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self.retracted: dict[int, tuple[Any, int, RequestChain | None]] = {}

    def remember(self, req: Any, retract_keep: bool | None, offloaded_length: int, chain: RequestChain | None) -> None:
        """``req`` was released: ended (``retract_keep`` None), retracted keeping its progress
        (True) or retracted starting over (False: nothing remembered)."""
        key = id(req)
        if retract_keep is True:
            try:
                held = weakref.ref(req, lambda _, key=key: self.retracted.pop(key, None))
            except TypeError:  # a class without weakref support: held until it runs again
                held = lambda req=req: req  # noqa: E731
            self.retracted[key] = (held, offloaded_length, chain)
        elif retract_keep is None:
            try:
                self._ended[key] = req
            except TypeError:  # a class without weakref support: not remembered
                pass

    def has_ended(self, req: Any) -> bool:
        """Whether ``req`` (this object) finished or was aborted and released."""
        return self._ended.get(id(req)) is req

    def resumed(self, req: Any) -> tuple[int, RequestChain | None] | None:
        """The offloaded length (tokens) and chain ``req`` kept at its retraction, or None."""
        kept = self.retracted.get(id(req))
        return None if kept is None or kept[0]() is not req else (kept[1], kept[2])

    def forget_retracted(self, req: Any) -> None:
        """``req`` runs again (a new lifecycle is tracked): its kept progress is taken."""
        self.retracted.pop(id(req), None)
