"""A plain model's stand-in for :class:`~kvstage.offload.hybrid.Hybrid` (one full-attention
component, nothing more to move)."""

from __future__ import annotations

from typing import Any

from kvstage.errors import InvalidArgumentError, require
from kvstage.kernels.streams import CopyHandle
from kvstage.offload.load_path import LoadHandle

__all__ = ["PlainModel"]


class PlainModel:
    """A plain model's stand-in for :class:`Hybrid`: one full-attention component, nothing more
    to move (the manager behaves exactly as before hybrid models)."""

    lookup = None
    in_flight = 0

    def attach(self, *_: Any) -> None:
        """Nothing to attach."""

    def check_runs(self, *_: Any) -> None:
        """No window slots to check."""

    def gather_pages(self, *_: Any) -> None:
        """No other component's pages."""

    def start_over(self, _req: Any) -> None:
        """No window pages gathered."""

    def wait_loads(self, _state: Any, _aborted: bool) -> None:
        """No other component's scatters."""

    def settled(self, _run: Any) -> None:
        """Nothing waits for keys."""

    def poll(self, _states: Any) -> list:
        """Nothing in flight."""
        return []

    def writes_ended(self, ended: list) -> list:
        """No component writes: every lifecycle in ``ended`` is done."""
        return ended

    def wait(self) -> None:
        """Nothing in flight."""

    def clear(self) -> int:
        """No other store."""
        return 0

    def close(self) -> None:
        """Nothing linked."""

    def snapshot(self, *_: Any) -> CopyHandle:
        """Raises: InvalidArgumentError: a plain model has no request state."""
        raise InvalidArgumentError("snapshot: the model has no request-state component (a plain model)")

    def check_load(self, handle: Any, num_pages: int, component_slots: Any, state_slot: Any) -> dict:
        """Raises: InvalidArgumentError: component arguments for a plain model."""
        require(component_slots is None, "component_slots", "a plain model has no other component")
        require(state_slot is None, "state_slot", "a plain model has no request state")
        return {}

    def load(self, *_: Any) -> dict:
        """Nothing more to load."""
        return {}

    def load_handle(self, base: LoadHandle, _launched: Any) -> LoadHandle:
        """The full pages' handle itself."""
        return base
