"""``KVStageWorker``: the worker side of :class:`KVStageOffloadingSpec`.

It moves one worker's blocks between vLLM's canonical block tensors and the store: a block is a
slot of a :class:`kvstage.kernels.KVPool` whose layers are the group's block tensors, copied by
kvstage's :class:`kvstage.offload.Copier` and written and read on
:class:`kvstage.offload.StoreWorkers` threads through :class:`kvstage.offload.KeyedCopies`; or,
where the blocks are in host memory and the store adopts and lends pages, copied once each way
on those threads by :class:`kvstage.offload.one_hop_copies.OneHopCopies`.
No job's failure reaches vLLM as a failed transfer (see :class:`KVStageWorker`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec, OffloadingWorker, TransferResult

from kvstage.errors import require
from kvstage.integrations.vllm.groups import group_of_key
from kvstage.integrations.vllm.manager import KVStageLoadStoreSpec
from kvstage.kernels import KVPool
from kvstage.offload import Copier, HostPool, KeyedCopies, StoreWorkers
from kvstage.offload.one_hop_copies import OneHopCopies
from kvstage.offload.store_io import read_failure_cause, write_failure_cause
from kvstage.storage.backend import adopts_pages, lends_pages
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
    scheduler (``kv_load_failure_policy``: ``"recompute"`` computes them again), or, for a model
    of several KV cache groups (``load_errors_by_request``), with its job id in
    :meth:`take_failed_load_jobs`, which the connector reports as the request's failed receive
    (vLLM's ``failed_recving``: a block id names a block only within its group). Either way the
    page each failed group part stopped at is kept for :meth:`take_unreadable_keys`. Without that
    connector (``report_load_errors`` False) a failed load is reported failed: vLLM's own
    ``OffloadingConnector`` has no way to take it and its worker stops the engine.

    Args:
        kv_caches: vLLM's ``CanonicalKVCaches``: each layer's tensor ``(num_blocks, page bytes)``
            int8, contiguous (a row's padding is stored with it).
        storage: the store; its page is one block of every layer of the group; for several
            groups a :class:`kvstage.integrations.vllm.groups.GroupStores` (a store per group).
        num_host_pages: host pages for blocks in flight (a job of more blocks moves in parts);
            on the one-hop path the pages of one put or loan, and the spare page buffers kept.
        report_load_errors: failed loads go to :meth:`take_block_ids_with_load_errors`: the
            blocks from the first page that did not land on (the pages before it landed); the
            page each stopped at goes to :meth:`take_unreadable_keys`.
        load_errors_by_request: with ``report_load_errors``, a failed load's job id goes to
            :meth:`take_failed_load_jobs` instead of its blocks (vLLM 0.33.0's scheduler refuses
            block ids of failed loads for a model of several KV cache groups).
        load_failure_policy: vLLM's ``kv_load_failure_policy`` (``"recompute"`` or ``"fail"``),
            for the warnings only.
        reports_stores: keep for :meth:`take_store_report` the keys each store job could not
            write and the store's evictions and removals of this worker's key space
            (:class:`KVStageConnector` hands them to the scheduler's manager; without it the
            store's events stay with the store, for a manager sharing this process).
        group_ids: the KV group ids of ``kv_caches.group_data_refs``, in order (several groups);
            None: one group. A job's blocks of each group move to and from that group's store,
            and a failed load names, per group, the blocks from its first page not read.

    Raises:
        InvalidArgumentError: several groups without ``group_ids`` (or groups other than the
            store's), a strided layer tensor, layers of different page sizes, or a store of another
            page size; before anything is allocated.
            On any raise the store stays the caller's (it is this worker's once built).
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        storage: Any,
        *,
        num_host_pages: int = 256,
        report_load_errors: bool = False,
        load_errors_by_request: bool = False,
        load_failure_policy: str = "fail",
        reports_stores: bool = False,
        group_ids: tuple[int, ...] | None = None,
    ) -> None:
        num_groups = len(kv_caches.group_data_refs)
        if group_ids is None:
            require(num_groups == 1, "kv_caches", lambda: f"must hold one KV group, got {num_groups}")
            stores = [storage]
        else:
            require(
                len(group_ids) == num_groups and list(getattr(storage, "stores", {})) == list(group_ids),
                "kv_caches",
                lambda: f"must hold the {len(group_ids)} KV groups {list(group_ids)} the store keys, got {num_groups}",
            )
            stores = [storage.stores[group_id] for group_id in group_ids]
        self.group_ids = group_ids
        self._group_index = {group_id: index for index, group_id in enumerate(group_ids or ())}
        self._workers = StoreWorkers()
        self._movers: list[_GroupMover] = []
        try:
            for index, store in enumerate(stores):
                self._movers.append(
                    _GroupMover(kv_caches, index, store, num_host_pages=num_host_pages, workers=self._workers)
                )
        except BaseException:
            for mover in self._movers:  # the caller keeps the store: it is this worker's only once built
                mover.close()
            self._workers.close()
            raise
        first = self._movers[0]
        # the (first) group's; copier None where it moves in one hop (OneHopCopies)
        self.kv_pool, self.copier, self.keyed = first.kv_pool, first.copier, first.keyed
        self.storage = storage
        self.report_load_errors = report_load_errors
        self.load_errors_by_request = load_errors_by_request
        self.load_failure_policy = load_failure_policy
        self.pages_failed = 0  # pages of store jobs not written (reported done to vLLM)
        self.loads_failed = 0  # load jobs that could not read every page
        self._jobs: dict[int, _Job] = {}  # job id -> its parts (one per group with blocks in it)
        self._done: list[TransferResult] = []  # jobs of no blocks, reported at the next get_finished
        self._load_errors: set[int] = set()
        self._failed_load_jobs: list[int] = []  # load_errors_by_request: job ids of failed loads
        self._unreadable: list[str] = []  # the page each failed load's group part stopped at
        self.reports_stores = reports_stores
        self._unwritten: list[str] = []  # keys of store jobs not written, since the last report
        self._removed: list[str] = []  # keys the store evicted or removed, in order

    def _parts(self, gpu_spec: GPULoadStoreSpec, page_keys: list[str], prior_keys: list | None) -> list[tuple]:
        """A job's parts, one per group with blocks in it: (group index, block ids, page keys,
        prior keys). vLLM orders the blocks by group (``group_sizes``, in the offloading
        config's group order); a key names its group (its last 4 bytes)."""
        block_ids = [int(block) for block in gpu_spec.block_ids]
        if self.group_ids is None:
            return [(0, block_ids, list(page_keys), prior_keys)]
        keys: list[list[str]] = [[] for _ in self._movers]
        priors: list[list] = [[] for _ in self._movers]
        for position, key in enumerate(page_keys):
            group = group_of_key(key)
            require(group in self._group_index, "page_keys", lambda: f"key {key!r} is of group {group}, not offloaded")
            keys[self._group_index[group]].append(key)
            priors[self._group_index[group]].append(None if prior_keys is None else prior_keys[position])
        parts, start = [], 0
        for index, size in enumerate(gpu_spec.group_sizes):
            blocks, start = block_ids[start : start + size], start + size
            require(
                len(keys[index]) == size,
                "page_keys",
                lambda: f"group {self.group_ids[index]} has {size} blocks and {len(keys[index])} keys in the job",
            )
            if size:
                parts.append((index, blocks, keys[index], None if prior_keys is None else priors[index]))
        return parts

    def _submit(self, job_id: int, parts: list[tuple], is_store: bool) -> None:
        if not parts:
            self._done.append(TransferResult(job_id, True, transfer_size=0, transfer_time=0.0))
            return
        self._jobs[job_id] = _Job(
            is_store, {index: blocks for index, blocks, _, _ in parts}, {index: keys for index, _, keys, _ in parts}
        )
        for index, blocks, keys, priors in parts:
            mover = self._movers[index]
            slots = torch.tensor(blocks, dtype=torch.int64, device=mover.kv_pool.device)
            if is_store:
                mover.keyed.store(job_id, slots, keys, prior_keys=priors)
            else:
                mover.keyed.load(job_id, keys, slots)

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: KVStageLoadStoreSpec) -> bool:
        """Copy the GPU blocks out and write them under the spec's keys, each chained to the
        spec's prior key (asynchronously; a hybrid model's groups each to their own key space);
        always accepted."""
        self._submit(job_id, self._parts(src_spec, dst_spec.page_keys, dst_spec.prior_keys), is_store=True)
        return True

    def submit_load(
        self, job_id: int, src_spec: KVStageLoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        """Read the spec's keys and copy them into the GPU blocks (asynchronously); always
        accepted."""
        self._submit(job_id, self._parts(dst_spec, src_spec.page_keys, None), is_store=False)
        return True

    @property
    def jobs_in_flight(self) -> int:
        """Jobs submitted and not yet reported by :meth:`get_finished`."""
        return len(self._jobs) + len(self._done)

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call (every group's part of them); never blocks."""
        results, self._done = self._done, []
        for index, mover in enumerate(self._movers):
            for result in mover.keyed.poll():
                job = self._jobs[result.job]
                job.results[index] = result
                if len(job.results) == len(job.blocks):
                    del self._jobs[result.job]
                    results.append(self._finish(result.job, job))
        if self.reports_stores:  # after the jobs: a put's eviction is reported with the job that made it
            self._take_store_events()
        return results

    def _group_name(self, index: int) -> str:
        return "" if self.group_ids is None else f" (KV group {self.group_ids[index]})"

    def _finish(self, job_id: int, job: "_Job") -> TransferResult:
        """One job's result from its groups' parts."""
        ok = True
        for index, result in sorted(job.results.items()):
            if result.ok:
                continue
            ok = False
            if job.is_store:
                written = result.bytes // self._movers[index].storage.page_bytes
                self.pages_failed += result.num_pages - written
                logger.warning(
                    "kvstage: store job %s%s wrote %d of %d pages: %s",
                    job_id,
                    self._group_name(index),
                    written,
                    result.num_pages,
                    write_failure_cause(result.error),
                )
                if self.reports_stores:
                    self._unwritten.extend(result.failed_keys)
            else:
                failed = job.blocks[index][result.loaded_pages :]  # vLLM recomputes from the first invalid block
                logger.warning(
                    "kvstage: load job %s%s: page %d of %d could not be read (%s); %s",
                    job_id,
                    self._group_name(index),
                    result.loaded_pages,
                    result.num_pages,
                    read_failure_cause(result.error),
                    self._load_failure_outcome(len(failed)),
                )
                if self.report_load_errors and result.loaded_pages < len(job.keys[index]):
                    self._unreadable.append(job.keys[index][result.loaded_pages])
                    if not self.load_errors_by_request:
                        self._load_errors.update(failed)
        if not ok and not job.is_store:
            self.loads_failed += 1
            if self.report_load_errors and self.load_errors_by_request:
                self._failed_load_jobs.append(job_id)
        # a store that failed is reported done (vLLM only frees the blocks; the manager learns which
        # pages are missing); a failed load too where its blocks go to vLLM's scheduler
        reported_ok = ok or job.is_store or self.report_load_errors
        size = sum(result.bytes for result in job.results.values())
        seconds = max(result.seconds for result in job.results.values())
        return TransferResult(job_id, reported_ok, transfer_size=size, transfer_time=seconds)

    def _take_store_events(self) -> None:
        for mover in self._movers:
            prefix = mover.storage.prefix
            self._removed.extend(
                event.key
                for event in mover.storage.take_events()
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
        if self.load_errors_by_request:  # vLLM's failed_recving: the request, every group
            if self.load_failure_policy == "recompute":
                return (
                    "its request is computed again from what the store can still restore in every KV group "
                    "(kv_load_failure_policy 'recompute')"
                )
            return f"its request fails (kv_load_failure_policy {self.load_failure_policy!r})"
        if self.load_failure_policy == "recompute":
            return f"its {num_blocks} blocks from that page on are computed again (kv_load_failure_policy 'recompute')"
        return f"its {num_blocks} blocks from that page on are reported invalid and vLLM fails the request (kv_load_failure_policy {self.load_failure_policy!r})"

    def take_block_ids_with_load_errors(self) -> set[int]:
        """GPU block ids of loads that failed since the last call (vLLM's
        ``get_block_ids_with_load_errors``); a load's job is reported done in the same
        :meth:`get_finished` call or an earlier one."""
        block_ids, self._load_errors = self._load_errors, set()
        return block_ids

    def take_failed_load_jobs(self) -> list[int]:
        """Job ids of loads that failed since the last call (with ``load_errors_by_request``);
        a job is reported done in the same :meth:`get_finished` call."""
        job_ids, self._failed_load_jobs = self._failed_load_jobs, []
        return job_ids

    def take_unreadable_keys(self) -> list[str]:
        """Page keys (hex ``OffloadKey``) failed loads stopped at since the last call (with
        ``report_load_errors``): per failed group part of a job, its first page that did not
        land; the scheduler's manager makes them misses (the pages before them were read)."""
        keys, self._unreadable = self._unreadable, []
        return keys

    def wait(self, job_ids: set[int]) -> None:
        """Block until the given jobs finished (their results stay for :meth:`get_finished`)."""
        for mover in self._movers:
            mover.keyed.wait(list(job_ids))

    def shutdown(self) -> None:
        """vLLM's worker shutdown: as :meth:`close`."""
        self.close()

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the jobs in flight (at most ``timeout_s`` seconds: gathers still to be
        written, parts waiting for host pages), then stop the threads and close the store;
        jobs unfinished by then are dropped and logged. Idempotent."""
        if self.storage is None:
            return
        for index, mover in enumerate(self._movers):
            if not mover.keyed.wait(timeout=timeout_s):
                logger.warning(
                    "kvstage: worker closed with %d jobs%s unfinished after %.1f s; their pages are dropped",
                    mover.keyed.jobs_in_flight,
                    self._group_name(index),
                    timeout_s,
                )
        for mover in self._movers:
            mover.close()
        self._workers.close()
        release_shared_storage(self.storage)
        self.storage = None


class _Job:
    """A job's parts in flight: each group's blocks and page keys, and each group's result as it
    ends."""

    def __init__(self, is_store: bool, blocks: dict[int, list[int]], keys: dict[int, list[str]]) -> None:
        self.is_store = is_store
        self.blocks = blocks  # group index -> the job's GPU block ids of that group
        self.keys = keys  # group index -> the page keys of those blocks, in order
        self.results: dict[int, Any] = {}  # group index -> its KeyedResult


class _GroupMover:
    """One KV group's blocks: a :class:`KVPool` whose layers are the group's block tensors (a
    block is a slot; a layer's row, padding included, is its page) and how they move to and
    from the group's store: :class:`OneHopCopies` (one copy of each byte) where the blocks
    are in host memory and the store adopts and lends pages, else :class:`KeyedCopies` through
    a copier and host pages.

    Raises:
        InvalidArgumentError: a strided layer tensor, layers of different row sizes, or a store
            of another page size; before anything is allocated past the failing check.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, index: int, storage: Any, *, num_host_pages: int, workers) -> None:
        layers = []
        for layer, ref in enumerate(kv_caches.group_data_refs[index]):
            tensor = kv_caches.tensors[ref.tensor_idx].tensor
            require(
                tensor.dim() == 2 and tensor.is_contiguous() and tensor.shape[1] >= ref.page_size_bytes,
                f"kv_caches.group_data_refs[{index}][{layer}]",
                lambda: (
                    f"must be a contiguous (num_blocks, page bytes) tensor, got shape {tuple(tensor.shape)} "
                    f"strides {tensor.stride()} for a page of {ref.page_size_bytes} bytes"
                ),
            )
            layers.append(tensor.view(torch.uint8).view(tensor.shape[0], 1, tensor.shape[1]))
        self.kv_pool = KVPool.mla(layers)  # a block is a slot; a layer's page is its row
        block_bytes = sum(layer.shape[2] for layer in layers)
        require(
            storage.page_bytes == block_bytes,
            "storage",
            lambda: (
                f"holds pages of {storage.page_bytes} bytes, a block of the group's layers is {block_bytes} "
                "(each layer's row, padding included)"
            ),
        )
        self.storage = storage
        self.copier = None
        if self.kv_pool.device.type == "cpu" and adopts_pages(storage) and lends_pages(storage):
            rows = [layer.view(layer.shape[0], layer.shape[2]) for layer in layers]
            self.keyed = OneHopCopies(rows, storage, workers, part_pages=num_host_pages)
            return
        host_pool = HostPool.like(self.kv_pool, num_pages=num_host_pages, page_size=1)
        self.copier = Copier(self.kv_pool, host_pool)
        try:
            self.keyed = KeyedCopies(self.copier, storage, workers)
        except BaseException:
            self.copier.close()
            raise

    def close(self) -> None:
        """Stop the copier's stream (the two-hop path) or the row-copy threads (one hop); the store stays open."""
        if self.copier is not None:
            self.copier.close()
        else:
            self.keyed.close()
