"""Test helpers for tests/integrations/vllm (importable as ``vllm_rig``; they import vLLM lazily)."""

from __future__ import annotations


CHUNK_BYTES = 4096  # one block of one worker a chunk: the page-aligned row vLLM's primary tier keeps


def offloading_config(extra_config: dict, *, events: bool = True, engine_id: str | None = None, world_size: int = 1, rank: int = 0):
    """vLLM's OffloadingConfig for a model of one KV group (2 layers, 16-token blocks) whose
    worker holds CHUNK_BYTES a block, as vLLM's connector builds it for a spec."""
    import uuid

    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0", "model.layers.1"), group_id=0),),
        worker_kv_bytes_per_block=CHUNK_BYTES,
        enable_kv_cache_events=events,
        extra_config=extra_config,
        engine_id=engine_id or f"kvstage-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name="org/tiny-llama", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank, world_size=world_size, tp_size=world_size, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=False,
        ),
    )
