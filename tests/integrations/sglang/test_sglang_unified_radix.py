"""sglang 0.5.23's own ``UnifiedRadixCache.init_hicache`` on CPU with KVStageStorage as its L3
backend (``hicache_storage_backend="dynamic"``): sglang's Mamba stack strategy builds the host
pool set and the ``HybridCacheController``, which opens kvstage's store on both pools.

What blocks it on CPU, found here: sglang's assembler builds host pools with
``pin_memory=True``, whose ``cudaHostRegister`` (``pool_host.common._cuda_host_register``)
needs a CUDA torch; the test skips that registration (a CPU torch has nothing to register).
"""

from __future__ import annotations

import json

import pytest
import torch
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.environ import envs
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.runtime_context import get_context
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

from kvstage.integrations.sglang import KVStageStorage

from sglang_rig import PAGE_SIZE, extra_config, one_rank_gloo_world


@pytest.fixture(scope="module", autouse=True)
def one_rank_world(tmp_path_factory):
    with one_rank_gloo_world(tmp_path_factory.mktemp("gloo")) as world:
        yield world


@pytest.fixture
def cpu_host_pools(monkeypatch):
    """sglang's host pools on a CPU torch: no cudaHostRegister; the CPU server args restored after."""
    import sglang.srt.mem_cache.pool_host.common as pool_host_common

    monkeypatch.setattr(pool_host_common, "_cuda_host_register", lambda *args, **kwargs: None)
    yield
    get_context().override_server_args(device="cpu").install()


def mamba_unified_cache(url: str) -> UnifiedRadixCache:
    """A FULL + MAMBA ``UnifiedRadixCache`` (layers 1, 3 attention; 0, 2 Mamba2) whose
    ``init_hicache`` attaches KVStageStorage on ``url``, as sglang's scheduler does."""
    args = ServerArgs(
        model_path="dummy",
        page_size=PAGE_SIZE,
        hicache_io_backend="direct",
        hicache_mem_layout="page_first_direct",
        hicache_write_policy="write_through",
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(extra_config(url, model_id="org/tiny-hybrid")),
    )
    args._mamba_cache_chunk_size = 64  # the dummy model has no config to take it from
    set_global_server_args_for_scheduler(args)
    with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
        shape = Mamba2StateShape.create(
            tp_world_size=1, intermediate_size=32, n_groups=1, num_heads=2, head_dim=16, state_size=8, conv_kernel=4
        )
        mamba = Mamba2CacheParams(shape=shape, layers=[0, 2])
    requests = HybridReqToTokenPool(
        size=8,
        mamba_size=16,
        mamba_spec_state_size=8,
        max_context_len=256,
        device="cpu",
        enable_memory_saver=False,
        cache_params=mamba,
        mamba_layer_ids=[0, 2],
        enable_mamba_extra_buffer=True,
        speculative_num_draft_tokens=3,
    )
    kv = HybridLinearKVPool(
        size=128,
        dtype=torch.bfloat16,
        page_size=PAGE_SIZE,
        head_num=2,
        head_dim=8,
        full_attention_layer_ids=[1, 3],
        device="cpu",
        enable_memory_saver=False,
        mamba_pool=requests.mamba_pool,
    )
    allocator = TokenToKVPoolAllocator(size=128, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=requests,
        token_to_kv_pool_allocator=allocator,
        page_size=PAGE_SIZE,
        tree_components=(ComponentType.FULL, ComponentType.MAMBA),
        enable_mamba_extra_buffer=True,
    )
    cache = UnifiedRadixCache(params=params)
    cache.init_hicache(args, params)
    return cache


def test_unified_radix_caches_mamba_stack_opens_kvstage_on_its_kv_and_mamba_pools(tmp_path, cpu_host_pools):
    cache = mamba_unified_cache(f"file:{tmp_path}")
    controller = cache.cache_controller
    try:
        assert isinstance(controller, HybridCacheController)
        backend = controller.storage_backend
        assert isinstance(backend, KVStageStorage)
        assert set(cache.host_pool_group.entry_map) == {PoolName.KV, PoolName.MAMBA}
        assert sorted(backend.hybrid.stores) == ["kv", "mamba"]
        assert backend.store is backend.hybrid.stores["kv"]
        assert backend.hybrid.pools["mamba"] is cache.host_pool_group.entry_map[PoolName.MAMBA].host_pool
    finally:
        controller.detach_storage_backend()
