"""kvstage inside vLLM 0.33.0's KV offloading (from a kvstage checkout: ``pip install ".[vllm]"``).

Public API:
    KVStageTier: a kvstage store (memory, file, Mooncake) as a secondary tier of vLLM's
        ``TieringOffloadingSpec`` (config: ``{"type": "KVStageTier", "module_path":
        "kvstage.integrations.vllm", "storage": URL}``).
    KVStageOffloadingSpec: kvstage as the OffloadingConnector's backend (``spec_name``
        ``"KVStageOffloadingSpec"``, ``spec_module_path`` ``"kvstage.integrations.vllm"``): its
        manager (``KVStageOffloadingManager``) and worker (``KVStageWorker``).
    KVStageConnector: vLLM's ``OffloadingConnector`` that hands failed loads to vLLM's scheduler
        (``kv_connector`` ``"KVStageConnector"``, ``kv_connector_module_path``
        ``"kvstage.integrations.vllm"``, ``kv_load_failure_policy`` ``"recompute"``).

Modules: ``keys`` (offload keys as page keys, the fingerprint of vLLM's chunks, store events as
vLLM events), ``groups`` (a hybrid model's KV cache groups as kvstage components, a key space
each), ``tier`` (``KVStageTier``), ``spec`` (``KVStageOffloadingSpec``), ``manager``
(its scheduler side), ``worker`` (its worker side), ``connector`` (``KVStageConnector``). Importing this package imports vLLM.

vLLM's ``--kv-offloading-size`` rewrites ``kv_connector`` by ``--kv-offloading-backend``
(``config/vllm.py`` ``_post_init_kv_transfer_config``: ``native``: ``"OffloadingConnector"``, or
``"SimpleCPUOffloadConnector"`` with ``VLLM_USE_SIMPLE_KV_OFFLOAD``; ``lmcache``:
``"LMCacheMPConnector"``) and keeps kvstage's ``kv_connector_module_path``, so vLLM looks that
name up here; the lookup raises an error saying what to do.
"""

from kvstage.integrations.vllm.connector import KVStageConnector
from kvstage.integrations.vllm.manager import KVStageOffloadingManager
from kvstage.integrations.vllm.spec import KVStageOffloadingSpec
from kvstage.integrations.vllm.tier import KVStageTier
from kvstage.integrations.vllm.worker import KVStageWorker

__all__ = ["KVStageConnector", "KVStageOffloadingManager", "KVStageOffloadingSpec", "KVStageTier", "KVStageWorker"]

# kv_connector names vLLM 0.33.0's --kv-offloading-size writes, with the backend that writes each.
_REWRITTEN_CONNECTORS = {
    "OffloadingConnector": "native",
    "SimpleCPUOffloadConnector": "native",
    "LMCacheMPConnector": "lmcache",
}


def __getattr__(name: str):
    """Module attribute fallback: a connector name vLLM's ``--kv-offloading-size`` writes
    raises a clear error (see the module doc).

    Raises:
        InvalidArgumentError: for a name in ``_REWRITTEN_CONNECTORS`` (vLLM's factory lets it
            through: it rewraps only AttributeError).
        AttributeError: for any other missing name.
    """
    if name in _REWRITTEN_CONNECTORS:
        from kvstage.errors import InvalidArgumentError

        raise InvalidArgumentError(
            "kv_connector: vLLM's --kv-offloading-size (cache_config.kv_offloading_size) with --kv-offloading-backend "
            f"{_REWRITTEN_CONNECTORS[name]!r} replaced kvstage's connector with {name!r} and kept kv_connector_module_path 'kvstage.integrations.vllm'; kvstage's connector "
            "offloads to its own store: leave out --kv-offloading-size (and --kv-offloading-backend) when "
            "--kv-transfer-config names KVStageConnector, or for a CPU tier in front of a kvstage store use "
            "spec_name 'TieringOffloadingSpec' with cpu_bytes_to_use and a KVStageTier secondary tier"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
