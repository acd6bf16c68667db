"""Token ids -> the bytes a page hash reads.

The rule (sglang 0.5.23's native page hash, ``mem_cache/cpp_utils/hash_binding.cpp``; facts in
``shared/reference/sglang-storage-keys.md``, "Wide token ids"): every id must satisfy
``0 <= id <= 2**63-1``. A page whose ids all fit u32 (``<= 2**32-1``) hashes them as unsigned
32-bit little-endian integers, one after another (:data:`TOKEN_BYTES` each). A page holding an id
above ``2**32-1`` hashes the byte ``0xff`` (:data:`WIDE_PAGE_TAG`), then every id of the page as
u64 little-endian (:data:`WIDE_TOKEN_BYTES` each): ``1 + 8 * page_size`` bytes, an odd count, so
the two encodings never give the same bytes. The encoding is chosen page by page. An id outside
the range is an error, never a wrap.

Accepted inputs: a list, tuple or range of ints; a 1-D numpy integer array; a 1-D torch integer
tensor on any device (a CUDA tensor is copied to the host in one transfer, never read element by
element); an ``array.array`` of any integer typecode (sglang 0.5.23 keeps a request's
``origin_input_ids`` and ``output_ids`` as ``array('q')``) or any other 1-D object exposing the
buffer protocol with an integer format (``memoryview``, ctypes arrays): signed or unsigned, 1, 2,
4 or 8 bytes, native or standard size, either byte order, contiguous or strided. ``bytes`` and
``bytearray`` are refused although they export format ``'B'``: a byte string is text or a
payload, not token ids (8-bit ids: ``array('B')`` or a uint8 array); so are buffers of chars
(``'c'``), bools (``'?'``), floats and structs. An unsigned id above ``2**63-1`` is out of range
like any other.

Two paths give the same bytes and the same errors. Where a scheme's chain is compiled, it reads
the ids itself (:func:`compiled_source` hands it the list, tuple or numpy array as it is) and
converts them page by page while hashing; a contiguous native-endian buffer (an ``array.array``)
is read in place, without a copy, and a strided or big-endian one is first copied into a
contiguous native array. While a chain reads an ``array.array`` (for a large input with the
GIL released) the array cannot be resized: an ``append`` from another thread raises
``BufferError``, so code that hashes an engine's live token list off the engine's thread hashes
a slice of it (a copy), as :func:`kvstage.offload.request.request_tokens` gives. Otherwise (and for whatever the compiled chain
declines: ranges, int subclasses, numpy scalars in a list) :func:`token_ids` converts the whole
input at once, with one ``array('I', ...)`` (lists) or numpy's ``astype('<u4')`` (arrays) while
every id fits u32; only an input holding a wider id is converted again, to u64, and
:func:`wide_pages` then encodes it page by page. Python touches single elements only to name the
first bad one in an error message.

:func:`token_buffer` / :func:`token_bytes` give the u32 stream alone: they take ids up to
``2**32-1`` only.
"""

from __future__ import annotations

import array
import operator
import sys

import numpy as np

from kvstage.errors import ArgumentTypeError, InvalidArgumentError

TOKEN_BYTES = 4  # bytes per id in a page whose ids all fit u32
WIDE_TOKEN_BYTES = 8  # bytes per id in a page holding an id above 2**32-1
WIDE_PAGE_TAG = b"\xff"  # hashed before a wide page's ids (after the prior)
U32_LIMIT = 1 << 32  # ids below it fit u32
ID_LIMIT = 1 << 63  # ids below it are hashed; from it on, an error (as sglang)
_CHUNK = 1 << 17  # elements checked and converted at a time (1 MiB of int64: stays in L2)
_ACCEPTED = (
    "a list/tuple/range of ints, a numpy integer array, a torch integer tensor, or an array.array or buffer of integers"
)
# Buffer format letters of integer types (struct module syntax); the compiled chains read them too.
_INTEGER_LETTERS = frozenset("bBhHiIlLqQnN")
_RULE = "every token id must satisfy 0 <= id <= 2**63-1"
_U32_RULE = "every token id must satisfy 0 <= id <= 2**32-1 to be written as u32 (page keys take ids up to 2**63-1)"

# array('I') is C unsigned int: 4 bytes on every platform kvstage runs on; 'L' as a fallback.
_U32_CODE = "I" if array.array("I").itemsize == 4 else "L"
assert array.array(_U32_CODE).itemsize == 4
_LITTLE_ENDIAN = sys.byteorder == "little"


def _describe(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def out_of_range_error(argument: str, position: int, value: int, rule: str = _RULE) -> InvalidArgumentError:
    """The error for token ``position`` holding ``value``, outside ``0 <= id <= 2**63-1`` (or
    the ``rule`` given)."""
    return InvalidArgumentError(f"{argument}: {rule}; {argument}[{position}] = {value}")


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


def _broken_rule(value: object, limit: int) -> str | None:
    """Why ``value`` is no id in ``0 <= id < limit``: ``"bool"``, ``"type"`` (no integer) or
    ``"range"``; None when it is one."""
    if _is_bool_like(value):
        return "bool"
    try:
        as_int = operator.index(value)
    except TypeError:
        return "type"
    return None if 0 <= as_int < limit else "range"


def _first_bad_element(seq, argument: str, limit: int, rule: str) -> Exception:
    """Scan ``seq`` in order and build the error for its first bad element, an id outside
    ``0 <= id < limit`` breaking ``rule`` (error path only)."""
    for position, value in enumerate(seq):
        broken = _broken_rule(value, limit)
        if broken == "bool":
            return ArgumentTypeError(
                f"{argument}: token ids must be integers, not bools; {argument}[{position}] = {_describe(value)}"
            )
        if broken == "type":
            return ArgumentTypeError(
                f"{argument}: token ids must be integers; {argument}[{position}] = {_describe(value)}"
            )
        if broken == "range":
            return out_of_range_error(argument, position, operator.index(value), rule)
    raise AssertionError("no bad element found")  # the caller saw one; unreachable


def first_bad_id(tokens) -> tuple[int, str] | None:
    """The first id of ``tokens`` that :func:`token_ids` refuses, as ``(offset, why)``: ``why`` is
    ``"bool"``, ``"type"`` (no integer) or ``"range"`` (outside ``0 <= id <= 2**63-1``, negative
    ones included); None when every id keeps the rule. For a caller that hashes the ids only
    later and must refuse them now; one conversion as :func:`token_ids` (a Python scan only
    when an id breaks the rule).

    Args:
        tokens: what :func:`token_ids` takes (a 1-D sequence of ids).

    Raises:
        ArgumentTypeError / InvalidArgumentError: :func:`token_ids`' error where no single id is
            to blame (a container it does not take, an array that is not 1-D).
    """
    try:
        token_ids(tokens)
    except (ArgumentTypeError, InvalidArgumentError):
        for offset, value in enumerate(tokens):
            broken = _broken_rule(value, ID_LIMIT)
            if broken is not None:
                return offset, broken
        raise
    return None


def _sequence_ids(seq, argument: str, wide: bool) -> tuple[memoryview, int]:
    """A list or tuple as ``(little-endian buffer, bytes per id)``: u32 while every id fits,
    else (``wide`` only) int64."""
    if len(seq) == 0:
        return memoryview(b""), TOKEN_BYTES  # bytes: already read-only
    limit, rule = (ID_LIMIT, _RULE) if wide else (U32_LIMIT, _U32_RULE)
    try:
        # One C-level pass: rejects floats (TypeError) and ids outside 0..2**32-1 (OverflowError).
        packed = array.array(_U32_CODE, seq)
    except TypeError:
        raise _first_bad_element(seq, argument, limit, rule) from None
    except OverflowError:
        if not wide:
            raise _first_bad_element(seq, argument, limit, rule) from None
        # An id above 2**32-1 or below 0: a second pass, as int64 ('q' is 8 bytes everywhere).
        try:
            packed = array.array("q", seq)
        except (TypeError, OverflowError):
            raise _first_bad_element(seq, argument, limit, rule) from None
        if np.frombuffer(packed, dtype=np.int64).min() < 0:
            raise _first_bad_element(seq, argument, limit, rule) from None
    # array() takes bools as 0/1, so only elements that became 0 or 1 can be bools: find those
    # few with numpy and look at their types, instead of a type check per element.
    as_numbers = np.frombuffer(packed, dtype=np.uint32 if packed.itemsize == TOKEN_BYTES else np.int64)
    candidates = np.flatnonzero(as_numbers <= 1).tolist()
    if candidates and any(map(_is_bool_like, map(seq.__getitem__, candidates))):
        raise _first_bad_element(seq, argument, limit, rule)
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    return memoryview(packed).cast("B").toreadonly(), packed.itemsize


def _range_array(ids: range, argument: str, limit: int = ID_LIMIT, rule: str = _RULE) -> np.ndarray:
    """A range as an int64 array, its rule (``0 <= id < limit``) checked at its ends first, so
    that a range with an id out of range raises at once instead of being walked (a range is
    monotonic; its length may not even fit a ``Py_ssize_t``)."""
    if not ids:
        return np.empty(0, dtype=np.int64)
    if not 0 <= ids[0] < limit:
        raise out_of_range_error(argument, 0, ids[0], rule)
    if not 0 <= ids[-1] < limit:
        # The first id past the bound: ids[i] >= limit going up, ids[i] < 0 going down.
        first_bad = -((ids.start - limit) // ids.step) if ids.step > 0 else ids.start // -ids.step + 1
        raise out_of_range_error(argument, first_bad, ids[first_bad], rule)
    if len(ids) == 1:
        return np.array([ids[0]], dtype=np.int64)  # its step may not fit int64
    # ids[0] + i * step, not np.arange(start, stop, step): stop may be 2**63, past int64. Both
    # ends are in 0..2**63-1, so neither the step nor any partial sum overflows.
    values = np.arange(len(ids), dtype=np.int64)
    values *= ids.step
    values += ids[0]
    return values


def _wide_ids(values: np.ndarray, argument: str) -> tuple[memoryview, int]:
    """A numpy integer array holding an id outside u32 as ``(u64 little-endian buffer, 8)``;
    an id below 0 or above 2**63-1 is named."""
    bad = values < 0 if values.dtype.kind == "i" else values >= np.uint64(ID_LIMIT)
    if bad.any():
        position = int(np.argmax(bad))
        raise out_of_range_error(argument, position, int(values[position]))
    return memoryview(np.ascontiguousarray(values.astype("<u8"))).cast("B").toreadonly(), WIDE_TOKEN_BYTES


def _numpy_ids(values: np.ndarray, argument: str, wide: bool) -> tuple[memoryview, int]:
    """A numpy array as ``(little-endian buffer, bytes per id)``: u32 while every id fits,
    else (``wide`` only) u64."""
    if values.ndim != 1:
        raise InvalidArgumentError(f"{argument}: must be 1-D, got shape {tuple(values.shape)}")
    kind = values.dtype.kind
    if kind == "O":
        return _sequence_ids(values.tolist(), argument, wide)
    if kind == "b":
        raise ArgumentTypeError(f"{argument}: token ids must be integers, got dtype bool")
    if kind not in "iu":
        raise ArgumentTypeError(f"{argument}: token ids must be integers, got dtype {values.dtype}")
    signed = kind == "i"
    if not signed and values.dtype.itemsize <= 4:
        # uint8/16/32 always fit: no check. A view of the converted array, not tobytes(): a
        # second copy would cost as much as the conversion (fresh pages from the allocator).
        return memoryview(np.ascontiguousarray(values.astype("<u4", copy=False))).cast("B").toreadonly(), TOKEN_BYTES
    out = np.empty(values.shape[0], dtype="<u4")
    # Check and convert a chunk at a time, so the range check reads each chunk from cache
    # right before the conversion does (one pass over memory instead of three).
    for start in range(0, values.shape[0], _CHUNK):
        part = values[start : start + _CHUNK]
        if (signed and part.min() < 0) or (values.dtype.itemsize > 4 and part.max() >= U32_LIMIT):
            if wide:  # an id past u32 (or below 0): the whole input again, as u64
                return _wide_ids(values, argument)
            bad = (part < 0) | (part >= U32_LIMIT) if signed else part >= U32_LIMIT
            position = start + int(np.argmax(bad))
            raise out_of_range_error(argument, position, int(values[position]), _U32_RULE)
        np.copyto(out[start : start + _CHUNK], part, casting="unsafe")
    return memoryview(out).cast("B").toreadonly(), TOKEN_BYTES


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


def _format_letter(buffer_format: str) -> tuple[str, str]:
    """``(byte order prefix, type letter)`` of a buffer format: ``"<q"`` -> ``("<", "q")``,
    ``"l"`` -> ``("", "l")``; the letter is the rest when it is not one character."""
    if buffer_format[:1] in ("@", "=", "<", ">", "!"):
        return buffer_format[0], buffer_format[1:]
    return "", buffer_format


def _is_native_integer_format(buffer_format: str) -> bool:
    """Whether the compiled chains read a buffer of this format in place: an integer type,
    native or little-endian (they build on little-endian hosts only)."""
    order, letter = _format_letter(buffer_format)
    return letter in _INTEGER_LETTERS and order in ("", "@", "=", "<") and _LITTLE_ENDIAN


def _buffer_array(tokens, argument: str) -> np.ndarray:
    """A 1-D buffer of integers (``array.array``, ``memoryview``, ctypes array, ...) as a numpy
    array: a view of its memory where it is contiguous, else a contiguous copy."""
    if isinstance(tokens, (bytes, bytearray)):
        raise ArgumentTypeError(
            f"{argument}: {type(tokens).__name__} is a byte string, not token ids (8-bit ids: array('B') or a "
            f"numpy uint8 array); must be {_ACCEPTED}"
        )
    try:
        view = memoryview(tokens)
    except TypeError:
        raise ArgumentTypeError(
            f"{argument}: must be {_ACCEPTED}, got {type(tokens).__module__}.{type(tokens).__qualname__}"
        ) from None
    order, letter = _format_letter(view.format)
    if letter not in _INTEGER_LETTERS or view.itemsize not in (1, 2, 4, 8):
        raise ArgumentTypeError(
            f"{argument}: token ids must be integers, got a buffer of format {view.format!r}; must be {_ACCEPTED}"
        )
    if view.ndim != 1:
        raise InvalidArgumentError(f"{argument}: must be 1-D, got shape {tuple(view.shape)}")
    byte_order = {"<": "<", ">": ">", "!": ">"}.get(order, "=")
    dtype = np.dtype(f"{byte_order}{'i' if letter.islower() else 'u'}{view.itemsize}")
    # tobytes() copies a strided view in its logical order; a contiguous one is read in place.
    return np.frombuffer(view if view.c_contiguous else view.tobytes(), dtype=dtype)


def _ids(tokens, argument: str, wide: bool) -> tuple[memoryview, int]:
    if isinstance(tokens, (list, tuple)):
        return _sequence_ids(tokens, argument, wide)
    if isinstance(tokens, range):
        limit, rule = (ID_LIMIT, _RULE) if wide else (U32_LIMIT, _U32_RULE)
        return _numpy_ids(_range_array(tokens, argument, limit, rule), argument, wide)
    if isinstance(tokens, np.ndarray):
        return _numpy_ids(tokens, argument, wide)
    if _is_torch_tensor(tokens):
        return _numpy_ids(_host_array(tokens, argument), argument, wide)
    return _numpy_ids(_buffer_array(tokens, argument), argument, wide)


def token_ids(tokens, argument: str = "tokens") -> tuple[memoryview, int]:
    """The token ids as one read-only little-endian byte view and its bytes per id: what the
    Python chains hash.

    ``(u32 view, 4)`` when every id fits u32, the common case, converted in one pass (the view
    may share memory with ``tokens`` when it already is a contiguous little-endian uint32
    array); else ``(u64 view, 8)``, for :func:`wide_pages` to encode page by page.

    Args:
        tokens: list/tuple/range of ints, 1-D numpy integer array, 1-D torch integer tensor
            (CPU or CUDA; a CUDA tensor is moved to the host in one transfer), or a 1-D
            ``array.array`` / buffer of integers (see the module doc).
        argument: the name used in error messages.

    Returns:
        ``(memoryview of format "B", 4 or 8)``; the view holds ``4 * len(tokens)`` or
        ``8 * len(tokens)`` bytes.

    Raises:
        ArgumentTypeError: a float, bool or other non-integer id (float/bool dtype, a buffer
            of a format other than an integer's), or an unsupported container type (str,
            bytes, bytearray, dict, generators, ...).
        InvalidArgumentError: an id outside ``0 <= id <= 2**63-1`` (the message names the first
            bad position and its value), or an array that is not 1-D.
    """
    return _ids(tokens, argument, wide=True)


def wide_pages(data, page_size: int):
    """The bytes each full page of u64 ids hashes after its prior, page by page (a generator).

    A page whose ids all fit u32: its ids as u32 little-endian (``4 * page_size`` bytes). A page
    with an id above ``2**32-1``: :data:`WIDE_PAGE_TAG` (``0xff``), then its ids as u64
    little-endian (``1 + 8 * page_size`` bytes). The ids of a partial last page are not read.

    Args:
        data: a bytes-like object of u64 little-endian ids, each at most ``2**63-1`` (the
            second item of :func:`token_ids` when it is 8).
        page_size: ids per page (>= 1).

    Returns:
        An iterator of ``bytes``, one per full page, in page order.
    """
    ids = np.frombuffer(data, dtype="<u8")
    num_pages = len(ids) // page_size
    if num_pages == 0:
        return
    pages = ids[: num_pages * page_size].reshape(num_pages, page_size)
    is_wide = (pages >> np.uint64(32)).any(axis=1).tolist()
    for page, wide in zip(pages, is_wide):
        yield WIDE_PAGE_TAG + page.tobytes() if wide else page.astype("<u4").tobytes()


def token_buffer(tokens, argument: str = "tokens") -> memoryview:
    """The token ids as a read-only byte view: ``4 * len(tokens)`` bytes, each id as u32 little-endian.

    The u32 stream only: the bytes a chain of pages hashes when every id fits u32 (ids above
    ``2**32-1`` hash their page as u64, see the module doc and :func:`token_ids`); :func:`token_bytes`
    is the same as ``bytes``. The view may share memory with ``tokens`` when it already is a
    contiguous little-endian uint32 array.

    Args:
        tokens: list/tuple/range of ints, 1-D numpy integer array, 1-D torch integer tensor
            (CPU or CUDA; a CUDA tensor is moved to the host in one transfer), or a 1-D
            ``array.array`` / buffer of integers (see the module doc).
        argument: the name used in error messages.

    Returns:
        A ``memoryview`` (format ``"B"``) of ``4 * number of tokens`` bytes.

    Raises:
        ArgumentTypeError: a float, bool or other non-integer id (float/bool dtype, a buffer
            of a format other than an integer's), or an unsupported container type (str,
            bytes, bytearray, dict, generators, ...).
        InvalidArgumentError: an id outside ``0 <= id <= 2**32-1`` (the message names the first
            bad position and its value, and that page keys take ids up to ``2**63-1``), or an
            array that is not 1-D.
    """
    return _ids(tokens, argument, wide=False)[0]


def compiled_source(tokens, argument: str = "tokens"):
    """``tokens`` as a compiled chain reads them, or None where only :func:`token_ids` can.

    A list or tuple passes as it is (the chain declines it if an element is not an exact int),
    and so does a 1-D C-contiguous buffer of native or little-endian integers (an
    ``array.array``, a ``memoryview``, a ctypes array: the chain reads its memory in place); a
    numpy integer array, a range, a torch integer tensor (moved to the host in one transfer) or
    any other buffer of integers (strided, big-endian) becomes a 1-D C-contiguous numpy array in
    native byte order. Cheap checks only, nothing per element: the chain checks every id's range.

    Raises:
        ArgumentTypeError / InvalidArgumentError: a torch tensor of a non-integer dtype, not
            1-D, sparse or on the meta device; a range holding an id outside
            ``0 <= id <= 2**63-1``; a buffer that is not 1-D or not of integers (as
            :func:`token_ids`). Other bad inputs (``bytes`` and ``bytearray`` among them)
            return None, and :func:`token_ids` then raises.
    """
    if type(tokens) is list or type(tokens) is tuple:
        return tokens
    if isinstance(tokens, np.ndarray):
        values = tokens
    elif isinstance(tokens, range):
        values = _range_array(tokens, argument)
    elif _is_torch_tensor(tokens):
        values = _host_array(tokens, argument)
    elif isinstance(tokens, (bytes, bytearray)):
        return None  # refused by token_ids, though they export format "B"
    else:
        try:
            view = memoryview(tokens)
        except TypeError:
            return None
        if view.ndim == 1 and view.c_contiguous and _is_native_integer_format(view.format):
            return tokens
        values = _buffer_array(tokens, argument)
    if values.ndim != 1 or values.dtype.kind not in "iu":
        return None
    if not values.dtype.isnative:
        values = values.astype(values.dtype.newbyteorder("="))
    return np.ascontiguousarray(values)


def token_bytes(tokens, argument: str = "tokens") -> bytes:
    """:func:`token_buffer` as ``bytes`` (a copy): ``4 * len(tokens)`` bytes, u32 little-endian
    (ids up to ``2**32-1`` only).

    Raises: as :func:`token_buffer`.
    """
    return token_buffer(tokens, argument).tobytes()
