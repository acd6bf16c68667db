"""Small stand-ins for an engine's parts, for tests, benchmarks and integration checks.

- :class:`SimpleRequest`: a request that satisfies :class:`kvstage.offload.OffloadRequest`.
- :class:`SlotTable`: hands out device slots to requests and is the manager's
  ``slot_indices_of`` (what sglang's ``req_to_token`` row is).
- :class:`FlakyStore`: a :class:`MemoryStore` whose writes fail on demand.

Nothing here is used by the manager itself.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from kvstage.errors import InvalidArgumentError, StorageError
from kvstage.offload.memory_store import MemoryStore
from kvstage.offload.storage import LayoutFingerprint, PutStatus


class SimpleRequest:
    """A request: prompt, sampled tokens, namespace, and a ``done`` flag behind ``finished()``.

    Equality and hashing are the object's identity (Python's default); tests subclass it to
    define them by ``rid`` and check that the manager does not use them.
    """

    def __init__(
        self,
        rid: Any,
        origin_input_ids: Sequence[int],
        output_ids: Sequence[int] = (),
        *,
        extra_key: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.rid = rid
        self.origin_input_ids = list(origin_input_ids)
        self.output_ids = list(output_ids)
        self.extra_key = extra_key
        self.cache_salt = cache_salt
        self.done = False

    def finished(self) -> bool:
        """True once ``done`` is set."""
        return self.done

    @property
    def tokens_with_kv(self) -> int:
        """``len(origin_input_ids) + len(output_ids) - 1`` (the last sampled token has no KV yet)."""
        return len(self.origin_input_ids) + max(len(self.output_ids) - 1, 0)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rid={self.rid!r}, prompt={len(self.origin_input_ids)}, output={len(self.output_ids)})"


class SlotTable:
    """Device slots of requests, keyed by request object; callable as ``slot_indices_of``.

    Args:
        num_slots: slots in the KV pool.
        device: where the slot index tensors live (the KV pool's device).
        generator: a ``torch.Generator`` for the order slots are handed out in (scattered
            slots, as in a real pool after some churn); None: ascending.
    """

    def __init__(self, num_slots: int, device: torch.device | str = "cpu", generator: torch.Generator | None = None) -> None:
        order = torch.randperm(num_slots, generator=generator) if generator is not None else torch.arange(num_slots)
        self._free: list[int] = order.tolist()[::-1]
        self.device = torch.device(device)
        self._rows: dict[int, tuple[Any, torch.Tensor]] = {}

    @property
    def free_slots(self) -> int:
        """Slots not held by any request."""
        return len(self._free)

    def assign(self, req: Any, n_slots: int) -> torch.Tensor:
        """Give ``req`` ``n_slots`` slots (its row; an existing row is replaced by a longer one
        that keeps the old slots first).

        Raises:
            InvalidArgumentError: not enough free slots.
        """
        old = self._rows.get(id(req))
        have = [] if old is None else old[1].tolist()
        more = n_slots - len(have)
        if more > len(self._free):
            raise InvalidArgumentError(f"n_slots: {more} more slots wanted, {len(self._free)} free")
        taken = [self._free.pop() for _ in range(max(more, 0))]
        row = torch.tensor(have + taken, dtype=torch.int64, device=self.device)
        self._rows[id(req)] = (req, row)
        return row

    def release(self, req: Any) -> list[int]:
        """Take the request's slots back; returns them.

        Raises:
            InvalidArgumentError: the request holds no slots (released twice?).
        """
        entry = self._rows.pop(id(req), None)
        if entry is None:
            raise InvalidArgumentError(f"req: {req!r} holds no slots (released twice?)")
        slots = entry[1].tolist()
        self._free.extend(reversed(slots))
        return slots

    def holds(self, req: Any) -> bool:
        """Whether ``req`` holds slots."""
        return id(req) in self._rows

    def __call__(self, req: Any) -> torch.Tensor:
        return self._rows[id(req)][1]


class FlakyStore(MemoryStore):
    """A :class:`MemoryStore` whose writes fail when ``fail(key)`` says so.

    Args:
        fingerprint: the KV layout.
        fail: ``fail(key) -> bool`` per page key (no prefix); True: that page's put is FAILED
            (and not visible). None: never.
        raise_on_put: ``raise_on_put() -> bool`` per put call; True: the call raises
            :class:`StorageError` and writes nothing (a backend that fails as a whole).
        capacity_pages: as for :class:`MemoryStore` (default: unbounded for tests).
    """

    def __init__(
        self,
        fingerprint: LayoutFingerprint,
        *,
        fail: Callable[[str], bool] | None = None,
        raise_on_put: Callable[[], bool] | None = None,
        capacity_pages: int = 1 << 40,
    ) -> None:
        super().__init__(fingerprint, capacity_pages=capacity_pages)
        self.fail = fail
        self.raise_on_put = raise_on_put

    def _put(self, full_keys: list[str], pages: list[torch.Tensor]) -> list[PutStatus]:
        if self.raise_on_put is not None and self.raise_on_put():
            raise StorageError("storage: injected failure of a whole put")
        statuses: list[PutStatus | None] = [None] * len(full_keys)
        keep_keys, keep_pages, keep_at = [], [], []
        prefix = len(self.prefix)
        for index, (key, page) in enumerate(zip(full_keys, pages)):
            if self.fail is not None and key not in self._pages and self.fail(key[prefix:]):
                statuses[index] = PutStatus.FAILED
            else:
                keep_keys.append(key)
                keep_pages.append(page)
                keep_at.append(index)
        for index, status in zip(keep_at, super()._put(keep_keys, keep_pages)):
            statuses[index] = status
        return statuses  # type: ignore[return-value]
