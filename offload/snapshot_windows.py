"""Which sliding-window pages a hybrid model stores for its state snapshots (the store path of
:mod:`kvstage.offload.hybrid`).

A resume at ``L`` needs the window pages before ``L`` (:func:`~kvstage.offload.restorable.swa_store_mask`).
A run of full pages stores the window before its own end and before every snapshot length of its
request; a snapshot at a length whose window pages were in runs already launched without them
gathers those pages itself. This module remembers, per request, the snapshot lengths later runs
must serve and the window pages already gathered.
"""

from __future__ import annotations

from typing import Any

import torch

from kvstage.errors import require
from kvstage.model_layout import ModelLayout
from kvstage.offload.restorable import swa_store_mask

__all__ = ["SnapshotWindows", "window_slots"]


class _Request:
    __slots__ = ("req", "lengths", "gathered")

    def __init__(self, req: Any, names: list[str]) -> None:
        self.req, self.lengths = req, []  # snapshot lengths later runs must serve
        self.gathered: dict[str, set[int]] = {name: set() for name in names}


class SnapshotWindows:
    """Per request: snapshot lengths and the window pages gathered (module doc). Not thread-safe:
    the manager's thread only."""

    def __init__(self, layout: ModelLayout, page_size: int) -> None:
        self.windows = layout.of_kind("swa")
        self.page_size = page_size
        self._requests: dict[int, _Request] = {}

    def _of(self, req: Any) -> _Request:
        tracked = self._requests.get(id(req))
        if tracked is None or tracked.req is not req:
            tracked = self._requests[id(req)] = _Request(req, [c.name for c in self.windows])
        return tracked

    def run_pages(
        self, component: Any, req: Any, first: int, end: int, first_kept: int = 0, record: bool = True
    ) -> list[int]:
        """The window pages of a run of pages ``first .. end - 1`` to gather: before the run's end
        or a snapshot length of ``req``, none before ``first_kept`` (the engine may have freed
        their slots); counted gathered unless ``record`` is False (a check before the launch)."""
        tracked = self._of(req)
        ahead = [length for length in tracked.lengths if length > first * self.page_size]  # windows ahead
        resumes = [end * self.page_size, *ahead]
        mask = swa_store_mask(component, self.page_size, resumes, end_page=end, first_page=first)
        indices = [first + i for i, keep in enumerate(mask) if keep and first + i >= first_kept]
        if record:
            tracked.lengths = ahead
            tracked.gathered[component.name].update(indices)
        return indices

    def snapshot_pages(
        self, req: Any, length: int, launched_pages: int, slots_of: Any, first_kept: Any = None
    ) -> list[tuple[Any, list[int]]]:
        """Per sliding window, its pages before a snapshot at ``length`` that runs of the first
        ``launched_pages`` pages left out (to gather now), none before ``first_kept(name)``
        (None: 0); ``length`` is served by later runs. Call :meth:`gathered` once they are
        launched.

        Raises:
            InvalidArgumentError: ``slots_of[name](req)`` gives no slot for each of those pages.
        """
        page_size, k = self.page_size, length // self.page_size
        tracked, found = self._of(req), []
        for component in self.windows:
            done = tracked.gathered[component.name]
            first = max(0, k - component.window_pages(page_size))
            if first_kept is not None:
                first = max(first, first_kept(component.name))
            indices = [i for i in range(first, min(k, launched_pages)) if i not in done]
            if indices:
                table = slots_of[component.name](req)
                require(
                    isinstance(table, torch.Tensor) and table.dim() == 1 and table.shape[0] >= k * page_size,
                    f"slots_of[{component.name!r}]",
                    lambda table=table: (
                        f"must give a 1-D tensor with a slot for each of the {k * page_size} positions before the "
                        f"snapshot, got {tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__}"
                    ),
                )
                found.append((component, indices))
        tracked.lengths.append(length)
        return found

    def gathered(self, req: Any, component: Any, indices: list[int]) -> None:
        """``indices`` of ``component`` were launched for ``req``."""
        self._of(req).gathered[component.name].update(indices)

    def forget(self, req: Any) -> None:
        """``req`` starts over (retracted, its progress discarded): nothing of it counts gathered."""
        self._requests.pop(id(req), None)

    def forget_untracked(self, tracked: Any) -> None:
        """Drop the requests not in ``tracked`` (ids) once they outnumber them by 64."""
        if len(self._requests) > len(tracked) + 64:
            self._requests = {i: r for i, r in self._requests.items() if i in tracked}


def window_slots(table: torch.Tensor, page_size: int, indices: list[int]) -> torch.Tensor:
    """A window pool's slots of pages ``indices`` (ascending), position by position: a view when
    they are consecutive."""
    if indices[-1] - indices[0] + 1 == len(indices):
        return table[indices[0] * page_size : (indices[-1] + 1) * page_size]
    return torch.cat([table[i * page_size : (i + 1) * page_size] for i in indices])
