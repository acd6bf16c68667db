"""A store of the one-hop protocol for tests (:func:`kvstage.storage.backend.adopts_pages`,
``lends_pages``): it keeps the very tensors ``put_adopting`` hands it, lends its own, and evicts
oldest first at ``capacity_pages``, never a page on loan (chains are not tracked).

It records what the path under test did: ``puts`` (keys, prior key, adopting or copying) and
``loans_out`` (loans not ended). ``fail_puts`` makes the next puts raise it.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict

import torch

from kvstage.storage import LayoutFingerprint, PutStatus, PutStatuses, StorageBackend


class Loan:
    def __init__(self, store: "AdoptingStore", full_keys: list[str], pages: list) -> None:
        self.pages, self._store, self._keys, self.ended = pages, store, full_keys, False

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            with self._store._lock:
                for key, page in zip(self._keys, self.pages):
                    if page is not None:
                        self._store.loans[key] -= 1


class AdoptingStore(StorageBackend):
    tier = "memory"

    def __init__(self, page_bytes: int, capacity_pages: int = 1 << 20) -> None:
        super().__init__(LayoutFingerprint.opaque("adopting", page_bytes=page_bytes, page_format="test"))
        self.capacity_pages = capacity_pages
        self.pages: OrderedDict[str, torch.Tensor] = OrderedDict()  # full key -> flat uint8 page
        self.loans: Counter[str] = Counter()
        self.puts: list[tuple[list[str], str | None, bool]] = []
        self.fail_puts: BaseException | None = None
        self._lock = threading.Lock()

    @property
    def loans_out(self) -> int:
        return sum(self.loans.values())

    def page(self, key: str) -> torch.Tensor | None:
        return self.pages.get(self.prefix + key)

    # the protocol ------------------------------------------------------------------------

    def adoptable(self, page: object) -> bool:
        return (
            isinstance(page, torch.Tensor)
            and page.device.type == "cpu"
            and page.is_contiguous()
            and page.storage_offset() == 0
            and page.untyped_storage().nbytes() == self.page_bytes == page.numel() * page.element_size()
        )

    def put_adopting(self, keys, pages, *, prior_key=None):
        assert all(self.adoptable(page) for page in pages), "put_adopting got a page it cannot keep"
        spares: list[torch.Tensor] = []
        statuses = self._store_pages(list(keys), list(pages), prior_key, spares)
        return statuses, spares

    def lend(self, keys) -> Loan:
        full_keys = [self.prefix + key for key in keys]
        with self._lock:
            pages = [self.pages.get(key) for key in full_keys]
            for key, page in zip(full_keys, pages):
                if page is not None:
                    self.loans[key] += 1
        return Loan(self, full_keys, pages)

    # what a backend implements -------------------------------------------------------------

    def _store_pages(self, keys, pages, prior_key, spares) -> PutStatuses:
        """Adopt (``spares`` a list) or copy (``spares`` None) each page; FIFO eviction."""
        self.puts.append((list(keys), prior_key, spares is not None))
        if self.fail_puts is not None:
            raise self.fail_puts
        statuses = PutStatuses()
        stored = []
        of_call = {self.prefix + key for key in keys}  # never evicted for a page of this call
        with self._lock:
            for key, page in zip(keys, pages):
                full = self.prefix + key
                if full in self.pages:
                    statuses.append(PutStatus.DEDUPLICATED)
                    continue
                buffer = None
                if len(self.pages) >= self.capacity_pages:
                    victim = next((k for k in self.pages if not self.loans[k] and k not in of_call), None)
                    if victim is None:
                        statuses.append(PutStatus.FAILED)
                        continue
                    buffer = self.pages.pop(victim)
                if spares is None:
                    buffer = torch.empty(self.page_bytes, dtype=torch.uint8) if buffer is None else buffer
                    buffer.copy_(page.reshape(-1).view(torch.uint8))
                    self.pages[full] = buffer
                else:
                    if buffer is not None:
                        spares.append(buffer)
                    self.pages[full] = page.view(torch.uint8).view(-1)
                stored.append(key)
                statuses.append(PutStatus.STORED)
        self._events.record("stored", stored)
        return statuses

    def _exists(self, full_keys):
        return [key in self.pages for key in full_keys]

    def _put(self, full_keys, pages, full_prior_key=None):
        start = len(self.prefix)
        return self._store_pages([key[start:] for key in full_keys], pages, full_prior_key, None)

    def _get(self, full_keys, into):
        hits = []
        for key, target in zip(full_keys, into):
            page = self.pages.get(key)
            if page is not None:
                target.reshape(-1).view(torch.uint8).copy_(page)
            hits.append(page is not None)
        return hits

    def _clear(self):
        removed = len(self.pages)
        self.pages.clear()
        return removed
