"""A hybrid sglang 0.5.23 device pool as the decode drop-in's kvstage pools, in the key spaces of
the prefill side's host pool set (:mod:`kvstage.integrations.sglang.hybrid_pools`).

Stored so far: DeepSeek V3.2's ``DSATokenToKVPool`` (``sglang.srt.mem_cache.memory_pool``), the
MLA latent per layer (``kv_buffer``) plus the indexer's packed keys and scales per page
(``index_k_with_scale_buffer``: ``[num_pages, page_size * row]`` uint8 per layer). Its layout is
the one the prefill side's ``kv`` + ``indexer`` host pools give: ``FullAttention`` "kv" over the
pool's layers, ``PageSidecar`` "indexer" on the same layers, one ``row``-byte tensor
``index_k_scale`` per token. The indexer's pages are moved as ``page_size`` rows on the KV pool's
slots (a page's bytes in sglang's packing, row by row): sglang's paged allocator gives a page
the slots ``page * page_size ...`` in order, so the rows of a page are its bytes, as the host
pool's page entry holds them.
"""

from __future__ import annotations

from typing import Any

import torch

from kvstage.errors import InvalidArgumentError
from kvstage.kernels import KVPool
from kvstage.model_layout import FullAttention, ModelLayout, PageSidecar, TensorSpec

__all__ = ["dsa_pools"]


def dsa_pools(kv_cache: Any, kv_dtype: torch.dtype) -> tuple[KVPool, ModelLayout, dict[str, KVPool]]:
    """(the latent's ``KVPool.mla``, the model's :class:`ModelLayout`, ``{"indexer": its rows'
    KVPool}``) of sglang's ``DSATokenToKVPool`` ``kv_cache`` (module doc); the latent viewed as
    ``kv_dtype`` (fp8 held as ``uint8``; no copy).

    Raises:
        InvalidArgumentError: an indexer page that is not ``page_size`` equal rows, or indexer
            buffers of another layer count than the latent's, naming ``token_to_kv_pool_allocator``.
    """
    page_size = kv_cache.page_size
    latents = [buffer.view(kv_dtype) for buffer in kv_cache.kv_buffer]
    pages = list(kv_cache.index_k_with_scale_buffer)
    if len(pages) != len(latents):
        raise InvalidArgumentError(
            f"token_to_kv_pool_allocator: the DSA pool has {len(pages)} indexer layers and {len(latents)} latent "
            "layers; kvstage stores index rows beside each latent layer"
        )
    row, rest = divmod(pages[0].shape[1], page_size)
    if rest:
        raise InvalidArgumentError(
            f"token_to_kv_pool_allocator: a DSA indexer page of {pages[0].shape[1]} elements is not "
            f"{page_size} equal rows"
        )
    kv_pool = KVPool.mla(latents)
    kv = FullAttention(range(kv_pool.layout.num_layers), kv_pool.layout, name="kv")
    indexer = PageSidecar(kv.layers, (TensorSpec("index_k_scale", (row,), pages[0].dtype),), name="indexer")
    rows = KVPool.from_rows([page.view(-1, row) for page in pages])
    return kv_pool, ModelLayout(kv.num_layers, (kv, indexer)), {"indexer": rows}
