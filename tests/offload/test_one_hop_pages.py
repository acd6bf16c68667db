"""The manager's full pages move one hop with host pages of their own (``buffer_pages=1``) over a
store that adopts and lends: a gather copies a KV pool in host memory by rows into the host
pages, the write hands the pages themselves to the store (its spares take their place), a
prefetch lends the store's pages in and the scatter copies from them.

What must hold: every byte lands (random data, poisoned host pages and load slots, page counts
1, 3 and 5, slots in aligned page runs or not); the store keeps the host pages (no copy into it)
and a steady state at capacity allocates nothing; a store that does not adopt or lend still moves
every byte (copying as ``put`` / ``get`` do); no loan outlives its copy (loaded, cancelled); a
page on loan is never evicted nor its memory reused while the scatter runs, however many puts
evict at capacity meanwhile.
"""

from __future__ import annotations

import pytest
import torch

from kvstage.hashing import PageHasher
from kvstage.kernels import KVPool
from kvstage.kv_layout import KVLayout
from kvstage.offload import HostPool, OffloadManager
from kvstage.offload.copy_stream import ManualCopyStream
from kvstage.offload.testing import SimpleRequest
from kvstage.storage import LayoutFingerprint, MemoryStore

from offload_rig import InlineStoreWorkers

PAGE = 4
LAYOUT = KVLayout(3, 2, 2, 8, "bfloat16")  # 3 layers, K and V, 2 heads of 8
NUM_SLOTS = 256
POISON = 0x5A


class CopyingStore(MemoryStore):
    """A memory store with a put and a get of its own: it neither adopts nor lends."""

    def _put(self, keys, pages, prior_key=None):
        return super()._put(keys, pages, prior_key)

    def _get(self, keys, into):
        return super()._get(keys, into)


class OneHopRig:
    def __init__(self, store_class=MemoryStore, capacity_pages: int = 1 << 20, host_pages: int = 8) -> None:
        stacked = torch.empty(
            (2, LAYOUT.num_layers, NUM_SLOTS, LAYOUT.num_heads, LAYOUT.head_dim), dtype=torch.bfloat16
        )
        stacked.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(7))
        self.stacked = stacked
        self.kv_pool = KVPool.from_stacked(stacked)
        self.host_pool = HostPool.like(self.kv_pool, num_pages=host_pages, page_size=PAGE, pin=False, buffer_pages=1)
        for buffer in self.host_pool.buffers:  # what a copy does not write shows
            buffer.view(torch.uint8).fill_(POISON)
        self.store = store_class(LayoutFingerprint("one-hop", LAYOUT, PAGE), capacity_pages=capacity_pages)
        self.stream = ManualCopyStream()
        self.slots: dict[str, torch.Tensor] = {}
        self.manager = OffloadManager(
            self.kv_pool,
            self.host_pool,
            self.store,
            PageHasher(page_size=PAGE),
            lambda req: self.slots[req.rid],
            copy_stream=self.stream,
            store_workers=InlineStoreWorkers(),
            backend="torch",
        )

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        return self.stacked[:, :, slots].clone()

    def store_request(self, rid: str, prompt: list[int], slots: torch.Tensor, held: tuple = ()) -> None:
        self.slots[rid] = slots
        req = SimpleRequest(rid, prompt)
        self.manager.offload(req)
        req.done = True
        self.manager.finish(req)
        self.settle(held)

    def settle(self, held: tuple = ()) -> None:
        for _ in range(4):
            for handle in [h for h in self.stream.pending if all(h is not kept for kept in held)]:
                self.stream.complete(handle)
            self.manager.poll()

    def start_load(self, rid: str, prompt: list[int], slots: torch.Tensor, layer_by_layer: bool = False):
        """Prefetch ``prompt`` and launch its load into ``slots`` (poisoned first); the load's
        copies are left pending."""
        self.stacked.view(torch.uint8)[:, :, slots] = POISON
        self.slots[rid] = slots
        req = SimpleRequest(rid, prompt)
        handle = self.manager.prefetch(req, policy="wait_complete")
        handle.wait()
        loaded = self.manager.load(handle, slots[: handle.tokens_ready], layer_by_layer=layer_by_layer)
        return req, loaded


def _slots(first_page: int, num_pages: int, aligned: bool) -> torch.Tensor:
    """Slots of ``num_pages`` pages from page ``first_page`` on: whole pages in reverse order
    (``aligned``), else those slots shuffled (no page an aligned run)."""
    pages = torch.arange(first_page, first_page + num_pages).flip(0)
    slots = (pages.view(-1, 1) * PAGE + torch.arange(PAGE)).view(-1)
    if aligned:
        return slots
    return slots[torch.randperm(slots.numel(), generator=torch.Generator().manual_seed(first_page))]


def _prompt(seed: int, num_pages: int) -> list[int]:
    return [seed * 1000 + t for t in range(num_pages * PAGE + 1)]


@pytest.mark.parametrize("layer_by_layer", [False, True])
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("num_pages", [1, 3, 5])
def test_every_byte_lands_one_hop_and_the_store_keeps_the_host_pages(num_pages, aligned, layer_by_layer):
    rig = OneHopRig()
    source, target = _slots(0, num_pages, aligned), _slots(40, num_pages, aligned)
    prompt = _prompt(1, num_pages)
    rig.store_request("s", prompt, source)
    assert rig.manager.metrics.pages_stored == num_pages
    assert rig.store.pages_adopted == num_pages and rig.store.buffers_allocated == 0  # kept, not copied
    req, loaded = rig.start_load("l", prompt, target, layer_by_layer)
    assert rig.store.pages_on_loan == num_pages == rig.host_pool.pages_lent_in  # read from the store's pages
    if layer_by_layer:  # one copy a layer, each landing its layer alone
        assert len(rig.stream.pending) == LAYOUT.num_layers
        rig.stream.complete(rig.stream.pending[0])
        assert torch.equal(rig.stacked[:, 0, target].view(torch.uint8), rig.stacked[:, 0, source].view(torch.uint8))
        assert bool((rig.stacked[:, 1:, target].view(torch.uint8) == POISON).all())
    rig.settle()
    assert loaded.error is None and loaded.num_tokens == num_pages * PAGE
    assert torch.equal(rig.rows(target).view(torch.uint8), rig.rows(source).view(torch.uint8))
    rig.manager.abort(req)
    rig.manager.poll()
    assert rig.store.pages_on_loan == 0 and rig.host_pool.pages_lent_in == 0  # the loans ended with the copy
    rig.manager.close()


def test_a_store_that_neither_adopts_nor_lends_still_moves_every_byte():
    rig = OneHopRig(CopyingStore)
    assert not rig.store.adopts and not rig.store.lends
    source, target = _slots(0, 3, False), _slots(40, 3, False)
    rig.store_request("s", _prompt(2, 3), source)
    req, loaded = rig.start_load("l", _prompt(2, 3), target)
    assert rig.host_pool.pages_lent_in == 0
    rig.settle()
    assert loaded.error is None
    assert torch.equal(rig.rows(target).view(torch.uint8), rig.rows(source).view(torch.uint8))
    assert rig.store.pages_adopted == 0 and rig.store.buffers_allocated == 3
    rig.manager.close()


def test_a_cancelled_prefetch_ends_its_loans():
    rig = OneHopRig()
    rig.store_request("s", _prompt(3, 3), _slots(0, 3, True))
    handle = rig.manager.prefetch(SimpleRequest("l", _prompt(3, 3)), policy="wait_complete")
    handle.wait()
    assert rig.store.pages_on_loan == 3
    rig.manager.cancel(handle)
    rig.manager.poll()
    assert rig.store.pages_on_loan == 0 and rig.host_pool.pages_lent_in == 0
    rig.manager.close()


def test_evictions_at_capacity_never_touch_a_page_on_loan_and_a_steady_state_allocates_nothing():
    num_pages = 3
    rig = OneHopRig(capacity_pages=2 * num_pages, host_pages=3 * num_pages)
    sources = [_slots(8 * i, num_pages, True) for i in range(3)]
    for round_ in range(6):
        prompt = _prompt(10 + round_, num_pages)
        rig.store_request(f"s{round_}", prompt, sources[round_ % 3])
        expected = rig.rows(sources[round_ % 3]).view(torch.uint8)
        target = _slots(50, num_pages, True)
        req, loaded = rig.start_load(f"l{round_}", prompt, target)
        held = tuple(rig.stream.pending)  # the scatter, from the lent pages
        rig.stacked.view(torch.uint8)[:, :, sources[(round_ + 1) % 3]] ^= 0xFF  # other KV in those slots
        for extra in range(2):  # two more requests at capacity: each put evicts
            rig.store_request(
                f"x{round_}-{extra}", _prompt(100 + 10 * round_ + extra, num_pages), sources[(round_ + 1) % 3], held
            )
        assert rig.store.pages_on_loan == num_pages
        rig.settle()
        assert loaded.error is None
        assert torch.equal(rig.rows(target).view(torch.uint8), expected)  # the lent pages were never reused
        rig.manager.abort(req)
        rig.manager.poll()
        assert rig.store.pages_on_loan == 0
        if round_ == 1:
            allocated = rig.host_pool.buffers_allocated
    assert rig.store.buffers_allocated == 0 and rig.host_pool.buffers_allocated == allocated  # memory changes hands
    assert rig.manager.metrics.pages_failed == 0
    rig.manager.close()
