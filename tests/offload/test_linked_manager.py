"""LinkedStores under the offload manager, which links its component stores itself: a hybrid
model's requests stored through the manager into memory stores too small for them (every
component evicts); after each request, every restorable length the manager's lookup answers is
held whole, nothing is held past a chain's gap, and flush empties every component's store."""

from __future__ import annotations

import torch

from kvstage.hashing import PageHasher
from kvstage.kernels import KVPool
from kvstage.kernels.state_pool import StatePool
from kvstage.kv_layout import KVLayout
from kvstage.model_layout import FullAttention, ModelLayout, PageSidecar, RequestState, SlidingWindow, TensorSpec
from kvstage.offload import HostPool
from kvstage.offload.components import ComponentPools
from kvstage.offload.copy_stream import ManualCopyStream
from kvstage.offload.manager import OffloadManager
from kvstage.offload.restorable import pages_to_load
from kvstage.offload.testing import SimpleRequest, SlotTable
from kvstage.storage import MemoryStore

from offload_rig import InlineStoreWorkers

PAGE = 2
SLOTS = 512
STATE = (TensorSpec("conv", (3, 2), "bfloat16"), TensorSpec("recurrent", (2, 5), "float32"))
KV = KVLayout(2, 2, 1, 4, "float32")
LAYOUT = ModelLayout(
    4,
    (
        SlidingWindow((0,), KVLayout(1, 2, 1, 4, "float32"), window=5),
        FullAttention((1, 3), KV),
        PageSidecar((1, 3), (TensorSpec("index", (6,), "uint8"),), name="indexer"),
        RequestState((1, 2), STATE),
    ),
)
CAPACITY = {"full": 16, "indexer": 12, "swa": 8, "state": 3}


def engine(stores: dict) -> tuple[OffloadManager, ManualCopyStream, SlotTable, SlotTable, dict]:
    torch.manual_seed(0)
    full = KVPool.from_stacked(torch.randn(2, 2, SLOTS, 1, 4))
    slots, window_slots = SlotTable(SLOTS), SlotTable(SLOTS)
    pools = {
        "swa": KVPool.from_stacked(torch.randn(2, 1, SLOTS, 1, 4)),
        "indexer": KVPool.from_rows([torch.randint(0, 255, (SLOTS, 6), dtype=torch.uint8) for _ in range(2)]),
        "state": StatePool.from_layers([[torch.randn(4, *s.shape).to(s.dtype) for s in STATE] for _ in range(2)]),
    }
    stream = ManualCopyStream()
    manager = OffloadManager(
        full,
        HostPool.like(full, num_pages=64, page_size=PAGE),
        stores,
        PageHasher(page_size=PAGE),
        slots,
        components=ComponentPools(LAYOUT, pools, slots_of={"swa": window_slots}),
        copy_stream=stream,
        store_workers=InlineStoreWorkers(),
        backend="torch",
    )
    return manager, stream, slots, window_slots, pools


def settle(manager, stream) -> None:
    for _ in range(20):
        stream.complete_all()
        manager.poll()
    manager.drain()


def held(store: MemoryStore) -> set[str]:
    return set(store._pages.keys())  # a memory store is keyed by page keys


def test_requests_through_the_manager_into_full_stores_stay_restorable_and_flush_empties_them():
    # no LinkedStores made here: the manager links the stores of its components by default
    fps = LAYOUT.fingerprints("m", page_size=PAGE)
    stores = {name: MemoryStore(fp, capacity_pages=CAPACITY[name]) for name, fp in fps.items()}
    manager, stream, slots, window_slots, pools = engine(stores)
    generator = torch.Generator().manual_seed(1)
    prompts, answered = [], 0
    for index in range(12):
        prompt = torch.randint(0, 5000, (int(torch.randint(9, 16, (1,), generator=generator)),), generator=generator)
        prompt = prompt.tolist()
        req = SimpleRequest(f"r{index}", prompt)
        slots.assign(req, len(prompt) + 2)
        window_slots.assign(req, len(prompt) + 2)
        manager.offload(req, kv_length=4)
        manager.offload(req)
        for length in range(4, len(prompt), 4):
            manager.snapshot(req, length, 0)
            stream.complete_all()
        req.done = True
        manager.finish(req)
        settle(manager, stream)
        prompts.append(prompt)
        holding = {name: held(store) for name, store in stores.items()}
        for tokens in prompts:
            keys = manager.hasher.prefill_keys(tokens)
            gap = min(
                (i for name in ("full", "indexer") for i, key in enumerate(keys) if key not in holding[name]),
                default=len(keys),
            )
            assert not any(key in holding[name] for name in stores for key in keys[gap:])
            found = manager.match_prefix(token_ids=tokens)
            for length in found.lengths:
                for name, pages in pages_to_load(LAYOUT, PAGE, length).items():
                    assert all(keys[i] in holding[name] for i in pages), (name, length)
            answered += len(found.lengths)
    assert all(store.stats.pages_evicted > 0 for store in stores.values())
    assert answered > 0 and sum(store.stats.pages_removed for store in stores.values()) > 0  # dependents went
    before = sum(len(held(store)) for store in stores.values())
    removed = manager.flush()  # every component's store, dependents first
    assert removed == before and all(not held(store) for store in stores.values())
    manager.close()
