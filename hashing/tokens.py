"""Token ids -> the bytes a page hash reads: unsigned 32-bit little-endian, one after another.

Accepted inputs: a list, tuple or range of ints; a 1-D numpy integer array; a 1-D torch integer
tensor on any device (a CUDA tensor is copied to the host in one transfer, never read element by
element). Every id must satisfy ``0 <= id < 2**32``: an id outside that range cannot be encoded
and is an error, never a wrap (sglang-storage-keys.md, "Page hash").

Two paths give the same bytes and the same errors. Where a scheme's chain is compiled, it reads
the ids itself (:func:`compiled_source` hands it the list, tuple or numpy array as it is) and
converts them page by page while hashing. Otherwise (and for whatever the compiled chain
declines: ranges, int subclasses, numpy scalars in a list) :func:`token_buffer` converts the
whole input at once, with one ``array('I', ...)`` (lists) or numpy's ``astype('<u4')``
(arrays). Python touches single elements only to name the first bad one in an error message.
"""

from __future__ import annotations

import array
import operator
import sys

import numpy as np

from kvstage.errors import ArgumentTypeError, InvalidArgumentError

TOKEN_BYTES = 4  # bytes per token id in the hashed stream
_LIMIT = 1 << 32
_CHUNK = 1 << 17  # elements checked and converted at a time (1 MiB of int64: stays in L2)
_RULE = "every token id must satisfy 0 <= id < 2**32"

# array('I') is C unsigned int: 4 bytes on every platform kvstage runs on; 'L' as a fallback.
_U32_CODE = "I" if array.array("I").itemsize == 4 else "L"
assert array.array(_U32_CODE).itemsize == 4
_LITTLE_ENDIAN = sys.byteorder == "little"


def _describe(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def out_of_range_error(argument: str, position: int, value: int) -> InvalidArgumentError:
    """The error for token ``position`` holding ``value``, outside ``0 <= id < 2**32``."""
    return InvalidArgumentError(f"{argument}: {_RULE}; {argument}[{position}] = {value}")


def _is_bool_like(value: object) -> bool:
    """A Python/numpy bool, or a numpy array or torch tensor of dtype bool (which ``__index__``
    would otherwise turn into 0 or 1)."""
    if isinstance(value, (bool, np.bool_)):
        return True
    dtype = getattr(value, "dtype", None)
    if isinstance(dtype, np.dtype):
        return dtype.kind == "b"
    torch = sys.modules.get("torch")
    return torch is not None and dtype is torch.bool


def _first_bad_element(seq, argument: str) -> Exception:
    """Scan ``seq`` in order and build the error for its first bad element (error path only)."""
    for position, value in enumerate(seq):
        if _is_bool_like(value):
            return ArgumentTypeError(f"{argument}: token ids must be integers, not bools; {argument}[{position}] = {_describe(value)}")
        try:
            as_int = operator.index(value)
        except TypeError:
            return ArgumentTypeError(f"{argument}: token ids must be integers; {argument}[{position}] = {_describe(value)}")
        if not 0 <= as_int < _LIMIT:
            return out_of_range_error(argument, position, as_int)
    raise AssertionError("no bad element found")  # the caller saw one; unreachable


def _sequence_buffer(seq, argument: str) -> memoryview:
    if len(seq) == 0:
        return memoryview(b"")  # bytes: already read-only
    try:
        # One C-level pass: rejects floats (TypeError) and ids outside 0..2**32-1 (OverflowError).
        packed = array.array(_U32_CODE, seq)
    except (TypeError, OverflowError):
        raise _first_bad_element(seq, argument) from None
    # array() takes bools as 0/1, so only elements that became 0 or 1 can be bools: find those
    # few with numpy and look at their types, instead of a type check per element.
    candidates = np.flatnonzero(np.frombuffer(packed, dtype=np.uint32) <= 1).tolist()
    if candidates and any(map(_is_bool_like, map(seq.__getitem__, candidates))):
        raise _first_bad_element(seq, argument)
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    return memoryview(packed).cast("B").toreadonly()


def _range_array(ids: range, argument: str) -> np.ndarray:
    """A range as an int64 array, its rule checked at its ends first, so that a range with an
    id out of range raises at once instead of being walked (a range is monotonic)."""
    if len(ids) == 0:
        return np.empty(0, dtype=np.int64)
    if not 0 <= ids[0] < _LIMIT:
        raise out_of_range_error(argument, 0, ids[0])
    if not 0 <= ids[-1] < _LIMIT:
        # The first id past the bound: ids[i] >= 2**32 going up, ids[i] < 0 going down.
        first_bad = -((ids.start - _LIMIT) // ids.step) if ids.step > 0 else ids.start // -ids.step + 1
        raise out_of_range_error(argument, first_bad, ids[first_bad])
    values = np.arange(ids.start, ids.stop, ids.step, dtype=np.int64)
    assert len(values) == len(ids)
    return values


def _numpy_buffer(values: np.ndarray, argument: str) -> memoryview:
    if values.ndim != 1:
        raise InvalidArgumentError(f"{argument}: must be 1-D, got shape {tuple(values.shape)}")
    kind = values.dtype.kind
    if kind == "O":
        return _sequence_buffer(values.tolist(), argument)
    if kind == "b":
        raise ArgumentTypeError(f"{argument}: token ids must be integers, got dtype bool")
    if kind not in "iu":
        raise ArgumentTypeError(f"{argument}: token ids must be integers, got dtype {values.dtype}")
    signed = kind == "i"
    if not signed and values.dtype.itemsize <= 4:
        # uint8/16/32 always fit: no check. A view of the converted array, not tobytes(): a
        # second copy would cost as much as the conversion (fresh pages from the allocator).
        return memoryview(np.ascontiguousarray(values.astype("<u4", copy=False))).cast("B").toreadonly()
    out = np.empty(values.shape[0], dtype="<u4")
    # Check and convert a chunk at a time, so the range check reads each chunk from cache
    # right before the conversion does (one pass over memory instead of three).
    for start in range(0, values.shape[0], _CHUNK):
        part = values[start : start + _CHUNK]
        if (signed and part.min() < 0) or (values.dtype.itemsize > 4 and part.max() >= _LIMIT):
            bad = (part < 0) | (part >= _LIMIT) if signed else part >= _LIMIT
            position = start + int(np.argmax(bad))
            raise out_of_range_error(argument, position, int(values[position]))
        np.copyto(out[start : start + _CHUNK], part, casting="unsafe")
    return memoryview(out).cast("B").toreadonly()


def _host_array(tensor, argument: str) -> np.ndarray:
    """A 1-D integer torch tensor as a numpy array on the host (one transfer from a GPU)."""
    import torch

    if tensor.dtype == torch.bool:
        raise ArgumentTypeError(f"{argument}: token ids must be integers, got dtype torch.bool")
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        raise ArgumentTypeError(f"{argument}: token ids must be integers, got dtype {tensor.dtype}")
    if tensor.dim() != 1:
        raise InvalidArgumentError(f"{argument}: must be 1-D, got shape {tuple(tensor.shape)}")
    if tensor.layout != torch.strided:
        raise ArgumentTypeError(f"{argument}: must be a dense (strided) tensor, got layout {tensor.layout}")
    if tensor.is_meta:
        raise ArgumentTypeError(f"{argument}: must be on a device with data, got a meta tensor")
    # One device-to-host copy of the whole tensor (a no-op on CPU); the checks run on the host.
    # resolve_neg: a lazily negated view (torch's neg bit) cannot become a numpy array as it is.
    return tensor.detach().cpu().resolve_neg().numpy()


def _is_torch_tensor(value: object) -> bool:
    torch = sys.modules.get("torch")  # a tensor exists only if torch is imported: don't import it
    return torch is not None and isinstance(value, torch.Tensor)


def token_buffer(tokens, argument: str = "tokens") -> memoryview:
    """The token ids as a read-only byte view: ``4 * len(tokens)`` bytes, each id as u32 little-endian.

    What the chains hash; :func:`token_bytes` is the same as ``bytes``. The view may share
    memory with ``tokens`` when it already is a contiguous little-endian uint32 array.

    Args:
        tokens: list/tuple/range of ints, 1-D numpy integer array, or 1-D torch integer tensor
            (CPU or CUDA; a CUDA tensor is moved to the host in one transfer).
        argument: the name used in error messages.

    Returns:
        A ``memoryview`` (format ``"B"``) of ``4 * number of tokens`` bytes.

    Raises:
        ArgumentTypeError: a float, bool or other non-integer id (or float/bool dtype), or an
            unsupported container type (str, bytes, dict, generators, ...).
        InvalidArgumentError: an id outside ``0 <= id < 2**32`` (the message names the first
            bad position and its value), or an array that is not 1-D.
    """
    if isinstance(tokens, (list, tuple)):
        return _sequence_buffer(tokens, argument)
    if isinstance(tokens, range):
        return _numpy_buffer(_range_array(tokens, argument), argument)
    if isinstance(tokens, np.ndarray):
        return _numpy_buffer(tokens, argument)
    if _is_torch_tensor(tokens):
        return _numpy_buffer(_host_array(tokens, argument), argument)
    raise ArgumentTypeError(
        f"{argument}: must be a list/tuple/range of ints, a numpy integer array or a torch integer tensor, "
        f"got {type(tokens).__module__}.{type(tokens).__qualname__}"
    )


def compiled_source(tokens, argument: str = "tokens"):
    """``tokens`` as a compiled chain reads them, or None where only :func:`token_buffer` can.

    A list or tuple passes as it is (the chain declines it if an element is not an exact int);
    a numpy integer array, a range or a torch integer tensor (moved to the host in one
    transfer) becomes a 1-D C-contiguous numpy array in native byte order. Cheap checks only, nothing per element:
    the chain checks every id's range.

    Raises:
        ArgumentTypeError / InvalidArgumentError: a torch tensor of a non-integer dtype, not
            1-D, sparse or on the meta device; a range holding an id out of range (as
            :func:`token_buffer`). Other bad inputs return None, and
            :func:`token_buffer` then raises.
    """
    if type(tokens) is list or type(tokens) is tuple:
        return tokens
    if isinstance(tokens, np.ndarray):
        values = tokens
    elif isinstance(tokens, range):
        values = _range_array(tokens, argument)
    elif _is_torch_tensor(tokens):
        values = _host_array(tokens, argument)
    else:
        return None
    if values.ndim != 1 or values.dtype.kind not in "iu":
        return None
    if not values.dtype.isnative:
        values = values.astype(values.dtype.newbyteorder("="))
    return np.ascontiguousarray(values)


def token_bytes(tokens, argument: str = "tokens") -> bytes:
    """:func:`token_buffer` as ``bytes`` (a copy): ``4 * len(tokens)`` bytes, u32 little-endian.

    Raises: as :func:`token_buffer`.
    """
    return token_buffer(tokens, argument).tobytes()
