"""Which of sglang 0.5.23's KV pools kvstage stores, and a clear refusal of every other.

kvstage stores one token's KV as MHA K/V rows or an MLA latent. sglang's other pools add data
that such a page has no room for, often as a subclass of the MHA or MLA pool: DeepSeek V3.2's
``DSATokenToKVPool`` is an ``MLATokenToKVPool`` plus the indexer's keys and scales, so a check
by ``isinstance`` would store the latent only and lose the index keys without a word. The
checks here are an allow-list of exact classes; anything else is refused, naming its kind.

Device pools stored: ``MHATokenToKVPool``, ``MLATokenToKVPool``
(``sglang.srt.mem_cache.memory_pool``); by the decode drop-in also ``DSATokenToKVPool``, as the
prefill side's ``kv`` + ``indexer`` components, and ``SWAKVPool``, as its ``kv`` + ``swa``
components (:func:`decode_device_pool_kind`). Host pools stored: ``MHATokenToKVPoolHost``,
``MLATokenToKVPoolHost`` (``sglang.srt.mem_cache.pool_host``), registered as the controller's
anchor pool (``register_mem_pool_host``) or as that same pool under the name ``"kv"``
(``register_mem_host_pool_v2``). A hybrid model's other host pools (``register_mem_host_pool_v2``):
``swa`` (MHA / MLA host pool), ``indexer`` (``DSAIndexerPoolHost``), ``mamba`` (``MambaPoolHost``),
exact classes too (:mod:`kvstage.integrations.sglang.hybrid_pools`).
"""

from __future__ import annotations

from typing import Any

from kvstage.errors import InvalidArgumentError

__all__ = [
    "decode_device_pool_kind",
    "require_stored_device_pool",
    "require_stored_host_pool",
    "require_stored_v2_pool",
    "pool_kind",
]

# (a class name in the pool's MRO, the kind it names), first match wins: subclasses first.
_KINDS = (
    ("DeepSeekV4", "DeepSeek V4"),
    ("DSAIndexerPoolHost", "DSA indexer (DeepSeek V3.2's index keys)"),
    ("DSATokenToKVPool", "DSA (DeepSeek V3.2: the MLA latent plus the indexer's keys)"),
    ("QSA", "QSA indexer"),
    ("MambaPoolHost", "Mamba"),
    ("MambaPool", "Mamba"),
    ("HybridLinearKVPool", "Mamba (hybrid linear attention)"),
    ("BaseSWAKVPool", "SWA"),
    ("UnifiedPageEnvelopeHostPool", "unified page (SWA)"),
    ("MHATokenToKOnlyPool", "K-only"),
    ("MiniMax", "MiniMax sparse"),
    ("FP4", "FP4"),
    ("MXFP8", "MXFP8"),
    ("HiSparse", "HiSparse"),
    ("PageInterleave", "page-interleaved"),
    ("LayerSplit", "layer-split"),
)
# sglang's PoolName values (register_mem_host_pool_v2) and the kind each names ('indexer' is
# DeepSeek V3.2's DSA index keys, and also QSA's and MiniMax M3's sparse layers' K-only pool).
_NAMED_KINDS = {
    "mamba": "Mamba",
    "swa": "SWA",
    "auxiliary_swa": "SWA",
    "draft_swa": "SWA (draft model)",
    "indexer": "sparse-attention indexer",
    "draft_indexer": "sparse-attention indexer (draft model)",
    "draft": "draft model KV",
}


def pool_kind(pool: Any, pool_name: Any = None) -> str:
    """A reader's name for ``pool``'s kind (e.g. ``"DSA (...)"``, ``"Mamba"``, ``"SWA"``),
    from sglang's pool name when given and known, else from its class; never raises."""
    named = _NAMED_KINDS.get(str(pool_name)) if pool_name is not None else None
    if named is None and pool_name is not None and str(pool_name).startswith("deepseek_v4"):
        named = "DeepSeek V4"
    if named is not None:
        return named
    names = [cls.__name__ for cls in type(pool).__mro__]
    for fragment, kind in _KINDS:
        if any(fragment in name for name in names):
            return kind
    return type(pool).__name__


def _device_classes() -> tuple[type, type]:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    return MHATokenToKVPool, MLATokenToKVPool


def _host_classes() -> tuple[type, type]:
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    return MHATokenToKVPoolHost, MLATokenToKVPoolHost


def require_stored_device_pool(kv_cache: Any, argument: str) -> bool:
    """Check that kvstage stores every byte of sglang device pool ``kv_cache``; True for an
    MLA pool, False for MHA.

    Raises:
        InvalidArgumentError: ``type(kv_cache)`` is not exactly ``MHATokenToKVPool`` or
            ``MLATokenToKVPool`` (DSA, SWA, Mamba, FP4 and other pools, subclasses included);
            the message names ``argument``, the pool's kind and class.
    """
    mha, mla = _device_classes()
    if type(kv_cache) is mla:
        return True
    if type(kv_cache) is mha:
        return False
    raise InvalidArgumentError(
        f"{argument}: a {pool_kind(kv_cache)} device pool ({type(kv_cache).__name__}) is not one kvstage stores; "
        "only sglang's MHATokenToKVPool and MLATokenToKVPool are (its extra data would be lost)"
    )


def decode_device_pool_kind(kv_cache: Any, argument: str) -> str:
    """The kind of sglang device pool ``kv_cache`` as the decode drop-in stores it: ``"mha"``,
    ``"mla"``, ``"dsa"`` (exactly ``DSATokenToKVPool``: the latent and the indexer's keys) or
    ``"swa"`` (exactly ``SWAKVPool``: full and sliding-window layers), as
    :mod:`~kvstage.integrations.sglang.decode_hybrid` stores them.

    Raises:
        InvalidArgumentError: any other class (Mamba, FP4 pools...; subclasses included);
            the message names ``argument``, the pool's kind and class.
    """
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    if type(kv_cache) is DSATokenToKVPool:
        return "dsa"
    if type(kv_cache) is SWAKVPool:
        return "swa"
    mha, mla = _device_classes()
    if type(kv_cache) in (mha, mla):
        return "mla" if type(kv_cache) is mla else "mha"
    raise InvalidArgumentError(
        f"{argument}: a {pool_kind(kv_cache)} device pool ({type(kv_cache).__name__}) is not one kvstage's decode "
        "offload stores yet; it stores sglang's MHATokenToKVPool, MLATokenToKVPool, DSATokenToKVPool and SWAKVPool "
        "(its extra data would be lost)"
    )


def require_stored_host_pool(host_pool: Any, argument: str = "mem_pool_host") -> None:
    """Check that kvstage stores every byte of sglang host pool ``host_pool``.

    Raises:
        InvalidArgumentError: ``type(host_pool)`` is not exactly ``MHATokenToKVPoolHost`` or
            ``MLATokenToKVPoolHost``; the message names ``argument``, the pool's kind and class.
    """
    if type(host_pool) not in _host_classes():
        raise InvalidArgumentError(
            f"{argument}: a {pool_kind(host_pool)} host pool ({type(host_pool).__name__}) is not one kvstage stores; "
            "only sglang's MHATokenToKVPoolHost and MLATokenToKVPoolHost are"
        )


_V2_CLASSES = {  # pool name -> (module, class) of the host pool kvstage stores under it
    "swa": (
        ("sglang.srt.mem_cache.pool_host.mha", "MHATokenToKVPoolHost"),
        ("sglang.srt.mem_cache.pool_host.mla", "MLATokenToKVPoolHost"),
    ),
    "indexer": (("sglang.srt.mem_cache.pool_host.dsa", "DSAIndexerPoolHost"),),
    "mamba": (("sglang.srt.mem_cache.pool_host.mamba", "MambaPoolHost"),),
}


def _classes(name: str) -> tuple[type, ...]:
    import importlib

    return tuple(getattr(importlib.import_module(module), cls) for module, cls in _V2_CLASSES[name])


def require_stored_v2_pool(host_pool: Any, pool_name: Any, anchor: Any) -> str:
    """Check a ``register_mem_host_pool_v2(host_pool, pool_name)`` registration and return the
    pool name kvstage stores it under: ``"kv"`` (the anchor pool, ``register_mem_pool_host``'s,
    again), ``"swa"`` (an MHA or MLA host pool of the sliding-window layers), ``"indexer"``
    (DeepSeek V3.2's ``DSAIndexerPoolHost``) or ``"mamba"`` (``MambaPoolHost``), each of exactly
    that class.

    Raises:
        InvalidArgumentError: any other registration (a draft model's pools, DeepSeek V4's, an
            auxiliary SWA pool, a pool of another class under a known name); the message names
            the pool's name, kind and class.
    """
    name = str(pool_name)
    if name == "kv" and host_pool is anchor:
        return name
    if name == "kv":
        raise InvalidArgumentError(
            f"host pool 'kv' ({type(host_pool).__name__}) is not the pool registered by register_mem_pool_host; "
            "kvstage stores that one only"
        )
    if name in _V2_CLASSES and type(host_pool) in _classes(name):
        return name
    raise InvalidArgumentError(
        f"host pool {name!r}: a {pool_kind(host_pool, pool_name)} pool ({type(host_pool).__name__}) is not one kvstage "
        "stores, so this model's pages would lack that pool's data; kvstage stores the pools 'kv', 'swa' "
        "(MHATokenToKVPoolHost, MLATokenToKVPoolHost), 'indexer' (DSAIndexerPoolHost) and 'mamba' (MambaPoolHost)"
    )
