"""MemoryStore's one-hop paths: ``put_adopting`` keeps the caller's buffer and hands back the
evicted pages' buffers; ``lend`` hands out the stored pages themselves, never evicted while lent."""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.kv_layout import KVLayout
from kvstage.offload.store_io import write_pages
from kvstage.storage import AdoptedPagesError, MemoryStore, PutStatus
from kvstage.storage.backend import adopts_pages, lends_pages
from kvstage.storage.fingerprint import LayoutFingerprint

PAGE_BYTES = 64


def _store(capacity_pages: int = 3) -> MemoryStore:
    return MemoryStore(LayoutFingerprint("one-hop", KVLayout(1, 1, 1, 16, "uint8"), 4), capacity_pages=capacity_pages)


def _page(seed: int) -> torch.Tensor:
    """A whole buffer of random bytes ([1, PAGE_BYTES] uint8, as a staging buffer of one row)."""
    return torch.randint(0, 256, (1, PAGE_BYTES), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _read(store: MemoryStore, key: str) -> torch.Tensor | None:
    into = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    return into if store.get([key], [into]) == [True] else None


def test_put_adopting_keeps_the_buffer_without_a_copy():
    store = _store()
    page = _page(1)
    expected = page.clone()
    statuses, spares = store.put_adopting(["a"], [page])
    assert statuses == [PutStatus.STORED] and spares == []
    assert (store.pages_adopted, store.buffers_allocated, store.stats.pages_stored) == (1, 0, 1)
    loan = store.lend(["a"])
    assert loan.pages[0].data_ptr() == page.data_ptr()  # the very buffer, not a copy
    loan.end()
    assert torch.equal(_read(store, "a"), expected.view(-1))
    assert [event.kind for event in store.take_events()] == ["stored"]


def test_at_capacity_the_victims_buffer_comes_back_and_poisoning_it_harms_no_stored_page():
    store = _store(capacity_pages=2)
    pages = {key: _page(seed) for seed, key in enumerate("abcdef")}
    expected = {key: page.clone().view(-1) for key, page in pages.items()}
    pointers = {}
    spare_pointers = []
    for key, page in pages.items():
        pointers[key] = page.data_ptr()
        statuses, spares = store.put_adopting([key], [page])
        assert statuses == [PutStatus.STORED]
        for spare in spares:
            assert spare.dtype == torch.uint8 and spare.shape == (PAGE_BYTES,)
            spare_pointers.append(spare.data_ptr())
            spare.fill_(0x5A)  # the caller reuses it: a stored page must not see it
    assert len(store) == 2 and store.stats.pages_evicted == 4
    assert spare_pointers == [pointers[key] for key in "abcd"]  # least recently used first, each once
    assert _read(store, "a") is None
    for key in "ef":
        assert torch.equal(_read(store, key), expected[key])


def test_deduplicated_and_failed_pages_stay_the_callers():
    store = _store(capacity_pages=1)
    store.put(["a"], [_page(1)])
    page = _page(2)
    statuses, spares = store.put_adopting(["a"], [page])
    assert statuses == [PutStatus.DEDUPLICATED] and spares == [] and store.pages_adopted == 0
    statuses, _ = store.put_adopting(["c"], [_page(3)], prior_key="missing")  # unreachable: refused
    assert statuses == [PutStatus.FAILED] and statuses.error is not None
    loan = store.lend(["a"])  # the only page is lent: nothing may be evicted for a new one
    statuses, spares = store.put_adopting(["b"], [_page(4)])
    assert statuses == [PutStatus.FAILED] and spares == [] and store.pages_adopted == 0
    loan.end()
    statuses, spares = store.put_adopting(["b"], [_page(4)])
    assert statuses == [PutStatus.STORED] and len(spares) == 1


def test_put_adopting_refuses_buffers_it_cannot_own_before_storing_anything():
    store = _store()
    big = torch.zeros(2, PAGE_BYTES, dtype=torch.uint8)
    with pytest.raises(InvalidArgumentError, match=r"pages\[0\].*whole of its"):
        store.put_adopting(["a"], [big[0]])  # a view into a larger buffer
    with pytest.raises(InvalidArgumentError, match=r"pages\[0\]"):
        store.put_adopting(["a"], [torch.zeros(PAGE_BYTES // 2, dtype=torch.uint8)])
    page = _page(1)
    with pytest.raises(InvalidArgumentError, match=r"pages\[1\].*another page's"):
        store.put_adopting(["a", "b"], [page, page.view(1, PAGE_BYTES)])
    store.put(["c"], [_page(2)])
    loan = store.lend(["c"])
    with pytest.raises(InvalidArgumentError, match=r"pages\[0\].*on loan"):
        store.put_adopting(["d"], [loan.pages[0]])
    assert len(store) == 1 and store.pages_adopted == 0 and [e.key for e in store.take_events()] == ["c"]


def test_a_lent_page_is_never_evicted_and_keeps_its_bytes():
    store = _store(capacity_pages=2)
    store.put(["a"], [_page(1)])
    store.put(["b"], [_page(2)])
    loan = store.lend(["a", "x"])
    assert loan.pages[1] is None and store.pages_on_loan == 1
    assert (store.pages_lent, store.stats.pages_read, store.stats.pages_missed) == (1, 1, 1)
    lent = loan.pages[0].clone()
    assert torch.equal(lent, _page(1).view(-1))
    for seed, key in enumerate("cdef", start=3):  # "a" is the oldest, yet only "b" .. go
        if seed % 2:
            statuses = store.put([key], [_page(seed)])
        else:
            statuses, _ = store.put_adopting([key], [_page(seed)])
        assert statuses == [PutStatus.STORED]
    assert torch.equal(loan.pages[0], lent) and torch.equal(_read(store, "a"), lent)
    loan.end()
    loan.end()  # idempotent
    assert store.pages_on_loan == 0
    store.put(["g"], [_page(9)])
    store.put(["h"], [_page(10)])
    assert _read(store, "a") is None  # evictable again


def test_clear_remove_and_close_during_a_loan_never_hand_its_memory_on():
    store = _store(capacity_pages=2)
    store.put(["a"], [_page(1)])
    store.put(["b"], [_page(2)])
    loan = store.lend(["a", "b"])
    lent = [page.clone() for page in loan.pages]
    store.remove(["a"])
    for seed, key in enumerate("vwxyz", start=20):  # a removed page's memory may serve a put; never a lent one's
        assert store.put([key], [_page(seed)]) == [PutStatus.STORED]
    assert all(torch.equal(page, copy) for page, copy in zip(loan.pages, lent))
    store.clear()
    assert len(store) == 0
    spares = []
    for seed, key in enumerate("cdefg", start=3):
        spares += store.put_adopting([key], [_page(seed)])[1]
    assert all(spare.data_ptr() not in {page.data_ptr() for page in loan.pages} for spare in spares)
    assert all(torch.equal(page, copy) for page, copy in zip(loan.pages, lent))
    other = store.lend(["f"])
    store.close()
    assert store.pages_on_loan == 0
    loan.end()
    other.end()
    assert store.pages_on_loan == 0


def test_a_page_lent_twice_stays_kept_until_both_loans_end():
    store = _store(capacity_pages=1)
    store.put(["a"], [_page(1)])
    first, second = store.lend(["a"]), store.lend(["a"])
    first.end()
    assert store.put(["b"], [_page(2)]) == [PutStatus.FAILED]
    second.end()
    assert store.put(["b"], [_page(2)]) == [PutStatus.STORED]


def test_removed_pages_memory_comes_back_as_spares_but_never_a_lent_pages():
    store = _store(capacity_pages=4)
    pages = {key: _page(seed) for seed, key in enumerate("abc")}
    for key, page in pages.items():
        store.put_adopting([key], [page])
    loan = store.lend(["b"])
    assert store.remove(["a", "b"]) == 2
    _, spares = store.put_adopting(["d"], [_page(7)])  # below capacity: the removed page's memory comes back
    assert [spare.data_ptr() for spare in spares] == [pages["a"].data_ptr()]
    _, spares = store.put_adopting(["e"], [_page(8)])
    assert spares == []  # "b"'s memory is on loan: never handed on, even once removed
    assert torch.equal(loan.pages[0], _page(1).view(-1))
    store.clear()
    loan.end()
    assert store.put_adopting(["f"], [_page(9)])[1] == []


def test_a_subclass_with_its_own_reads_or_writes_is_not_bypassed():
    class CheckedReads(MemoryStore):
        def _get(self, full_keys, into):
            return [False for _ in full_keys]

    class CheckedWrites(MemoryStore):
        def _put(self, full_keys, pages, full_prior_key=None):
            return super()._put(full_keys, pages, full_prior_key)

    class BothHooks(CheckedReads):
        def _lend(self, full_keys):
            return [None for _ in full_keys]

    fp = LayoutFingerprint("one-hop", KVLayout(1, 1, 1, 16, "uint8"), 4)
    assert (_store().adopts, _store().lends) == (True, True)
    assert (CheckedReads(fp).adopts, CheckedReads(fp).lends) == (True, False)
    assert (CheckedWrites(fp).adopts, CheckedWrites(fp).lends) == (False, True)
    assert BothHooks(fp).lends
    # what every one-hop caller asks (the vLLM worker's too): never the adopting path around a _put of its own
    assert (adopts_pages(_store()), lends_pages(_store())) == (True, True)
    assert (adopts_pages(CheckedWrites(fp)), lends_pages(CheckedReads(fp))) == (False, False)


def test_a_put_adopting_that_raises_after_keeping_the_pages_says_which_it_kept():
    """A change listener raising after the put kept the pages: the error carries the statuses and
    spares (the kept tensors are the store's, whatever the listeners did meanwhile), and a write
    through store_io counts the write failed yet reports those pages adopted, so the caller
    replaces their buffers instead of reusing them under the store's stored pages."""
    store = _store(capacity_pages=6)
    store.put_adopting(["a"], [_page(1)])
    failing = {"on": True}

    def listener(_store, kind, keys, _priors):
        if failing["on"] and kind == "stored":
            raise RuntimeError("listener failed")

    store.add_change_listener(listener)
    pages = [_page(2), _page(3)]
    with pytest.raises(AdoptedPagesError) as raised:
        store.put_adopting(["b", "c"], pages, prior_key="a")
    assert raised.value.statuses == [PutStatus.STORED, PutStatus.STORED] and raised.value.spares == []
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert store.exists(["a", "b", "c"]) == [True, True, True]
    loan = store.lend(["b"])
    assert loan.pages[0].data_ptr() == pages[0].data_ptr()
    loan.end()
    outcome = write_pages(store, ["d", "e"], [_page(4), _page(5)], prior_key="c", adopt=True)
    assert outcome.adopted == [True, True] and outcome.failed_keys == ["d", "e"]
    assert isinstance(outcome.error, AdoptedPagesError)
    failing["on"] = False
    assert store.put_adopting(["e"], [_page(6)], prior_key="d")[0] == [PutStatus.DEDUPLICATED]


def test_a_lend_whose_timing_listener_raises_leaves_no_page_on_loan():
    store = _store(capacity_pages=2)
    store.put_adopting(["a"], [_page(1)])

    def listener(op, pages, seconds):
        raise RuntimeError("timing listener failed")

    store.add_timing_listener(listener)
    with pytest.raises(RuntimeError, match="timing listener failed"):
        store.lend(["a"])
    assert store.pages_on_loan == 0  # "a" can be evicted again
    store.remove_timing_listener(listener)
    store.put_adopting(["b"], [_page(2)])
    store.put_adopting(["c"], [_page(3)])
    assert store.exists(["a", "b", "c"]) == [False, True, True]
