"""Token ids -> u32 little-endian bytes: every accepted container, the range rule, the type rule.

``token_bytes`` / ``token_buffer`` write u32, so they take ids up to 2**32-1 only; page keys take
ids up to 2**63-1 (``test_hash_wide_ids.py``)."""

from __future__ import annotations

import re
import struct
from array import array

import numpy as np
import pytest
import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError, KvstageError
from kvstage.hashing import page_keys, token_bytes
from kvstage.hashing.tokens import first_bad_id, token_ids

IDS = [0, 1, 2, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1]
EXPECTED = struct.pack(f"<{len(IDS)}I", *IDS)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: IDS, id="list"),
        pytest.param(lambda: tuple(IDS), id="tuple"),
        pytest.param(lambda: np.array(IDS, dtype=np.int64), id="numpy-int64"),
        pytest.param(lambda: np.array(IDS, dtype=np.uint64), id="numpy-uint64"),
        pytest.param(lambda: np.array(IDS, dtype=np.uint32), id="numpy-uint32"),
        pytest.param(lambda: np.array(IDS, dtype=">u4"), id="numpy-big-endian-uint32"),
        pytest.param(lambda: np.repeat(np.array(IDS, dtype=np.int64), 2)[::2], id="numpy-strided"),
        pytest.param(lambda: np.array(IDS, dtype=object), id="numpy-object"),
        pytest.param(lambda: [np.int64(t) for t in IDS], id="list-of-numpy-ints"),
    ],
)
def test_containers_give_the_same_little_endian_bytes(make):
    assert token_bytes(make()) == EXPECTED


def test_small_integer_dtypes():
    small = [0, 1, 100, 127]
    for dtype in (np.int8, np.int16, np.int32, np.uint8, np.uint16):
        assert token_bytes(np.array(small, dtype=dtype)) == struct.pack("<4I", *small)
    assert token_bytes(range(3, 7)) == struct.pack("<4I", 3, 4, 5, 6)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_torch_tensors_on_every_device(device, dtype):
    ids = [0, 1, 100, 127]
    tensor = torch.tensor(ids, dtype=dtype, device=device)
    assert token_bytes(tensor) == struct.pack("<4I", *ids)


def test_strided_torch_tensor(device):
    tensor = torch.arange(20, dtype=torch.int64, device=device)[::3]
    assert token_bytes(tensor) == struct.pack("<7I", *range(0, 20, 3))


def test_token_buffer_is_a_read_only_byte_view():
    from kvstage.hashing import token_buffer

    for tokens in ([1, 2], np.array([1, 2], dtype=np.uint32), np.array([1, 2])):
        view = token_buffer(tokens)
        assert view.readonly and view.format == "B" and view.tobytes() == struct.pack("<2I", 1, 2)


def test_torch_int64_full_range(device):
    tensor = torch.tensor(IDS, dtype=torch.int64, device=device)
    assert token_bytes(tensor) == EXPECTED


def test_torch_tensor_is_converted_in_one_transfer_not_per_element(device, monkeypatch):
    """No .item(), .tolist() or iteration over the tensor: the whole tensor moves at once."""
    tensor = torch.arange(64, dtype=torch.int64, device=device)

    def forbidden(*args, **kwargs):
        raise AssertionError("per-element access to a token tensor")

    for name in ("item", "tolist", "__iter__", "__getitem__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    assert token_bytes(tensor) == struct.pack("<64I", *range(64))


def test_empty_inputs_give_no_bytes_and_no_keys(device):
    for empty in ([], (), range(0), np.array([], dtype=np.int64), torch.empty(0, dtype=torch.int64, device=device)):
        assert token_bytes(empty) == b""
        assert page_keys(empty, 4) == []


@pytest.mark.parametrize(
    "tokens, position, value",
    [
        ([5, -1, 2**32], 1, -1),
        ([5, 6, 2**32], 2, 2**32),
        ([2**70, -1], 0, 2**70),
        ([3, 3, 3, -(2**70)], 3, -(2**70)),
    ],
)
def test_out_of_range_ids_name_the_first_bad_position_and_value(tokens, position, value):
    for container in (tokens, tuple(tokens)):
        with pytest.raises(InvalidArgumentError) as info:
            token_bytes(container)
        assert f"tokens[{position}] = {value}" in str(info.value)
        assert "0 <= id <= 2**32-1 to be written as u32" in str(info.value)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.int8])
def test_negative_ids_in_numpy_arrays(dtype):
    with pytest.raises(InvalidArgumentError, match=r"tokens\[2\] = -3"):
        token_bytes(np.array([4, 5, -3, -1], dtype=dtype))


def test_too_large_ids_in_numpy_arrays():
    with pytest.raises(InvalidArgumentError, match=r"tokens\[1\] = 4294967296"):
        token_bytes(np.array([4, 2**32, 2**40], dtype=np.uint64))
    with pytest.raises(InvalidArgumentError, match=r"tokens\[0\] = -7"):
        token_bytes(np.array([-7, 2**32], dtype=np.int64))


def test_out_of_range_ids_in_torch_tensors(device):
    with pytest.raises(InvalidArgumentError, match=r"tokens\[3\] = 4294967296"):
        token_bytes(torch.tensor([1, 2, 3, 2**32], dtype=torch.int64, device=device))
    with pytest.raises(InvalidArgumentError, match=r"tokens\[0\] = -1"):
        token_bytes(torch.tensor([-1, 2], dtype=torch.int32, device=device))


@pytest.mark.parametrize(
    "tokens, position",
    [
        ([1, 2.0, 3], 1),
        ([1, 2, 3.5], 2),
        ([1, np.float32(2)], 1),
        (["1", 2], 0),
        ([1, None], 1),
    ],
)
def test_non_integer_ids_in_lists_are_type_errors(tokens, position):
    with pytest.raises(ArgumentTypeError, match=rf"tokens\[{position}\] = "):
        token_bytes(tokens)


@pytest.mark.parametrize(
    "tokens, position",
    [
        ([True, False], 0),
        ([7, 8, True], 2),
        ([0, 1, 2, False, 1], 3),
        ([1, np.True_], 1),
        ([2] * 50 + [1, 0] * 1000 + [True], 2050),
        ([True, -1], 0),
    ],
)
def test_bools_in_lists_are_type_errors(tokens, position):
    with pytest.raises(ArgumentTypeError, match=rf"not bools; tokens\[{position}\] = "):
        token_bytes(tokens)


def test_first_bad_element_wins_whatever_its_kind():
    with pytest.raises(InvalidArgumentError, match=r"tokens\[0\] = -1"):
        token_bytes([-1, True])


def test_float_and_bool_arrays_are_type_errors(device):
    for bad in (
        np.array([1.0, 2.0]),
        np.array([True, False]),
        np.array([1 + 0j]),
        np.array([]),  # an empty float array is still a float array
        torch.tensor([1.0, 2.0], device=device),
        torch.tensor([True, False], device=device),
        torch.tensor([1.0], dtype=torch.bfloat16, device=device),
    ):
        with pytest.raises(ArgumentTypeError, match="tokens: token ids must be integers, got dtype"):
            token_bytes(bad)


def test_unsupported_containers_are_type_errors():
    for bad in ("abc", {1: 2}, (t for t in [1, 2]), 5, None):
        with pytest.raises(
            ArgumentTypeError,
            match="tokens: must be a list/tuple/range of ints, .* or an array.array or buffer of integers, got",
        ):
            token_bytes(bad)
    with pytest.raises(
        ArgumentTypeError, match="tokens: bytes is a byte string, not token ids"
    ):  # test_hash_token_arrays.py
        token_bytes(b"\x01\x02")


def test_arrays_must_be_one_dimensional(device):
    with pytest.raises(InvalidArgumentError, match=r"tokens: must be 1-D, got shape \(2, 2\)"):
        token_bytes(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(InvalidArgumentError, match=r"tokens: must be 1-D, got shape \(\)"):
        token_bytes(torch.tensor(3, device=device))


def test_errors_are_kvstage_errors_and_builtin_kinds():
    with pytest.raises(ValueError):
        token_bytes([-1])
    with pytest.raises(TypeError):
        token_bytes([1.5])
    with pytest.raises(KvstageError):
        page_keys([True], 1)


def test_bad_id_past_the_first_conversion_chunk_is_found():
    values = np.arange(300_000, dtype=np.int64)
    values[200_001] = -5
    values[250_000] = 2**33
    with pytest.raises(InvalidArgumentError, match=r"tokens\[200001\] = -5"):
        token_bytes(values)
    values[200_001] = 0
    with pytest.raises(InvalidArgumentError, match=r"tokens\[250000\] = 8589934592"):
        token_bytes(values)
    values[250_000] = 0
    assert token_bytes(values)[-8:] == struct.pack("<2I", 299_998, 299_999)


def test_bool_tensors_in_lists_are_type_errors():
    with pytest.raises(ArgumentTypeError, match=r"not bools; tokens\[0\] = "):
        token_bytes([torch.tensor(True), torch.tensor(2)])
    with pytest.raises(ArgumentTypeError, match=r"not bools; tokens\[1\] = "):
        page_keys([5, np.array(True), 3, 4], 2)
    assert token_bytes([torch.tensor(1), torch.tensor(2)]) == struct.pack("<2I", 1, 2)  # int tensors are ids


@pytest.mark.parametrize(
    "make, rule",
    [
        (lambda: torch.tensor([1, 2], device="meta"), "tokens: must be on a device with data"),
        (lambda: torch.tensor([1, 2]).to_sparse(), "tokens: must be a dense (strided) tensor"),
    ],
)
def test_tensors_that_cannot_be_read_are_named(make, rule):
    with pytest.raises(ArgumentTypeError, match=re.escape(rule)):
        token_bytes(make())
    with pytest.raises(ArgumentTypeError, match=re.escape(rule)):
        page_keys(make(), 2)


def test_negative_view_tensors_are_read_as_their_values():
    tensor = torch.tensor([-1, -2, -3, -4])._neg_view()  # values 1..4 held as a lazy negation
    assert token_bytes(tensor) == struct.pack("<4I", 1, 2, 3, 4)
    assert page_keys(tensor, 2) == page_keys([1, 2, 3, 4], 2)


def test_a_huge_range_is_checked_without_walking_it():
    with pytest.raises(InvalidArgumentError, match=r"tokens\[0\] = -1"):
        token_bytes(range(-1, 2**40))
    with pytest.raises(InvalidArgumentError, match=rf"tokens\[{2**32 - 5}\] = {2**32}"):
        token_bytes(range(5, 2**40))
    with pytest.raises(InvalidArgumentError, match=rf"tokens\[{2**63 - 5}\] = {2**63}"):
        page_keys(range(5, 2**64), 2**40)
    assert token_bytes(range(2**32 - 3, 2**32)) == struct.pack("<3I", 2**32 - 3, 2**32 - 2, 2**32 - 1)
    assert token_bytes(range(10, 0, -3)) == struct.pack("<4I", 10, 7, 4, 1)
    assert page_keys(range(0, 300, 7), 4) == page_keys(list(range(0, 300, 7)), 4)


@pytest.mark.parametrize(
    "tokens, expected",
    [
        ([1, 2, 3], None),
        (array("q", [1, 2, 3]), None),
        (np.arange(4, dtype=np.int32), None),
        ([np.int64(1), 2], None),  # numpy integers are integers
        ([1, 2.0, 3], (1, "type")),
        ([1, None], (1, "type")),
        ([0, 1, True], (2, "bool")),  # taken as 1 by array(), found by its type
        ([5, -1, 2.5], (1, "range")),  # the first bad id, whatever breaks later
        ([1, 2**63], (1, "range")),
        (array("d", [1.0]), (0, "type")),
        (np.array([0, 1.5]), (0, "type")),  # a float array: its first element is no integer
    ],
)
def test_first_bad_id_is_the_first_id_token_ids_refuses_and_why(tokens, expected):
    assert first_bad_id(tokens) == expected
    if expected is not None:
        with pytest.raises((ArgumentTypeError, InvalidArgumentError)):
            token_ids(tokens)


def test_first_bad_id_reraises_what_no_single_id_breaks():
    with pytest.raises(InvalidArgumentError, match="must be 1-D"):
        first_bad_id(np.zeros((0, 2), dtype=np.int64))
