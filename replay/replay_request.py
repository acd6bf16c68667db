"""A trace request as the replay engine and the offload manager see it, and where a fleet
engine's requests come from."""

from __future__ import annotations

from array import array
from typing import Any, Protocol

import numpy as np
import torch

from kvstage.replay.trace import TraceRequest

__all__ = ["ReplayRequest", "RequestFeed"]


def _int64_array(ids: np.ndarray) -> array:
    """Token ids as an ``array('q')`` (one copy of their bytes, no Python int per id)."""
    out = array("q")
    out.frombytes(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
    return out


class ReplayRequest:
    """A trace request as the engine and the offload manager see it (the ``OffloadRequest`` protocol).

    Attributes:
        rid: ``"r<index>"``.
        origin_input_ids: prompt token ids, an ``array('q')`` as sglang 0.5.23's ``Req`` keeps them.
        output_ids: sampled token ids so far (``array('q')``); the last has no KV yet.
        extra_key, cache_salt: the request's namespace (None when unset).
        trace: the trace line it came from.
        page_keys: the keys of every full page the request will have KV for (prompt then decode).
        device_pages: the device pool pages it holds; ``slots``: its slot of each token position.
        prefetch: its :class:`~kvstage.offload.PrefetchHandle` while it waits to load (else None).
        order: its position in the engine's timestamp-sorted trace (set by the engine).
    """

    def __init__(
        self, trace: TraceRequest, prompt: np.ndarray, output: np.ndarray, extra_key: str | None, cache_salt: str | None
    ) -> None:
        self.trace = trace
        self.rid = f"r{trace.index}"
        self.origin_input_ids = _int64_array(prompt)
        self.output_ids = array("q")
        self.extra_key = extra_key
        self.cache_salt = cache_salt
        self._target_output = _int64_array(output)
        self.page_keys: list[str] = []
        self.masks: torch.Tensor | None = None  # per page: its KV content mask (kv_content)
        self.mask_values: list[int] = []
        self.device_pages: list[int] = []
        self.slot_indices: torch.Tensor | None = None
        self.prefetch: Any = None
        self.order = -1  # its position in the engine's timestamp-sorted trace
        self.loaded_pages = 0  # leading pages loaded from the store rather than prefilled

    @property
    def output_length(self) -> int:
        """Output tokens the request will produce (its trace line's ``output_length``)."""
        return len(self._target_output)

    def finished(self) -> bool:
        """True once every output token of the trace line is sampled."""
        return len(self.output_ids) >= len(self._target_output)

    def sample_next(self) -> None:
        """Append the next output token."""
        self.output_ids.append(self._target_output[len(self.output_ids)])

    @property
    def kv_tokens(self) -> array:
        """Every token that will have KV: the prompt and all but the last output token."""
        return self.origin_input_ids + self._target_output[:-1]

    @property
    def namespace(self) -> tuple[str | None, str | None]:
        """(extra_key, cache_salt)."""
        return (self.extra_key, self.cache_salt)


class RequestFeed(Protocol):
    """Where a fleet engine's requests come from (``kvstage replay --engines``): the router's
    assignments, as orders into the engine's timestamp-sorted trace.

    ``take(wait)`` returns newly assigned orders (``wait``: the engine is idle, block briefly for
    some); ``exhausted`` is True once no more will come; ``admitted(req)`` is told when a
    request (a :class:`ReplayRequest`, its page keys made) is admitted, ``stored(req)`` when it
    has finished and its last store write has ended (the manager's ``on_stored``).
    """

    exhausted: bool

    def take(self, wait: bool) -> list[int]: ...

    def admitted(self, req: "ReplayRequest") -> None: ...

    def stored(self, req: "ReplayRequest") -> None: ...
