"""What the manager tracks per request lifecycle, per gather and per load (records and their bookkeeping)."""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

from kvstage.offload.backup import RequestWrites
from kvstage.offload.copier import CopyResult
from kvstage.offload.key_chain import ChainRun, RequestChain
from kvstage.offload.load_path import PrefetchHandle
from kvstage.offload.load_plan import LoadResume, plan_load_resume

__all__ = ["LoadJob", "RequestState", "Segment"]


class RequestState:
    """One request lifecycle's offload state (token counts are positions, not pages)."""

    __slots__ = (
        "req",
        "offloaded_length",
        "launched_length",
        "kv_length",
        "chain",
        "unsettled",
        "copies_in_flight",
        "loads",
        "ending",
        "aborted",
        "retract_keep",
        "prefetch",
        "backlog_pages",
        "writes",
    )

    def __init__(self, req: Any, offloaded_length: int) -> None:
        self.req = req  # held: keeps id(req) from being reused while tracked
        self.offloaded_length = offloaded_length  # tokens [0, offloaded_length) stored, loaded or launched
        self.launched_length = 0  # tokens [0, launched_length) launched by this lifecycle's calls
        self.kv_length = 0  # finish(): the tokens with KV its waiting pages go up to
        self.chain: RequestChain | None = None  # None: nothing launched or loaded yet
        # Launched segments not settled yet, in launch order: a finished one waits for those
        # before it, so its request's writes reach the store in chain order.
        self.unsettled: deque[Segment] = deque()
        self.copies_in_flight = 0  # gathers and loads of its device slots not polled yet
        self.loads: list[LoadJob] = []
        self.ending = False  # finish(), abort() or retract() was called
        self.aborted = False
        self.retract_keep: bool | None = None  # retract(): keep the offload progress for a rerun
        self.prefetch: PrefetchHandle | None = None
        self.backlog_pages = 0  # whole pages finish() is waiting for host pages for
        self.writes = RequestWrites(req)  # this lifecycle's store writes (on_stored)

    def launched(self, segment: Segment) -> None:
        """``segment``'s gather launched: its run joins the chain (only once launched: a run
        whose launch raised is no part of it), in flight and unsettled."""
        self.chain.add(segment.run)
        self.unsettled.append(segment)
        self.offloaded_length += len(segment.run.tokens)
        self.launched_length = self.offloaded_length
        self.copies_in_flight += 1

    def load_started(self, load: LoadJob) -> None:
        """``load``'s scatter launched: in flight until :meth:`load_ended`."""
        self.copies_in_flight += 1
        self.loads.append(load)

    def load_ended(self, load: LoadJob) -> None:
        """``load``'s scatter was polled (done or failed)."""
        self.copies_in_flight -= 1
        self.loads.remove(load)

    def resume_after_load(
        self, num_pages: int, page_size: int, page_keys: Sequence[str], prompt_end: int
    ) -> LoadResume:
        """``num_pages`` leading pages were loaded: offloading resumes where
        :func:`~kvstage.offload.load_plan.plan_load_resume` says (arguments as there), the chain
        replaced when it says so (by one from its stored prior key, or by none). Returns its
        decision."""
        resume = plan_load_resume(
            num_pages, page_size, page_keys, prompt_end, self.offloaded_length, self.chain is not None
        )
        self.offloaded_length = resume.offloaded_length
        if resume.new_chain:
            self.chain = None if resume.prior_key is None else RequestChain(resume.prior_key, True)
        return resume

    def pages_to_launch(self, page_size: int) -> int:
        """Whole pages of ``[offloaded_length, kv_length)``: what a finish still has to launch."""
        return max(self.kv_length - self.offloaded_length, 0) // page_size


class Segment:
    """One gather (the copier's job): a run of the request's chain and its copy's outcome."""

    __slots__ = ("state", "run", "result")

    def __init__(self, state: RequestState, run: ChainRun) -> None:
        self.state = state
        self.run = run
        self.result: CopyResult | None = None  # its copy's outcome, once polled


class LoadJob:
    """One load (the copier's job): the request state and the pages it scatters."""

    __slots__ = ("state", "num_pages")

    def __init__(self, state: RequestState, num_pages: int) -> None:
        self.state = state
        self.num_pages = num_pages
