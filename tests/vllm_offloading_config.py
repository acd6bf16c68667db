"""vLLM's ``OffloadingConfig`` and keyed chunks, for tests that build a spec or tier without a
scheduler (importable as ``vllm_offloading_config``; they import vLLM lazily)."""

from __future__ import annotations

CHUNK_BYTES = 4096  # one block of one worker a chunk: the page-aligned row vLLM's primary tier keeps


def keys_of(*ids: int, tag: str = "block") -> list[bytes]:
    """vLLM ``OffloadKey``s of KV group 0, one per id: ``"<tag>-<id>"`` padded to a 32-byte hash."""
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(f"{tag}-{i}".encode().ljust(32, b"."), 0) for i in ids]


def chunks_for(keys: list[bytes], seed: int = 7) -> dict:
    """Random CHUNK_BYTES uint8 chunks (torch tensors) by key, from ``seed``."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return {key: torch.randint(0, 256, (CHUNK_BYTES,), dtype=torch.uint8, generator=generator) for key in keys}


def offloading_config(
    extra_config: dict,
    *,
    events: bool = True,
    engine_id: str | None = None,
    world_size: int = 1,
    rank: int = 0,
    window_chunks: int | None = None,
):
    """vLLM's OffloadingConfig for a model of one KV group (2 layers, 16-token blocks) whose
    worker holds CHUNK_BYTES a block, as vLLM's connector builds it for a spec; with
    ``window_chunks`` a hybrid model's second group (1 layer) keeping that many chunks a request
    (vLLM's ``sliding_window_size_in_chunks``: a sliding window, or 1 for a Mamba state)."""
    import uuid

    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    groups = [OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0", "model.layers.1"), group_id=0)]
    if window_chunks is not None:
        groups.append(
            OffloadingGroupConfig(
                tokens_per_block=16,
                layer_names=("model.layers.2",),
                group_id=1,
                sliding_window_size_in_chunks=window_chunks,
            )
        )
    return OffloadingConfig(
        groups=tuple(groups),
        worker_kv_bytes_per_block=CHUNK_BYTES,
        enable_kv_cache_events=events,
        extra_config=extra_config,
        engine_id=engine_id or f"kvstage-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name="org/tiny-llama", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
