"""sglang 0.5.23's own ``UnifiedRadixCache`` on CPU, one per stack strategy of its
``hybrid_pool_assembler._STRATEGIES`` (``STRATEGIES``: those kvstage stores; ``REFUSED``: the
two whose pools it refuses), with KVStageStorage as its L3 backend: ``init_hicache`` picks the
strategy, which builds the host pool set and the ``HybridCacheController``. The test plays the
scheduler (device slots, ``insert``, ``check_hicache_events``, ``match_prefix``,
``prefetch_from_storage``, ``check_prefetch_progress``); each pool's host pages are read at the
slots the cache hands its controller to store (``write_storage``) and those of a finished
prefetch it inserts into its tree (``_handle_prefetch_result``).

What a CPU torch lacks, and what stands in for it here:

- pinned host memory: sglang's host pools register theirs with ``cudaHostRegister``
  (``pool_host.common._cuda_host_register``); nothing to register on CPU, so it is a no-op.
- sglang's device->host copy (``io_backend="direct"``, ``page_first_direct`` host layout) is
  ``sgl_kernel.kvcacheio.transfer_kv_all_layer_direct_lf_pf``, a CUDA op the host pool
  modules import only on CUDA/ROCm. :func:`transfer_kv_all_layer_direct_lf_pf` is a torch
  stand-in bound in their place; the tests check its result against the device bytes.
"""

from __future__ import annotations

import contextlib
import json
import time

import torch
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.environ import envs
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.memory_pool import (
    DSATokenToKVPool,
    HybridLinearKVPool,
    HybridReqToTokenPool,
    MiniMaxSparseKVPool,
    ReqToTokenPool,
)
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.runtime_context import get_context
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

from sglang_rig import DSA_PAGE_SIZE, PAGE_SIZE, extra_config, mha_device_pool

# the rig's name for each strategy, and sglang's class for it
STRATEGIES = {
    "mamba": "_MambaStrategy",
    "swa": "_SwaStrategy",
    "mamba_swa": "_MambaSwaStrategy",
    "dsa": "_DsaStrategy",
    "plain_kv": "_PlainKvStrategy",
}
# strategies whose host pool set kvstage refuses at registration (init_hicache raises):
# sglang's class, the refusal, the stores opened (and closed again) before it
REFUSED = {
    "minimax_sparse": (
        "_MiniMaxSparseStrategy",
        r"^host pool 'indexer': a sparse-attention indexer pool \(MHATokenToKOnlyPoolHost\) is not one",
        1,
    ),
    "deepseek_v4": (
        "_DeepSeekV4Strategy",
        r"^mem_pool_host: a LogicalHostPool host pool \(LogicalHostPool\) is not one kvstage stores",
        0,
    ),
}
WINDOW = 9  # sglang's SWA component keeps and reads ceil(9/4) = 3 trailing pages
TIMEOUT = 60


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """Torch stand-in for ``sgl_kernel.kvcacheio.transfer_kv_all_layer_direct_lf_pf``: rows
    ``src_indices`` of each layer-first source (``len(src_ptrs)`` = destinations x layers:
    all of the first destination's layers, then the next's) into slots ``dst_indices`` of the
    page-first destinations (``[pages, layers, page_size, ...]``; slot s is page s //
    page_size, row s % page_size)."""
    layers = len(src_ptrs) // len(dst_ptrs)
    pages, offsets = dst_indices // page_size, dst_indices % page_size
    for group, dst in enumerate(dst_ptrs):
        rows = dst.view(dst.shape[0], dst.shape[1], page_size, -1)
        for layer in range(layers):
            src = src_ptrs[group * layers + layer]
            assert src.dtype == dst.dtype, (src.dtype, dst.dtype)
            rows[pages, layer, offsets] = src.index_select(0, src_indices.to(src.device)).reshape(len(src_indices), -1)


@contextlib.contextmanager
def cpu_hicache(monkeypatch):
    """sglang's host pools and device->host copies on a CPU torch (see the module docstring);
    the CPU server args restored after."""
    import sglang.srt.mem_cache.pool_host.common as common
    import sglang.srt.mem_cache.pool_host.dsa as dsa
    import sglang.srt.mem_cache.pool_host.mamba as mamba
    import sglang.srt.mem_cache.pool_host.mha as mha
    import sglang.srt.mem_cache.pool_host.mla as mla

    monkeypatch.setattr(common, "_cuda_host_register", lambda *args, **kwargs: None)
    for module in (mha, mla, dsa, mamba):
        monkeypatch.setattr(module, "transfer_kv_all_layer_direct_lf_pf", transfer_kv_all_layer_direct_lf_pf, False)
    try:
        yield
    finally:
        get_context().override_server_args(device="cpu").install()


def server_args(url: str, page_size: int, extra: dict) -> ServerArgs:
    """The server args sglang's scheduler publishes for a HiCache server with KVStageStorage on
    ``url`` (write-through; a prefetch waits for every page, from one page on)."""
    args = ServerArgs(
        model_path="dummy",
        page_size=page_size,
        hicache_io_backend="direct",
        hicache_mem_layout="page_first_direct",
        hicache_write_policy="write_through",
        hicache_storage_backend="dynamic",
        hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_backend_extra_config=json.dumps(
            {**extra_config(url, model_id="org/tiny-hybrid", **extra), "prefetch_threshold": page_size}
        ),
    )
    args._mamba_cache_chunk_size = 64  # the dummy model has no config to take it from
    set_global_server_args_for_scheduler(args)
    return args


def mamba_params(layers: list[int]) -> Mamba2CacheParams:
    with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
        shape = Mamba2StateShape.create(
            tp_world_size=1, intermediate_size=32, n_groups=1, num_heads=2, head_dim=16, state_size=8, conv_kernel=4
        )
        return Mamba2CacheParams(shape=shape, layers=layers)


def hybrid_requests(layers: list[int]) -> HybridReqToTokenPool:
    return HybridReqToTokenPool(
        size=8,
        mamba_size=16,
        mamba_spec_state_size=8,
        max_context_len=256,
        device="cpu",
        enable_memory_saver=False,
        cache_params=mamba_params(layers),
        mamba_layer_ids=layers,
        enable_mamba_extra_buffer=True,
        speculative_num_draft_tokens=3,
    )


def random_bytes_(tensor: torch.Tensor, generator: torch.Generator) -> None:
    raw = tensor.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


class UnifiedRig:
    """One server's ``UnifiedRadixCache`` for ``strategy`` (fresh device and host pools) whose
    ``init_hicache`` attaches KVStageStorage on ``url``; random bytes in its device pools."""

    def __init__(self, strategy: str, url: str, seed: int) -> None:
        self.strategy = strategy
        # DSA's indexer reads 64-token pages, DeepSeek V4 256-token ones
        self.page_size = {"dsa": DSA_PAGE_SIZE, "deepseek_v4": 256}.get(strategy, PAGE_SIZE)
        extra = {"sliding_window": WINDOW} if "swa" in strategy else {}
        args = server_args(url, self.page_size, extra)
        components = [ComponentType.FULL]
        self.mamba = None
        if strategy == "plain_kv":
            self.requests = ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False)
            kv = mha_device_pool(layer_num=2)
            allocator = PagedTokenToKVPoolAllocator(128, PAGE_SIZE, torch.bfloat16, "cpu", kv, need_sort=False)
            device_buffers = [*kv.k_buffer, *kv.v_buffer]
        elif strategy == "deepseek_v4":  # its fp8 byte layout fixes the head dims
            self.requests = ReqToTokenPool(size=4, max_context_len=1024, device="cpu", enable_memory_saver=False)
            kv = DeepSeekV4TokenToKVPool(
                max_num_reqs=4,
                swa_size=1024,
                c4_size=512,
                c128_size=64,
                c4_state_pool_size=64,
                c128_state_pool_size=8,
                page_size=256,
                swa_page_size=256,
                dtype=torch.float8_e4m3fn,
                c4_state_dtype=torch.float32,
                c128_state_dtype=torch.float32,
                qk_nope_head_dim=448,
                qk_rope_head_dim=64,
                indexer_head_dim=128,
                layer_num=2,
                device="cpu",
                enable_memory_saver=False,
                compression_ratios=[4, 128],
                sliding_window=128,
                start_layer=0,
                end_layer=2,
            )
            allocator = SWATokenToKVPoolAllocator(1024, 1024, 256, torch.float8_e4m3fn, "cpu", kv, need_sort=False)
            components.append(ComponentType.SWA)
            device_buffers = []
        elif strategy == "minimax_sparse":  # MiniMax M3: a dense layer, a sparse one with index keys
            self.requests = ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False)
            kv = MiniMaxSparseKVPool(
                size=128,
                page_size=PAGE_SIZE,
                dtype=torch.bfloat16,
                head_num=2,
                head_dim=8,
                idx_head_dim=8,
                dense_layer_ids=[0],
                sparse_layer_ids=[1],
                disable_value_sparse_layer_ids=[1],
                device="cpu",
                start_layer=0,
                end_layer=2,
            )
            allocator = PagedTokenToKVPoolAllocator(128, PAGE_SIZE, torch.bfloat16, "cpu", kv, need_sort=False)
            device_buffers = []
        elif strategy == "dsa":
            self.requests = ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False)
            kv = DSATokenToKVPool(
                size=256,
                page_size=DSA_PAGE_SIZE,
                kv_lora_rank=16,
                dtype=torch.bfloat16,
                qk_rope_head_dim=8,
                layer_num=2,
                device="cpu",
                index_head_dim=128,
                enable_memory_saver=False,
                kv_cache_dim=24,
            )
            allocator = PagedTokenToKVPoolAllocator(256, DSA_PAGE_SIZE, torch.bfloat16, "cpu", kv, need_sort=False)
            device_buffers = [*kv.kv_buffer, *kv.index_k_with_scale_buffer]
        elif strategy == "mamba":
            self.requests = hybrid_requests([0, 2])
            self.mamba = self.requests.mamba_pool
            kv = HybridLinearKVPool(
                size=128,
                dtype=torch.bfloat16,
                page_size=PAGE_SIZE,
                head_num=2,
                head_dim=8,
                full_attention_layer_ids=[1, 3],
                device="cpu",
                enable_memory_saver=False,
                mamba_pool=self.mamba,
            )
            allocator = PagedTokenToKVPoolAllocator(128, PAGE_SIZE, torch.bfloat16, "cpu", kv, need_sort=False)
            device_buffers = [*kv.full_kv_pool.k_buffer, *kv.full_kv_pool.v_buffer]
        else:  # swa, mamba_swa: full attention on layers 0, 2; sliding window on 1, 3
            kv = SWAKVPool(
                size=128,
                size_swa=96,
                page_size=PAGE_SIZE,
                dtype=torch.bfloat16,
                head_num=2,
                head_dim=8,
                swa_attention_layer_ids=[1, 3],
                full_attention_layer_ids=[0, 2],
                device="cpu",
            )
            allocator = SWATokenToKVPoolAllocator(128, 96, PAGE_SIZE, torch.bfloat16, "cpu", kv, need_sort=False)
            components.append(ComponentType.SWA)
            pools = (kv.full_kv_pool, kv.swa_kv_pool)
            device_buffers = [buffer for pool in pools for buffer in (*pool.k_buffer, *pool.v_buffer)]
            if strategy == "mamba_swa":
                self.requests = hybrid_requests([4])
                self.mamba = self.requests.mamba_pool
            else:
                self.requests = ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False)
        if self.mamba is not None:
            components.append(ComponentType.MAMBA)
            device_buffers += [self.mamba.mamba_cache.temporal, *self.mamba.mamba_cache.conv]
        generator = torch.Generator().manual_seed(seed)
        for buffer in device_buffers:
            random_bytes_(buffer, generator)
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=self.requests,
            token_to_kv_pool_allocator=allocator,
            page_size=self.page_size,
            tree_components=tuple(components),
            sliding_window_size={"swa": WINDOW, "mamba_swa": WINDOW, "deepseek_v4": 128}.get(strategy),
            enable_mamba_extra_buffer=self.mamba is not None,  # sglang's rule for pages of more than 1 token
        )
        self.cache = UnifiedRadixCache(params=params)
        self.cache.init_hicache(args, params)
        self.allocator, self.kv = allocator, kv
        self.stored, self.prefetched = [], []  # what sglang handed its controller / its tree
        write, handle = self.cache.cache_controller.write_storage, self.cache._handle_prefetch_result

        def write_storage(host_indices, token_ids, hash_value, prefix_keys=None, extra_pools=None):
            self.stored.append(self.pages(host_indices, hash_value, extra_pools or []))
            return write(host_indices, token_ids, hash_value, prefix_keys, extra_pools=extra_pools)

        def handle_prefetch_result(operation):
            tokens = operation.completed_tokens
            self.prefetched.append(
                self.pages(operation.host_indices[:tokens], operation.hash_value, operation.pool_transfers or [])
            )
            return handle(operation)

        self.cache.cache_controller.write_storage = write_storage
        self.cache._handle_prefetch_result = handle_prefetch_result

    def host_pool(self, name: str):
        return self.cache.host_pool_group.entry_map[PoolName(name)].host_pool

    def pages(self, kv_indices: torch.Tensor, hashes: list[str], transfers: list) -> dict[str, dict[str, torch.Tensor]]:
        """Each pool's host pages at the slots of a storage write or a finished prefetch, by page
        key: ``{pool: {key: flat page (sglang's get_data_page)}}``. A transfer whose indices
        come from the KV pool's (the DSA indexer) is read at the KV slots, under the KV keys."""
        size = self.page_size
        pages = {"kv": self._pages("kv", kv_indices[::size], hashes)}
        for transfer in transfers:
            name = transfer.name.value
            if transfer.indices_from_pool is not None:
                assert transfer.indices_from_pool == PoolName.KV, transfer
                pages[name] = self._pages(name, kv_indices[::size], hashes)
            else:
                step = 1 if name == "mamba" else size  # a Mamba slot holds one page's state
                pages[name] = self._pages(name, transfer.host_indices[::step], transfer.keys)
        return pages

    def _pages(self, name: str, starts: torch.Tensor, keys: list[str]) -> dict[str, torch.Tensor]:
        host = self.host_pool(name)
        assert len(starts) == len(keys), (name, len(starts), len(keys))
        return {key: host.get_data_page(int(start)).clone() for start, key in zip(starts, keys)}

    def device_pages(self, slots: torch.Tensor, swa: bool = False) -> list[torch.Tensor]:
        """The device bytes of the full-attention (or, ``swa``, the sliding-window) layers at
        ``slots``, page by page, in a ``page_first_direct`` host page's order (K then V (MHA) or
        the latent (MLA); layer; token)."""
        kv = self.kv
        if isinstance(kv, (SWAKVPool, HybridLinearKVPool)):
            kv = kv.swa_kv_pool if swa else kv.full_kv_pool
        if swa:
            slots = self.allocator.full_to_swa_index_mapping[slots]
        parts = [kv.kv_buffer] if isinstance(kv, DSATokenToKVPool) else [kv.k_buffer, kv.v_buffer]
        size = self.page_size
        return [
            torch.stack([torch.stack([layer[slots[i : i + size]] for layer in part]) for part in parts]).flatten()
            for i in range(0, len(slots), size)
        ]

    def stop(self) -> None:
        self.cache.cache_controller.detach_storage_backend()

    def device_slots(self, tokens: int) -> torch.Tensor:
        """Page-aligned device KV slots for ``tokens`` new tokens, as the scheduler's extend
        allocates them (the SWA allocator maps each full slot to an SWA slot of its own)."""
        if isinstance(self.allocator, SWATokenToKVPoolAllocator):
            full = self.allocator.full_attn_allocator.alloc(tokens)
            self.allocator.set_full_to_swa_mapping(full, self.allocator.swa_attn_allocator.alloc(tokens))
            return full
        return self.allocator.alloc(tokens)

    def until(self, done, what: str) -> None:
        """Run the scheduler's per-step HiCache poll until ``done()``."""
        deadline = time.monotonic() + TIMEOUT
        while not done():
            assert time.monotonic() < deadline, f"{what}: not done within {TIMEOUT} s"
            self.cache.check_hicache_events()
            time.sleep(0.01)

    def insert_and_write_through(self, key: RadixKey) -> torch.Tensor:
        """Insert a finished request's KV (and its Mamba state) as the scheduler does; sglang
        backs the node up to host memory (write_through), then to KVStageStorage. Returns the
        device slots."""
        slots = self.device_slots(len(key))
        mamba = self.requests.mamba_allocator.alloc(1) if self.mamba is not None else None
        self.cache.insert(InsertParams(key=key, value=slots, mamba_value=mamba))
        self.until(lambda: not self.cache.ongoing_write_through and not self.cache.ongoing_backup, "write-through")
        return slots

    def prefetch(self, key: RadixKey, rid: str = "next-turn") -> int:
        """The scheduler's storage prefetch of ``key`` at its admission: the match, the
        prefetch, polls until sglang's progress check lets it in. Returns the host hit."""
        match = self.cache.match_prefix(MatchPrefixParams(key=key))
        handle = CacheRequestHandle(rid, 0)
        self.cache.prefetch_from_storage(
            handle,
            match.last_host_node,
            key.token_ids,
            self.cache.get_last_hash_value(match.last_host_node),
            extra_key=key.extra_key,
            cache_salt=key.cache_salt,
        )
        self.until(lambda: self.cache.check_prefetch_progress(handle), "prefetch")
        return self.cache.match_prefix(MatchPrefixParams(key=key)).host_hit_length
