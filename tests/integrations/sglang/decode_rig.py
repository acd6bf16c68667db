"""sglang's decode-side objects on CPU (its Req, ReqToTokenPool, paged allocator, a disabled
RadixCache as the tree cache, MHA/MLA/DSA device pools, and an SWA pool with sglang's
SWATokenToKVPoolAllocator and its decode-time window eviction) around
KVStageDecodeOffloadManager, and one decode run driven as sglang's scheduler drives it."""

from __future__ import annotations

import contextlib
import json
import time
from array import array

import torch
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import free_swa_out_of_window_slots
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.runtime_context import get_context, get_parallel
from sglang.srt.sampling.sampling_params import SamplingParams

from kvstage.integrations.sglang import KVStageDecodeOffloadManager

from sglang_rig import (
    LAYERS,
    PAGE_SIZE,
    canonical_of,
    dsa_device_pool,
    extra_config,
    hicache_controller,
    host_buffer_of,
    host_pool,
    mha_device_pool,
    mla_device_pool,
)


def install_settings(
    url: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    stride: int | None = None,
    page_size: int = PAGE_SIZE,
    extra: dict | None = None,
    speculative_algorithm: str | None = None,
    hicache_ratio: float = 2.0,
):
    """sglang's published config for a decode server using kvstage (restore() undoes it);
    the stride defaults to one page; ``extra``: more keys of the storage extra config;
    ``speculative_algorithm``: sglang's ``--speculative-algorithm`` (e.g. ``"EAGLE"``);
    ``hicache_ratio``: host pages per device slot page (2.0 over 256 slots: 128 host pages)."""
    import os

    os.environ["SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE"] = str(page_size if stride is None else stride)
    override = get_context().override_server_args(
        device="cpu",
        page_size=page_size,
        tp_size=tp_size,
        hicache_ratio=hicache_ratio,
        served_model_name="org/tiny-model",
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(extra_config(url, **(extra or {}))),
        speculative_algorithm=speculative_algorithm,
    )
    override.install()
    get_parallel().override_permanently(
        tp_rank=tp_rank, pp_rank=0, attn_tp_rank=tp_rank, attn_dp_rank=0, attn_cp_rank=0, attn_dcp_rank=0
    )
    return override


@contextlib.contextmanager
def settings_installed(url: str, **settings):
    """:func:`install_settings` for a ``with`` block, restored when it ends."""
    override = install_settings(url, **settings)
    try:
        yield override
    finally:
        override.restore()


def swa_device_pool(size: int = 256) -> SWAKVPool:
    """sglang's SWAKVPool: ``LAYERS`` full layers (2 heads) interleaved with ``LAYERS`` window
    layers (1 head), the pools of the hybrid rig's ``"swa"`` strategy (sglang_hybrid_rig)."""
    return SWAKVPool(
        size=size,
        size_swa=size // 2,
        page_size=PAGE_SIZE,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        full_attention_layer_ids=list(range(0, 2 * LAYERS, 2)),
        swa_attention_layer_ids=list(range(1, 2 * LAYERS, 2)),
        device="cpu",
        swa_kv_pool_kwargs=dict(
            page_size=PAGE_SIZE, enable_memory_saver=False, device="cpu", head_num=1, head_dim=8, allocation_label="SWA"
        ),
    )


class DecodeSide:
    """One decode rank: sglang's pools and a KVStageDecodeOffloadManager over ``tp_group``
    (``kind``: ``"mha"``, ``"mla"`` or ``"dsa"``, DeepSeek V3.2's pool with 64-token pages).
    ``draft_layers``: one-layer draft device pools over the same slots (an MTP draft model's
    KV), made before the manager; ``before_manager(side)`` runs then (what sglang's speculative
    worker does before the scheduler builds the offload manager)."""

    def __init__(
        self, kind: str, tp_group, draft_layers: int = 0, before_manager=None, window: int | None = None
    ) -> None:
        """``window``: with ``kind="swa"``, the sliding window sglang's decode eviction keeps."""
        pools = {"mha": mha_device_pool, "mla": mla_device_pool, "dsa": dsa_device_pool, "swa": swa_device_pool}
        self.device = pools[kind](size=256)
        make_draft = {"mha": mha_device_pool, "mla": mla_device_pool}.get(kind)
        self.drafts = [make_draft(size=256, layer_num=1) for _ in range(draft_layers)]
        page_size = self.device.page_size
        self.window = window
        self.written: dict[str, list[list[torch.Tensor]]] = {}  # rid -> per buffer, the rows written, in order
        self.req_to_token_pool = ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False)
        if kind == "swa":
            self.allocator = SWATokenToKVPoolAllocator(
                self.device.size, self.device.size_swa, page_size, self.device.dtype, "cpu", self.device, False
            )
            self.allocator.swa_attn_allocator.alloc(3 * page_size)  # another request's: window slots != full slots
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                self.device.size, page_size, self.device.dtype, "cpu", self.device, need_sort=False
            )
        self.tree_cache = RadixCache(
            CacheInitParams(
                disable=True,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.allocator,
                page_size=page_size,
            )
        )
        if before_manager is not None:
            before_manager(self)
        self.manager = KVStageDecodeOffloadManager(
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            tp_group=tp_group,
            tree_cache=self.tree_cache,
        )
        self.generator = torch.Generator().manual_seed(0)

    def admit(self, rid: str, prompt: list[int], max_tokens: int, extra_key: str | None = None) -> Req:
        """A request whose prompt KV arrived from the prefill side: a req_to_token row and
        slots for the whole request, the prompt's KV written."""
        req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=max_tokens), extra_key=extra_key)
        self.req_to_token_pool.alloc([req])
        page_size = self.device.page_size
        total = -(-(len(prompt) + max_tokens) // page_size) * page_size
        if isinstance(self.allocator, SWATokenToKVPoolAllocator):  # its paged alloc, both pools in step
            slots = self.allocator.full_attn_allocator.alloc(total)
            self.allocator.set_full_to_swa_mapping(slots, self.allocator.swa_attn_allocator.alloc(total))
        else:
            slots = self.allocator.alloc(total)
        self.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, total)), slots.to(torch.int32))
        req.kv.kv_allocated_len = total
        self.write_kv(req, 0, len(prompt))
        return req

    def write_kv(self, req: Req, start: int, end: int) -> None:
        """Random KV at token positions [start, end) of ``req`` (the forward pass's stand-in)."""
        slots = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:end].long()
        written = self.written.setdefault(req.rid, [[] for _ in self.buffers()])
        for buffer, buffer_slots, rows in zip(self.buffers(), self._slots_of(slots), written):
            values = self._random(buffer, len(slots))
            buffer[buffer_slots] = values
            rows.append(values)

    def _random(self, buffer: torch.Tensor, count: int) -> torch.Tensor:
        shape = (count, *buffer.shape[1:])
        if buffer.dtype == torch.uint8:  # DSA index rows: any bytes
            return torch.randint(0, 256, shape, dtype=torch.uint8, generator=self.generator)
        return torch.randn(shape, generator=self.generator).to(buffer.dtype)

    def _slots_of(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """Per buffer of :meth:`buffers`, its slots of the full-pool ``slots``."""
        if isinstance(self.device, SWAKVPool):
            full, window = slots, self.device.translate_loc_from_full_to_swa(slots)
            return [full] * (2 * LAYERS) + [window] * (2 * LAYERS)
        return [slots] * len(self.buffers())

    def written_kv(self, req: Req, end: int) -> list[torch.Tensor]:
        """Per buffer, the rows :meth:`write_kv` wrote at positions ``[0, end)`` (an SWA pool's
        window rows too, after sglang freed their slots)."""
        return [torch.cat(rows)[:end] for rows in self.written[req.rid]]

    def evict_window(self, req: Req) -> None:
        """sglang's decode-time SWA eviction (``free_swa_out_of_window_slots`` at ``seqlen - 1``,
        as ``ScheduleBatch.maybe_evict_swa``), then random bytes in the freed window slots (a
        later request reusing them)."""
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx].long()
        before = self.device.translate_loc_from_full_to_swa(row).clone()
        free_swa_out_of_window_slots(
            req,
            len(req.origin_input_ids) + len(req.output_ids) - 1,
            sliding_window_size=self.window,
            page_size=self.device.page_size,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
        )
        freed = before[(self.device.translate_loc_from_full_to_swa(row) != before) & (before > 0)]
        self.freed_window_slots = getattr(self, "freed_window_slots", 0) + len(freed)
        for buffer in self.buffers()[2 * LAYERS :]:  # the window layers' K, V
            buffer[freed] = self._random(buffer, len(freed))

    def buffers(self) -> list[torch.Tensor]:
        """Every layer's buffer, the drafts' after the target's: MLA latents (a DSA pool's then its
        index pages as per-token rows, ``[slots, bytes per token]``), or K layers then V layers."""
        pools = [self.device, *self.drafts]
        if isinstance(self.device, SWAKVPool):
            full, window = self.device.full_kv_pool, self.device.swa_kv_pool
            return [*full.k_buffer, *full.v_buffer, *window.k_buffer, *window.v_buffer]
        if hasattr(self.device, "index_k_with_scale_buffer"):
            page_size = self.device.page_size
            rows = [b.view(-1, b.shape[1] // page_size) for b in self.device.index_k_with_scale_buffer]
            return [*self.device.kv_buffer, *rows]
        if hasattr(self.device, "kv_buffer"):
            return [buffer for pool in pools for buffer in pool.kv_buffer]
        return [b for pool in pools for b in pool.k_buffer] + [b for pool in pools for b in pool.v_buffer]

    def kv_of(self, req: Req, end: int) -> list[torch.Tensor]:
        assert not released(req), f"{req.rid} is back with sglang: its slots may hold other KV"
        slots = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :end].long()
        return [buffer[own].clone() for buffer, own in zip(self.buffers(), self._slots_of(slots))]

    def decode_step(self, req: Req, token: int) -> None:
        """One step of sglang's decode loop for ``req``: the last sampled token gets its KV,
        a new token is sampled, then the scheduler's offload calls."""
        kv_end = len(req.origin_input_ids) + len(req.output_ids)
        if self.window is not None:
            self.evict_window(req)
        if req.output_ids:
            self.write_kv(req, kv_end - 1, kv_end)
        req.output_ids.append(token)
        if len(req.output_ids) >= req.sampling_params.max_new_tokens:
            req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        if req.finished():
            if not self.manager.offload_kv_cache(req):
                self.manager.finalize_release_on_finish(req)
        else:
            self.manager.offload_kv_cache(req)


def released(req: Req) -> bool:
    return req.kv.req_pool_idx is None


def run_until_released(side: DecodeSide, reqs: list[Req], timeout: float = 30.0) -> int:
    """check_offload_progress once a step until every request is back with sglang; the steps."""
    steps = 0
    deadline = time.monotonic() + timeout
    while not all(released(req) for req in reqs):
        assert time.monotonic() < deadline, "requests not released"
        side.manager.check_offload_progress()
        steps += 1
        time.sleep(0.002)
    return steps


def controller_over(side: DecodeSide, url: str, layout: str):
    """sglang's HiCacheController with KVStageStorage on ``url``, over a host pool of the
    decode side's device pool (its draft pools packed as tail layers): the prefill side's
    writer and the next turn's reader."""
    host = host_pool(side.device, layout, drafts=tuple(side.drafts))
    cc = hicache_controller(side.device, host, url)
    return cc, host


def put_kv_in_host(host, kv: list[torch.Tensor], indices: torch.Tensor) -> None:
    """The device KV rows ``kv`` (per buffer: K layers then V layers, or MLA latents) into
    host slots ``indices``, through the canonical order."""
    canonical = canonical_of(host)
    mla = hasattr(host, "kv_cache_dim")
    layers = host.layer_num
    for i, rows in enumerate(kv):
        if mla:
            canonical[i, indices] = rows.view(len(indices), -1)
        else:
            canonical[i // layers, i % layers, indices] = rows
    host.kv_buffer.copy_(host_buffer_of(host.layout, canonical, mla))
