"""``KVStageWorker``: the worker side of :class:`KVStageOffloadingSpec`.

It moves one worker's blocks between vLLM's canonical block tensors and the store: a block is a
slot of a :class:`kvstage.kernels.KVPool` whose layers are the group's block tensors, copied by
kvstage's :class:`kvstage.offload.Copier` and written and read on
:class:`kvstage.offload.StoreWorkers` threads through :class:`kvstage.offload.KeyedCopies`.
No job's failure reaches vLLM as a failed transfer (see :class:`KVStageWorker`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec, OffloadingWorker, TransferResult

from kvstage.errors import require
from kvstage.integrations.vllm.manager import KVStageLoadStoreSpec
from kvstage.kernels import KVPool
from kvstage.offload import Copier, HostPool, KeyedCopies, StoreWorkers
from kvstage.offload.store_io import read_failure_cause, write_failure_cause
from kvstage.storage.shared import release_shared_storage

__all__ = ["KVStageWorker"]

logger = logging.getLogger(__name__)


class KVStageWorker(OffloadingWorker):
    """Moves one worker's blocks between vLLM's canonical block tensors and the store.

    vLLM 0.33.0's connector worker asserts that every transfer succeeded
    (``offloading/worker.py``), so a job's failure is never reported as one: a job is never
    refused (it waits for host pages, in parts of at most ``num_host_pages`` blocks); a store
    that could not write every page is reported done (vLLM only frees the blocks) and counted in
    :attr:`pages_failed` (the scheduler's manager asks the store before it offers those keys);
    a load that could not read every page is reported done with its blocks in
    :meth:`take_block_ids_with_load_errors`, which :class:`KVStageConnector` hands to vLLM's
    scheduler (``kv_load_failure_policy``: ``"recompute"`` computes them again). Without that
    connector (``report_load_errors`` False) a failed load is reported failed: vLLM's own
    ``OffloadingConnector`` has no way to take it and its worker stops the engine.

    Args:
        kv_caches: vLLM's ``CanonicalKVCaches`` of one KV group: each layer's tensor
            ``(num_blocks, page_size_bytes)`` int8, contiguous, unpadded.
        storage: the store; its page is one block of every layer of the group.
        num_host_pages: host pages for blocks in flight (a job of more blocks moves in parts).
        report_load_errors: failed loads go to :meth:`take_block_ids_with_load_errors`: the
            blocks from the first page that did not land on (the pages before it landed).
        load_failure_policy: vLLM's ``kv_load_failure_policy`` (``"recompute"`` or ``"fail"``),
            for the warnings only.
        reports_stores: keep for :meth:`take_store_report` the keys each store job could not
            write and the store's evictions and removals of this worker's key space
            (:class:`KVStageConnector` hands them to the scheduler's manager; without it the
            store's events stay with the store, for a manager sharing this process).

    Raises:
        InvalidArgumentError: more than one group, a padded or strided layer tensor, layers of
            different page sizes, or a store of another page size; before anything is allocated.
            On any raise the store stays the caller's (it is this worker's once built).
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        storage: Any,
        *,
        num_host_pages: int = 256,
        report_load_errors: bool = False,
        load_failure_policy: str = "fail",
        reports_stores: bool = False,
    ) -> None:
        require(
            len(kv_caches.group_data_refs) == 1,
            "kv_caches",
            lambda: f"must hold one KV group, got {len(kv_caches.group_data_refs)}",
        )
        layers = []
        for index, ref in enumerate(kv_caches.group_data_refs[0]):
            tensor = kv_caches.tensors[ref.tensor_idx].tensor
            require(
                tensor.dim() == 2 and tensor.is_contiguous() and tensor.shape[1] == ref.page_size_bytes,
                f"kv_caches.group_data_refs[0][{index}]",
                lambda: (
                    f"must be a contiguous (num_blocks, page bytes) tensor without padding, got shape {tuple(tensor.shape)} "
                    f"strides {tensor.stride()} for a page of {ref.page_size_bytes} bytes"
                ),
            )
            layers.append(tensor.view(torch.uint8).view(tensor.shape[0], 1, tensor.shape[1]))
        self.kv_pool = KVPool.mla(layers)  # a block is a slot; a layer's page is its row
        host_pool = HostPool.like(self.kv_pool, num_pages=num_host_pages, page_size=1)
        self.copier = Copier(self.kv_pool, host_pool)
        self._workers = StoreWorkers()
        self.storage = storage
        try:
            self.keyed = KeyedCopies(self.copier, storage, self._workers)
        except BaseException:
            self.copier.close()  # the caller keeps the store: it is this worker's only once built
            self._workers.close()
            raise
        self.report_load_errors = report_load_errors
        self.load_failure_policy = load_failure_policy
        self.pages_failed = 0  # pages of store jobs not written (reported done to vLLM)
        self.loads_failed = 0  # load jobs that could not read every page
        self._load_blocks: dict[int, list[int]] = {}  # load job id -> its GPU block ids
        self._load_errors: set[int] = set()
        self.reports_stores = reports_stores
        self._unwritten: list[str] = []  # keys of store jobs not written, since the last report
        self._removed: list[str] = []  # keys the store evicted or removed, in order

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: KVStageLoadStoreSpec) -> bool:
        """Copy the GPU blocks out and write them under the spec's keys, each chained to the
        spec's prior key (asynchronously); always accepted."""
        self.keyed.store(job_id, self._slots(src_spec), dst_spec.page_keys, prior_keys=dst_spec.prior_keys)
        return True

    def submit_load(
        self, job_id: int, src_spec: KVStageLoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        """Read the spec's keys and copy them into the GPU blocks (asynchronously); always
        accepted."""
        slots = self._slots(dst_spec)
        self.keyed.load(job_id, src_spec.page_keys, slots)
        self._load_blocks[job_id] = [int(block) for block in dst_spec.block_ids]
        return True

    def _slots(self, gpu_spec: GPULoadStoreSpec) -> torch.Tensor:
        return torch.from_numpy(gpu_spec.block_ids.astype("int64")).to(self.kv_pool.device)

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call; never blocks."""
        results = []
        for result in self.keyed.poll():
            ok = result.ok
            if result.is_store:
                block_ids = None
                if not ok:
                    written = result.bytes // self.storage.page_bytes
                    self.pages_failed += result.num_pages - written
                    logger.warning(
                        "kvstage: store job %s wrote %d of %d pages: %s",
                        result.job,
                        written,
                        result.num_pages,
                        write_failure_cause(result.error),
                    )
                    ok = True  # vLLM only frees the blocks; the manager learns which pages are missing
                    if self.reports_stores:
                        self._unwritten.extend(result.failed_keys)
            else:
                block_ids = self._load_blocks.pop(result.job, [])
                if not ok:
                    self.loads_failed += 1
                    failed = block_ids[
                        result.loaded_pages :
                    ]  # vLLM's scheduler recomputes from the first invalid block
                    logger.warning(
                        "kvstage: load job %s: page %d of %d could not be read (%s); %s",
                        result.job,
                        result.loaded_pages,
                        result.num_pages,
                        read_failure_cause(result.error),
                        self._load_failure_outcome(len(failed)),
                    )
                    if self.report_load_errors:
                        self._load_errors.update(failed)
                        ok = True
            results.append(TransferResult(result.job, ok, transfer_size=result.bytes, transfer_time=result.seconds))
        if self.reports_stores:  # after the jobs: a put's eviction is reported with the job that made it
            self._take_store_events()
        return results

    def _take_store_events(self) -> None:
        prefix = self.storage.prefix
        self._removed.extend(
            event.key
            for event in self.storage.take_events()
            if event.kind != "stored" and event.key_space == prefix  # stores are the scheduler's to announce
        )

    def take_store_report(self) -> tuple[list[str], list[str]]:
        """What the scheduler's manager must know of this worker's stores since the last call
        (with ``reports_stores``): the page keys store jobs reported done could not write, and
        the page keys the store evicted or removed in this worker's key space, in order. Each
        is taken by the :meth:`get_finished` call that reports its job done, or a later one."""
        report = self._unwritten, self._removed
        self._unwritten, self._removed = [], []
        return report

    def _load_failure_outcome(self, num_blocks: int) -> str:
        """What vLLM does with a failed load, by the policy in force."""
        if not self.report_load_errors:
            return "reported as a failed transfer (vLLM's OffloadingConnector stops the engine; use KVStageConnector)"
        if self.load_failure_policy == "recompute":
            return f"its {num_blocks} blocks from that page on are computed again (kv_load_failure_policy 'recompute')"
        return f"its {num_blocks} blocks from that page on are reported invalid and vLLM fails the request (kv_load_failure_policy {self.load_failure_policy!r})"

    def take_block_ids_with_load_errors(self) -> set[int]:
        """GPU block ids of loads that failed since the last call (vLLM's
        ``get_block_ids_with_load_errors``); a load's job is reported done in the same
        :meth:`get_finished` call or an earlier one."""
        block_ids, self._load_errors = self._load_errors, set()
        return block_ids

    def wait(self, job_ids: set[int]) -> None:
        """Block until the given jobs finished (their results stay for :meth:`get_finished`)."""
        self.keyed.wait(list(job_ids))

    def shutdown(self) -> None:
        """vLLM's worker shutdown: as :meth:`close`."""
        self.close()

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the jobs in flight (at most ``timeout_s`` seconds: gathers still to be
        written, parts waiting for host pages), then stop the threads and close the store;
        jobs unfinished by then are dropped and logged. Idempotent."""
        if self.storage is None:
            return
        if not self.keyed.wait(timeout=timeout_s):
            logger.warning(
                "kvstage: worker closed with %d jobs unfinished after %.1f s; their pages are dropped",
                self.keyed.jobs_in_flight,
                timeout_s,
            )
        self.copier.close()
        self._workers.close()
        release_shared_storage(self.storage)
        self.storage = None
