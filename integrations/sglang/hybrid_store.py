"""sglang 0.5.23's HiCache L3 v2 calls (``batch_exists_v2``, ``batch_set_v2``, ``batch_get_v2``)
over one kvstage store per component of a hybrid model.

sglang hands each call ``PoolTransfer`` values: a pool name, its keys and host slots (the slots
of that pool: ``page_size`` per key, one per key for Mamba) and a hit policy. The KV pool
itself moves through the v1 calls; a ``kv`` transfer here is served by them too. What is
restorable is kvstage's rule (:func:`kvstage.offload.restorable.restorable_lengths`): every KV
and indexer page before a length (sglang's ``ALL_PAGES``), the sliding-window pages of the
window before it and the Mamba snapshot at it (``TRAILING_PAGES``; a snapshot after ``k`` pages
is keyed by page ``k-1``'s key, as sglang keys the node's last page). sglang then reads the
``len(keys)`` trailing SWA pages it asked about (``ceil(W/P)``, one more than kvstage's
``ceil((W-1)/P)`` when ``P`` divides ``W-1``: both rules in
:func:`~kvstage.offload.restorable.reader_window_pages`), given to the core's rule as its
``window_pages``: a length whose extra page is missing is not reported, since that read would fail.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransferResult

from kvstage.errors import InvalidArgumentError
from kvstage.integrations.sglang.hybrid_pools import entry_pieces, pack, unpack
from kvstage.model_layout import ModelLayout
from kvstage.offload.restorable import restorable_lengths
from kvstage.offload.store_io import write_pages
from kvstage.storage import MissingPriorError, StorageBackend

__all__ = ["HybridStores"]

logger = logging.getLogger(__name__)

CHUNK = 8  # entries a call stages at once: bounds its memory (a DSA indexer page is ~0.5 MB)

# the hit policy sglang gives each component kind (anything else is a caller's error)
_POLICY = {
    "sidecar": PoolHitPolicy.ALL_PAGES,
    "swa": PoolHitPolicy.TRAILING_PAGES,
    "state": PoolHitPolicy.TRAILING_PAGES,
}


class HybridStores:
    """The stores and host pools of a hybrid model's components, by sglang pool name.

    Args:
        layout: the model's layout; component names are sglang's pool names (``kv``, ``swa``,
            ``indexer``, ``mamba``).
        stores: per component name, its store (opened on ``layout.fingerprints(...)[name]``).
        pools: per component name, its sglang host pool.
        page_size: tokens per KV page.
    """

    def __init__(
        self,
        layout: ModelLayout,
        stores: Mapping[str, StorageBackend],
        pools: Mapping[str, Any],
        page_size: int,
    ) -> None:
        self.layout, self.stores, self.pools, self.page_size = layout, dict(stores), dict(pools), page_size

    def close(self) -> None:
        """Close every store. Idempotent."""
        for store in self.stores.values():
            store.close()

    # -- the v2 calls ---------------------------------------------------------------------------

    def exists(self, keys: list[str], transfers: Sequence[Any]) -> PoolTransferResult:
        """sglang's ``batch_exists_v2``: the restorable prefixes of ``keys`` (a run of whole pages)
        over the KV pool and the pools of ``transfers`` (module doc). ``kv_hit_pages``: the
        longest; ``restorable_prefix_pages``: all of them, ascending; ``extra_pool_hit_pages``:
        per pool, the longest its own entries (and the KV pages) restore.

        Raises:
            InvalidArgumentError: a transfer of a pool not registered, or with a hit policy that is
                not its kind's (``ALL_PAGES`` for the indexer, ``TRAILING_PAGES`` for SWA, Mamba).
        """
        keys = list(keys)
        asked = {}
        for index, transfer in enumerate(transfers or ()):
            name = self._component_name(transfer, f"pool_transfers[{index}]")
            if name != "kv":
                asked[name] = transfer
        kv = self.stores["kv"].exists(keys)
        present = {c.name: [True] * len(keys) for c in self.layout.components}  # a pool not asked: no limit
        present["kv"] = kv
        for name in asked:
            present[name] = self.stores[name].exists(keys)
        pages = self._restorable_pages(present, asked)
        hits = {"kv": kv.index(False) if False in kv else len(kv)}
        for name in asked:
            alone = {c.name: [True] * len(keys) for c in self.layout.components}
            alone["kv"], alone[name] = kv, present[name]
            own = self._restorable_pages(alone, {name: asked[name]})
            hits[name] = own[-1] if own else 0
        hits = {name: count for name, count in hits.items() if count}
        return PoolTransferResult(pages[-1] if pages else 0, hits, pages)

    def set(self, transfers: Sequence[Any], prefix_keys: list[str] | None, set_kv: Callable) -> dict[str, list[bool]]:
        """sglang's ``batch_set_v2``: each transfer's host slots stored under its keys in its
        component's key space (``set_kv(keys, host_indices)`` for a ``kv`` transfer); per pool
        name, True per key stored or already there. Pages of a run after ``prefix_keys[-1]`` are
        linked to it where it is stored (as the KV pages are); a snapshot is linked to nothing.

        Raises:
            InvalidArgumentError: an unregistered pool, or host slots that do not match its keys,
                before anything is written.
        """
        plans = self._plans(transfers)
        results: dict[str, list[bool]] = {}
        for name, keys, host_indices, starts in plans:
            if name == "kv":
                results[name] = set_kv(keys, host_indices)
                continue
            component, pool, store = self.layout.component(name), self.pools[name], self.stores[name]
            prior = prefix_keys[-1] if prefix_keys and component.per_page else None
            staging = self._staging(component)
            results[name] = []
            for first in range(0, len(keys), CHUNK):
                chunk, entries = keys[first : first + CHUNK], staging[: len(starts[first : first + CHUNK])]
                for start, entry in zip(starts[first : first + CHUNK], entries):
                    pack(entry_pieces(component, pool, start), entry)
                outcome = write_pages(store, chunk, list(entries), prior_key=prior)
                if prior is not None and isinstance(outcome.error, MissingPriorError):
                    outcome = write_pages(store, chunk, list(entries))  # the prior is not stored: a chain's start
                if outcome.failed_keys:
                    logger.warning(
                        "KVStageStorage: %d %s entries not stored: %r", len(outcome.failed_keys), name, outcome.error
                    )
                failed = set(outcome.failed_keys)
                results[name] += [key not in failed for key in chunk]
                prior = chunk[-1] if component.per_page else None
        return results

    def get(self, transfers: Sequence[Any], get_kv: Callable) -> dict[str, list[bool]]:
        """sglang's ``batch_get_v2``: each transfer's keys read into its host slots; per pool name,
        True per entry found intact and written (a miss writes nothing into the pool).

        Raises:
            InvalidArgumentError: as :meth:`set`, before anything is read.
        """
        plans = self._plans(transfers)
        results: dict[str, list[bool]] = {}
        for name, keys, host_indices, starts in plans:
            if name == "kv":
                results[name] = get_kv(keys, host_indices)
                continue
            component, pool = self.layout.component(name), self.pools[name]
            staging = self._staging(component)
            results[name] = []
            for first in range(0, len(keys), CHUNK):
                chunk = keys[first : first + CHUNK]
                entries = list(staging[: len(chunk)])
                hits = self.stores[name].get(chunk, entries)
                for start, entry, hit in zip(starts[first : first + CHUNK], entries, hits):
                    if hit:
                        unpack(entry, entry_pieces(component, pool, start))
                results[name] += list(hits)
        return results

    # -- helpers --------------------------------------------------------------------------------

    def _staging(self, component: Any) -> torch.Tensor:
        """``CHUNK`` entries of ``component`` to stage one call's chunk in (each call its own:
        sglang's backup and prefetch threads call at once)."""
        return torch.empty((CHUNK, component.entry_bytes(self.page_size)), dtype=torch.uint8)

    def _component_name(self, transfer: Any, argument: str) -> str:
        name = str(transfer.name)
        if name not in self.pools:
            raise InvalidArgumentError(
                f"{argument}: pool {name!r} is not registered (registered: {sorted(self.pools)})"
            )
        if name != "kv":
            kind = self.layout.component(name).kind
            if transfer.hit_policy != _POLICY[kind]:
                raise InvalidArgumentError(
                    f"{argument}: pool {name!r} with hit policy {transfer.hit_policy}; kvstage stores it as "
                    f"{_POLICY[kind]}"
                )
        return name

    def _restorable_pages(self, present: dict[str, list[bool]], asked: Mapping[str, Any]) -> list[int]:
        num_keys = len(present["kv"])
        # sglang hands whole pages of tokens it may reuse and computes the next token itself
        # sglang reads the len(keys) trailing window pages it asked (ceil(W/P) by its rule), and
        # attention needs kvstage's: a length is restorable with both held
        window_pages = {
            name: max(1, len(transfer.keys or ()), self.layout.component(name).window_pages(self.page_size))
            for name, transfer in asked.items()
            if self.layout.component(name).kind == "swa"
        }
        found = restorable_lengths(self.layout, self.page_size, num_keys * self.page_size + 1, present, window_pages)
        return [length // self.page_size for length in found.lengths]

    def _plans(self, transfers: Sequence[Any]) -> list[tuple[str, list[str], Any, list[int]]]:
        """(pool name, keys, host_indices, first host slot per key) per transfer, all checked first."""
        plans = []
        for index, transfer in enumerate(transfers or ()):
            argument = f"transfers[{index}]"
            name = self._component_name(transfer, argument)
            keys = list(transfer.keys or ())
            host_indices = transfer.host_indices
            pool = self.pools[name]
            per_key = pool.page_size
            if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
                if not keys:
                    plans.append((name, keys, host_indices, []))
                    continue
                raise InvalidArgumentError(f"{argument}.host_indices: must be a 1-D tensor of {name!r} host slots")
            if host_indices.numel() != len(keys) * per_key:
                raise InvalidArgumentError(
                    f"{argument}.host_indices: {host_indices.numel()} slots for {len(keys)} keys of pool {name!r} "
                    f"({per_key} slots per key)"
                )
            starts = host_indices[::per_key].tolist() if keys else []
            for position, start in enumerate(starts):
                if start % per_key != 0 or not 0 <= start < pool.size:
                    raise InvalidArgumentError(
                        f"{argument}.host_indices[{position * per_key}]: {start} is not an entry start of pool "
                        f"{name!r} (a multiple of {per_key} below {pool.size})"
                    )
            plans.append((name, keys, host_indices, starts))
        return plans
