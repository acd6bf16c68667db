"""What the manager reads from an engine's request object, and the token arithmetic on it."""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from kvstage.errors import InvalidArgumentError

__all__ = ["OffloadRequest", "SlotIndicesOf", "kv_length", "request_tokens"]


@runtime_checkable
class OffloadRequest(Protocol):
    """What the manager reads from an engine's request object (adapt yours to it).

    Attributes:
        rid: the request id (only for log lines; never a key: ids are reused).
        origin_input_ids: the prompt's token ids (list or 1-D int sequence).
        output_ids: the sampled token ids so far; the last one has no KV yet.
        extra_key: namespace part (LoRA adapter and similar), or None.
        cache_salt: namespace part (per-tenant secret), or None.

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


def request_tokens(req: OffloadRequest, start: int, end: int) -> list[int]:
    """Token ids at positions ``[start, end)`` of ``req``'s prompt followed by its output.

    Raises:
        InvalidArgumentError: a negative id among them (a placeholder such as -1 that
            speculative decoding or async scheduling leaves in ``output_ids`` before the real
            token is known); the message names the request and the position.
    """
    prompt, output = req.origin_input_ids, req.output_ids
    prompt_length = len(prompt)
    if end <= prompt_length:
        tokens = list(prompt[start:end])
    elif start >= prompt_length:
        tokens = list(output[start - prompt_length : end - prompt_length])
    else:
        tokens = list(prompt[start:]) + list(output[: end - prompt_length])
    if tokens and min(tokens) < 0:
        offset = next(index for index, token in enumerate(tokens) if token < 0)
        position = start + offset
        where = f"origin_input_ids[{position}]" if position < prompt_length else f"output_ids[{position - prompt_length}]"
        raise InvalidArgumentError(
            f"{where}: rid={req.rid!r} holds the placeholder id {tokens[offset]} at token position {position}; "
            "offload a position only once its real token id is known"
        )
    return tokens
