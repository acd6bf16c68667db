"""Small stand-ins for an engine's parts, for tests, benchmarks and integration checks.

- :class:`SimpleRequest`: a request that satisfies :class:`kvstage.offload.OffloadRequest`.
- :class:`SlotTable`: hands out device slots to requests and is the manager's
  ``slot_indices_of`` (what sglang's ``req_to_token`` row is).

Nothing here is used by the manager itself. The test suite's rig (a tiny engine around the
manager, a store that fails on demand) lives in ``tests/offload_rig.py``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kvstage.errors import InvalidArgumentError
from kvstage.offload.request import kv_length


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
    def kv_length(self) -> int:
        """:func:`kvstage.offload.request.kv_length` of this request."""
        return kv_length(self)

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

    def __init__(
        self, num_slots: int, device: torch.device | str = "cpu", generator: torch.Generator | None = None
    ) -> None:
        order = torch.randperm(num_slots, generator=generator) if generator is not None else torch.arange(num_slots)
        self._free: list[int] = order.tolist()[::-1]
        self.device = torch.device(device)
        self._rows: dict[int, tuple[Any, torch.Tensor]] = {}

    def assign(self, req: Any, num_slots: int) -> torch.Tensor:
        """Give ``req`` ``num_slots`` slots (its row; an existing row is replaced by a longer one
        that keeps the old slots first).

        Raises:
            InvalidArgumentError: not enough free slots.
        """
        old = self._rows.get(id(req))
        have = [] if old is None else old[1].tolist()
        more = num_slots - len(have)
        if more > len(self._free):
            raise InvalidArgumentError(f"num_slots: {more} more slots wanted, {len(self._free)} free")
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
