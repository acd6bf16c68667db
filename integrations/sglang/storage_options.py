"""Storage-config options that the key space module does not parse: an SWA pool's window (taken
out by KVStageStorage and the decode drop-in alike) and sglang's ``tp_lcm_size`` (heads split
across TP sizes)."""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from kvstage.errors import InvalidArgumentError
from kvstage.integrations.sglang.key_space import ExtraConfig

__all__ = ["pop_sliding_window", "require_head_groups"]


def pop_sliding_window(extra: dict) -> int | None:
    """Take ``sliding_window`` (an ``swa`` host pool's window in tokens; the pools do not carry
    it) out of the extra config ``extra``; None when absent.

    Raises:
        InvalidArgumentError: not a positive int, naming ``extra_config.sliding_window``.
    """
    window = extra.pop("sliding_window", None)
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise InvalidArgumentError(
            f"extra_config.sliding_window: must be a positive int (the model's window in tokens), got {window!r}"
        )
    return window


def require_head_groups(storage_config: HiCacheStorageConfig, tp_lcm_size: Any, config: ExtraConfig) -> None:
    """Refuse a ``tp_lcm_size`` kvstage cannot split pages by, before anything is opened.

    Raises:
        InvalidArgumentError: not a positive int, not a multiple of ``tp_size``, an MLA model, or
            with KV events; naming ``storage_config.tp_lcm_size``.
    """
    argument = "storage_config.tp_lcm_size"
    if not isinstance(tp_lcm_size, int) or isinstance(tp_lcm_size, bool) or tp_lcm_size < 1:
        raise InvalidArgumentError(f"{argument}: must be a positive int, got {tp_lcm_size!r}")
    if tp_lcm_size % storage_config.tp_size != 0:
        raise InvalidArgumentError(
            f"{argument}: {tp_lcm_size} must be a multiple of tp_size {storage_config.tp_size} "
            "(a common multiple of every TP size sharing the store)"
        )
    if storage_config.is_mla_model:
        raise InvalidArgumentError(
            f"{argument}: an MLA latent has no KV heads to split and is the same on every TP rank "
            "(its pages are shared by every TP size already); drop tp_lcm_size"
        )
    if config.kv_events_endpoint is not None:
        raise InvalidArgumentError(
            f"{argument}: KV events (extra_config.kv_events_endpoint) do not announce pages split by head groups yet"
        )
