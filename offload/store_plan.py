"""The store path's decision: which of a request's token ranges to launch now (pure arithmetic).

The manager asks at each ``offload``/``finish`` (and for waiting pages at each ``poll``);
:func:`plan_store` answers from numbers alone (no request, no host pool, no tensor), so every
case is testable without a manager. The manager then checks the tokens and slots of the
``[offloaded_length, wanted_end)`` range the answer names and launches its ``runs``.
"""

from __future__ import annotations

import dataclasses

__all__ = ["StorePlan", "plan_store"]


@dataclasses.dataclass(frozen=True)
class StorePlan:
    """What :func:`plan_store` decided (token positions, not pages).

    Attributes:
        first: the request's ``offloaded_length``: where the range starts.
        wanted_end: the end of every whole page (prompt) and whole unit (decode) with KV:
            ``[first, wanted_end)`` is checked now, also the part that does not fit.
            ``wanted_end == first``: nothing new (no check, no launch).
        runs: the ``(begin, end)`` ranges to launch now, oldest first, each within the free
            host pages: at most one for the prompt's pages and one for whole units after it.
        rejected: the ranges wanted that found no free host page (``offloads_rejected``).
    """

    first: int
    wanted_end: int
    runs: tuple[tuple[int, int], ...] = ()
    rejected: int = 0

    @property
    def nothing(self) -> bool:
        """Nothing new to check or launch."""
        return self.wanted_end <= self.first


def plan_store(
    offloaded_length: int, kv_length: int, unit: int, page_size: int, prompt_end: int, free_pages: int
) -> StorePlan:
    """Decide what to launch of ``[offloaded_length, kv_length)``.

    The prompt's whole pages go page by page, as far as they have KV; once they are all
    wanted, the tokens after them go in whole ``unit``s (the offload stride, or one page at a
    ``finish``). What fits in ``free_pages`` is launched, oldest first; the rest waits for a
    later call.

    Args:
        offloaded_length: tokens ``[0, offloaded_length)`` stored, loaded or launched already.
        kv_length: tokens with KV (``kv_length >= offloaded_length``).
        unit: tokens per decode run, a positive multiple of ``page_size``.
        page_size: tokens per page (> 0).
        prompt_end: the end of the prompt's last whole page (a multiple of ``page_size``).
        free_pages: host pages free now (>= 0).

    Returns:
        A :class:`StorePlan`; ``plan.nothing`` when less than a whole page (or, past the
        prompt, a whole unit) is new.
    """
    first = offloaded_length
    nothing = StorePlan(first, first)
    if kv_length - first < page_size:  # most calls: nothing new
        return nothing
    unit_pages = unit // page_size
    if first >= prompt_end:  # decode tokens go in whole units (the common case)
        units = (kv_length - first) // unit
        if units <= 0:
            return nothing
        fitting = min(units, free_pages // unit_pages)
        runs = ((first, first + fitting * unit),) if fitting else ()
        return StorePlan(first, first + units * unit, runs, 0 if fitting else 1)
    prompt_wanted = max((min(prompt_end, kv_length) - first) // page_size, 0)
    wanted_end = first + prompt_wanted * page_size
    if wanted_end >= prompt_end and kv_length - wanted_end >= unit:
        wanted_end += (kv_length - wanted_end) // unit * unit
    if wanted_end <= first:
        return nothing
    runs: list[tuple[int, int]] = []
    rejected = 0
    start, free = first, free_pages
    fitting = min(prompt_wanted, free)  # the prompt's pages that fit now, oldest first
    if fitting:
        runs.append((start, start + fitting * page_size))
        start, free = start + fitting * page_size, free - fitting
    else:
        rejected += 1
    if start >= prompt_end and wanted_end > start:
        fitting = min((wanted_end - start) // unit, free // unit_pages)
        if fitting:
            runs.append((start, start + fitting * unit))
        else:
            rejected += 1
    return StorePlan(first, wanted_end, tuple(runs), rejected)
