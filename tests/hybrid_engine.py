"""A hybrid model's engine for the offload tests: random device pools of a layout, a slot table
per pool, a memory store per component that can lose or fail entries, and a manager over them
(``tests/offload/test_hybrid*.py``)."""

from __future__ import annotations

import torch

from kvstage.kernels import KVPool
from kvstage.kernels.state_pool import StatePool
from kvstage.kv_layout import KVLayout
from kvstage.model_layout import FullAttention, ModelLayout, PageSidecar, RequestState, SlidingWindow, TensorSpec
from kvstage.offload import HostPool
from kvstage.offload.components import ComponentPools, component_stores
from kvstage.offload.copy_stream import ManualCopyStream
from kvstage.offload.manager import OffloadManager
from kvstage.offload.testing import SimpleRequest, SlotTable
from kvstage.storage import MemoryStore

from offload_rig import InlineStoreWorkers

PAGE = 2
SLOTS = 64
POISON = -7.0


class HidingStore(MemoryStore):
    """A memory store that can lose entries (evicted) or fail their reads (corrupt)."""

    def __init__(self, fingerprint) -> None:
        super().__init__(fingerprint)
        self.evicted: set[str] = set()
        self.corrupt: set[str] = set()

    def _exists(self, full_keys):
        return [
            hit and not any(k.endswith(e) for e in self.evicted)
            for k, hit in zip(full_keys, super()._exists(full_keys))
        ]

    def _get(self, full_keys, into):
        hits = super()._get(full_keys, into)
        return [hit and not any(k.endswith(e) for e in self.evicted | self.corrupt) for k, hit in zip(full_keys, hits)]

    def _lend(self, full_keys):
        pages = super()._lend(full_keys)
        return [
            None if any(k.endswith(e) for e in self.evicted | self.corrupt) else p for k, p in zip(full_keys, pages)
        ]


def kv(layers: int, parts: int = 2) -> KVLayout:
    return KVLayout(layers, parts, 1, 4, "float32")


STATE = (TensorSpec("conv", (3, 2), "bfloat16"), TensorSpec("recurrent", (2, 5), "float32"))
LAYOUTS = {
    # gpt-oss-like: sliding window (W=5: 2 pages of 2 before a length) beside full attention
    "swa": ModelLayout(4, (SlidingWindow((0, 2), kv(2), window=5), FullAttention((1, 3), kv(2)))),
    # DeepSeek V3.2-like: an MLA latent and an indexer sidecar on the same layers
    "sidecar": ModelLayout(
        2, (FullAttention((0, 1), kv(2, 1)), PageSidecar((0, 1), (TensorSpec("index", (6,), "uint8"),), name="indexer"))
    ),
    # Qwen3-Next-like: linear-attention state beside full attention
    "state": ModelLayout(3, (RequestState((0, 1), STATE), FullAttention((2,), kv(1)))),
    # every kind at once; layer 1 has KV, a sidecar and state (Falcon-H1 keeps KV and state in a layer)
    "all": ModelLayout(
        4,
        (
            SlidingWindow((0,), kv(1), window=5),
            FullAttention((1, 3), kv(2)),
            PageSidecar((1, 3), (TensorSpec("index", (6,), "uint8"),), name="indexer"),
            RequestState((1, 2), STATE),
        ),
    ),
}


def window_kept_of(window_kept) -> dict:
    return {} if window_kept is None else {"window_kept": window_kept}


class Engine:
    """Random device pools of a layout, a slot table per pool, and a manager over them."""

    def __init__(
        self,
        layout: ModelLayout,
        seed: int = 0,
        stores=None,
        store_workers=None,
        host_pages: int = 32,
        window_kept=None,
        **manager,
    ) -> None:
        torch.manual_seed(seed)
        self.layout = layout
        full = layout.of_kind("full")[0]
        self.full = KVPool.from_stacked(torch.randn(full.layout.kv_parts, full.layout.num_layers, SLOTS, 1, 4))
        self.slots = SlotTable(SLOTS)
        self.window_slots = SlotTable(SLOTS)
        pools = {}
        for component in layout.components:
            if component.kind == "swa":
                shape = (component.layout.kv_parts, component.layout.num_layers, SLOTS, 1, 4)
                pools[component.name] = KVPool.from_stacked(torch.randn(shape))
            elif component.kind == "sidecar":
                row = component.row_bytes
                pools[component.name] = KVPool.from_rows(
                    [torch.randint(0, 255, (SLOTS, row), dtype=torch.uint8) for _ in component.layers]
                )
            elif component.kind == "state":
                pools[component.name] = StatePool.from_layers(
                    [
                        [torch.randn(4, *spec.shape).to(spec.dtype) for spec in component.tensors]
                        for _ in component.layers
                    ]
                )
        self.pools = pools
        windows = {c.name: self.window_slots for c in layout.of_kind("swa")}
        self.stores = stores or component_stores(layout, "m", PAGE, HidingStore)
        self.stream = ManualCopyStream()
        self.released = []
        self.manager = OffloadManager(
            self.full,
            HostPool.like(self.full, num_pages=host_pages, page_size=PAGE),
            self.stores,
            __import__("kvstage.hashing", fromlist=["PageHasher"]).PageHasher(page_size=PAGE),
            self.slots,
            components=ComponentPools(layout, pools, slots_of=windows, **window_kept_of(window_kept)),
            copy_stream=self.stream,
            store_workers=store_workers or InlineStoreWorkers(),
            backend="torch",
            release=self.released.append,
            **manager,
        )

    def settle(self) -> None:
        for _ in range(20):
            self.stream.complete_all()
            self.manager.poll()
        self.manager.drain()

    def request(self, rid: str, prompt, extra: int = 4, **namespace) -> SimpleRequest:
        req = SimpleRequest(rid, prompt, **namespace)
        self.slots.assign(req, len(prompt) + extra)
        self.window_slots.assign(req, len(prompt) + extra)
        return req

    def state_of(self, slot: int) -> list[torch.Tensor]:
        return [t[slot].clone() for t in self.pools["state"].tensors]


def store(engine: Engine, req, *, chunks=(), snapshots=()) -> dict[int, list[torch.Tensor]]:
    """Offload ``req`` (prefill chunk ends ``chunks``, then all), snapshots at ``snapshots``
    (state slot 0, fresh random state each); returns each snapshot's tensors."""
    saved = {}
    for end in chunks:
        engine.manager.offload(req, kv_length=end)
    engine.manager.offload(req)
    for length in snapshots:
        for t in engine.pools["state"].tensors:
            t[0] = torch.randn(t.shape[1:]).to(t.dtype)
        saved[length] = engine.state_of(0)
        engine.manager.snapshot(req, length, 0)
        engine.stream.complete_all()  # the slot's state stays until its copy is done
    req.done = True
    engine.manager.finish(req)
    engine.settle()
    return saved


PROMPT = list(range(100, 113))  # 13 tokens: 6 whole pages of 2


def load(engine: Engine, req, **kwargs):
    handle = engine.manager.prefetch(req, policy="wait_complete")
    handle.wait()
    engine.manager.poll()
    pages = handle.pages_ready
    loaded = engine.manager.load(handle, engine.slots(req)[: pages * PAGE], **kwargs)
    engine.stream.complete_all()
    loaded.wait()
    return loaded


def poison(engine: Engine, req) -> None:
    slots = engine.slots(req)
    for part in engine.full.buffers:
        for buffer in part:
            buffer[slots] = POISON
    for name, pool in engine.pools.items():
        if isinstance(pool, KVPool):
            where = engine.slots(req) if name != "swa" else engine.window_slots(req)
            for part in pool.buffers:
                for buffer in part:
                    buffer[where] = 0 if buffer.dtype == torch.uint8 else POISON


def rows(pool: KVPool, slots: torch.Tensor) -> list[torch.Tensor]:
    return [buffer[slots].clone() for part in pool.buffers for buffer in part]
