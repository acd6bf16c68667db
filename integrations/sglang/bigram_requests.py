"""EAGLE bigram keys in the decode drop-in: sglang requests seen by the offload manager as one
"pair unit" per KV position, and the hasher that turns those units back into bigram keys.

An EAGLE tree keys the KV of position ``j`` by ``(t[j], t[j+1])`` (:mod:`kvstage.hashing.bigram`),
so a page's key reads one token past the page; :class:`kvstage.offload.OffloadManager` hashes the
token ids of the positions it stores only. :class:`BigramRequest` shows it a request whose id at
position ``j`` is the unit ``t[j] | t[j+1] << 32`` (live: sglang's growing ``output_ids`` are read
at each slice; the last sampled token, which has no KV, gets the placeholder ``-1``, as does any
position next to a placeholder), and :class:`PairUnitHasher` unpacks the units of a run into its
``P + 1`` token ids and keys them with :class:`~kvstage.hashing.BigramPageHasher`. Units hold ids
below ``2**31`` (every vocabulary; sglang's wide ids are multimodal hashes, refused here).
"""

from __future__ import annotations

import weakref
from array import array
from typing import Any

import numpy as np

from kvstage.errors import InvalidArgumentError
from kvstage.hashing import BigramPageHasher

__all__ = ["BigramRequest", "PairUnitHasher", "UNIT_ID_LIMIT"]

UNIT_ID_LIMIT = 2**31  # ids below it pack two to a non-negative int64
_LOW = (1 << 32) - 1


class _PairUnits:
    """``req``'s prompt (``prompt=True``) or output positions as pair units, read live."""

    def __init__(self, request: BigramRequest, prompt: bool) -> None:
        self._request = request
        self._prompt = prompt

    def __len__(self) -> int:
        req = self._request.req
        return len(req.origin_input_ids if self._prompt else req.output_ids)

    def __getitem__(self, index: slice) -> array:
        if not isinstance(index, slice):
            raise TypeError("pair units are read by slices")
        req = self._request.req
        prompt = len(req.origin_input_ids)
        start, stop, _ = index.indices(len(self))
        offset = 0 if self._prompt else prompt
        total = prompt + len(req.output_ids)
        end = min(offset + stop + 1, total)  # one token past the slice: the last pair's second id
        tokens = _tokens(req, offset + start, end)
        if len(tokens) and (tokens.max() >= UNIT_ID_LIMIT):
            position = offset + start + int(np.argmax(tokens >= UNIT_ID_LIMIT))
            raise InvalidArgumentError(
                f"rid={req.rid!r}: token id {int(tokens.max())} at position {position}: EAGLE bigram keys in the "
                f"decode drop-in take ids below 2**31"
            )
        count = max(stop - start, 0)
        units = np.full(count, -1, dtype=np.int64)
        pairs = min(count, len(tokens) - 1)
        if pairs > 0:
            first, second = tokens[:pairs], tokens[1 : pairs + 1]
            units[:pairs] = np.where((first < 0) | (second < 0), -1, first | (second << 32))
        return array("q", units.tobytes())


def _tokens(req: Any, start: int, end: int) -> np.ndarray:
    prompt = req.origin_input_ids
    n = len(prompt)
    head = list(prompt[start : min(end, n)]) if start < n else []
    tail = list(req.output_ids[max(start - n, 0) : max(end - n, 0)]) if end > n else []
    return np.array(head + tail, dtype=np.int64)


class BigramRequest:
    """What the offload manager sees of sglang ``req``: its ids as pair units; ``rid``,
    ``extra_key``, ``cache_salt``, ``kv`` and ``finished()`` are the request's. Holds ``req``
    weakly (:meth:`of` keeps one per request alive as long as the request)."""

    _views: weakref.WeakKeyDictionary[Any, BigramRequest] = weakref.WeakKeyDictionary()

    def __init__(self, req: Any) -> None:
        self._req = weakref.ref(req)
        self.origin_input_ids = _PairUnits(self, prompt=True)
        self.output_ids = _PairUnits(self, prompt=False)

    @classmethod
    def of(cls, req: Any) -> BigramRequest:
        """The one view of ``req``."""
        view = cls._views.get(req)
        if view is None:
            view = cls._views[req] = cls(req)
        return view

    @property
    def req(self) -> Any:
        req = self._req()
        if req is None:
            raise ReferenceError("the sglang request of this bigram view was dropped")
        return req

    rid = property(lambda self: self.req.rid)
    extra_key = property(lambda self: self.req.extra_key)
    cache_salt = property(lambda self: self.req.cache_salt)
    kv = property(lambda self: self.req.kv)

    def finished(self) -> bool:
        return self.req.finished()

    def __repr__(self) -> str:
        return f"BigramRequest(rid={self.rid!r})"


class PairUnitHasher(BigramPageHasher):
    """:class:`~kvstage.hashing.BigramPageHasher` over pair units: ``n`` units (positions) give
    ``n // page_size`` keys, the bigram keys of their ``n + 1`` token ids.

    Raises (from its key methods):
        InvalidArgumentError: a placeholder unit (``-1``) among them.
    """

    def prefill_keys(self, units, extra_key: str | None = None, cache_salt: str | None = None) -> list[str]:
        return super().prefill_keys(_unpack(units), extra_key=extra_key, cache_salt=cache_salt)

    def continue_keys(self, units, prior_hash: str | None) -> list[str]:
        return super().continue_keys(_unpack(units), prior_hash)

    def full_pages(self, num_tokens: int) -> tuple[int, int]:
        return divmod(num_tokens, self.page_size)


def _unpack(units) -> np.ndarray:
    values = np.asarray(units, dtype=np.int64)
    if len(values) and values.min() < 0:
        raise InvalidArgumentError(
            f"tokens[{int(np.argmax(values < 0))}]: a placeholder bigram (a token id not known yet)"
        )
    if not len(values):
        return values
    return np.concatenate([values & _LOW, values[-1:] >> 32])
