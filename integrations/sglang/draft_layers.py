"""The draft-model KV layers sglang packs into its host pool's pages, for the decode drop-in.

With an MTP draft (NextN layers, ``--speculative-algorithm EAGLE``/``NEXTN`` on a model with
``num_nextn_predict_layers``) sglang 0.5.23's HiCache packs each one-layer draft KV pool as a tail
layer of the target's host pool (``BaseSpecWorker._build_hicache_draft_plan``, mode ``PACKED``;
``MHATokenToKVPoolHost``/``MLATokenToKVPoolHost`` ``draft_buffer_infos``): the prefill side's
pages hold target + draft layers, and :class:`~kvstage.integrations.sglang.KVStageStorage` keys
them in that layer count's key space. The decode drop-in must store the same layers, or its pages
land in another key space. sglang hands its decode offload manager the target's allocator only,
so :func:`record_packed_drafts` (an ``AFTER`` hook on ``BaseSpecWorker.init_hicache_draft_plan``,
which sglang runs on every rank before it builds the offload manager) remembers, per target KV
pool, the draft pools sglang's own rule (``_can_pack_hicache_mtp``) packs; the drop-in reads them
with :func:`packed_drafts_of`. EAGLE/EAGLE3 draft models (their own model, a ``SIDECAR`` host pool
of their own) are not packed: their KV is not in the prefill side's pages.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["DRAFT_PLAN_HOOK_TARGET", "packed_drafts_of", "record_packed_drafts", "remember_packed_drafts"]

DRAFT_PLAN_HOOK_TARGET = "sglang.srt.speculative.base_spec_worker.BaseSpecWorker.init_hicache_draft_plan"

# target KV pool -> its packed draft KV pools (weak: a pool sglang drops is not kept alive)
_PACKED: weakref.WeakKeyDictionary[Any, tuple[Any, ...]] = weakref.WeakKeyDictionary()


def remember_packed_drafts(target_pool: Any, draft_pools: tuple[Any, ...]) -> None:
    """Record that sglang packs ``draft_pools`` (one layer each, in order) after ``target_pool``'s layers."""
    _PACKED[target_pool] = tuple(draft_pools)


def packed_drafts_of(target_pool: Any) -> tuple[Any, ...]:
    """The draft KV pools packed after ``target_pool``'s layers (empty: none recorded)."""
    return _PACKED.get(target_pool, ())


def record_packed_drafts(result: Any, worker: Any) -> Any:
    """sglang plugin hook (``AFTER`` on :data:`DRAFT_PLAN_HOOK_TARGET`): with ``worker`` a
    speculative worker whose draft runners sglang would pack (its ``_can_pack_hicache_mtp``,
    whether or not this server enables HiCache itself: the prefill side does), remember their KV
    pools for the target's. Returns ``result`` unchanged."""
    from sglang.srt.speculative.base_spec_worker import _can_pack_hicache_mtp

    runners = worker._draft_model_runners()
    target = worker.target_worker.model_runner
    if runners and _can_pack_hicache_mtp(target.spec_algorithm, runners):
        remember_packed_drafts(target.token_to_kv_pool, tuple(runner.token_to_kv_pool for runner in runners))
    return result
