"""Finished requests whose whole pages wait for free host pages, counted against a limit.

A finished request's pages that find no free host page wait (its device slots held
meanwhile) until a later poll launches them; ``finish_backlog_pages`` caps how many pages may
wait in all (None: no cap).
"""

from __future__ import annotations

from kvstage.offload.request_state import RequestState

__all__ = ["FinishBacklog"]


class FinishBacklog:
    """The waiting requests, oldest first, and the pages they wait for in all.

    Args:
        limit: the most pages that may wait in all; None: no limit.

    Attributes:
        states: the waiting requests' states, oldest first.
        pages: the sum of their ``backlog_pages``.
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.states: list[RequestState] = []
        self.pages = 0

    def __bool__(self) -> bool:
        return bool(self.states)

    def admit(self, state: RequestState, pages: int) -> bool:
        """Let ``state`` wait for ``pages`` (> 0) pages; False (nothing changed) when that
        would pass the limit."""
        if self.limit is not None and self.pages + pages > self.limit:
            return False
        self.set_pages(state, pages)
        self.states.append(state)
        return True

    def set_pages(self, state: RequestState, pages: int) -> None:
        """``state`` waits for ``pages`` pages now (fewer once some launched)."""
        self.pages += pages - state.backlog_pages
        state.backlog_pages = pages

    def remove(self, state: RequestState) -> int:
        """Stop ``state`` waiting; returns the pages it still waited for (never launched now)."""
        pages = state.backlog_pages
        self.set_pages(state, 0)
        self.states.remove(state)
        return pages
