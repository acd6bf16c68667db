"""MooncakeStore.remove and chain-aware eviction across a hybrid layout's component stores
(LinkedStores) against a real mooncake_master: the master evicts on its own; when a lookup finds
an entry gone, its dependents go before the other stores are asked."""

from __future__ import annotations

import time
import uuid

import torch

from kvstage.hashing import prefill_page_keys
from kvstage.kv_layout import KVLayout
from kvstage.model_layout import FullAttention, ModelLayout, PageSidecar, RequestState, SlidingWindow, TensorSpec
from kvstage.offload.linked_stores import LinkedStores
from kvstage.offload.restorable import pages_to_load, restorable_lengths, swa_store_mask
from kvstage.storage import LayoutFingerprint, PutStatus
from kvstage.storage.mooncake.store import MooncakeStore

PAGE = 16
LAYOUT = ModelLayout(
    4,
    (
        SlidingWindow((0,), KVLayout(1, 2, 16, 128, "bfloat16"), window=17),  # 128 KiB pages, 1 before a length
        FullAttention((1, 3), KVLayout(2, 2, 16, 128, "bfloat16")),  # 256 KiB pages
        PageSidecar((1, 3), (TensorSpec("index", (1024,), "uint8"),), name="indexer"),  # 32 KiB
        RequestState((1, 2), (TensorSpec("conv", (64, 64), "float32"),)),  # 32 KiB snapshots
    ),
)
SWA = LAYOUT.component("swa")


def entry(fp: LayoutFingerprint, key: str, name: str) -> torch.Tensor:
    seed = int(key[:8], 16) ^ (hash(name) & 0xFFFF)
    return torch.randint(0, 256, (fp.page_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_remove_names_the_keys_removed_and_skips_those_gone(mooncake_master):
    fp = LayoutFingerprint(f"remove-{uuid.uuid4().hex[:8]}", KVLayout(2, 2, 2, 64, "bfloat16"), 16)
    with MooncakeStore(fp, mooncake_master.url()) as store:
        keys = [uuid.uuid4().hex for _ in range(4)]
        assert store.put(keys, [entry(fp, key, "p") for key in keys]) == [PutStatus.STORED] * 4
        store.take_events()
        assert store.remove(keys[:2] + keys[:1]) == 2  # a key twice counts once
        assert store.exists(keys) == [False, False, True, True]
        assert store.remove(keys[:2]) == 0  # gone already: not announced again
        events = store.take_events()
        assert sorted((e.kind, e.key) for e in events) == sorted(("removed", key) for key in keys[:2])
        assert store.stats.pages_removed == 2


def lookup(stores: dict, keys: list[str]) -> dict:
    """As the offload manager's lookup: the full store first, the others up to its first miss."""
    full = stores["full"].exists(keys)
    leading = next((i for i, hit in enumerate(full) if not hit), len(keys))
    present = {"full": full}
    for name in ("indexer", "swa", "state"):
        present[name] = stores[name].exists(keys[:leading]) + [False] * (len(keys) - leading)
    return present


def test_master_evictions_take_their_dependents_and_restorable_lengths_load(mooncake_master):
    fps = LAYOUT.fingerprints(f"linked-{uuid.uuid4().hex[:8]}", page_size=PAGE)
    url = mooncake_master.url(segment="16MiB", buffer="16MiB")
    stores = {name: MooncakeStore(fp, url) for name, fp in fps.items()}
    try:
        linked = LinkedStores(LAYOUT, stores, PAGE)
        generator = torch.Generator().manual_seed(3)
        requests = []

        def write(how_many: int) -> None:
            for _ in range(how_many):
                tokens = torch.randint(
                    0, 50000, (int(torch.randint(80, 140, (1,), generator=generator)),), generator=generator
                ).tolist()
                keys = prefill_page_keys(tokens, PAGE)
                answer = stores["full"].put(keys, [entry(fps["full"], key, "full") for key in keys])
                count = next((i for i, status in enumerate(answer) if status is PutStatus.FAILED), len(keys))
                stores["indexer"].put(keys[:count], [entry(fps["indexer"], key, "indexer") for key in keys[:count]])
                lengths = [k * PAGE for k in range(2, count + 1, 2) if k * PAGE < len(tokens)]
                for key, keep in zip(keys, swa_store_mask(SWA, PAGE, lengths, count)):
                    if keep:
                        stores["swa"].put([key], [entry(fps["swa"], key, "swa")])
                for length in lengths:
                    key = keys[length // PAGE - 1]
                    stores["state"].put([key], [entry(fps["state"], key, "state")])
                requests.append((tokens, keys))

        write(40)  # about 100 MiB into 64 MiB of segments: the master evicts
        # Which objects the master evicts is its choice: in a rare run it takes only entries with
        # no dependents, so more requests are written until an eviction takes some (at most 3 times).
        for attempt in range(3):
            time.sleep(1.0)  # the master's eviction thread settles
            for _ in range(3):  # lookups notice evictions (each removes its dependents): until nothing moves
                before = sum(linked.dependents_removed.values())
                for _, keys in requests:
                    lookup(stores, keys)
                if sum(linked.dependents_removed.values()) == before:
                    break
            if sum(linked.dependents_removed.values()) > 0 or attempt == 2:
                break
            write(20)
        gone = sum(store.stats.events_evicted for store in stores.values())
        assert gone > 0 and sum(linked.dependents_removed.values()) > 0, (gone, linked.dependents_removed)
        restorable = 0
        for tokens, keys in requests:
            present = {name: stores[name].exists(keys) for name in stores}  # every store, every key
            gap = min(
                (i for name in ("full", "indexer") for i, hit in enumerate(present[name]) if not hit), default=len(keys)
            )
            assert not any(hit for name in stores for hit in present[name][gap:])  # nothing after a gap
            for k in range(1, len(keys) + 1):
                if present["state"][k - 1]:
                    assert present["swa"][k - 1]  # a snapshot's window (1 page) is there
            lengths = restorable_lengths(LAYOUT, PAGE, len(tokens), present).lengths
            for length in lengths:
                for name, pages in pages_to_load(LAYOUT, PAGE, length).items():
                    wanted = [keys[i] for i in pages]
                    into = [torch.empty(fps[name].page_bytes, dtype=torch.uint8) for _ in wanted]
                    assert stores[name].get(wanted, into) == [True] * len(wanted)
                    assert all(torch.equal(got, entry(fps[name], key, name)) for got, key in zip(into, wanted))
            restorable += len(lengths)
        assert restorable > 0
        # A sidecar page removed from a request held whole: the master keeps no chains, so the
        # full pages after it go by the links LinkedStores took from the full store's puts.
        whole = next(keys for _, keys in reversed(requests) if len(keys) >= 4 and all(stores["full"].exists(keys)))
        before = dict(linked.dependents_removed)
        assert stores["indexer"].remove([whole[1]]) == 1
        assert stores["full"].exists(whole) == [True] + [False] * (len(whole) - 1)
        assert stores["indexer"].exists(whole) == [True] + [False] * (len(whole) - 1)
        assert not any(stores["swa"].exists(whole[1:])) and not any(stores["state"].exists(whole[1:]))
        assert linked.dependents_removed["full"] - before.get("full", 0) == len(whole) - 1
        for name, store in stores.items():
            events = store.take_events()
            assert {e.component for e in events} == {name} and {e.key_space for e in events} == {store.prefix}
            direct = 1 if name == "indexer" else 0  # the page removed by hand above
            assert sum(e.kind == "removed" for e in events) == linked.dependents_removed[name] + direct
        linked.close()
    finally:
        for store in stores.values():
            store.close()
