"""``KVStageTier``: a kvstage store as a secondary tier of vLLM's ``TieringOffloadingSpec``.

vLLM 0.33.0 keeps a CPU primary tier of fixed-size chunks and cascades each stored chunk to
its secondary tiers, and promotes a chunk a secondary tier holds back into a primary slot when a
lookup finds it (``vllm/v1/kv_offload/tiering/``). This adapter answers for one kvstage store
(memory, file, Mooncake): a chunk is one page, its ``OffloadKey`` in hex is the page key, under
the fingerprint of :func:`kvstage.integrations.vllm.keys.tier_fingerprint`.

Every call comes from vLLM's scheduler thread, under its manager's lock, and returns without
waiting for the store: writes and reads run on :class:`kvstage.offload.StoreWorkers` threads,
lookups answer from a :class:`kvstage.offload.StoreIndex`, results are polled. Configure it as::

    "secondary_tiers": [{"type": "KVStageTier", "module_path": "kvstage.integrations.vllm",
                         "storage": "file:/var/cache/kv"}]
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    ReqContext,
    RequestOffloadingContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvstage.errors import ArgumentTypeError, require
from kvstage.integrations.vllm.keys import (
    lookup_result,
    offloading_events,
    page_keys,
    prior_page_keys,
    tier_fingerprint,
)
from kvstage.offload import StoreIndex, StoreWorkers
from kvstage.offload.keyed_copies import chain_runs
from kvstage.offload.store_io import write_failure_cause, write_pages
from kvstage.storage import open_storage

__all__ = ["KVStageTier"]

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    """One submitted transfer: its keys, the store call's future, when it was submitted."""

    job_id: int
    keys: list[bytes]
    page_keys: list[str]
    future: Future
    is_promotion: bool
    started: float


# The options of a KVStageTier's config dict (what vLLM passes on as keywords).
TIER_OPTIONS = ("storage", "model_id", "read_threads", "miss_ttl_s", "hit_ttl_s", "locality")


class KVStageTier(SecondaryTierManager):
    """A kvstage store below vLLM's CPU tier.

    Args (vLLM passes the first three; the rest come from the tier's config dict):
        offloading_spec: the ``TieringOffloadingSpec``; its ``config`` names the model and
            block layout for the fingerprint.
        primary_kv_view: the primary tier's memoryview ``(num_chunks, row_bytes)``; a chunk is
            ``row_bytes`` bytes (padding included), the store's page size.
        tier_type: this tier's type name (``"KVStageTier"``).
        storage: a kvstage storage URL (``memory``, ``memory:BYTES``, ``file:DIR``,
            ``mooncake://...``), see :func:`kvstage.storage.open_storage`; required, as for
            :class:`KVStageOffloadingSpec` (a tier that fell back to a private in-process store
            would silently share and keep nothing).
        model_id: the model's name in the key space; None: the model vLLM runs.
        read_threads: reader threads (promotions and lookups; >= 1).
        miss_ttl_s: seconds a "not held" answer is trusted before the store is asked again.
        hit_ttl_s: seconds after which a held key is checked again in the background (a
            store shared with other processes, e.g. Mooncake, may evict it unseen); None: never.
        locality: ``"LOCAL"`` or ``"REMOTE"`` (vLLM's ``Locality``), or None.
        backpressure_detector: vLLM's, passed through.

    Raises:
        InvalidArgumentError, ArgumentTypeError: ``storage`` missing, an option not listed here
            (naming it and the valid ones), a bad URL, ``locality``, fingerprint or thread count
            (from kvstage, naming the argument); before any thread starts.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        storage: str | None = None,
        model_id: str | None = None,
        read_threads: int = 2,
        miss_ttl_s: float = 1.0,
        hit_ttl_s: float | None = 10.0,
        locality: str | None = None,
        backpressure_detector: Any = None,
        **unknown: Any,
    ) -> None:
        # vLLM passes the tier's config dict as keywords: a misspelled option lands here, not in a TypeError
        require(
            not unknown,
            ", ".join(sorted(unknown)),
            lambda: (
                f"not an option of KVStageTier (its secondary_tiers config); its options are {list(TIER_OPTIONS)}, "
                "besides vLLM's own 'type', 'module_path' and 'backpressure'"
            ),
        )
        require(
            storage is not None,
            "storage",
            "required in the KVStageTier config: a kvstage storage URL (file:DIR, mooncake://..., memory[:BYTES]); "
            'write "memory" for an in-process store that is lost with the engine',
        )
        require(
            isinstance(storage, str),
            "storage",
            lambda: f"must be a storage URL string, got {type(storage).__name__}",
            ArgumentTypeError,
        )
        localities = [member.value for member in Locality]
        require(
            locality is None or locality in localities,
            "locality",
            lambda: f"must be one of {localities} or None, got {locality!r}",
        )
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if locality is not None:
            self.locality = Locality(locality)
        # The primary chunks, zero-copy: row c is chunk c (vLLM pins it during a transfer).
        self._primary = torch.from_numpy(np.asarray(primary_kv_view)).view(torch.uint8)
        self.fingerprint = tier_fingerprint(offloading_spec.config, page_bytes=self.block_size_bytes, model_id=model_id)
        self.storage = open_storage(storage, self.fingerprint)
        try:
            self._workers = StoreWorkers(read_threads=read_threads)
            self.index = StoreIndex(self.storage, self._workers, miss_ttl_s=miss_ttl_s, hit_ttl_s=hit_ttl_s)
        except Exception:
            self.storage.close()
            raise
        self._events_enabled = bool(offloading_spec.kv_events_config.enable_kv_cache_events)
        self._jobs: list[_Job] = []
        self._events: list[OffloadingEvent] = []
        config = offloading_spec.config  # a partial tail (a key inside a chunk) is no chunk's predecessor
        self._chunk_tokens = {g.group_id: g.tokens_per_block * config.cache.blocks_per_chunk for g in config.groups}
        # a sliding-window or Mamba group's chunk links to none: vLLM stores only those that can serve a hit
        self._unchained_groups = frozenset(
            g.group_id for g in config.groups if g.sliding_window_size_in_chunks is not None
        )

    # -- lookups ----------------------------------------------------------------------------

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        """HIT when the store is known to hold ``key``, MISS when known not to, RETRY while
        the store is being asked (never a store round trip on this thread)."""
        return lookup_result(self.index, key)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Chunk level: only newly computed chunks cascade here."""
        return RequestOffloadingContext()

    # -- transfers --------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Write the job's primary chunks to the store on the writer thread: one ``put`` per
        run of one chain of one KV group (in the order vLLM gives them), its first chunk linked
        to its request's chunk before it (vLLM records each key's place in the request's
        ``ReqContext``), so a prefix cascaded over several jobs stays one chain."""
        keys = self._checked_keys(job_metadata)
        wanted = page_keys(keys)
        pages = [self._primary[int(chunk)] for chunk in job_metadata.chunk_ids]
        # each run's first chunk links to its request's chunk before it (an earlier job's)
        priors = prior_page_keys(job_metadata.req_context, keys, chunk_tokens=self._chunk_tokens)
        if self._unchained_groups:
            priors = [
                None if get_offload_group_idx(key) in self._unchained_groups else prior
                for key, prior in zip(keys, priors)
            ]
        runs = [
            (group_start + start, group_start + stop, prior)
            for group_start, group_stop in _runs_by_group(keys)
            for start, stop, prior in chain_runs(wanted[group_start:group_stop], priors[group_start:group_stop])
        ]
        storage = self.storage

        def write() -> tuple[int, BaseException | None]:
            failed, error = 0, None
            for start, stop, prior in runs:
                outcome = write_pages(storage, wanted[start:stop], pages[start:stop], prior_key=prior)
                failed += len(outcome.failed_keys)
                error = error or outcome.error
            return failed, error

        self._track(job_metadata, keys, wanted, self._workers.write(write), is_promotion=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Read the job's pages from the store into its primary chunks on a reader thread; a
        page the store cannot give intact (missing, corrupted) fails that key only."""
        keys = self._checked_keys(job_metadata)
        pages = [self._primary[int(chunk)] for chunk in job_metadata.chunk_ids]
        storage, wanted = self.storage, page_keys(keys)
        self._track(
            job_metadata, keys, wanted, self._workers.read(lambda: storage.get(wanted, pages)), is_promotion=True
        )

    @staticmethod
    def _checked_keys(job_metadata: TransferJob) -> list[bytes]:
        """The job's keys, one per chunk id, checked before anything is submitted."""
        keys = list(job_metadata.keys)
        require(
            len(keys) == len(job_metadata.chunk_ids),
            "job_metadata",
            lambda: f"must give one key per chunk id, got {len(keys)} keys for {len(job_metadata.chunk_ids)} chunk_ids",
        )
        return keys

    def _track(
        self, job_metadata: TransferJob, keys: list[bytes], wanted: list[str], future: Future, *, is_promotion: bool
    ) -> None:
        self._jobs.append(_Job(job_metadata.job_id, keys, wanted, future, is_promotion, time.perf_counter()))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Jobs whose store call finished since the last call; never blocks."""
        self.index.poll()
        finished, pending = [], []
        for job in self._jobs:
            (finished if job.future.done() else pending).append(job)
        self._jobs = pending
        results = [self._result(job) for job in finished]
        self._drain_store_events()
        return results

    def _result(self, job: _Job) -> JobResult:
        seconds = time.perf_counter() - job.started
        error = job.future.exception()
        if job.is_promotion:
            if error is not None:
                logger.warning("kvstage: promotion job %s of %d pages failed: %r", job.job_id, len(job.keys), error)
            hits = [False] * len(job.keys) if error is not None else list(job.future.result())
            self.index.discard([key for key, hit in zip(job.page_keys, hits) if not hit])
            self.index.add([key for key, hit in zip(job.page_keys, hits) if hit])
            read = [key for key, hit in zip(job.keys, hits) if hit]
            ok = len(read) == len(job.keys)
            return JobResult(
                job.job_id,
                ok,
                successful_keys=None if ok else read,
                transfer_time=seconds,
                transfer_bytes=len(read) * self.block_size_bytes,
            )
        failed, error = (len(job.keys), error) if error is not None else job.future.result()
        if failed == 0:
            self.index.add(job.page_keys)
        else:
            logger.warning(
                "kvstage: store job %s wrote %d of %d pages: %s",
                job.job_id,
                len(job.keys) - failed,
                len(job.keys),
                write_failure_cause(error),
            )
        return JobResult(
            job.job_id,
            failed == 0,
            transfer_time=seconds,
            transfer_bytes=(len(job.keys) - failed) * self.block_size_bytes,
        )

    def has_pending_work(self) -> bool:
        """Transfers in flight, or lookups waiting for the store's answer."""
        return bool(self._jobs) or self.index.refreshing

    def drain_jobs(self) -> None:
        """Block until every submitted transfer finished; their results stay for
        :meth:`get_finished_jobs`."""
        wait([job.future for job in self._jobs])

    # -- events -----------------------------------------------------------------------------

    def on_schedule_end(self, context: Any) -> None:
        """Send queued lookups, and keep the index current with the store's events."""
        self.index.poll()
        self._drain_store_events()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The store's stored / evicted / removed pages since the last call, as vLLM events
        (only while vLLM publishes KV events)."""
        self._drain_store_events()
        events, self._events = self._events, []
        return events

    def _drain_store_events(self) -> None:
        store_events = self.storage.take_events()
        if not store_events:
            return
        prefix = self.storage.prefix
        self.index.apply_events(store_events, prefix)  # every stored page of this tier's store is its own write
        if self._events_enabled:
            self._events.extend(
                offloading_events(
                    store_events, key_space=prefix, medium=self.medium, locality=self.locality, ownership=self.tier_type
                )
            )

    def shutdown(self) -> None:
        """Finish queued transfers, stop the threads, close the store, and let go of the
        primary tier's memory (vLLM unmaps it only once no view of it is left)."""
        self._workers.close()
        self.storage.close()
        self._jobs = []
        self._primary = None


def _runs_by_group(keys: list[bytes]) -> list[tuple[int, int]]:
    """``(start, stop)`` of each run of consecutive keys of one KV group."""
    runs, start = [], 0
    for index in range(1, len(keys) + 1):
        if index == len(keys) or get_offload_group_idx(keys[index]) != get_offload_group_idx(keys[start]):
            runs.append((start, index))
            start = index
    return runs
