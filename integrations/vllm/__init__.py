"""kvstage inside vLLM 0.33.0's KV offloading (``pip install "kvstage[vllm]"``).

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
vLLM events), ``tier`` (``KVStageTier``), ``spec`` (``KVStageOffloadingSpec``), ``manager``
(its scheduler side), ``worker`` (its worker side), ``connector`` (``KVStageConnector``). Importing this package imports vLLM.
"""

from kvstage.integrations.vllm.connector import KVStageConnector
from kvstage.integrations.vllm.manager import KVStageOffloadingManager
from kvstage.integrations.vllm.spec import KVStageOffloadingSpec
from kvstage.integrations.vllm.worker import KVStageWorker
from kvstage.integrations.vllm.tier import KVStageTier

__all__ = ["KVStageConnector", "KVStageOffloadingManager", "KVStageOffloadingSpec", "KVStageTier", "KVStageWorker"]
