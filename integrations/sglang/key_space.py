"""The key space both sglang adapters store pages under, built one way.

:class:`~kvstage.integrations.sglang.KVStageStorage` (the prefill side's HiCache L3 backend) and
:class:`~kvstage.integrations.sglang.KVStageDecodeOffloadManager` (the decode side) read the same
``--hicache-storage-backend-extra-config`` JSON and must put the same KV under the same
:class:`~kvstage.storage.LayoutFingerprint`, or decode pages never continue the prefill chain.
:class:`ExtraConfig` parses that JSON and builds the fingerprint and the store for both.

sglang 0.5.23 holds fp8 KV (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``) in ``uint8`` buffers
(``MHATokenToKVPool.store_dtype``), which do not say which fp8 kind they hold: the extra config's
``kv_cache_dtype`` names it, so e4m3 and e5m2 pages never share a key space.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch

from kvstage.errors import InvalidArgumentError
from kvstage.events import SGLANG_FORMAT, KVEventPublisher
from kvstage.kv_layout import KVLayout
from kvstage.storage import LayoutFingerprint, StorageBackend, open_storage
from kvstage.storage.head_groups import HeadGroups

__all__ = ["ExtraConfig", "FP8_KINDS"]

# sglang's --kv-cache-dtype names of the fp8 kinds it holds as uint8.
FP8_KINDS: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

_KVSTAGE_KEYS = {
    "url",
    "model_id",
    "kv_cache_dtype",
    "kv_events_endpoint",
    "kv_events_replay_endpoint",
    "kv_events_topic",
}
# sglang's own keys of the same JSON (its factory's, and those its cache reads).
_SGLANG_KEYS = {
    "backend_name",
    "module_path",
    "class_name",
    "interface_v1",
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys",
    "tp_lcm_size",
}
KNOWN_KEYS = frozenset(_KVSTAGE_KEYS | _SGLANG_KEYS)

# the argument name a store factory's error starts with ("url: ...", "storage: ...")
_FACTORY_ARGUMENT = re.compile(r"^(url|storage): ")


@dataclass(frozen=True)
class ExtraConfig:
    """kvstage's part of sglang's storage extra config.

    Attributes:
        url: a :func:`kvstage.storage.open_storage` URL (``"file:/path"``, ``"memory"``,
            ``"mooncake://host:port?..."``).
        model_id: the model's key-space name (the extra config's ``model_id``, else sglang's
            model name).
        kv_cache_dtype: ``"fp8_e4m3"``, ``"fp8_e5m2"`` or None: the fp8 kind of a ``uint8`` pool.
        kv_events_endpoint: where to bind a KV event publisher in sglang's format (e.g.
            ``"tcp://*:5560"``), or None: no events.
        kv_events_replay_endpoint: its replay socket's address, or None (no replay).
        kv_events_topic: its topic (default ``""``; routers key a stream by it).
        tp_lcm_size: sglang's ``tp_lcm_size`` where the JSON still holds it (sglang's cache
            controller takes it out before the storage backend sees it; the decode side reads
            the raw JSON), else None.
    """

    url: str
    model_id: str
    kv_cache_dtype: str | None
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    tp_lcm_size: int | None = None

    @classmethod
    def parse(cls, extra: Mapping[str, Any], default_model_id: str | None) -> "ExtraConfig":
        """Check and read ``extra`` (the parsed extra-config JSON).

        Args:
            extra: the JSON object; sglang's own keys are allowed and ignored.
            default_model_id: sglang's model name, used when ``extra`` has no ``model_id``.

        Raises:
            InvalidArgumentError: an unknown key; no ``url`` (or not a non-empty str); no model
                id; a ``kv_cache_dtype`` other than those of :data:`FP8_KINDS`. Each message
                names the key as ``extra_config.<key>``.
        """
        unknown = sorted(set(extra) - KNOWN_KEYS)
        if unknown:
            raise InvalidArgumentError(f"extra_config: unknown keys {unknown}; known: {sorted(KNOWN_KEYS)}")
        url = extra.get("url")
        if not isinstance(url, str) or not url:
            raise InvalidArgumentError(
                'extra_config.url: a kvstage storage URL is required (e.g. "file:/path", "memory", "mooncake://host:port")'
            )
        model_id = extra.get("model_id") or default_model_id
        if not model_id:
            raise InvalidArgumentError("extra_config.model_id: required when sglang has no model name")
        kind = extra.get("kv_cache_dtype")
        if kind is not None and kind not in FP8_KINDS:
            raise InvalidArgumentError(f"extra_config.kv_cache_dtype: must be one of {sorted(FP8_KINDS)}, got {kind!r}")
        events = {}
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_topic"):
            value = extra.get(name)
            if value is not None:
                if not isinstance(value, str) or (not value and name != "kv_events_topic"):
                    raise InvalidArgumentError(f"extra_config.{name}: must be a non-empty str, got {value!r}")
                events[name] = value
        if "kv_events_endpoint" not in events and len(events):
            raise InvalidArgumentError(
                f"extra_config.kv_events_endpoint: required with {sorted(events)} (it turns KV events on)"
            )
        lcm = extra.get("tp_lcm_size")
        if lcm is not None and (not isinstance(lcm, int) or isinstance(lcm, bool) or lcm < 1):
            raise InvalidArgumentError(f"extra_config.tp_lcm_size: must be a positive int, got {lcm!r}")
        return cls(url, model_id, kind, **events, tp_lcm_size=lcm)

    def kv_event_publisher(self, tp_rank: int) -> KVEventPublisher | None:
        """A KV event publisher in sglang's format
        (:data:`~kvstage.events.sglang_format.SGLANG_FORMAT`) bound at ``kv_events_endpoint``,
        on TP rank 0 only (one stream per engine, as sglang's ``is_kv_publisher_rank``); None
        on other ranks or without the key.

        Raises:
            InvalidArgumentError: an endpoint cannot be bound (``extra_config.kv_events_...: ...``).
        """
        if self.kv_events_endpoint is None or tp_rank != 0:
            return None
        try:
            return KVEventPublisher(
                self.kv_events_endpoint,
                replay_endpoint=self.kv_events_replay_endpoint,
                topic=self.kv_events_topic,
                event_format=SGLANG_FORMAT,
            )
        except InvalidArgumentError as error:
            raise InvalidArgumentError(f"extra_config.kv_events_{error}") from error

    def kv_dtype(self, pool_dtype: torch.dtype, pool: str) -> torch.dtype:
        """The dtype of the KV a pool of ``pool_dtype`` holds: the named fp8 kind for a ``uint8``
        pool, else the pool's own dtype.

        Args:
            pool_dtype: the element dtype of sglang's buffers.
            pool: the pool's name for messages (e.g. ``"host pool"``).

        Raises:
            InvalidArgumentError: a ``uint8`` pool without ``kv_cache_dtype``; ``kv_cache_dtype``
                on a pool that holds neither ``uint8`` nor that fp8 dtype (the message names
                both).
        """
        if self.kv_cache_dtype is None:
            if pool_dtype == torch.uint8:
                raise InvalidArgumentError(
                    f"extra_config.kv_cache_dtype: the {pool} holds fp8 KV as uint8; name its kind "
                    f"({sorted(FP8_KINDS)}) so e4m3 and e5m2 pages never share a key space"
                )
            return pool_dtype
        declared = FP8_KINDS[self.kv_cache_dtype]
        if pool_dtype not in (torch.uint8, declared):
            raise InvalidArgumentError(
                f"extra_config.kv_cache_dtype: {self.kv_cache_dtype!r} contradicts the {pool}'s dtype {pool_dtype} "
                "(fp8 KV is held as uint8); drop kv_cache_dtype or serve with that --kv-cache-dtype"
            )
        return declared

    def fingerprint(
        self,
        layout: KVLayout,
        pool: str,
        *,
        page_size: int,
        tp_rank: int,
        tp_size: int,
        first_layer: int,
        head_groups: HeadGroups | None = None,
    ) -> LayoutFingerprint:
        """The key space of pages of ``layout`` (a pool's layout, its dtype as sglang holds it),
        with the dtype resolved by :meth:`kv_dtype`; with ``head_groups`` (sglang's
        ``tp_lcm_size``), that of their entries (:mod:`kvstage.storage.head_groups`), shared by
        every TP size.

        Raises:
            InvalidArgumentError: ``tp_lcm_size`` in the JSON but no ``head_groups`` (the
                decode-side offload, which keeps per-rank keys: its pages would not continue a
                head-group chain); as :meth:`kv_dtype`, or as :class:`LayoutFingerprint`.
        """
        if self.tp_lcm_size is not None and head_groups is None:
            raise InvalidArgumentError(
                f"extra_config.tp_lcm_size: the {pool}'s pages would be keyed per TP rank, not in the head-group "
                "key space tp_lcm_size opts in to (the decode-side offload does not split heads yet); drop tp_lcm_size"
            )
        resolved = replace(layout, dtype=self.kv_dtype(layout.dtype, pool))
        groups = 0
        if head_groups is not None:
            resolved, groups = head_groups.entry_layout(resolved), head_groups.tp_lcm_size
        return LayoutFingerprint(
            self.model_id,
            resolved,
            page_size,
            tp_rank=tp_rank,
            tp_size=tp_size,
            first_layer=first_layer,
            head_groups=groups,
        )

    def open_store(self, fingerprint: LayoutFingerprint) -> StorageBackend:
        """``open_storage(url, fingerprint)``; a bad URL's error names ``extra_config.url``.

        Raises:
            InvalidArgumentError: the URL's scheme or options are bad (``extra_config.url: ...``).
            BackendUnavailableError, StorageError: as :func:`kvstage.storage.open_storage`.
        """
        try:
            return open_storage(self.url, fingerprint)
        except InvalidArgumentError as error:
            rule = _FACTORY_ARGUMENT.sub("", str(error))
            # the factories quote the URL too ("'memory:x': ...", "... in 's3://...'"): named once, first
            quoted = re.escape(repr(self.url))
            rule = re.sub(rf"^{quoted}:? |,? (?:in|got) {quoted}", "", rule)
            raise InvalidArgumentError(f"extra_config.url: {self.url!r}: {rule}") from error
