"""sglang host pools and storage backends of the TP ranks of a server whose pages are split by
KV head groups (``tp_lcm_size``), for the head-group tests."""

from __future__ import annotations

import dataclasses

import torch
from sglang.srt.mem_cache.storage import StorageBackendFactory

from sglang_rig import host_pool, mha_device_pool, storage_config

HEADS = 4  # the model's KV heads


def split_config(url: str, rank: int, size: int, layout: str, tp_lcm_size: int | None):
    """The storage config sglang's controller builds for TP rank ``rank`` of ``size``: it takes
    ``tp_lcm_size`` out of the extra config and splits heads on a ``page_head`` pool whose TP
    size is below it (``HiCacheController``'s rule in sglang 0.5.23)."""
    config = storage_config(url, tp_rank=rank, tp_size=size)
    split = tp_lcm_size is not None and layout == "page_head" and tp_lcm_size > size
    return dataclasses.replace(config, tp_lcm_size=tp_lcm_size, should_split_heads=split)


def rank_backend(url: str, host, rank: int, size: int, tp_lcm_size: int | None):
    config = split_config(url, rank, size, host.layout, tp_lcm_size)
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    return backend


def rank_host(size: int, layout: str):
    return host_pool(mha_device_pool(head_num=HEADS // size), layout)


def model_kv(host, seed: int) -> torch.Tensor:
    """Random bit patterns for every head of the model: ``[2, L, slots, HEADS, D]``."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2, host.layer_num, host.size, HEADS, host.head_dim * host.dtype.itemsize)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator).view(host.dtype)


def rank_heads(rank: int, size: int) -> slice:
    share = HEADS // size
    return slice(rank * share, (rank + 1) * share)
