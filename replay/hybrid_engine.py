"""The replay engine for a hybrid model (:class:`~kvstage.replay.models.HybridShape`): the
sliding-window KV or the linear-attention state beside the full-attention KV, through the
manager's components (:class:`~kvstage.offload.components.ComponentPools`, one store per
component).

What it adds to :class:`~kvstage.replay.engine.ReplayEngine`'s flow:

- Content: sliding-window KV as :class:`~kvstage.replay.kv_content.KVContent` with another base
  and the same page masks; the state after ``L`` tokens as
  :class:`~kvstage.replay.kv_content.StateContent` of the key of the page ending at ``L``. So
  every entry of every component is a function of (tokens, position) and is checked exactly.
- Resume points every ``snapshot_every`` pages (``L`` a multiple of ``snapshot_every *
  page_size``): in prefill, past the loaded prefix up to the prompt's end, a state model
  writes the state after ``L`` into a state slot and calls ``manager.snapshot``, a
  sliding-window model calls ``manager.offload(req, kv_length=L)`` (the window before each
  run's end is what the manager stores); in decode, a state model snapshots at each such ``L``
  it reaches, a sliding-window model's resume points are the stride's runs.
- Load: the prefetched restorable length (``handle.pages_ready``), the window pages into the
  request's slots before it, the snapshot into a load state slot; every loaded page of every
  component and the snapshot are checked byte for byte (``load_mismatches``).
- Counts (:class:`HybridStats`): per request the stored prefix (the full store's leading whole
  pages of its lookup) against the restorable length it loaded.

The sliding-window pool has the full pool's slots (a request's window slots are its full slots):
the replay measures storage and copies, not device memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvstage.offload.request import kv_length
from kvstage.replay.engine import MEMORY_STORE_SHARE, POISON_WORD, ReplayEngine, _available_host_bytes
from kvstage.replay.kv_content import KVContent, StateContent
from kvstage.replay.models import HybridShape, ModelShape
from kvstage.replay.replay_request import ReplayRequest

LOAD_STATE_SLOT = 0  # a load's (and verify's) target state slot, checked right after the load
SNAPSHOT_RING = 8  # state slots snapshots are written into in turn (each waits for its last copy)


@dataclass
class HybridStats:
    """Restorable-length counters of a hybrid replay (tokens; a *hit* is a request whose lookup
    found a stored prefix of whole full pages).

    Attributes:
        requests_hit: requests with a stored prefix.
        hits_rounded_down: of those, requests that loaded less than their stored prefix (the
            restorable length: a snapshot or window further back, or nothing).
        tokens_stored_prefix: the stored prefixes' tokens, summed.
        tokens_restored: the loaded restorable lengths, summed.
        snapshots_taken: ``manager.snapshot`` calls; ``resume_offloads``: prefill offloads at
            resume points (sliding window).
        expected_snapshots: keys of every snapshot some request takes (verify's target).
    """

    requests_hit: int = 0
    hits_rounded_down: int = 0
    tokens_stored_prefix: int = 0
    tokens_restored: int = 0
    snapshots_taken: int = 0
    resume_offloads: int = 0
    expected_snapshots: set[str] = field(default_factory=set)


def _word_views(pool: Any, parts: int, layers: int, word: torch.dtype, width: int) -> list[list[torch.Tensor]]:
    slots = pool.num_slots
    return [
        [pool.layer(p, i).view(slots, -1).view(word).view(slots, width) for i in range(layers)] for p in range(parts)
    ]


def _mismatches(words, content: KVContent, slots: torch.Tensor, masks: torch.Tensor, device) -> torch.Tensor:
    num_pages = masks.shape[0]
    wrong = torch.zeros(num_pages, dtype=torch.bool, device=device)
    for part, layers in enumerate(words):
        for layer, view in enumerate(layers):
            expected = content.page_words_for_layer(masks, layer, part)
            wrong |= (view.index_select(0, slots) != expected).view(num_pages, -1).any(dim=1)
    return wrong


class HybridReplayEngine(ReplayEngine):
    """A :class:`ReplayEngine` of a :class:`HybridShape` (``config.model``); see the module doc.

    Attributes:
        layout: the model's :class:`~kvstage.model_layout.ModelLayout`.
        stores: one store per component (``stores["full"]`` is :attr:`storage`).
        every: resume-point spacing in tokens (``config.snapshot_every * page_size``).
        hybrid: the :class:`HybridStats`.

    Raises:
        As :class:`ReplayEngine`; InvalidArgumentError: ``config.model`` is no HybridShape.
    """

    def __init__(
        self, config, requests, on_progress: Callable | None = None, open_store: Callable | None = None
    ) -> None:
        from kvstage.errors import InvalidArgumentError

        if not isinstance(config.model, HybridShape):
            raise InvalidArgumentError(f"--model: {config.model.name} is no hybrid model")
        self.layout = config.model.model_layout
        self.every = config.snapshot_every * config.page_size
        self.hybrid = HybridStats()
        super().__init__(config, requests, on_progress=on_progress, open_store=open_store)

    # -- pools and stores (called by ReplayEngine.__init__ before the manager is made) ----------

    def _open_storage(self, open_store: Callable[[str, Any], Any]) -> tuple[Any, Any]:
        from kvstage.kernels import KVPool
        from kvstage.kernels.state_pool import StatePool
        from kvstage.offload.components import ComponentPools

        model, ps, layout = self.model, self.page_size, self.layout
        slots, pools, slots_of = self.kv_pool.num_slots, {}, {}
        self.swa = next(iter(layout.of_kind("swa")), None)
        self.state = next(iter(layout.of_kind("state")), None)
        if self.swa is not None:
            n = self.swa.num_layers
            shape = (slots, model.num_heads, model.head_dim)
            k = [torch.empty(shape, dtype=model.dtype, device=self.device) for _ in range(n)]
            v = [torch.empty(shape, dtype=model.dtype, device=self.device) for _ in range(n)]
            pools[self.swa.name] = swa_pool = KVPool.mha(k, v)
            slots_of[self.swa.name] = lambda req: req.slot_indices
            swa_shape = ModelShape(model.name, n, 2, model.num_heads, model.head_dim, model.dtype_name)
            self.swa_content = KVContent(swa_shape, ps, self.config.seed, self.device, salt=1)
            c = self.swa_content
            self._swa_words = _word_views(swa_pool, 2, n, c.word, c.words_per_row)
            self.window_pages = self.swa.window_pages(ps)
        if self.state is not None:
            count = 1 + SNAPSHOT_RING
            layers = [
                [torch.empty((count, *s.shape), dtype=s.dtype, device=self.device) for s in self.state.tensors]
                for _ in self.state.layers
            ]
            pools[self.state.name] = StatePool.from_layers(layers)
            self._state_bytes = [t.view(count, -1).view(torch.uint8) for layer in layers for t in layer]
            self.state_content = StateContent(self.state.entry_bytes(ps), self.config.seed, self.content, self.device)
            self._ring: list[Any] = [None] * SNAPSHOT_RING
            self._ring_next = 0
        fingerprints = layout.fingerprints(model.name, page_size=ps)
        self.fingerprint = fingerprints["full"]
        self.stores = {}
        sizes = self._memory_sizes()
        for component in layout.components:
            url = self.config.storage if sizes is None else f"memory:{sizes[component.name]}"
            self.stores[component.name] = open_store(url, fingerprints[component.name])
        self.storage = self.stores["full"]
        self.storage_url = self.config.storage
        return self.stores, ComponentPools(layout, pools, slots_of)

    def _memory_sizes(self) -> dict[str, int] | None:
        """With ``--storage memory``: each component's store bytes, an entry for every whole page
        (nothing evicted), all of them together at most :data:`MEMORY_STORE_SHARE` of the host
        memory available (then scaled down, and :attr:`notes` says so)."""
        if self.config.storage != "memory":
            return None
        entries = {c.name: c.entry_bytes(self.page_size) for c in self.layout.components}
        need = {name: max(self.expected_pages_bound, 1) * size for name, size in entries.items()}
        total, available = sum(need.values()), _available_host_bytes()
        if available is not None and total > available * MEMORY_STORE_SHARE:
            share = available * MEMORY_STORE_SHARE / total
            need = {
                name: max(entries[name], int(n * share) // entries[name] * entries[name]) for name, n in need.items()
            }
            self.notes.append(
                f"storage: the trace may store {total / 2**30:.1f} GiB over its components, more than "
                f"{MEMORY_STORE_SHARE:.0%} of the {available / 2**30:.1f} GiB of host memory available; the memory "
                f"stores are capped at {sum(need.values()) / 2**30:.1f} GiB and may evict (use file:DIR to keep all)"
            )
        return need

    def close(self) -> None:
        """Close the manager and every component's store."""
        self.manager.close()
        for store in self.stores.values():
            store.close()

    # -- content --------------------------------------------------------------------------------

    def _write_kv(self, slot_indices: torch.Tensor, masks: torch.Tensor, offsets: torch.Tensor | None) -> None:
        super()._write_kv(slot_indices, masks, offsets)
        if self.swa is None:
            return
        c = self.swa_content
        for part, layers in enumerate(self._swa_words):
            for layer, words in enumerate(layers):
                if offsets is None:
                    rows = c.page_words_for_layer(masks, layer, part)[: slot_indices.shape[0]]
                else:
                    rows = c.token_rows(masks, offsets, layer, part)
                words.index_copy_(0, slot_indices, rows)

    def poison(self, slot_indices: torch.Tensor) -> None:
        """Poison these slots in the full and window pools, and the load state slot."""
        super().poison(slot_indices)
        if self.swa is not None:
            for layers in self._swa_words:
                for words in layers:
                    words.index_fill_(0, slot_indices, POISON_WORD)
        if self.state is not None:
            for view in self._state_bytes:
                view[LOAD_STATE_SLOT].fill_(POISON_WORD)

    def write_state(self, slot: int, key: str) -> None:
        """Write the state stored under ``key`` (:class:`StateContent`) into state slot ``slot``."""
        entry, offset = self.state_content.snapshot(key), 0
        for view in self._state_bytes:
            view[slot].copy_(entry[offset : offset + view.shape[1]])
            offset += view.shape[1]

    def state_matches(self, slot: int, key: str) -> bool:
        """Whether state slot ``slot`` holds exactly the snapshot of ``key``."""
        held = torch.cat([view[slot] for view in self._state_bytes])
        return bool(torch.equal(held, self.state_content.snapshot(key)))

    # -- load and check ---------------------------------------------------------------------

    def window_range(self, num_pages: int) -> range:
        """The sliding window's pages before a resume after ``num_pages`` pages."""
        return range(max(0, num_pages - self.window_pages), num_pages)

    def load_targets(self, slots: torch.Tensor, num_pages: int) -> dict[str, Any]:
        """``manager.load``'s ``state_slot`` and ``component_slots`` for a load of ``num_pages``
        pages whose positions have ``slots`` (position ``p`` at index ``p``)."""
        if num_pages == 0:
            return {}
        ps, targets = self.page_size, {}
        if self.swa is not None:
            window = self.window_range(num_pages)
            targets["component_slots"] = {self.swa.name: slots[window.start * ps : window.stop * ps]}
        if self.state is not None:
            targets["state_slot"] = LOAD_STATE_SLOT
        return targets

    def check_load(
        self, slots: torch.Tensor, keys: list[str], num_pages: int, full: bool = True
    ) -> dict[str, list[tuple[str, bool]]]:
        """After a load of ``num_pages`` pages (positions at ``slots``, keys ``keys``): per component,
        ``(key, matches)`` of each entry the load wrote (``full`` False: not the full pages)."""
        ps = self.page_size
        masks = self.content.masks(keys[:num_pages])
        checked = {}
        if full:
            wrong = _mismatches(self._words, self.content, slots[: num_pages * ps], masks, self.device).tolist()
            checked["full"] = [(key, not bad) for key, bad in zip(keys, wrong)]
        if self.swa is not None:
            window = self.window_range(num_pages)
            wslots = slots[window.start * ps : window.stop * ps]
            bad = _mismatches(self._swa_words, self.swa_content, wslots, masks[window.start :], self.device).tolist()
            checked[self.swa.name] = [(keys[i], not b) for i, b in zip(window, bad)]
        if self.state is not None:
            key = keys[num_pages - 1]
            checked[self.state.name] = [(key, self.state_matches(LOAD_STATE_SLOT, key))]
        return checked

    def _make_request(self, order, trace) -> ReplayRequest:
        req = super()._make_request(order, trace)
        if self.state is not None:
            for length in range(self.every, len(req.kv_tokens) + 1, self.every):
                self.hybrid.expected_snapshots.add(req.page_keys[length // self.page_size - 1])
        return req

    def _load_and_prefill(self, req: ReplayRequest) -> None:
        """Load the restorable prefix (every component), check it, prefill the rest, take the
        prompt's resume points, sample token 0."""
        ps = self.page_size
        handle, req.prefetch = req.prefetch, None
        num_pages = handle.pages_ready
        asked = list(handle.page_keys)
        held = list(self.storage.exists(asked)) if asked else []
        stored = next((i for i, hit in enumerate(held) if not hit), len(held))
        slots = req.slot_indices[: num_pages * ps]
        if num_pages:
            self.poison(req.slot_indices[: num_pages * ps])
        load = self.manager.load(handle, slots, **self.load_targets(req.slot_indices, num_pages))
        if num_pages:
            load.wait()
            checked = self.check_load(req.slot_indices, req.page_keys, num_pages)
            self.stats.load_mismatches += sum(not ok for entries in checked.values() for _, ok in entries)
        self.stats.prefill_tokens_saved += load.num_tokens
        req.loaded_pages = load.num_pages
        if stored:
            self.hybrid.requests_hit += 1
            self.hybrid.hits_rounded_down += load.num_pages < stored
            self.hybrid.tokens_stored_prefix += stored * ps
            self.hybrid.tokens_restored += load.num_tokens
        prompt_length = len(req.origin_input_ids)
        self._write_kv(
            req.slot_indices[load.num_tokens : prompt_length],
            req.masks[load.num_pages : -(-prompt_length // ps)],
            None,
        )
        first = (load.num_tokens // self.every + 1) * self.every
        for length in range(first, prompt_length + 1, self.every):
            if self.state is not None:
                self._snapshot(req, length, prompt_length)
            if self.swa is not None:
                self.manager.offload(req, kv_length=length)
                self.hybrid.resume_offloads += 1
        req.sample_next()

    def _snapshot(self, req: ReplayRequest, length: int, tokens: int) -> None:
        index = self._ring_next
        self._ring_next = (index + 1) % SNAPSHOT_RING
        if self._ring[index] is not None:
            self._ring[index].synchronize()  # its gather read the slot: done before it is rewritten
        slot = 1 + index
        self.write_state(slot, req.page_keys[length // self.page_size - 1])
        self._ring[index] = self.manager.snapshot(req, length, slot, kv_length=tokens)
        self.hybrid.snapshots_taken += 1

    def _decode_step(self, running: list[ReplayRequest]) -> None:
        active = [req for req in running if not req.finished()]
        super()._decode_step(running)
        if self.state is None:
            return
        for req in active:
            tokens = kv_length(req)  # the token just written is the last with KV
            if tokens % self.every == 0:
                self._snapshot(req, tokens, tokens)
