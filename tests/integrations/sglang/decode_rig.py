"""sglang's decode-side objects on CPU (its Req, ReqToTokenPool, paged allocator, a disabled
RadixCache as the tree cache, MHA/MLA device pools) around KVStageDecodeOffloadManager, and
one decode run driven as sglang's scheduler drives it."""

from __future__ import annotations

import contextlib
import json
import time
from array import array

import torch
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.runtime_context import get_context, get_parallel
from sglang.srt.sampling.sampling_params import SamplingParams

from kvstage.integrations.sglang import KVStageDecodeOffloadManager

from sglang_rig import (
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
):
    """sglang's published config for a decode server using kvstage (restore() undoes it);
    the stride defaults to one page; ``extra``: more keys of the storage extra config;
    ``speculative_algorithm``: sglang's ``--speculative-algorithm`` (e.g. ``"EAGLE"``)."""
    import os

    os.environ["SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE"] = str(page_size if stride is None else stride)
    override = get_context().override_server_args(
        device="cpu",
        page_size=page_size,
        tp_size=tp_size,
        hicache_ratio=2.0,
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


class DecodeSide:
    """One decode rank: sglang's pools and a KVStageDecodeOffloadManager over ``tp_group``
    (``kind``: ``"mha"``, ``"mla"`` or ``"dsa"``, DeepSeek V3.2's pool with 64-token pages).
    ``draft_layers``: one-layer draft device pools over the same slots (an MTP draft model's
    KV), made before the manager; ``before_manager(side)`` runs then (what sglang's speculative
    worker does before the scheduler builds the offload manager)."""

    def __init__(self, kind: str, tp_group, draft_layers: int = 0, before_manager=None) -> None:
        self.device = {"mha": mha_device_pool, "mla": mla_device_pool, "dsa": dsa_device_pool}[kind](size=256)
        make_draft = {"mha": mha_device_pool, "mla": mla_device_pool}.get(kind)
        self.drafts = [make_draft(size=256, layer_num=1) for _ in range(draft_layers)]
        page_size = self.device.page_size
        self.req_to_token_pool = ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False)
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
        slots = self.allocator.alloc(total)
        self.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, total)), slots.to(torch.int32))
        req.kv.kv_allocated_len = total
        self.write_kv(req, 0, len(prompt))
        return req

    def write_kv(self, req: Req, start: int, end: int) -> None:
        """Random KV at token positions [start, end) of ``req`` (the forward pass's stand-in)."""
        slots = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:end].long()
        for buffer in self.buffers():
            shape = (len(slots), *buffer.shape[1:])
            if buffer.dtype == torch.uint8:  # DSA index rows: any bytes
                values = torch.randint(0, 256, shape, dtype=torch.uint8, generator=self.generator)
            else:
                values = torch.randn(shape, generator=self.generator).to(buffer.dtype)
            buffer[slots] = values

    def buffers(self) -> list[torch.Tensor]:
        """Every layer's buffer, the drafts' after the target's: MLA latents (a DSA pool's then its
        index pages as per-token rows, ``[slots, bytes per token]``), or K layers then V layers."""
        pools = [self.device, *self.drafts]
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
        return [buffer[slots].clone() for buffer in self.buffers()]

    def decode_step(self, req: Req, token: int) -> None:
        """One step of sglang's decode loop for ``req``: the last sampled token gets its KV,
        a new token is sampled, then the scheduler's offload calls."""
        kv_end = len(req.origin_input_ids) + len(req.output_ids)
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
