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

Also stored: sglang's ``SWAKVPool`` (``sglang.srt.mem_cache.swa_memory_pool``; gpt-oss, Gemma 3),
two ``MHATokenToKVPool`` s: ``full_kv_pool`` (the full-attention layers) and ``swa_kv_pool`` (the
sliding-window layers, with slots of their own). Its layout is the prefill side's ``kv`` + ``swa``
host pools' (:func:`~kvstage.integrations.sglang.hybrid_pools.hybrid_layout`): ``FullAttention``
"kv" over layers ``0 .. nf-1``, ``SlidingWindow`` "swa" over ``nf .. nf+ns-1`` (host-pool
positions), the window from ``extra_config.sliding_window``. A request's window slots are
``translate_loc_from_full_to_swa`` of its ``req_to_token`` row, read when a copy is launched.
sglang's decode eviction (``free_swa_out_of_window_slots``) frees them behind the request while it
runs, so the drop-in passes ``window_kept={"swa": W - 1}``
(:class:`~kvstage.offload.ComponentPools`): a copy reads only the pages holding the ``W - 1``
positions before the call's length, which the next token needs and no eviction has freed (sglang
frees a page of them two steps later at the soonest; its eviction does not wait for kvstage's
copy, a gather of microseconds on the copy stream after that step's forward). A run
launched late (host pool short) stores no window page older than that, so its end is not
restorable (never restorable with another request's bytes). sglang's reader asks
``ceil(W / page_size)`` trailing pages, kvstage stores ``ceil((W - 1) / page_size)``, so with a
stride above one page a run-end resume can be one window page short for it (every page is stored
at the default one-page stride).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from kvstage.errors import InvalidArgumentError
from kvstage.kernels import KVPool
from kvstage.model_layout import FullAttention, ModelLayout, PageSidecar, SlidingWindow, TensorSpec

__all__ = ["dsa_pools", "swa_pools"]


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


def swa_pools(
    kv_cache: Any, config: Any, window: int | None, rows_of: Callable[[Any], torch.Tensor]
) -> tuple[KVPool, ModelLayout, dict[str, KVPool], dict[str, Callable[[Any], torch.Tensor]]]:
    """(the full layers' ``KVPool.mha``, the model's :class:`ModelLayout`, ``{"swa": the window
    layers' KVPool}``, ``{"swa": slots_of}``) of sglang's ``SWAKVPool`` ``kv_cache`` (module doc);
    fp8 held as ``uint8`` viewed as ``config.kv_dtype`` gives it (no copy). ``rows_of(req)``: the
    request's full-pool slots (its ``req_to_token`` row).

    Raises:
        InvalidArgumentError: no ``window`` (naming ``extra_config.sliding_window``); sub-pools
            other than exactly ``MHATokenToKVPool``, a per-request SWA ring, or a V head size other
            than the K head size (naming ``token_to_kv_pool_allocator``); as ``config.kv_dtype``.
    """
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if window is None:
        raise InvalidArgumentError(
            "extra_config.sliding_window: required with an SWA device pool (the model's sliding window in tokens, "
            "as the prefill side's KVStageStorage is given it)"
        )
    parts = {"full": kv_cache.full_kv_pool, "swa": kv_cache.swa_kv_pool}
    for name, pool in parts.items():
        if type(pool) is not MHATokenToKVPool or pool.v_head_dim != pool.head_dim:
            raise InvalidArgumentError(
                f"token_to_kv_pool_allocator: the SWA pool's {name} sub-pool ({type(pool).__name__}) is not an "
                "MHATokenToKVPool with equal K and V head sizes; the decode drop-in stores only those"
            )
    if getattr(kv_cache, "swa_req_ring_size", None) is not None:
        raise InvalidArgumentError(
            "token_to_kv_pool_allocator: an SWA pool with a per-request ring (swa_req_ring_size) is not stored by "
            "the decode drop-in; its window slots are not sglang's full-to-SWA mapping"
        )
    pools = {}
    for name, pool in parts.items():
        dtype = config.kv_dtype(pool.k_buffer[0].dtype, f"{name} device pool")
        pools[name] = KVPool.mha([b.view(dtype) for b in pool.k_buffer], [b.view(dtype) for b in pool.v_buffer])
    full_layers = pools["full"].layout.num_layers
    kv = FullAttention(range(full_layers), pools["full"].layout, name="kv")
    end = full_layers + pools["swa"].layout.num_layers
    swa = SlidingWindow(range(full_layers, end), pools["swa"].layout, window, name="swa")

    def swa_slots(req: Any) -> torch.Tensor:
        return kv_cache.translate_loc_from_full_to_swa(rows_of(req).long())

    return pools["full"], ModelLayout(end, (kv, swa)), {"swa": pools["swa"]}, {"swa": swa_slots}
