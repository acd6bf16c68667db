"""``KVStageConnector``: vLLM 0.33.0's ``OffloadingConnector`` with a path for failed loads, and
the workers' stores reported to the scheduler.

vLLM's ``OffloadingConnector`` asserts that every transfer its worker reports succeeded
(``offloading/worker.py``) and reports no block as failed to load, so a page a store cannot give
back (corrupt, evicted by another process between lookup and load) would stop the engine. vLLM's
scheduler itself can take such a failure: a connector's ``get_block_ids_with_load_errors`` names
the blocks, and with ``kv_load_failure_policy`` ``"recompute"`` the scheduler computes them again
(``"fail"``, vLLM's default, fails the requests). For a model of several KV cache groups vLLM
0.33.0's scheduler refuses block ids (``_handle_invalid_blocks`` raises: a block id names a block
only within its group) and takes the request instead, in ``get_transfer_results``'
``failed_recving``: it drops the request's loaded tokens and looks it up again, and the pages the
load stopped at are misses by then, so it hits what every group can still restore. This
connector is vLLM's own with those two paths, fed by :class:`KVStageWorker`.

Its workers also report, through vLLM's own worker-to-scheduler metadata
(``KVConnectorOutput.kv_connector_worker_meta``, which vLLM's executors carry from worker
processes and aggregate across ranks), which pages their store jobs could not write and what
their stores evicted or removed (:class:`KVStageWorkerMetadata`), so the scheduler's manager
announces every stored and evicted block on vLLM's KV-event path whatever process the worker
runs in::

    --kv-transfer-config '{"kv_connector": "KVStageConnector",
        "kv_connector_module_path": "kvstage.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"spec_name": "KVStageOffloadingSpec",
            "spec_module_path": "kvstage.integrations.vllm", "storage": "file:/var/cache/kv"}}'
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvstage.errors import InvalidArgumentError, require
from kvstage.integrations.vllm.groups import KV_CACHE_CONFIG
from kvstage.integrations.vllm.manager import KVStageOffloadingManager
from kvstage.integrations.vllm.spec import KVStageOffloadingSpec

__all__ = ["KVStageConnector", "KVStageWorkerMetadata"]

logger = logging.getLogger(__name__)


_SPEC_NAME, _SPEC_MODULE = "KVStageOffloadingSpec", "kvstage.integrations.vllm"


def check_spec_config(extra_config) -> None:
    """Check that ``kv_connector_extra_config`` names kvstage's spec, without building it.

    The spec_name is required rather than defaulted: vLLM's own default is its CPU spec, and
    writing a default into the config would change vLLM's config after it was validated (and
    sent to the workers); an explicit error names what to write.

    Raises:
        InvalidArgumentError: naming ``spec_name`` or ``spec_module_path`` and the value to use.
    """
    want = f"spec_name '{_SPEC_NAME}' with spec_module_path '{_SPEC_MODULE}'"
    name, module = extra_config.get("spec_name"), extra_config.get("spec_module_path")
    require(
        isinstance(name, str),
        "spec_name",
        f"required in kv_connector_extra_config: KVStageConnector runs '{_SPEC_NAME}' (vLLM's default is its CPU spec); give {want}",
    )
    try:  # vLLM's own lookup (its registered specs by name, others from spec_module_path): imports, builds nothing
        spec_cls = OffloadingSpecFactory.get_spec_cls({"spec_name": name, "spec_module_path": module})
    except (ImportError, AttributeError, ValueError) as error:
        require(
            module is not None,
            "spec_module_path",
            f"required in kv_connector_extra_config with spec_name {name!r}: give '{_SPEC_MODULE}'",
        )
        raise InvalidArgumentError(
            f"spec_module_path: cannot load {name!r} from {module!r} ({error}); give {want}"
        ) from None
    except AssertionError:  # vLLM asserts the class is an OffloadingSpec
        raise InvalidArgumentError(
            f"spec_name: KVStageConnector runs '{_SPEC_NAME}' (give {want}), got {name!r}, not an OffloadingSpec"
        ) from None
    require(
        isinstance(spec_cls, type) and issubclass(spec_cls, KVStageOffloadingSpec),
        "spec_name",
        lambda: f"KVStageConnector runs '{_SPEC_NAME}' (give {want}), got {name!r}",
    )


@dataclass
class KVStageWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker-to-scheduler metadata of the offloading connector (completed jobs,
    transfer stats) plus what the workers' stores did, summed over workers by
    :meth:`aggregate` as vLLM's ``KVOutputAggregator`` does.

    Attributes:
        unwritten_keys: page keys (hex ``OffloadKey``) store jobs reported done could not write.
        removed_keys: page keys the workers' stores evicted or removed, in order per worker.
        unreadable_keys: page keys failed loads stopped at (:meth:`KVStageWorker.take_unreadable_keys`).
    """

    unwritten_keys: list[str] = field(default_factory=list)
    removed_keys: list[str] = field(default_factory=list)
    unreadable_keys: list[str] = field(default_factory=list)

    def aggregate(self, other) -> "KVStageWorkerMetadata":
        """This worker's metadata and ``other``'s (a plain ``OffloadingWorkerMetadata`` adds
        no keys)."""
        merged = OffloadingWorkerMetadata.aggregate(self, other)
        return KVStageWorkerMetadata(
            completed_jobs=merged.completed_jobs,
            transfer_stats=merged.transfer_stats,
            unwritten_keys=self.unwritten_keys + getattr(other, "unwritten_keys", []),
            removed_keys=self.removed_keys + getattr(other, "removed_keys", []),
            unreadable_keys=self.unreadable_keys + getattr(other, "unreadable_keys", []),
        )


class KVStageConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector`` over :class:`KVStageOffloadingSpec` that reports failed
    loads to vLLM's scheduler instead of stopping the engine: their blocks
    (``get_block_ids_with_load_errors``) for a model of one KV cache group, their requests
    (``failed_recving``) for several, as vLLM 0.33.0's scheduler takes them.

    Args:
        vllm_config, role, kv_cache_config: as vLLM's ``OffloadingConnector`` (vLLM passes them).

    Raises:
        InvalidArgumentError: ``spec_name`` is missing or names another spec than
            ``KVStageOffloadingSpec``, or ``spec_module_path`` is missing or does not give it;
            before vLLM builds any spec (another spec may map shared memory as it is built);
            or ``sync_load_budget_bytes`` set for a model of several KV cache groups (vLLM
            0.33.0's scheduler has no path for a failed sync load of such a model: its request
            runs in the step of its load, and ``failed_recving`` names waiting requests only).
    """

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        extra_config = vllm_config.kv_transfer_config.kv_connector_extra_config
        check_spec_config(extra_config)
        # vLLM's scheduler takes block ids of failed loads for one KV cache group only (all groups count)
        by_request = len(kv_cache_config.kv_cache_groups) > 1
        require(
            not (by_request and int(extra_config.get("sync_load_budget_bytes", 0) or 0)),
            "sync_load_budget_bytes",
            lambda: (
                f"must be 0 for a model of {len(kv_cache_config.kv_cache_groups)} KV cache groups: vLLM's scheduler "
                f"cannot recompute a failed sync load of such a model, got {extra_config.get('sync_load_budget_bytes')!r}"
            ),
        )
        token = KV_CACHE_CONFIG.set(kv_cache_config)  # the spec vLLM builds here reads each group's kind
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            KV_CACHE_CONFIG.reset(token)
        if self.connector_worker is not None:
            spec = self.connector_worker.spec
            require(
                isinstance(spec, KVStageOffloadingSpec),
                "spec_name",
                lambda: f"KVStageConnector runs KVStageOffloadingSpec, got {type(spec).__name__}",
            )
            spec.report_load_errors = True  # before vLLM asks the spec for its worker
            spec.load_errors_by_request = by_request
            spec.reports_stores = True
            spec.load_failure_policy = vllm_config.kv_transfer_config.kv_load_failure_policy
        else:
            manager = self.connector_scheduler.manager
            require(
                isinstance(manager, KVStageOffloadingManager),
                "spec_name",
                lambda: f"KVStageConnector runs KVStageOffloadingSpec, got a {type(manager).__name__}",
            )
            manager.workers_report_stores = True  # and the workers' stores
        # worker side, several groups: the request of each async load job in flight (from the metadata)
        self._load_requests: dict[int, str] | None = {} if by_request and self.connector_worker is not None else None
        policy = vllm_config.kv_transfer_config.kv_load_failure_policy
        if policy != "recompute":
            logger.warning(
                "kvstage: kv_load_failure_policy is %r: a request whose load fails (a corrupt or evicted page) fails; "
                "'recompute' computes its blocks again",
                policy,
            )

    def build_connector_worker_meta(self) -> KVStageWorkerMetadata | None:
        """vLLM's metadata of this worker's step (completed jobs, transfer stats) with the
        worker's store report (:meth:`KVStageWorker.take_store_report`) and the pages its
        failed loads stopped at (:meth:`KVStageWorker.take_unreadable_keys`); None when there is
        nothing to report."""
        meta = super().build_connector_worker_meta()
        worker = None if self.connector_worker is None else self.connector_worker.worker
        unwritten, removed = worker.take_store_report() if worker is not None else ([], [])
        unreadable = worker.take_unreadable_keys() if worker is not None else []
        if meta is None and not unwritten and not removed and not unreadable:
            return None
        base = meta or OffloadingWorkerMetadata()
        return KVStageWorkerMetadata(
            completed_jobs=base.completed_jobs,
            transfer_stats=base.transfer_stats,
            unwritten_keys=unwritten,
            removed_keys=removed,
            unreadable_keys=unreadable,
        )

    def update_connector_output(self, connector_output) -> None:
        """The workers' report first: the pages their failed loads stopped at become misses
        for ``miss_ttl_s`` (:meth:`KVStageOffloadingManager.loads_failed`: vLLM computes them
        instead of loading them again, and a request it looks up again hits what is still
        restorable), and their stores (:meth:`KVStageOffloadingManager.stores_reported`:
        before vLLM completes the store jobs of this output, so a page a worker did not write
        is not announced); then vLLM's bookkeeping of the workers' output (scheduler side)."""
        manager = self.connector_scheduler.manager
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVStageWorkerMetadata):
            with manager.lock:
                if meta.unreadable_keys:
                    manager.loads_failed(meta.unreadable_keys)
                if meta.unwritten_keys or meta.removed_keys:
                    manager.stores_reported(meta.unwritten_keys, meta.removed_keys)
        super().update_connector_output(connector_output)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        """vLLM's start of the step's transfers; for several KV cache groups, first the request
        of each async load job in this step's metadata (its failure names the request)."""
        if self._load_requests is not None:
            for job_id, job in self._get_connector_metadata().load_jobs.items():
                if not job.sync:  # refused at start for several groups (sync_load_budget_bytes)
                    self._load_requests[job_id] = job.req_id
        super().start_load_kv(forward_context, **kwargs)

    def get_transfer_results(self, finished_req_ids: set[str]):
        """vLLM's finished transfers (worker side); for several KV cache groups, with the
        requests whose loads failed in ``failed_recving`` (each also in ``finished_recving``,
        as vLLM's output aggregator requires), which vLLM's scheduler computes again from what
        the store can still restore (``kv_load_failure_policy`` ``"recompute"``) or fails."""
        results = super().get_transfer_results(finished_req_ids)
        if self._load_requests is not None:
            failed = self.connector_worker.worker.take_failed_load_jobs()
            results.failed_recving.update(self._load_requests[job_id] for job_id in failed)
            done = results.finished_recving
            self._load_requests = {job: req for job, req in self._load_requests.items() if req not in done}
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of loads that failed since the last call (worker side; vLLM calls it after
        collecting the step's finished transfers); none for several KV cache groups (their
        failed loads are requests in :meth:`get_transfer_results`)."""
        worker = None if self.connector_worker is None else self.connector_worker.worker
        return set() if worker is None else worker.take_block_ids_with_load_errors()
