"""What the manager reads from an engine's request object, and the token arithmetic on it."""

from __future__ import annotations

import array
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError, is_int
from kvstage.hashing.chain import request_namespace
from kvstage.hashing.tokens import first_bad_id

__all__ = [
    "OffloadRequest",
    "SlotIndicesOf",
    "as_int",
    "int_scalar",
    "kv_length",
    "request_namespace",
    "request_tokens",
]

_SIGNED_TYPECODES = frozenset("bhilq")  # array.array typecodes of signed integers


@runtime_checkable
class OffloadRequest(Protocol):
    """What the manager reads from an engine's request object (adapt yours to it).

    Attributes:
        rid: the request id (only for log lines; never a key: ids are reused).
        origin_input_ids: the prompt's token ids (list or 1-D int sequence).
        output_ids: the sampled token ids so far; the last one has no KV yet.
        extra_key: namespace part (LoRA adapter and similar), a str or None.
        cache_salt: namespace part (per-tenant secret), a str or None.

    Both namespace attributes must exist, None when unused (vLLM's ``Request`` has no
    ``extra_key``: an adapter sets it): a missing one is not read as None, since a request that
    forgot its ``cache_salt`` would share another tenant's pages
    (:func:`~kvstage.hashing.chain.request_namespace`).

    Positions with KV: the manager copies only token positions whose KV the engine has
    written, ``[0, kv_length)``. By default (:func:`kv_length`) that is the whole prompt and
    every output token but the last, right once the prefill is complete. Under chunked prefill
    the engine passes ``kv_length=`` to ``offload``/``finish`` after each chunk (the prompt
    positions computed so far); the manager then stores the prompt's whole pages up to it,
    chunk by chunk, never a page with a slot not written yet. ``kv_length`` never exceeds the
    prompt plus output tokens and never shrinks below what the request's lifecycle launched.

    The class should support weak references (plain classes do; a ``__slots__`` class needs
    ``"__weakref__"`` in its slots): the manager remembers released requests weakly, so that a
    late ``finish``/``abort`` of one is ignored and a late ``offload`` raises. Without that,
    such a late call starts a new lifecycle for the object.
    """

    rid: Any
    origin_input_ids: Sequence[int]
    output_ids: Sequence[int]
    extra_key: str | None
    cache_salt: str | None

    def finished(self) -> bool:
        """True once the request will produce no more tokens."""
        ...


# slot_indices_of(req) -> 1-D int32/int64 tensor on the KV pool's device whose entry i is the
# device slot holding token i's KV (e.g. sglang's req_to_token[req.req_pool_idx]); at least as
# long as the tokens with KV.
SlotIndicesOf = Callable[[Any], torch.Tensor]


def kv_length(req: OffloadRequest) -> int:
    """Token positions of ``req`` whose KV is in the device pool once its prefill is complete:
    the prompt and every output token but the last sampled one, which has no KV until the next
    decode step writes it. The default of the manager's ``kv_length=`` argument (an engine
    mid-way through a chunked prefill passes the positions computed so far instead)."""
    return len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)


def as_int(value: Any) -> Any:
    """An integer scalar (:func:`int_scalar`) as an int; anything else as it is, for the check
    that names it."""
    scalar = int_scalar(value)
    return value if scalar is None else scalar


def int_scalar(value: Any) -> int | None:
    """``value`` as an ``int`` when it is an integer scalar, else None.

    Integer scalars: an ``int`` that is not a ``bool`` (:func:`kvstage.errors.is_int`), a numpy
    integer (vLLM keeps ``num_computed_tokens`` as numpy), or a 0-d numpy array or torch tensor
    of an integer dtype (a CUDA tensor's ``item()`` waits for its stream). Bools, floats and
    arrays of more than one element are not.
    """
    if is_int(value):
        return value
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iu":
        return int(value)
    if (
        isinstance(value, torch.Tensor)
        and value.dim() == 0
        and not value.dtype.is_floating_point
        and not value.dtype.is_complex
        and value.dtype is not torch.bool
    ):
        return int(value.item())
    return None


def _token_slice(ids: Sequence[int], start: int, end: int) -> Sequence[int]:
    """``ids[start:end]`` as a copy the engine's later changes to ``ids`` cannot reach: a slice
    of an ``array.array``, list or tuple as it is (slicing copies; an array stays an array, which
    the hasher reads in place), anything else (numpy, torch) as a list of ints."""
    part = ids[start:end]
    if isinstance(part, (array.array, list, tuple)):
        return part
    tolist = getattr(part, "tolist", None)  # one transfer for a CUDA tensor, not one per id
    return tolist() if tolist is not None else list(part)


def _first_negative(tokens: Sequence[int]) -> int | None:
    """The offset of the first negative id in ``tokens``, or None."""
    if isinstance(tokens, array.array):
        if tokens.typecode not in _SIGNED_TYPECODES or len(tokens) == 0:
            return None
        negative = np.frombuffer(tokens, dtype=tokens.typecode) < 0
        return int(negative.argmax()) if negative.any() else None
    if tokens and min(tokens) < 0:
        return next(offset for offset, token in enumerate(tokens) if token < 0)
    return None


def request_tokens(req: OffloadRequest, start: int, end: int, *, integers: bool = False) -> Sequence[int]:
    """Token ids at positions ``[start, end)`` of ``req``'s prompt followed by its output.

    ``integers``: check first that every id is an integer, for a path that hashes them only later
    (an offload's keys, made after its copy), so that the call is refused before anything is
    copied; a lookup skips that pass (its hashing refuses such ids at once).

    Returns:
        A copy: an ``array.array`` where the positions lie in ``array.array`` token lists of one
        typecode (sglang 0.5.23's ``array('q')``), else a list or tuple of ints. Either is what
        :class:`kvstage.hashing.PageHasher` takes, with the same keys.

    Raises:
        ArgumentTypeError: with ``integers``, an id that is no integer (a float; a bool, which
            ``__index__`` would take as 0 or 1); the message names the request and the position.
        InvalidArgumentError: with ``integers``, an id above ``2**63-1``
            (:func:`kvstage.hashing.tokens.first_bad_id`); a negative id among them (a placeholder such as -1 that
            speculative decoding or async scheduling leaves in ``output_ids`` before the real
            token is known); the message names the request and the position.
    """
    prompt, output = req.origin_input_ids, req.output_ids
    prompt_length = len(prompt)
    if end <= prompt_length:
        tokens = _token_slice(prompt, start, end)
    elif start >= prompt_length:
        tokens = _token_slice(output, start - prompt_length, end - prompt_length)
    else:
        head, tail = _token_slice(prompt, start, prompt_length), _token_slice(output, 0, end - prompt_length)
        same_kind = type(head) is type(tail) and getattr(head, "typecode", None) == getattr(tail, "typecode", None)
        tokens = head + tail if same_kind else list(head) + list(tail)
    bad = first_bad_id(tokens) if integers else None  # hashing's own rule, checked once here
    if bad is not None:
        offset, broken = bad
        position, value = start + offset, tokens[offset]
        where = f"{_where(position, prompt_length)}: rid={req.rid!r} holds"
        if broken != "range":
            raise ArgumentTypeError(f"{where} {value!r}, not an integer token id, at token position {position}")
        if value >= 0:
            raise InvalidArgumentError(
                f"{where} {value}, above the largest token id 2**63-1, at token position {position}"
            )
    else:  # with integers, first_bad_id found no negative id either
        offset = None if integers else _first_negative(tokens)
    if offset is not None:
        position = start + offset
        raise InvalidArgumentError(
            f"{_where(position, prompt_length)}: rid={req.rid!r} holds the placeholder id {tokens[offset]} at token "
            f"position {position}; offload a position only once its real token id is known"
        )
    return tokens


def _where(position: int, prompt_length: int) -> str:
    """The request attribute and index of token ``position``."""
    return f"origin_input_ids[{position}]" if position < prompt_length else f"output_ids[{position - prompt_length}]"
