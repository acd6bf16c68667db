"""What an engine may inspect of an :class:`~kvstage.offload.OffloadManager` (read-only; not
checked for the owner thread: read from another thread, a racy snapshot), kept apart from the
manager's lifecycle code."""

from __future__ import annotations

from typing import Any

from kvstage.offload.metrics import OffloadMetrics, metrics_snapshot

__all__ = ["ManagerInspection"]


class ManagerInspection:
    """A mixin of :class:`~kvstage.offload.OffloadManager`: its inspectors."""

    _states: dict
    _lifecycles: Any
    _unhandled: Any
    _counters: OffloadMetrics
    _backup: Any
    _hybrid: Any
    copier: Any
    host_pool: Any
    storage: Any

    def is_tracked(self, req: Any) -> bool:
        """Whether the manager holds state for this request object (not released yet)."""
        return id(req) in self._states

    def in_flight(self, req: Any) -> int:
        """Copies of this request's device slots in flight (0 when untracked)."""
        state = self._states.get(id(req))
        return 0 if state is None else state.copies_in_flight

    def offloaded_length(self, req: Any) -> int | None:
        """Tokens of this request stored, loaded or launched so far (None when untracked)."""
        state = self._states.get(id(req))
        if state is not None:
            return state.offloaded_length
        resumed = self._lifecycles.resumed(req)
        return None if resumed is None else resumed[0]

    @property
    def requests_live(self) -> int:
        """Requests tracked and not yet released."""
        return len(self._states)

    @property
    def reports_pending(self) -> int:
        """Released request lifecycles whose ``on_stored`` is not called yet: their store
        writes (a hybrid model's component writes too) have not all ended, or have and the
        next :meth:`poll` reports them. 0 with :attr:`requests_live` 0: every callback is in."""
        return self._backup.reports_pending

    @property
    def copies_in_flight(self) -> int:
        """Copies launched and not yet handled by :meth:`poll`."""
        return self.copier.copies_in_flight + len(self._unhandled)

    @property
    def metrics(self) -> OffloadMetrics:
        """A snapshot of the counters."""
        backup = self._backup
        return metrics_snapshot(
            self._counters,
            self.host_pool,
            self.storage.stats,
            requests_live=len(self._states),
            copies_in_flight=self.copies_in_flight,
            writes_pending=backup.writes_pending,
            writes_parked=backup.writes_parked,
        )

    @property
    def entries_stored(self) -> dict[str, tuple[int, int]]:
        """A hybrid model's entries of each component but the full one (whose pages
        :attr:`metrics` counts): ``(stored, failed)``, stored counting deduplicated ones; ``{}``
        for a plain model."""
        hybrid = self._hybrid
        if hybrid.lookup is None:
            return {}
        return {c.name: (hybrid.stored[c.name], hybrid.failed[c.name]) for c in hybrid.others}
