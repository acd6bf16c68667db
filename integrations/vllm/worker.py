"""``KVStageWorker``: the worker side of :class:`KVStageOffloadingSpec`.

It moves one worker's blocks between vLLM's canonical block tensors and the store: a block is a
slot of a :class:`kvstage.kernels.KVPool` whose layers are the group's block tensors, copied by
kvstage's :class:`kvstage.offload.Copier` and written and read on
:class:`kvstage.offload.StoreWorkers` threads through :class:`kvstage.offload.KeyedCopies`.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec, OffloadingWorker, TransferResult

from kvstage.errors import InvalidArgumentError, require
from kvstage.integrations.vllm.manager import KVStageLoadStoreSpec
from kvstage.kernels import KVPool
from kvstage.offload import Copier, HostPool, KeyedCopies, StoreWorkers
from kvstage.storage.shared import release_shared_storage

__all__ = ["KVStageWorker"]


class KVStageWorker(OffloadingWorker):
    """Moves one worker's blocks between vLLM's canonical block tensors and the store.

    Args:
        kv_caches: vLLM's ``CanonicalKVCaches`` of one KV group: each layer's tensor
            ``(num_blocks, page_size_bytes)`` int8, contiguous, unpadded.
        storage: the store; its page is one block of every layer of the group.
        num_host_pages: host pages for blocks in flight.

    Raises:
        InvalidArgumentError: more than one group, a padded or strided layer tensor, layers of
            different page sizes, or a store of another page size; before anything is allocated.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, storage: Any, *, num_host_pages: int = 256) -> None:
        require(len(kv_caches.group_data_refs) == 1, "kv_caches", lambda: f"must hold one KV group, got {len(kv_caches.group_data_refs)}")
        layers = []
        for index, ref in enumerate(kv_caches.group_data_refs[0]):
            tensor = kv_caches.tensors[ref.tensor_idx].tensor
            require(
                tensor.dim() == 2 and tensor.is_contiguous() and tensor.shape[1] == ref.page_size_bytes,
                f"kv_caches.group_data_refs[0][{index}]",
                lambda: f"must be a contiguous (num_blocks, page bytes) tensor without padding, got shape {tuple(tensor.shape)} "
                f"strides {tensor.stride()} for a page of {ref.page_size_bytes} bytes",
            )
            layers.append(tensor.view(torch.uint8).view(tensor.shape[0], 1, tensor.shape[1]))
        self.kv_pool = KVPool.mla(layers)  # a block is a slot; a layer's page is its row
        host_pool = HostPool.like(self.kv_pool, num_pages=num_host_pages, page_size=1)
        self.copier = Copier(self.kv_pool, host_pool)
        self._workers = StoreWorkers()
        self.storage = storage
        try:
            self.keyed = KeyedCopies(self.copier, storage, self._workers)
        except InvalidArgumentError:
            self.close()
            raise
        self._refused: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: KVStageLoadStoreSpec) -> bool:
        """Copy the GPU blocks out and write them under the spec's keys (asynchronously)."""
        return self._submit(job_id, lambda slots: self.keyed.store(job_id, slots, dst_spec.page_keys), src_spec)

    def submit_load(self, job_id: int, src_spec: KVStageLoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False) -> bool:
        """Read the spec's keys and copy them into the GPU blocks (asynchronously)."""
        return self._submit(job_id, lambda slots: self.keyed.load(job_id, src_spec.page_keys, slots), dst_spec)

    def _submit(self, job_id: int, submit, gpu_spec: GPULoadStoreSpec) -> bool:
        slots = torch.from_numpy(gpu_spec.block_ids.astype("int64")).to(self.kv_pool.device)
        if not submit(slots):
            # No free host pages now: the job fails (vLLM drops the store, or recomputes).
            self._refused.append(TransferResult(job_id=job_id, success=False))
        return True

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call; never blocks."""
        results, self._refused = self._refused, []
        for result in self.keyed.poll():
            results.append(TransferResult(result.job, result.ok, transfer_size=result.bytes, transfer_time=result.seconds))
        return results

    def wait(self, job_ids: set[int]) -> None:
        """Block until the given jobs finished (their results stay for :meth:`get_finished`)."""
        self.keyed.wait(list(job_ids))

    def shutdown(self) -> None:
        self.close()

    def close(self) -> None:
        """Wait for copies, stop the threads, close the store. Idempotent."""
        if self.storage is None:
            return
        self.copier.close()
        self._workers.close()
        release_shared_storage(self.storage)
        self.storage = None
