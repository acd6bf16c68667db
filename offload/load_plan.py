"""The load path's decision: where a request's offloading resumes after a load (pure arithmetic).

After :meth:`~kvstage.offload.OffloadManager.load` scatters a prefix, the manager stores only
what follows it, and the chain of page keys continues from the last page it knows is stored.
:func:`plan_load_resume` answers from numbers and keys alone, so every case is testable
without a manager.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

__all__ = ["LoadResume", "plan_load_resume"]


@dataclasses.dataclass(frozen=True)
class LoadResume:
    """What :func:`plan_load_resume` decided.

    Attributes:
        offloaded_length: the request's new ``offloaded_length`` (tokens).
        new_chain: True: the request's chain is replaced (by one continuing from
            ``prior_key``, or by none when ``prior_key`` is None: the chain then starts at the
            first launch). False: the request keeps its chain.
        prior_key: the stored page's key that the new chain continues from (None: no chain).
    """

    offloaded_length: int
    new_chain: bool
    prior_key: str | None = None


def plan_load_resume(
    num_pages: int, page_size: int, page_keys: Sequence[str], prompt_end: int, offloaded_length: int, has_chain: bool
) -> LoadResume:
    """Where offloading resumes once ``num_pages`` leading pages are loaded.

    Offloading resumes after the loaded pages: further than the prompt pages a prefill side
    stored (``prompt_end``), or short of a resumed (retracted) request's old progress when a
    page of it was lost from the store: the engine recomputes from the loaded length, and
    storing those pages again mends the chain.

    Args:
        num_pages: the pages loaded (>= 0).
        page_size: tokens per page.
        page_keys: the keys the lookup made for the request's pages, from its namespace seed
            (at least ``num_pages``).
        prompt_end: with ``store_prompt=False``, the end of the prompt's last whole page (the
            prefill side stored up to it); 0 with ``store_prompt=True``.
        offloaded_length: the request's ``offloaded_length`` before the load.
        has_chain: whether the request has a chain before the load.

    Returns:
        A :class:`LoadResume`.
    """
    loaded = num_pages * page_size
    resume = max(loaded, prompt_end)
    new_chain, prior_key = False, None
    if resume != offloaded_length:
        new_chain = True
        prior_key = page_keys[num_pages - 1] if resume == loaded and num_pages else None
    chain_missing = prior_key is None if new_chain else not has_chain
    if chain_missing and resume == prompt_end and 0 < prompt_end <= len(page_keys) * page_size:
        # The lookup keyed the prompt's pages from its namespace seed: its last one is where
        # the chain continues (the prefill side's key), not hashed again.
        new_chain, prior_key = True, page_keys[prompt_end // page_size - 1]
    return LoadResume(resume, new_chain, prior_key)
