"""StatePool and the state copies refuse bad input by name, before anything is written."""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import ArgumentTypeError, BackendUnavailableError, DeviceMismatchError, InvalidArgumentError
from kvstage.kernels import StatePool, gather_state, scatter_state, warm_up_state

from kernel_helpers import as_bytes, random_bytes_

OTHER_DEVICES = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])


def test_pool_reports_rows_offsets_and_snapshot_bytes(device):
    conv = torch.zeros(6, 128, 4, dtype=torch.bfloat16, device=device)
    ssm = torch.zeros(6, 4, 16, 16, dtype=torch.float32, device=device)
    odd = torch.zeros(6, 3, dtype=torch.uint8, device=device)
    pool = StatePool([conv, ssm, odd])
    assert (pool.num_slots, pool.num_tensors, pool.device) == (6, 3, torch.device(device))
    assert pool.row_bytes == [1024, 4096, 3] and pool.offsets == [0, 1024, 5120]
    assert pool.snapshot_bytes == 5123 and pool.staging_shape(2) == (2, 5123)
    assert pool.slot_stride_bytes == [1024, 4096, 3]
    assert pool.word_alignment[2] == 1 and pool.word_alignment[0] == 16
    layered = StatePool.from_layers([[conv, ssm], [odd]])
    assert layered.names == ["layers[0][0]", "layers[0][1]", "layers[1][0]"]
    assert layered.snapshot_bytes == pool.snapshot_bytes


def test_strided_slot_views_are_described_by_their_strides(device):
    raw = torch.zeros(5, 300, dtype=torch.uint8, device=device)
    conv = raw[:, 16:272].view(torch.bfloat16).view(5, 32, 4)
    pool = StatePool([conv, raw[:, 272:292]])
    assert pool.row_bytes == [256, 20] and pool.slot_stride_bytes == [300, 300]


@pytest.mark.parametrize(
    "build, argument, error, rule",
    [
        (lambda d: StatePool([]), "tensors", InvalidArgumentError, "at least one"),
        (lambda d: StatePool(torch.zeros(2, 3, device=d)), "tensors", ArgumentTypeError, "sequence"),
        (lambda d: StatePool([torch.zeros(2, 3, device=d), "x"]), "tensors[1]", ArgumentTypeError, "torch.Tensor"),
        (lambda d: StatePool([torch.tensor(1.0, device=d)]), "tensors[0]", InvalidArgumentError, "0-d"),
        (lambda d: StatePool([torch.zeros(2, 0, device=d)]), "tensors[0]", InvalidArgumentError, ">= 1"),
        (
            lambda d: StatePool([torch.zeros(2, 3, device=d), torch.zeros(3, 3, device=d)]),
            "tensors[1]",
            InvalidArgumentError,
            "2 slots",
        ),
        (
            lambda d: StatePool([torch.zeros(2, 4, 3, device=d).transpose(1, 2)]),
            "tensors[0]",
            InvalidArgumentError,
            "one run of bytes",
        ),
        (
            lambda d: StatePool([torch.zeros(1, 8, device=d).expand(4, 8)]),
            "tensors[0]",
            InvalidArgumentError,
            "must not overlap",
        ),
        (
            lambda d: StatePool([torch.zeros(4, 8, device=d).view(-1)[: 8 * 3].as_strided((3, 8), (4, 1))]),
            "tensors[0]",
            InvalidArgumentError,
            "must not overlap",
        ),
        (
            lambda d: (lambda t: StatePool([t, t[:, :2]]))(torch.zeros(2, 3, device=d)),
            "tensors[1]",
            InvalidArgumentError,
            "same address as tensors[0]",
        ),
        (lambda d: StatePool([torch.zeros(2, 3, device=d)], names=["a", "b"]), "names", InvalidArgumentError, "1"),
        (lambda d: StatePool.from_layers([]), "layers", InvalidArgumentError, "non-empty"),
        (
            lambda d: StatePool.from_layers([[torch.zeros(2, device=d)], []]),
            "layers[1]",
            InvalidArgumentError,
            "non-empty",
        ),
        (
            lambda d: StatePool.from_layers([[torch.zeros(2, device=d)], [torch.zeros(3, device=d)]]),
            "layers[1][0]",
            InvalidArgumentError,
            "2 slots",
        ),
    ],
    ids=[
        "empty",
        "a-tensor-not-a-list",
        "not-a-tensor",
        "zero-dim",
        "zero-size",
        "slot-counts",
        "row-not-contiguous",
        "expanded",
        "overlapping-slots",
        "same-address",
        "names",
        "no-layers",
        "empty-layer",
        "layer-slot-counts",
    ],
)
def test_pool_rejects_bad_tensors(device, build, argument, error, rule):
    with pytest.raises(error) as info:
        build(device)
    message = str(info.value)
    assert message.startswith(f"{argument}:") and rule in message, message


@pytest.mark.parametrize("other", OTHER_DEVICES)
def test_pool_rejects_tensors_on_two_devices(other):
    with pytest.raises(DeviceMismatchError, match=rf"^tensors\[1\]: device must be cpu like tensors\[0\], got {other}"):
        StatePool([torch.zeros(2, 3), torch.zeros(2, 3, device=other)])


@pytest.fixture
def case(device):
    gen = torch.Generator().manual_seed(0)
    tensors = [
        random_bytes_(torch.empty(5, 16, 4, dtype=torch.bfloat16, device=device), gen),
        random_bytes_(torch.empty(5, 3, dtype=torch.uint8, device=device), gen),
    ]
    pool = StatePool(tensors)
    staging = torch.full(pool.staging_shape(2), 0xA5, dtype=torch.uint8, device=device)
    return pool, staging


def _bad(case, what):
    """(slot_ids, staging, options) with one thing broken, as named by ``what``."""
    pool, staging = case
    dev = pool.device
    ids = torch.tensor([3, 1], device=dev)
    if what == "ids-float":
        return ids.float(), staging, {}
    if what == "ids-2d":
        return ids.view(1, 2), staging, {}
    if what == "ids-list-of-floats":
        return [3.0, 1.0], staging, {}
    if what == "ids-string":
        return "3,1", staging, {}
    if what == "ids-out-of-range":
        return torch.tensor([3, 5], device=dev), staging, {}
    if what == "ids-negative":
        return [-1, 1], staging, {}
    if what == "ids-out-of-range-list":
        return [3, 99], staging, {}
    if what == "staging-dtype":
        return ids, staging.view(torch.int8), {}
    if what == "staging-slot-count":
        return torch.tensor([3], device=dev), staging, {}
    if what == "staging-bytes":
        return ids, staging[:, :-1].contiguous(), {}
    if what == "staging-flat":
        return ids, staging.view(-1), {}
    if what == "staging-not-contiguous":
        wide = torch.zeros(2, 2 * pool.snapshot_bytes, dtype=torch.uint8, device=dev)
        return ids, wide[:, : pool.snapshot_bytes], {}
    if what == "staging-not-tensor":
        return ids, bytearray(2 * pool.snapshot_bytes), {}
    if what == "backend":
        return ids, staging, {"backend": "cuda"}
    if what == "max-programs":
        return ids, staging, {"max_programs": 0}
    if what.startswith("tensors-"):
        bad = {"tensors-empty": range(1, 1), "tensors-past-the-end": range(1, 3), "tensors-step": range(0, 2, 2)}
        return ids, staging, {"tensors": bad.get(what, slice(0, 1))}
    raise ValueError(what)


BAD = {
    "ids-float": ("slot_ids", ArgumentTypeError, "int32 or int64"),
    "ids-2d": ("slot_ids", InvalidArgumentError, "1-D"),
    "ids-list-of-floats": ("slot_ids", ArgumentTypeError, "must hold ints"),
    "ids-string": ("slot_ids", ArgumentTypeError, "list of ints"),
    "ids-out-of-range": ("slot_ids", InvalidArgumentError, "must be in [0, 5)"),
    "ids-negative": ("slot_ids", InvalidArgumentError, "must be in [0, 5)"),
    "ids-out-of-range-list": ("slot_ids", InvalidArgumentError, "max 99"),
    "staging-dtype": ("staging", ArgumentTypeError, "torch.uint8"),
    "staging-slot-count": ("staging", InvalidArgumentError, "[len(slot_ids), snapshot_bytes] = [1, 131]"),
    "staging-bytes": ("staging", InvalidArgumentError, "[2, 131]"),
    "staging-flat": ("staging", InvalidArgumentError, "[2, 131]"),
    "staging-not-contiguous": ("staging", InvalidArgumentError, "contiguous"),
    "staging-not-tensor": ("staging", ArgumentTypeError, "torch.Tensor"),
    "backend": ("backend", InvalidArgumentError, "one of"),
    "max-programs": ("max_programs", InvalidArgumentError, ">= 1"),
    "tensors-empty": ("tensors", InvalidArgumentError, "non-empty range(start, stop) within [0, 2]"),
    "tensors-past-the-end": ("tensors", InvalidArgumentError, "got range(1, 3)"),
    "tensors-step": ("tensors", InvalidArgumentError, "range(0, 2, 2)"),
    "tensors-slice": ("tensors", InvalidArgumentError, "got slice(0, 1, None)"),
}


@pytest.mark.parametrize("op", ["gather", "scatter"])
@pytest.mark.parametrize("what", list(BAD))
def test_bad_arguments_raise_by_name_before_writing(case, what, op):
    pool, staging = case
    argument, error, rule = BAD[what]
    slot_ids, bad_staging, options = _bad(case, what)
    before_pool = [as_bytes(t).clone() for t in pool.tensors]
    before_staging = as_bytes(staging).clone()
    with pytest.raises(error) as info:
        if op == "gather":
            gather_state(pool, slot_ids, bad_staging, **options)
        else:
            scatter_state(bad_staging, pool, slot_ids, **options)
    message = str(info.value)
    assert message.startswith(f"{argument}:") and rule in message, message
    assert all(torch.equal(b, as_bytes(t)) for b, t in zip(before_pool, pool.tensors))
    assert torch.equal(before_staging, as_bytes(staging))


@pytest.mark.parametrize("kind", ["values", "expanded"])
def test_scatter_rejects_a_repeated_slot(case, kind):
    pool, staging = case
    ids = torch.tensor([2, 2]) if kind == "values" else torch.tensor([2]).expand(2)
    before = [as_bytes(t).clone() for t in pool.tensors]
    with pytest.raises(InvalidArgumentError, match="^slot_ids: must not repeat a slot in a scatter"):
        scatter_state(staging, pool, ids)
    assert all(torch.equal(b, as_bytes(t)) for b, t in zip(before, pool.tensors))


@pytest.mark.parametrize("other", OTHER_DEVICES)
def test_ids_and_staging_on_another_device(case, other):
    pool, staging = case
    with pytest.raises(DeviceMismatchError, match=r"^slot_ids: must be on the pool's device \(cpu\) or on CPU"):
        gather_state(pool, torch.tensor([3, 1], device=other), staging)
    with pytest.raises(DeviceMismatchError, match=r"^staging: must be pinned host memory or on the pool's device"):
        gather_state(pool, [3, 1], torch.zeros(pool.staging_shape(2), dtype=torch.uint8, device=other))


def test_pool_must_be_a_state_pool(case):
    _, staging = case
    with pytest.raises(ArgumentTypeError, match="^pool: must be a StatePool, got list"):
        gather_state([torch.zeros(5, 3)], [0], staging)
    with pytest.raises(ArgumentTypeError, match="^pool: must be a StatePool"):
        warm_up_state(object())


def test_triton_without_the_interpreter_is_unavailable(monkeypatch, case):
    pool, staging = case
    if pool.device.type == "cuda":
        pytest.skip("CUDA pools run native Triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailableError, match="^backend: 'triton' on CPU tensors needs TRITON_INTERPRET=1"):
        gather_state(pool, [3, 1], staging, backend="triton")
    assert (as_bytes(staging) == 0xA5).all()


def test_from_stacked_takes_sglang_style_per_kind_tensors(device):
    conv = torch.arange(3 * 4 * 8 * 3, dtype=torch.float32, device=device).view(3, 4, 8, 3)
    temporal = torch.zeros(3, 4, 2, 4, 4, dtype=torch.bfloat16, device=device)
    pool = StatePool.from_stacked([conv, temporal])
    assert pool.num_tensors == 6 and pool.num_slots == 4
    assert pool.names[:3] == ["stacked[0][0]", "stacked[1][0]", "stacked[0][1]"]
    assert pool.tensors[2].data_ptr() == conv[1].data_ptr() and pool.row_bytes[:2] == [96, 64]
    with pytest.raises(
        InvalidArgumentError, match=r"^stacked\[1\]: must hold 3 layers \(dim 0\) like stacked\[0\], got 2"
    ):
        StatePool.from_stacked([conv, temporal[:2]])
    with pytest.raises(InvalidArgumentError, match=r"^stacked\[0\]: must be \[num_layers, num_slots, ...\]"):
        StatePool.from_stacked([torch.zeros(3, device=device)])
    with pytest.raises(InvalidArgumentError, match=r"^stacked\[1\]\[0\]: must have 4 slots"):
        StatePool.from_stacked([conv, torch.zeros(3, 5, 2, device=device)])
    with pytest.raises(ArgumentTypeError, match="^stacked: must be a sequence"):
        StatePool.from_stacked(conv)


def test_warm_up_builds_the_tables_and_compiles_nothing_off_cuda(device):
    from kvstage.kernels import triton_state

    pool = StatePool([torch.zeros(3, 64, device=device), torch.zeros(3, 5, dtype=torch.uint8, device=device)])
    compiled = warm_up_state(pool)
    assert compiled == (8 if device.type == "cuda" else 0)
    assert warm_up_state(pool, backend="torch") == 0
    assert {key[:2] for key in triton_state._TABLES[pool]} == {(16, False), (16, True)}


def test_layers_must_cover_the_tensors_in_order(device):
    a, b = torch.zeros(2, 3, device=device), torch.zeros(2, 4, device=device)
    assert StatePool([a, b]).layers == [range(0, 1), range(1, 2)]
    assert StatePool([a, b], layers=[range(0, 2)]).layers == [range(0, 2)]
    for bad in ([range(1, 2)], [range(0, 1), range(0, 2)], [range(0, 0), range(0, 2)]):
        with pytest.raises(InvalidArgumentError, match="^layers: must be non-empty ranges covering the 2 tensors"):
            StatePool([a, b], layers=bad)
    stacked = StatePool.from_stacked([torch.zeros(3, 2, 4, device=device), torch.zeros(3, 2, 1, device=device)])
    assert stacked.layers == [range(0, 2), range(2, 4), range(4, 6)]
