"""How one put writes a chain's pages: page by page, or on I/O threads with the same answers.

The store supplies the steps (:class:`PutSteps`: is a page there, is its predecessor stored,
reserve and give back room, write a temporary file, commit it); this module decides their order.
:func:`put_serial` takes each page in turn. :func:`put_parallel` verifies the pages already there
at once, then, in chain order, reserves each page's room before its temporary file is written,
keeps at most ``threads`` writes in flight, and commits them in chain order, so what it stores,
refuses and reports is what :func:`put_serial` would (only the order of events may differ).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstage.storage.backend import MissingPriorError, PutStatus
from kvstage.storage.io_threads import IoThreads
from kvstage.storage.page_file import unlink

Outcome = tuple[PutStatus, OSError | MissingPriorError | None]
Written = tuple[Path, int] | OSError  # a temporary file and its size, or what stopped its write


@dataclass(frozen=True)
class PutSteps:
    """What a put needs of its store, for pages by full key and links by digest.

    Attributes:
        deduplicated: whether a key's page is there and intact (a use; a corrupt one removed).
        prior_stored: whether a digest (None: a chain's start) is stored.
        size: a key's page file size in bytes.
        reserve: hold room for that many bytes, evicting first (False: no room; nothing held).
        give_back: return held room of a page that will not land.
        write: a key's page, linked to a prior digest, as a temporary file (:data:`Written`).
        commit: ``commit(full_key, digest, prior, written, held=bytes)``: rename it into place
            and index it (the held room now the page's), or give the room back; its outcome.
        missing: the error of a page refused because the put's ``prior_key`` (a full key) is not stored.
    """

    deduplicated: Callable[[str], bool]
    prior_stored: Callable[[bytes | None], bool]
    size: Callable[[str], int]
    reserve: Callable[[int], bool]
    give_back: Callable[[int], None]
    write: Callable[[str, torch.Tensor, bytes | None], Written]
    commit: Callable[..., Outcome]
    missing: Callable[[str], MissingPriorError]


def put_serial(
    steps: PutSteps,
    full_keys: list[str],
    digests: list[bytes],
    pages: list[torch.Tensor],
    prior: bytes | None,
    full_prior_key: str | None,
) -> list[Outcome]:
    """Each page in turn: found there (``DEDUPLICATED``), refused (its prior is not stored:
    ``FAILED``, the first with :class:`MissingPriorError` when ``full_prior_key`` is the missing
    one), no room (``FAILED``), or written and committed, its room held from before the write
    until the rename. ``digests[i]`` is ``full_keys[i]``'s; ``prior`` the digest before the first."""
    outcomes = []
    for full_key, key, page in zip(full_keys, digests, pages):
        size = steps.size(full_key)
        if steps.deduplicated(full_key):
            outcomes.append((PutStatus.DEDUPLICATED, None))
        elif not steps.prior_stored(prior):  # unreachable: its predecessor is not here
            outcomes.append((PutStatus.FAILED, None if full_prior_key is None else steps.missing(full_prior_key)))
        elif not steps.reserve(size):
            outcomes.append((PutStatus.FAILED, None))  # no room: nothing written
        else:
            try:
                written = steps.write(full_key, page, prior)
            except BaseException:
                steps.give_back(size)
                raise
            outcomes.append(steps.commit(full_key, key, prior, written, held=size))
        prior, full_prior_key = key, None  # a later key's predecessor is in this call: not missing but refused
    return outcomes


def put_parallel(
    steps: PutSteps,
    io: IoThreads,
    full_keys: list[str],
    digests: list[bytes],
    pages: list[torch.Tensor],
    prior: bytes | None,
    full_prior_key: str | None,
) -> list[Outcome]:
    """The put on ``io``'s threads (``io.threads`` writes in flight), with the answers of
    :func:`put_serial`. Each file links to the digest before it, known up front; a page whose
    predecessor failed is refused (its file removed; the first page with a
    :class:`MissingPriorError` when the put's prior went meanwhile, e.g. dropped as corrupt by a
    reader). A page written beside one that then fails may have evicted for room it did not
    need. A write that fails while later pages' writes are in flight (whose files may hold the
    disk space it lacked) makes the put drop those files and go on page by page from that page,
    so a full disk fails the pages one thread would fail. For a put whose prior is stored (or
    None) at the start: a put refused then writes nothing."""
    return _ParallelPut(steps, io, full_keys, digests, pages, prior, full_prior_key).run()


class _ParallelPut:
    """One :func:`put_parallel` call's state: the outcomes so far and the writes in flight."""

    def __init__(self, steps: PutSteps, io: IoThreads, full_keys, digests, pages, prior, full_prior_key) -> None:
        self.steps, self.io = steps, io
        self.full_keys, self.digests, self.pages, self.full_prior_key = full_keys, digests, pages, full_prior_key
        self.priors = [prior, *digests[:-1]]
        found = [future.result() for future in io.map(steps.deduplicated, full_keys)]
        self.outcomes: list[Outcome | None] = [(PutStatus.DEDUPLICATED, None) if there else None for there in found]
        self.writes: deque[tuple[int, int, Future]] = deque()  # (page index, bytes held, its write)
        self.serial_from: int | None = None  # the page from which the put goes on page by page

    def run(self) -> list[Outcome]:
        try:
            for index in range(len(self.full_keys)):
                if self.outcomes[index] is None:
                    self._start(index)
                if self.serial_from is not None:
                    break
            while self.writes and self.serial_from is None:
                self._land_oldest()
        except BaseException:
            # Raised as page by page would at this page: the writes after it never land.
            self._drop_writes_in_flight()
            raise
        start = self.serial_from
        if start is not None:
            self.outcomes[start:] = put_serial(
                self.steps,
                self.full_keys[start:],
                self.digests[start:],
                self.pages[start:],
                self.priors[start],
                self.full_prior_key if start == 0 else None,
            )
        return self.outcomes

    def _start(self, index: int) -> None:
        """Refuse page ``index``, fail it for want of room, or reserve its room and write it."""
        full_key = self.full_keys[index]
        decided = index == 0 or self.outcomes[index - 1] is not None  # else its predecessor is in flight
        size = self.steps.size(full_key)
        if decided and not self.steps.prior_stored(self.priors[index]):
            self.outcomes[index] = self._refused(index)  # unreachable: nothing written
        elif not self.steps.reserve(size):
            self.outcomes[index] = (PutStatus.FAILED, None)  # no room: nothing written
        else:
            write = self.io.submit(self.steps.write, full_key, self.pages[index], self.priors[index])
            self.writes.append((index, size, write))
            if len(self.writes) >= self.io.threads:
                self._land_oldest()

    def _refused(self, index: int) -> Outcome:
        missing = index == 0 and self.full_prior_key is not None
        return PutStatus.FAILED, self.steps.missing(self.full_prior_key) if missing else None

    def _land_oldest(self) -> None:
        """Commit the oldest write in flight, or refuse it (its predecessor failed), or on a
        failed write with later writes in flight, drop those and go on page by page from it."""
        index, size, write = self.writes[0]
        written = write.result()  # if it raises, the write is still in ``writes``: given back by run
        self.writes.popleft()
        if isinstance(written, OSError) and self.writes:  # e.g. ENOSPC: a later page's file may hold the space
            self.steps.give_back(size)
            self._drop_writes_in_flight()
            self.serial_from = index
            return
        if not self.steps.prior_stored(self.priors[index]):  # a page before it failed, or the put's prior went
            self.steps.give_back(size)
            if not isinstance(written, OSError):
                unlink(written[0])
            self.outcomes[index] = self._refused(index)
        else:
            self.outcomes[index] = self.steps.commit(
                self.full_keys[index], self.digests[index], self.priors[index], written, held=size
            )

    def _drop_writes_in_flight(self) -> None:
        """Wait for the writes not landed yet, remove their files, give their room back."""
        while self.writes:
            _, size, write = self.writes.popleft()
            self.steps.give_back(size)
            if write.exception() is None and isinstance(write.result(), tuple):
                unlink(write.result()[0])
