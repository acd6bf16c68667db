"""``KVStageConnector``: vLLM 0.33.0's ``OffloadingConnector`` with a path for failed loads.

vLLM's ``OffloadingConnector`` asserts that every transfer its worker reports succeeded
(``offloading/worker.py``) and reports no block as failed to load, so a page a store cannot give
back (corrupt, evicted by another process between lookup and load) would stop the engine. vLLM's
scheduler itself can take such a failure: a connector's ``get_block_ids_with_load_errors`` names
the blocks, and with ``kv_load_failure_policy`` ``"recompute"`` the scheduler computes them again
(``"fail"``, vLLM's default, fails the requests). This connector is vLLM's own with that one
method, fed by :class:`KVStageWorker`::

    --kv-transfer-config '{"kv_connector": "KVStageConnector",
        "kv_connector_module_path": "kvstage.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"spec_name": "KVStageOffloadingSpec",
            "spec_module_path": "kvstage.integrations.vllm", "storage": "file:/var/cache/kv"}}'
"""

from __future__ import annotations

import logging

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvstage.errors import InvalidArgumentError, require
from kvstage.integrations.vllm.manager import KVStageOffloadingManager
from kvstage.integrations.vllm.spec import KVStageOffloadingSpec

__all__ = ["KVStageConnector"]

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


class KVStageConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector`` over :class:`KVStageOffloadingSpec` that reports the
    blocks of failed loads to vLLM's scheduler instead of stopping the engine.

    Args:
        vllm_config, role, kv_cache_config: as vLLM's ``OffloadingConnector`` (vLLM passes them).

    Raises:
        InvalidArgumentError: ``spec_name`` is missing or names another spec than
            ``KVStageOffloadingSpec``, or ``spec_module_path`` is missing or does not give it;
            before vLLM builds any spec (another spec may map shared memory as it is built).
    """

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        check_spec_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_worker is not None:
            spec = self.connector_worker.spec
            require(
                isinstance(spec, KVStageOffloadingSpec),
                "spec_name",
                lambda: f"KVStageConnector runs KVStageOffloadingSpec, got {type(spec).__name__}",
            )
            spec.report_load_errors = True  # before vLLM asks the spec for its worker
            spec.load_failure_policy = vllm_config.kv_transfer_config.kv_load_failure_policy
        else:
            manager = self.connector_scheduler.manager
            require(
                isinstance(manager, KVStageOffloadingManager),
                "spec_name",
                lambda: f"KVStageConnector runs KVStageOffloadingSpec, got a {type(manager).__name__}",
            )
            manager.tracks_loads = True  # update_connector_output reports each step's loads
        policy = vllm_config.kv_transfer_config.kv_load_failure_policy
        if policy != "recompute":
            logger.warning(
                "kvstage: kv_load_failure_policy is %r: a request whose load fails (a corrupt or evicted page) fails; "
                "'recompute' computes its blocks again",
                policy,
            )

    def update_connector_output(self, connector_output) -> None:
        """vLLM's bookkeeping of the workers' output (scheduler side), then: blocks reported
        with load errors make the keys of the loads that ended in this output misses for
        ``miss_ttl_s`` (:meth:`KVStageOffloadingManager.loads_reported`), so vLLM computes
        them instead of loading them again."""
        super().update_connector_output(connector_output)
        manager = self.connector_scheduler.manager
        with manager.lock:
            manager.loads_reported(failed=bool(connector_output.invalid_block_ids))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of loads that failed since the last call (worker side; vLLM calls it after
        collecting the step's finished transfers)."""
        worker = None if self.connector_worker is None else self.connector_worker.worker
        return set() if worker is None else worker.take_block_ids_with_load_errors()
