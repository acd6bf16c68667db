"""The store path's launch plan: the checked tokens and device slots of what :func:`plan_store` chose.

:func:`~kvstage.offload.store_plan.plan_store` decides which token ranges launch now from
numbers alone; :class:`LaunchPlanner` checks the token ids and slot indices of every whole page
wanted (also those that do not fit now, so that a call that raises has changed nothing), slices
them into runs, and names the chain they continue. It reads the request and calls the engine's
``slot_indices_of`` but changes nothing, so every case is testable without a manager.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from kvstage.errors import InvalidArgumentError
from kvstage.offload.collaborators import PageHasherLike
from kvstage.offload.key_chain import ChainRun, RequestChain
from kvstage.offload.request import SlotIndicesOf, request_namespace, request_tokens
from kvstage.offload.request_state import RequestState
from kvstage.offload.store_plan import plan_store

__all__ = ["NOTHING", "LaunchPlan", "LaunchPlanner"]


class LaunchPlan(NamedTuple):
    """What :meth:`LaunchPlanner.plan` found to launch.

    Attributes:
        runs: ``(run, slot_indices)`` per copy, oldest first: the run's token ids (whole
            pages) and their device slots (a 1-D int tensor, one slot per token).
        chain: the chain the runs continue: the request's, or a new one that the first launch
            sets (None: nothing launched or loaded yet, and no run now).
        rejected: the ranges wanted that found no free host page (``offloads_rejected``).
    """

    runs: list[tuple[ChainRun, torch.Tensor]]
    chain: RequestChain | None
    rejected: int = 0


NOTHING = LaunchPlan([], None)  # nothing to launch


class LaunchPlanner:
    """Plans one manager's launches (its page size, hasher and engine callbacks).

    Args:
        page_size: tokens per page.
        hasher: page keys (:class:`kvstage.hashing.PageHasher`), for a new chain's start.
        store_prompt: as :class:`~kvstage.offload.OffloadManager`'s: False, a new chain
            continues from the prompt's last whole page (stored by the prefill side).
        check_slot_indices: ``check_slot_indices(slot_indices, argument)`` raises on slots no
            copy may take (the copier's :meth:`~kvstage.offload.copier.Copier.check_slot_indices`).
    """

    def __init__(
        self,
        page_size: int,
        hasher: PageHasherLike,
        store_prompt: bool,
        check_slot_indices: Callable[[Any, str], Any],
    ) -> None:
        self.page_size = page_size
        self.hasher = hasher
        self.store_prompt = store_prompt
        self.check_slot_indices = check_slot_indices

    def plan(
        self, state: RequestState, length: int, unit: int, free_pages: int, slot_indices_of: SlotIndicesOf
    ) -> LaunchPlan:
        """The runs to launch now, every one checked: the prompt's whole pages up to
        ``length`` (if not stored), then whole ``unit``s of ``[offloaded_length, length)``, as
        many as ``free_pages`` host pages hold, oldest first.

        Args:
            state: the request's state (read, never changed).
            length: its tokens with KV.
            unit: tokens per decode run (the offload stride, or one page at a finish).
            free_pages: host pages free now.
            slot_indices_of: ``slot_indices_of(req)`` -> the request's device slots (called
                only when a whole page is new, after its token ids are checked).

        Raises:
            InvalidArgumentError / ArgumentTypeError / DeviceMismatchError: a placeholder id, an
                id that is no integer or above ``2**63-1``, too few slots, bad slot indices, a bad namespace (a new
                chain starts here).
        """
        page_size = self.page_size
        if length - state.offloaded_length < page_size:  # most calls: nothing new
            return NOTHING
        req = state.req
        prompt_end = len(req.origin_input_ids) // page_size * page_size
        decision = plan_store(state.offloaded_length, length, unit, page_size, prompt_end, free_pages)
        if decision.nothing:
            return NOTHING
        first, wanted_end, bounds = decision.first, decision.wanted_end, decision.runs
        tokens = request_tokens(req, first, wanted_end, integers=True)  # raises on a placeholder id too
        slot_indices = slot_indices_of(req)
        argument = f"slot_indices_of(rid={req.rid!r})"
        if isinstance(slot_indices, torch.Tensor) and slot_indices.dim() == 1:
            if slot_indices.shape[0] < wanted_end:
                raise InvalidArgumentError(
                    f"{argument}: {slot_indices.shape[0]} slots, its first {wanted_end} tokens have KV"
                )
            slot_indices = slot_indices[first:wanted_end]
        self.check_slot_indices(slot_indices, argument)
        chain = state.chain
        if bounds and chain is None:  # the namespace is checked here, before anything is tracked
            chain = RequestChain(*self.chain_start(req))
        if len(bounds) == 1 and bounds[0][1] == wanted_end:  # the common case: no slicing
            return LaunchPlan([(ChainRun(tokens), slot_indices)], chain, decision.rejected)
        runs = [
            (ChainRun(tokens[begin - first : end - first]), slot_indices[begin - first : end - first])
            for begin, end in bounds
        ]
        return LaunchPlan(runs, chain, decision.rejected)

    def chain_start(self, req: Any) -> tuple[str | None, bool]:
        """The prior of the request's first launched page, and whether it is a stored page's
        key: the namespace seed (not a page), or with ``store_prompt=False`` the last key of the
        prompt's whole pages (stored by the prefill side).

        Raises:
            InvalidArgumentError / ArgumentTypeError: a bad namespace (``extra_key``,
                ``cache_salt``).
        """
        extra_key, cache_salt = request_namespace(req)
        aligned = len(req.origin_input_ids) // self.page_size * self.page_size
        if not self.store_prompt and aligned:
            keys = self.hasher.prefill_keys(req.origin_input_ids[:aligned], extra_key=extra_key, cache_salt=cache_salt)
            return keys[-1], True
        return self.hasher.seed(extra_key, cache_salt), False
