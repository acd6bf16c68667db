"""Token ids -> the bytes a page hash reads: unsigned 32-bit little-endian, one after another.

Accepted inputs: a list, tuple or range of ints; a 1-D numpy integer array; a 1-D torch integer
tensor on any device (a CUDA tensor is copied to the host in one transfer, never read element by
element). Every id must satisfy ``0 <= id < 2**32``: an id outside that range cannot be encoded
and is an error, never a wrap (sglang-storage-keys.md, "Page hash").

The conversion is vectorised: one ``array('I', ...)`` (lists) or one ``astype('<u4')`` (arrays)
for the whole input, then one ``tobytes``; Python touches single elements only to name the first
bad one in an error message.
"""

from __future__ import annotations

import array
import operator
import sys

import numpy as np

from kvstage.errors import ArgumentTypeError, InvalidArgumentError

TOKEN_BYTES = 4  # bytes per token id in the hashed stream
_LIMIT = 1 << 32
_RULE = "every token id must satisfy 0 <= id < 2**32"

# array('I') is C unsigned int: 4 bytes on every platform kvstage runs on; 'L' as a fallback.
_U32_CODE = "I" if array.array("I").itemsize == 4 else "L"
assert array.array(_U32_CODE).itemsize == 4
_LITTLE_ENDIAN = sys.byteorder == "little"


def _describe(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def _first_bad_element(seq, argument: str) -> Exception:
    """Scan ``seq`` in order and build the error for its first bad element (error path only)."""
    for position, value in enumerate(seq):
        if isinstance(value, (bool, np.bool_)):
            return ArgumentTypeError(f"{argument}: token ids must be integers, not bools; {argument}[{position}] = {_describe(value)}")
        try:
            as_int = operator.index(value)
        except TypeError:
            return ArgumentTypeError(f"{argument}: token ids must be integers; {argument}[{position}] = {_describe(value)}")
        if not 0 <= as_int < _LIMIT:
            return InvalidArgumentError(f"{argument}: {_RULE}; {argument}[{position}] = {as_int}")
    raise AssertionError("no bad element found")  # the caller saw one; unreachable


def _sequence_bytes(seq, argument: str) -> bytes:
    if len(seq) == 0:
        return b""
    try:
        # One C-level pass: rejects floats (TypeError) and ids outside 0..2**32-1 (OverflowError).
        packed = array.array(_U32_CODE, seq)
    except (TypeError, OverflowError):
        raise _first_bad_element(seq, argument) from None
    # array() takes bools as 0/1, so only elements that became 0 or 1 can be bools: find those
    # few with numpy and look at their types, instead of a type check per element.
    values = np.frombuffer(packed, dtype=np.uint32)
    for position in np.flatnonzero(values <= 1).tolist():
        if isinstance(seq[position], bool):
            raise _first_bad_element(seq, argument)
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _numpy_bytes(values: np.ndarray, argument: str) -> bytes:
    if values.ndim != 1:
        raise InvalidArgumentError(f"{argument}: must be 1-D, got shape {tuple(values.shape)}")
    kind = values.dtype.kind
    if kind == "O":
        return _sequence_bytes(values.tolist(), argument)
    if kind == "b":
        raise ArgumentTypeError(f"{argument}: token ids must be integers, got dtype bool")
    if kind not in "iu":
        raise ArgumentTypeError(f"{argument}: token ids must be integers, got dtype {values.dtype}")
    if values.size:
        too_low = kind == "i" and values.min() < 0
        too_high = values.dtype.itemsize > 4 and values.max() >= _LIMIT
        if too_low or too_high:
            bad = values >= _LIMIT if kind == "u" else (values < 0) | (values >= _LIMIT)
            position = int(np.argmax(bad))
            raise InvalidArgumentError(f"{argument}: {_RULE}; {argument}[{position}] = {int(values[position])}")
    return values.astype("<u4", copy=False).tobytes()


def _torch_bytes(tensor, argument: str) -> bytes:
    import torch

    if tensor.dtype == torch.bool:
        raise ArgumentTypeError(f"{argument}: token ids must be integers, got dtype torch.bool")
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        raise ArgumentTypeError(f"{argument}: token ids must be integers, got dtype {tensor.dtype}")
    if tensor.dim() != 1:
        raise InvalidArgumentError(f"{argument}: must be 1-D, got shape {tuple(tensor.shape)}")
    # One device-to-host copy of the whole tensor (a no-op on CPU); the checks run on the host.
    return _numpy_bytes(tensor.detach().cpu().numpy(), argument)


def _is_torch_tensor(value: object) -> bool:
    torch = sys.modules.get("torch")  # a tensor exists only if torch is imported: don't import it
    return torch is not None and isinstance(value, torch.Tensor)


def token_bytes(tokens, argument: str = "tokens") -> bytes:
    """The token ids as one ``bytes``: ``4 * len(tokens)`` bytes, each id as u32 little-endian.

    Args:
        tokens: list/tuple/range of ints, 1-D numpy integer array, or 1-D torch integer tensor
            (CPU or CUDA; a CUDA tensor is moved to the host in one transfer).
        argument: the name used in error messages.

    Returns:
        ``bytes`` of length ``4 * number of tokens``.

    Raises:
        ArgumentTypeError: a float, bool or other non-integer id (or float/bool dtype), or an
            unsupported container type (str, bytes, dict, generators, ...).
        InvalidArgumentError: an id outside ``0 <= id < 2**32`` (the message names the first
            bad position and its value), or an array that is not 1-D.
    """
    if isinstance(tokens, (list, tuple, range)):
        return _sequence_bytes(tokens, argument)
    if isinstance(tokens, np.ndarray):
        return _numpy_bytes(tokens, argument)
    if _is_torch_tensor(tokens):
        return _torch_bytes(tokens, argument)
    raise ArgumentTypeError(
        f"{argument}: must be a list/tuple/range of ints, a numpy integer array or a torch integer tensor, "
        f"got {type(tokens).__module__}.{type(tokens).__qualname__}"
    )

