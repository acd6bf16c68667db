"""kvstage inside vLLM 0.33.0's KV offloading (``pip install "kvstage[vllm]"``).

Public API:
    KVStageTier: a kvstage store (memory, file, Mooncake) as a secondary tier of vLLM's
        ``TieringOffloadingSpec`` (config: ``{"type": "KVStageTier", "module_path":
        "kvstage.integrations.vllm", "storage": URL}``).

Modules: ``keys`` (offload keys as page keys, the fingerprint of vLLM's chunks, store events as
vLLM events), ``tier`` (``KVStageTier``). Importing this package imports vLLM.
"""

from kvstage.integrations.vllm.tier import KVStageTier

__all__ = ["KVStageTier"]
